// `esplag export --hf`: a model written as a Hugging Face model directory that
// transformers' AutoModelForCausalLM.from_pretrained loads:
//
//   DIR/config.json         the family's config (hf_config.h), torch_dtype float32
//   DIR/model.safetensors   dense f32 weights, named and shaped as transformers saves them
//                           (hf_tensors.h); metadata {"format": "pt"}, which transformers requires
//   DIR/tokenizer.json      the model's tokenizer: its tokenizer.json copied, or for the byte
//                           tokenizer an equivalent byte-level BPE without merges
//
// With `sparse_24` (LLaMA-shaped models whose block linears are 2:4), model.safetensors holds
// every block linear's weight in compressed-tensors' sparse-24-bitmask layout (hf_sparse24.h)
// and config.json its quantization_config; embeddings, norms, biases and lm_head stay dense.
#pragma once
#include <string>

#include "interop/hf_config.h"
#include "model/transformer.h"

namespace esplag {

struct HfExport {
  HfModelConfig config;
  size_t tensors = 0;
  std::string tokenizer_note;  // "" when tokenizer.json was written, else why not
  size_t compressed = 0;       // weights written in the sparse-24-bitmask layout
  double global_sparsity = 0;  // with sparse_24: the fraction of zeros over all parameters
};

// Writes the files above into `dir` (created if absent; files of those names are replaced,
// others left alone). Sparse Linear kinds export their effective dense weight (what forward
// multiplies by, adapters included). `tokenizer` is the checkpoint's tokenizer spec ("byte" or
// a tokenizer.json path). With `sparse_24`, a GPT-2 model, or a block linear whose effective
// weight is not 2:4, is an Error (naming the layer) and nothing is written.
HfExport export_hf(Transformer<float>& model, const std::string& tokenizer, const std::string& dir,
                   bool sparse_24 = false);

}  // namespace esplag
