// `esplag export --hf`: a model written as a Hugging Face model directory that
// transformers' AutoModelForCausalLM.from_pretrained loads:
//
//   DIR/config.json         the family's config (hf_config.h), torch_dtype float32
//   DIR/model.safetensors   dense f32 weights, named and shaped as transformers saves them
//                           (hf_tensors.h); metadata {"format": "pt"}, which transformers requires
//   DIR/tokenizer.json      the model's tokenizer: its tokenizer.json copied, or for the byte
//                           tokenizer an equivalent byte-level BPE without merges
#pragma once
#include <string>

#include "interop/hf_config.h"
#include "model/transformer.h"

namespace esplag {

struct HfExport {
  HfModelConfig config;
  size_t tensors = 0;
  std::string tokenizer_note;  // "" when tokenizer.json was written, else why not
};

// Writes the files above into `dir` (created if absent; files of those names are replaced,
// others left alone). Sparse Linear kinds export their effective dense weight.
// `tokenizer` is the checkpoint's tokenizer spec ("byte" or a tokenizer.json path).
HfExport export_hf(Transformer<float>& model, const std::string& tokenizer, const std::string& dir);

}  // namespace esplag
