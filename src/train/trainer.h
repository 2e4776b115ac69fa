// The training loop: micro-batches with gradient accumulation, global-norm clipping,
// AdamW, the LR schedule, periodic evaluation and checkpoints, a progress line and
// metrics.jsonl. Fresh runs and resumed runs go through the same loop, so a resumed run
// on the CPU reproduces the uninterrupted one bit for bit.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "data/loader.h"
#include "model/transformer.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/recipe.h"

namespace esplag {

struct EvalResult {
  double loss = 0;
  double perplexity = 0;
  int batches = 0;
  int64_t tokens = 0;
};

struct TrainResult {
  double first_loss = 0, last_loss = 0;
  double final_val_loss = 0;
  int64_t steps = 0;
  std::string last_checkpoint;
};

using LogFn = std::function<void(const std::string&)>;

class Trainer {
 public:
  // A new run in `run_dir` (created; it must not already hold checkpoints).
  Trainer(TrainConfig config, std::string run_dir, LogFn log);
  // Continues the run whose checkpoint (or run directory) is `dir`; `steps` > 0 extends
  // or shortens the total.
  static std::unique_ptr<Trainer> resume(const std::string& dir, LogFn log, int64_t steps = 0);

  TrainResult run();

  // One optimizer step (all micro-batches, clipping, AdamW, the Linear kinds' hooks);
  // what run() repeats. Public so that the profiler can observe exactly one step.
  struct StepStats {
    double loss = 0, grad_norm = 0, lr = 0;
  };
  StepStats train_step();
  const TrainConfig& config() const { return cfg_; }
  Transformer<float>& model() { return *model_; }

 private:
  Trainer(LogFn log) : log_(std::move(log)) {}
  void setup_data();
  // Parses and validates the config's recipe against the model.
  void setup_recipe();
  EvalResult evaluate();
  // Global L2 norm of every trained gradient (deterministic order).
  double grad_norm();
  void ensure_moments();
  void step_optimizer(int64_t step, double grad_scale, double lr);
  void save();
  void append_metrics(const std::string& json_line);

  TrainConfig cfg_;
  std::string run_dir_, tokenizer_;
  LogFn log_;
  std::unique_ptr<Transformer<float>> model_;
  std::unique_ptr<DataLoader> train_data_, val_data_;
  Moments m_, v_;
  TrainerState state_;
  Recipe recipe_;  // empty for dense training
  std::vector<int32_t> batch_x_, batch_y_;
  std::string last_checkpoint_;
};

// Loss and perplexity of a checkpoint on a data split ("val" or "train").
EvalResult evaluate_checkpoint(const std::string& checkpoint, const std::string& data_dir, const std::string& split,
                               int max_batches, int batch_size = 0, int seq_len = 0);

}  // namespace esplag
