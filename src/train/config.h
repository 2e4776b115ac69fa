// The run configuration: one YAML file with sections model, data, train, optimizer and
// schedule, and the sparsity `recipe` list. Every key is known and has a type and a range
// (one table in config.cpp): an unknown key, a value of the wrong type or out of its range,
// or an impossible combination is an Error naming the file, the key and the value, before
// anything is created. `--set key=value` overrides use the same dotted keys (e.g.
// `--set optimizer.lr=1e-3`); a recipe modifier's key is `recipe.<index>.<type>.<key>`.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "model/activation_checkpointing.h"
#include "model/config.h"
#include "model/linear_precision.h"
#include "train/recipe.h"
#include "train/schedule.h"

namespace esplag {

struct OptimizerConfig {
  double lr = 3e-3;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  double grad_clip = 1.0;  // max global grad norm; <= 0 turns clipping off
};

// How the ranks of a data-parallel run (docs/distributed.md) share the training state.
struct ParallelConfig {
  // ZeRO stage: 0 keeps the whole state on every rank (plain data parallel); 1 shards the
  // optimizer state, 2 the gradients too, 3 the parameters too (train.device cuda only, and
  // with every layer's kind fixed from step 0: docs/distributed.md).
  int zero = 0;
  // GPU runs: the gradients are averaged over the ranks in buckets of at least this many MiB
  // of consecutive blocks, each as soon as the backward has finished it, overlapping the
  // rest of the backward (docs/distributed.md); 0: one collective after the backward.
  double bucket_mb = 25;
};

struct TrainConfig {
  ModelConfig model;
  std::string data_path = "data/kjv";  // a directory written by `esplag data prepare`
  int batch_size = 16;
  int seq_len = 64;
  int grad_accum = 1;
  int64_t steps = 300;
  uint64_t seed = 1337;
  std::string device = "auto";  // auto | cpu | cuda
  int64_t log_every = 10;
  int64_t eval_every = 100;  // 0: only at the end
  int eval_batches = 16;
  int64_t checkpoint_every = 100;  // 0: only at the end
  int keep_checkpoints = 2;        // newest N step directories are kept; 0 keeps all
  ActivationCheckpointing checkpointing;  // train.checkpointing, train.checkpointing_every
  // train.memory: fixed runs the settings as written; auto chooses train.checkpointing for
  // the memory at hand when the run starts (train/memory_plan.h, apply_train_memory).
  std::string memory = "fixed";
  // train.offload: none | optimizer | optimizer+master, GPU training only (docs/memory.md):
  // where AdamW's moments (optimizer) and also the low halves of the master weights
  // (optimizer+master) live: pinned host memory that the update kernel reads across PCIe.
  std::string offload = "none";
  // train.precision: bf16 | fp8, the block Linear layers' products (docs/fp8.md). On the CPU,
  // bf16 computes in fp32 as every other op does; fp8 emulates e4m3 operands (model/linear_precision.h).
  std::string precision = "bf16";
  // train.fp8_grad: e4m3 | e5m2, the output gradient's format in fp8 (docs/fp8.md says why e4m3).
  std::string fp8_grad = "e4m3";
  // train.fp8_scaling: current | delayed, where X's and dY's fp8 scales come from: each
  // tensor's own amax, or the largest of the last train.fp8_amax_history steps' amaxes
  // (model/fp8_amax_history.h; docs/fp8.md, "Delayed scaling").
  std::string fp8_scaling = "current";
  int fp8_amax_history = 16;
  // train.sparse_dispatch: measure | sparse, the GPU's choice of products for 2:4 layers
  // (semi_sparse, semi_sparse_activation, slope): the faster of the 2:4 and the dense
  // products of the same operands, timed per layer shape when the layers appear; or the
  // 2:4 products everywhere, which makes runs repeat to the bit (docs/sparse-gpu.md).
  std::string sparse_dispatch = "measure";
  // A run or checkpoint directory (e.g. one `esplag import` wrote) whose weights start the
  // run instead of the initialisation, at step 0 with fresh optimizer state; the model
  // section is then the checkpoint's (train/checkpoint.h, init_from_model).
  std::string init_from;
  OptimizerConfig optimizer;
  ParallelConfig parallel;
  LrSchedule schedule;  // schedule.lr and total_steps mirror optimizer.lr and steps
  // The top-level `recipe:` list (sparsity modifiers, see docs/recipes.md) as YAML text;
  // empty for dense training. Parsed and validated against the model by the trainer.
  std::string recipe_yaml;
  // The file the config was read from (parse_train_config's `source`): recipe errors and the
  // recipe summary name it. Not a config key, not saved.
  std::string source = "config";
  // The model.* keys the config file or --set gave (model.preset among them), which
  // train.init_from checks against the checkpoint's model. Not a config key, not saved.
  std::vector<std::string> model_keys_given;

  // Checks every key's range, the model's shape (all but a vocab_size of 0, which the
  // dataset fills in) and the recipe against the model's linear weights and train.steps.
  void validate() const;
  // The checks of validate() that do not depend on the model section (what a config with
  // train.init_from can be checked for before the checkpoint's model is known).
  void validate_settings() const;
  // train.precision and the train.fp8_* settings as the model's layers take them.
  LinearPrecision linear_precision() const;
  // The recipe list, parsed (errors and describe() name `source`); empty for dense training.
  Recipe recipe() const;
};

// Flat "section.key" -> scalar text view of a config, in a stable order.
using FlatConfig = std::vector<std::pair<std::string, std::string>>;

// Reads a YAML file and applies overrides ("key=value"). `source` names the file in errors.
TrainConfig load_train_config(const std::string& path, const std::vector<std::string>& overrides = {});
// Same, from YAML text (used by tests and by --resume, which reads the saved config).
TrainConfig parse_train_config(const std::string& yaml_text, const std::string& source,
                               const std::vector<std::string>& overrides = {});
// Every resolved value, as YAML text that parse_train_config reads back to the same config.
std::string to_yaml(const TrainConfig& c);
FlatConfig flatten(const TrainConfig& c);

}  // namespace esplag
