// The name and layout mapping between esplag's parameters (model/transformer.h) and the
// tensors transformers saves for a family (hf_config.h). Per block l:
//
//   esplag                     gpt2 (transformer.h.l.)       llama (model.layers.l.)
//   norm1.weight/.bias         ln_1.weight/.bias             input_layernorm.weight
//   attn.qkv.weight [Q, C]     attn.c_attn.weight [C, 3C]ᵀ   self_attn.{q,k,v}_proj.weight, rows stacked
//   attn.proj.weight [C, C]    attn.c_proj.weight ᵀ          self_attn.o_proj.weight
//   norm2.weight/.bias         ln_2.weight/.bias             post_attention_layernorm.weight
//   mlp.fc.weight [F, C]       mlp.c_fc.weight ᵀ             mlp.{gate,up}_proj.weight, rows stacked
//   mlp.proj.weight [C, d_ff]  mlp.c_proj.weight ᵀ           mlp.down_proj.weight
//
// (ᵀ: GPT-2's Conv1D stores [in, out]; biases follow their weights' rows.) Outside the
// blocks: embed.tokens <-> transformer.wte / model.embed_tokens, embed.positions <->
// transformer.wpe, norm_f <-> transformer.ln_f / model.norm, lm_head <-> lm_head.
// No row permutation: esplag's RoPE pairs dimension i with i + head_size/2 (rotate_half),
// the convention of transformers' LLaMA weights.
#pragma once
#include <map>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "interop/hf_config.h"

namespace esplag {

// esplag parameters (f32, by name, for every parameter of a model of hf.model) from the
// tensors of a checkpoint of that family (any floating dtype). Biases the family lacks
// are zeros (hf_config.h). Errors name `where` and the tensor: one that is missing, has
// another shape or an integer dtype, or is not part of the model (buffers transformers
// saved with old versions, attn.bias, attn.masked_bias and rotary_emb.inv_freq, are
// skipped; a tied model's lm_head.weight is accepted when it equals the embedding).
std::map<std::string, Tensor> esplag_params_from_hf(const HfModelConfig& hf, const std::map<std::string, Tensor>& tensors,
                                                    const std::string& where);

// The family's tensors (f32, named as transformers names them) from esplag's dense
// parameters: the inverse of esplag_params_from_hf. GPT-2 biases of a model without
// biases are written as zeros.
std::vector<Tensor> hf_tensors_from_esplag(const HfModelConfig& hf, const std::map<std::string, Tensor>& params);

}  // namespace esplag
