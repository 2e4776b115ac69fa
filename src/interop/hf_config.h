// Hugging Face config.json <-> ModelConfig, for the two families esplag's model covers:
//
//   gpt2   GPT2LMHeadModel: LayerNorm, learned positions, GELU (tanh form), biases
//   llama  LlamaForCausalLM (and the LLaMA-shaped MistralForCausalLM, Qwen2ForCausalLM):
//          RMSNorm, rotary positions, SwiGLU, grouped-query heads
//
// Everything that would change the arithmetic and that esplag's model does not have
// (another activation, rope_scaling, a sliding window, quantization) is an
// Error naming the field and the file, never a model that computes something else.
#pragma once
#include <string>

#include "model/config.h"

namespace esplag {

enum class HfFamily { gpt2, llama };

struct HfModelConfig {
  HfFamily family = HfFamily::gpt2;
  std::string model_type;  // "gpt2", "llama", "mistral", "qwen2"
  ModelConfig model;       // bias: the model has biases at all (LLaMA-shaped: see below)
  // LLaMA-shaped models have biases on some linears only; esplag's `bias` puts one on every
  // linear, so the ones the checkpoint lacks are imported as zeros.
  bool qkv_bias = false;  // q_proj, k_proj, v_proj
  bool o_bias = false;    // o_proj
  bool mlp_bias = false;  // gate_proj, up_proj, down_proj
};

// Parses config.json (`path` names it in errors).
HfModelConfig parse_hf_config(const std::string& json_text, const std::string& path);

// The family a model of `m` exports as, or an Error naming the model key that has no
// Hugging Face counterpart (e.g. model.mlp relu2).
HfModelConfig hf_config_for(const ModelConfig& m);

// config.json text for `hf` as transformers writes it (keys sorted); eot_token >= 0 is
// written as bos_token_id and eos_token_id.
std::string hf_config_json(const HfModelConfig& hf, int eot_token);

std::string to_string(HfFamily f);

}  // namespace esplag
