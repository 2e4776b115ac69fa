// `esplag import --hf`: a Hugging Face model directory (hf_config.h's families) read into
// an esplag model, and written as a run directory that eval, sample, export and
// train.init_from take.
//
//   DIR/config.json                        the architecture (hf_config.h)
//   DIR/model.safetensors                  the weights (F32, BF16, F16 or F64), or
//   DIR/model.safetensors.index.json       {"weight_map": {tensor: shard file}} and the shards
//   DIR/tokenizer.json                     copied into the run and recorded as its tokenizer
#pragma once
#include <memory>
#include <string>

#include "interop/hf_config.h"
#include "model/transformer.h"

namespace esplag {

struct HfModel {
  HfModelConfig config;
  std::unique_ptr<Transformer<float>> model;
};

// Reads config.json and the weights of DIR. Every problem is an Error naming the file and
// the field or tensor.
HfModel load_hf_model(const std::string& dir);

struct HfImport {
  HfModelConfig config;
  std::string checkpoint;      // RUN/step-000000
  std::string tokenizer;       // the spec the checkpoint records: RUN/tokenizer.json
  std::string tokenizer_note;  // "" when esplag reads the tokenizer, else why not
};

// Writes RUN (absent or empty): config.yaml, tokenizer.json, step-000000 (weights and
// state.json, no optimizer state: the import starts runs through train.init_from) and
// latest. Nothing is written before the whole model has been read and checked.
HfImport import_hf(const std::string& dir, const std::string& run_dir);

}  // namespace esplag
