// esplag import: a Hugging Face model directory as an esplag run directory (interop/hf_import.h).
#include <cstdio>

#include "commands.h"
#include "interop/hf_import.h"

namespace esplag::cli {

namespace {

int import_model(const Args& a) {
  const HfImport r = import_hf(a.get("hf"), a.get("out"));
  const ModelConfig& m = r.config.model;
  std::printf("imported %s (%s family): %d layers, d_model %d, %d heads (%d key/value), vocabulary %d, %.2fM "
              "parameters\nwrote %s\n",
              r.config.model_type.c_str(), to_string(r.config.family).c_str(), m.n_layer, m.d_model, m.n_head,
              m.n_kv_head, m.vocab_size, m.num_params() / 1e6, r.checkpoint.c_str());
  if (!r.tokenizer_note.empty())
    std::printf("note: esplag's tokenizer cannot read %s (%s): sample and data prepare (token shards for "
                "eval and training) need one it reads\n",
                r.tokenizer.c_str(), r.tokenizer_note.c_str());
  return 0;
}

}  // namespace

const Command kImport = {
    "import",
    "turn a Hugging Face model directory into an esplag run directory",
    "Reads config.json, model.safetensors (or the shards of model.safetensors.index.json) and tokenizer.json of\n"
    "a GPT-2 (GPT2LMHeadModel) or LLaMA-shaped (LlamaForCausalLM, Mistral, Qwen2) model, and writes --out with\n"
    "config.yaml, tokenizer.json and step-000000 (weights, no optimizer state). eval, sample and export read it;\n"
    "training starts from it with train.init_from. Anything esplag's model would compute differently is an\n"
    "error naming the field or tensor (docs/interop.md).",
    {
        Option::text("hf", "DIR", "", "the Hugging Face model directory").mandatory(),
        Option::text("out", "RUN_DIR", "", "the run directory to write (absent or empty)").mandatory(),
    },
    import_model,
};

}  // namespace esplag::cli
