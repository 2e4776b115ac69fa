// Checkpoints: one directory per saved step, written under a temporary name and renamed
// into place, so a crash or a full disk never leaves a half-written checkpoint and never
// touches an existing one.
//
//   RUN/step-000100/model.safetensors      weights (f32); config, tokenizer, step and the
//                                          schedule's total in __metadata__
//   RUN/step-000100/optimizer.safetensors  AdamW moments "m.<param>", "v.<param>"
//   RUN/step-000100/state.json             step, RNG state, data position, tokens seen
//   RUN/latest                             name of the newest complete checkpoint (step-NNNNNN)
//
// Loading checks every tensor: a dtype its role does not allow, or a non-finite value, is
// an Error naming the tensor.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/rng.h"
#include "data/loader.h"
#include "model/transformer.h"
#include "train/config.h"

namespace esplag {

struct TrainerState {
  int64_t step = 0;  // number of optimizer steps completed
  int64_t tokens_seen = 0;
  Rng::State rng{};
  DataLoader::State data{};
};

// AdamW moments per trained tensor (see Transformer::trainable_params), by name.
using Moments = std::map<std::string, std::vector<float>>;
// The same as views of memory held elsewhere (a Moments, or a device's offloaded state):
// what a checkpoint writes, without another copy of the moments.
using MomentViews = std::map<std::string, std::span<const float>>;
MomentViews views_of(const Moments& m);

struct CheckpointContents {
  TrainConfig config;     // with schedule.total_steps as the run's schedule had it
  std::string tokenizer;  // tokenizer spec of the data the model was trained on
  // state.step is the model metadata's step; the rest comes from state.json when it is
  // `valid`: present, well formed, and at the step of the metadata and of the directory's
  // name. Only resuming needs it: inference and export read the metadata alone.
  TrainerState state;
  enum class StateFile { valid, missing, invalid };
  StateFile state_file = StateFile::missing;
  std::string state_problem;  // when not valid: one sentence naming the file and the field
};

// Writes RUN/step-XXXXXX (atomically) and updates RUN/latest. Returns the checkpoint
// directory. model.safetensors holds every trained tensor (the flat parameters and what
// Linear kinds own, e.g. compressed kept values instead of a dense weight) plus the kinds'
// state; optimizer.safetensors holds "m.<name>" and "v.<name>" for each of them.
std::string save_checkpoint(const std::string& run_dir, Transformer<float>& model, const TrainConfig& config,
                            const std::string& tokenizer, const TrainerState& state, const MomentViews& m,
                            const MomentViews& v);
// The same without optimizer.safetensors: a checkpoint that eval, sample, export and
// train.init_from read, but that cannot be resumed (imported models are saved so).
std::string save_weights_checkpoint(const std::string& run_dir, Transformer<float>& model, const TrainConfig& config,
                                    const std::string& tokenizer, const TrainerState& state);

// Resolves DIR to a checkpoint directory: DIR itself if it holds model.safetensors,
// else the checkpoint named by DIR/latest, which must be the bare name of a step directory
// of DIR (step-NNNNNN: no path, no "..").
std::string resolve_checkpoint(const std::string& dir);

// Reads the config and metadata of a checkpoint (no weights), and its trainer state
// (never an Error for state.json: see CheckpointContents::state_file).
CheckpointContents read_checkpoint_info(const std::string& checkpoint_dir);

// Loads the trained tensors into `model`, whose Linear kinds must already be those the
// checkpoint was saved with (shapes must match exactly: an Error names the tensor), and,
// when m/v are given, the optimizer moments.
void load_checkpoint_weights(const std::string& checkpoint_dir, Transformer<float>& model, Moments* m = nullptr,
                             Moments* v = nullptr);

// The model of a checkpoint, ready for inference or export: built from the saved config,
// with every Linear kind the recipe had given it by the saved step, and the saved values.
std::unique_ptr<Transformer<float>> load_model(const std::string& checkpoint_dir, CheckpointContents* info = nullptr);

// train.init_from: the model section a run of `config` trains, the model of the checkpoint
// of config.init_from (a run or checkpoint directory). Every model key the config gave
// (all of them when it gave model.preset; not init_std, nor a vocab_size of 0) must agree
// with it, and the data's tokenizer `data_tokenizer` must be the checkpoint's (the same
// spec, or tokenizer files of the same content): otherwise an Error naming the key.
ModelConfig init_from_model(const TrainConfig& config, const std::string& data_tokenizer);

// Whether two tokenizer specs name the same tokenizer: the same spec, or files of the same
// content (an imported run keeps its own copy of the tokenizer its data was prepared with).
bool same_tokenizer(const std::string& a, const std::string& b);
// Copies the weights of init_from's checkpoint into `model` (of init_from_model's config):
// every parameter, a sparse Linear's as its effective dense weight.
void load_init_weights(const std::string& init_from, Transformer<float>& model);

// Removes all but the newest `keep` step directories of a run (keep == 0 keeps all).
void prune_checkpoints(const std::string& run_dir, int keep);

}  // namespace esplag
