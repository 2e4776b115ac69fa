// The training loop: micro-batches with gradient accumulation, global-norm clipping,
// AdamW, the LR schedule, periodic evaluation and checkpoints, a progress line and
// metrics.jsonl. Fresh runs and resumed runs go through the same loop, so a resumed run
// on the CPU reproduces the uninterrupted one bit for bit.
//
// Where the arithmetic of a step runs is one seam, StepBackend: the CPU reference on the
// host model itself, or (train.device=cuda, CUDA build) the GPU model of
// train/gpu_step.h (the Linear kinds of gpu_trains_kind) working on a device copy that is
// written back to the host model for checkpoints. Data, schedule, recipe, logging and
// checkpoints are the trainer's and the same for both, so a checkpoint of either device
// resumes on the other.
//
// Data parallel (docs/distributed.md): started by a launcher (torchrun, mpirun, srun or
// `esplag train --gpus N`), every rank runs this loop on its own part of each global batch
// and the backends average the gradients over the ranks before every optimizer step; rank
// 0 alone logs, evaluates and writes the run directory.
#pragma once
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "data/loader.h"
#include "dist/host_channel.h"
#include "model/transformer.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/recipe.h"
#include "train/run_dir.h"
#include "train/schedule.h"

namespace esplag {

struct EvalResult {
  double loss = 0;
  double perplexity = 0;
  int batches = 0;
  int64_t tokens = 0;
  std::string device = "cpu";  // where the batches ran
};

struct TrainResult {
  // Losses of the first and last step this call ran (NaN when it ran none).
  double first_loss = std::nan(""), last_loss = std::nan("");
  double final_val_loss = std::nan("");  // of the last evaluation this call ran (NaN when none)
  int64_t steps = 0;      // the step the run has reached
  int64_t steps_run = 0;  // steps this call ran: 0 when a resumed run had nothing to do
  // A stop signal (train/stop_signal.h) ended the run early: the step reached is saved in
  // last_checkpoint, and resuming the run directory continues it.
  bool interrupted = false;
  std::string last_checkpoint;
};

using LogFn = std::function<void(const std::string&)>;

// --- where a run trains ---------------------------------------------------------------

// What this process can train on.
struct DeviceProbe {
  bool cuda_build = false;  // built with the CUDA backend (ESPLAG_CUDA=ON)
  int gpus = 0;             // CUDA devices visible
  std::string why_none;     // when gpus == 0 in a CUDA build: the runtime's reason
};
DeviceProbe probe_devices();

// Whether the GPU model trains Linear kind `kind` (Linear::kind()): a registered kind whose
// registry entry says so (model/linear_registry.h); LoRA-wrapped layers ("masked+lora") not.
bool gpu_trains_kind(const std::string& kind);
// "the GPU trains dense, masked, ... and vnm Linear layers only so far": the kinds of
// gpu_trains_kind, for the errors and notes that refuse the GPU.
std::string gpu_kinds_note();

// What the GPU path cannot train of this run, "" when nothing: the recipe's modifiers
// other than gradual_magnitude, kernel_replacement (without LoRA), semi_sparse and slope;
// semi_sparse and slope modifiers claiming layers (or a micro-batch) that cuSPARSELt cannot
// take (multiples of 16; with sparse_dw, outputs and tokens multiples of 64); and, when
// `model` is given, its Linear kinds the GPU lacks (LoRA-wrapped layers among them).
std::string gpu_training_blocker(const TrainConfig& config, Transformer<float>* model = nullptr);

struct DeviceChoice {
  std::string device;  // "cpu" or "cuda"
  std::string note;    // why `auto` stayed on the CPU although a GPU is visible ("" otherwise)
};
// train.device resolved: `cpu` is the CPU; `cuda` is the GPU, or an Error when the build
// has no CUDA backend, no GPU is visible, or `gpu_blocker` is not empty; `auto` is the GPU
// when `cuda` would succeed and the CPU otherwise (with a note when a GPU was there).
DeviceChoice choose_train_device(const std::string& requested, const DeviceProbe& probe,
                                 const std::string& gpu_blocker);

// --- the step seam ---------------------------------------------------------------------

// The arithmetic of training steps. A backend owns the optimizer state and the working
// copy of the weights (on the CPU: the host model itself).
class StepBackend {
 public:
  struct Stats {
    double loss = 0, grad_norm = 0;
    // When the step distilled (recipe distill): the means of its cross-entropy and KL parts.
    double distill_ce = std::nan(""), distill_kl = std::nan("");
  };
  virtual ~StepBackend() = default;
  virtual std::string device() const = 0;  // "cpu" or "cuda"
  // For the run's first log line, e.g. "cuda (NVIDIA H100 80GB HBM3, 1.2 GiB for the model)".
  virtual std::string describe() const = 0;
  // Optimizer step `step` (0-based): train.grad_accum micro-batches from `data`, each
  // adding d(loss / grad_accum)/dθ, then global-norm clipping and AdamW at `lr`. A device
  // backend may return before the device has finished.
  virtual void step(int64_t step, double lr, DataLoader& data) = 0;
  // Mean loss (over the micro-batches) and gradient norm (before clipping) of the last
  // step; waits for it. Throws the "training diverged" Error when a step since the last
  // call had a non-finite loss or this one a non-finite norm (the CPU throws from step()).
  virtual Stats last_stats() = 0;
  // Mean loss of one batch, no gradients.
  virtual double eval_loss(const int32_t* inputs, const int32_t* targets, int B, int T) = 0;
  // What a checkpoint holds: writes the current weights into the host model and returns
  // the AdamW moments by trained tensor (views, valid until the next step).
  struct HostMoments {
    MomentViews m, v;
  };
  virtual HostMoments state_to_host() = 0;
  // On every rank but the leader when the leader calls state_to_host for a checkpoint under
  // ZeRO: this rank's part of its collectives. The default runs state_to_host; the GPU's
  // writes the weights back as the leader does but keeps no host copy of the moments
  // (llama-7b's would take tens of GiB on every rank).
  virtual void state_to_leader() { state_to_host(); }
  // The current weights into the host model, without the moments: what a recipe update
  // needs (masks and kinds are chosen from the weights). The CPU backend trains the host
  // model itself: nothing to do.
  virtual void weights_to_host() {}
  // Lines for the run log that the last step produced (e.g. the GPU's per-layer choice of
  // products when a layer became semi_sparse); empty by default.
  virtual std::vector<std::string> take_notes() { return {}; }
  // Operand values the block linears' fp8 casts saturated so far (train.precision fp8; the
  // run log warns when it grows). Waits for the steps queued.
  virtual int64_t fp8_saturated() = 0;

 protected:
  // The divergence Error, worded the same on every device.
  [[noreturn]] static void diverged(const char* what, double value, int64_t step);
};

struct ResumeOptions {
  int64_t steps = 0;   // > 0: the run's new total (train.steps), longer or shorter
  std::string device;  // auto | cpu | cuda: replaces the saved train.device when not empty
  ScheduleOnResume schedule = ScheduleOnResume::keep;  // what a new total does to the LR schedule
  // Resume a checkpoint whose state.json is missing, from the weights, moments and step
  // alone: the data restarts from its first batch and the RNG state from train.seed (the
  // log says so). Without it such a checkpoint is refused.
  bool allow_inexact = false;
};

class Trainer {
 public:
  // A new run in `run_dir` (created; it must not already hold checkpoints). Everything
  // (config, model, data, device, host memory) is checked before the directory is
  // created or anything written. The run directory is locked (train/run_dir.h) for the
  // trainer's lifetime or until run() returns, and unfinished writes of dead processes in
  // it are removed.
  Trainer(TrainConfig config, std::string run_dir, LogFn log);
  // Continues the run whose checkpoint (or run directory) is `dir`. The checkpoint must be
  // consistent (state.json, the model's metadata and the directory's name at one step) and
  // complete (state.json present unless options.allow_inexact); nothing in the run
  // directory is touched before all of it is checked and the run's lock is taken. When the
  // checkpoint is already at (or past) the total, the trainer has nothing to do: run()
  // says so and returns steps_run = 0 without writing anything.
  static std::unique_ptr<Trainer> resume(const std::string& dir, LogFn log, const ResumeOptions& options);
  static std::unique_ptr<Trainer> resume(const std::string& dir, LogFn log, int64_t steps = 0,
                                         const std::string& device = "") {
    return resume(dir, std::move(log), ResumeOptions{steps, device});
  }

  // Trains to train.steps, logging, evaluating and saving as configured. After each step
  // it polls stop_requested() (train/stop_signal.h): on a stop signal it saves the step
  // reached and returns with `interrupted` set.
  TrainResult run();

  // One optimizer step (all micro-batches, clipping, AdamW, the Linear kinds' hooks);
  // what run() repeats. Public so that the profiler can observe exactly one step. Waits
  // for the step's loss (run() does so only when it logs, evaluates or saves).
  struct StepStats {
    double loss = 0, grad_norm = 0, lr = 0;
  };
  StepStats train_step();
  const TrainConfig& config() const { return cfg_; }
  const std::string& run_dir() const { return run_dir_; }
  // "cpu" or "cuda": where the steps run.
  const std::string& device() const { return device_; }
  // Whether this process speaks for the run: logs, evaluates and writes the run directory
  // (a data-parallel run's rank 0; a single process).
  bool leader() const { return world_.rank == 0; }
  // Whether this process runs the evaluation: the leader, and under ZeRO stage 3 on several
  // GPUs every rank (the forward gathers each bucket's weights from all of them).
  bool evaluates() const { return leader() || (device_ == "cuda" && cfg_.parallel.zero >= 3 && world_.size > 1); }
  // The host model. With a GPU backend it holds the weights of the last checkpoint (and
  // after run(), those of the last step, which is always saved).
  Transformer<float>& model() { return *model_; }

 private:
  Trainer(LogFn log) : log_(std::move(log)) {}
  void setup_data();
  // Parses and validates the config's recipe against the model.
  void setup_recipe();
  // Resolves cfg_.device into device_ (throws before anything is written).
  void resolve_device();
  // Values the fp8 casts saturated so far, summed over the data-parallel ranks (each casts
  // its own batches); a collective every rank calls at the same steps.
  int64_t fp8_saturated_over_ranks();
  // The backend for device_, taking over the optimizer moments.
  void make_backend(Moments m, Moments v);
  // The recipe's changes, the backend's step, the counters; returns the learning rate.
  double advance();
  EvalResult evaluate();
  void save();
  void append_metrics(const std::string& json_line);
  // Throws when run_dir_ already holds checkpoints (a new run must not overwrite them).
  void check_no_checkpoints() const;
  // Takes the run's lock and removes the unfinished writes of dead processes: what a run
  // does before its first write.
  void claim_run_dir();
  // The data-parallel world this process belongs to (dist/world.h: the launcher's
  // environment), connected to the other ranks; a single process when there is none.
  void join_world();
  int64_t tokens_per_step() const {
    return int64_t(cfg_.batch_size) * cfg_.seq_len * cfg_.grad_accum * world_.size;
  }

  TrainConfig cfg_;
  std::string run_dir_, tokenizer_;
  LogFn log_;
  std::unique_ptr<Transformer<float>> model_;
  std::unique_ptr<DataLoader> train_data_, val_data_;
  std::unique_ptr<StepBackend> backend_;
  World world_;
  std::unique_ptr<HostChannel> ranks_;  // the other ranks (null for a single process)
  std::string device_ = "cpu";
  std::string device_note_;  // why `auto` chose the CPU, when a GPU was visible
  TrainerState state_;
  Recipe recipe_;  // empty for dense training
  bool first_update_applied_ = false;  // the recipe's step-0 update ran before the backend was made
  std::string last_checkpoint_;
  std::unique_ptr<RunLock> lock_;
  std::string nothing_to_do_;  // why a resumed run has no step to run ("" when it has)
  int64_t fp8_saturated_logged_ = 0;  // fp8_saturated_over_ranks() at the last warning
};

// Loss and perplexity of a checkpoint on a data split ("val" or "train"), on `device`:
// "cpu", "cuda" (the GPU model with the checkpoint's Linear kinds: an Error without a
// CUDA build, without a visible device, or for kinds the GPU does not run) or "auto" (the
// GPU when "cuda" would work).
EvalResult evaluate_checkpoint(const std::string& checkpoint, const std::string& data_dir, const std::string& split,
                               int max_batches, int batch_size = 0, int seq_len = 0, const std::string& device = "cpu");

}  // namespace esplag
