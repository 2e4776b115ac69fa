// A real checkpoint of the default model (byte vocabulary) at step 100, written by
// save_checkpoint: the state target replaces its state.json with each input, and the seed
// writer takes that file as the state target's seed.
#pragma once
#include <string>

#include "model/transformer.h"
#include "train/checkpoint.h"

namespace esplag::fuzz {

inline std::string save_default_checkpoint(const std::string& run_dir) {
  TrainConfig config;
  config.model.vocab_size = 257;
  Transformer<float> model(config.model);
  Moments m, v;
  for (const auto& p : model.trainable_params()) {
    m[p.name].assign(shape_numel(p.shape), 0.0f);
    v[p.name].assign(shape_numel(p.shape), 0.0f);
  }
  TrainerState state;
  state.step = 100;
  state.tokens_seen = 102400;
  state.data.position = 100;
  return save_checkpoint(run_dir, model, config, "byte", state, m, v);
}

}  // namespace esplag::fuzz
