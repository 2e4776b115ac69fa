#include "model/config.h"

#include <cstdint>
#include <utility>

#include "core/error.h"

namespace esplag {

void ModelConfig::validate() const {
  ESPLAG_CHECK(vocab_size > 0, "model.vocab_size must be positive, got ", vocab_size);
  validate_shape();
}

void ModelConfig::validate_shape() const {
  const std::pair<const char*, int> sizes[] = {{"model.max_seq_len", max_seq_len}, {"model.n_layer", n_layer},
                                                {"model.n_head", n_head},           {"model.n_kv_head", n_kv_head},
                                                {"model.d_model", d_model},         {"model.d_ff", d_ff}};
  for (const auto& [key, value] : sizes) ESPLAG_CHECK(value > 0, key, " must be positive, got ", value);
  ESPLAG_CHECK(d_model % n_head == 0, "model.d_model (", d_model, ") must be a multiple of model.n_head (", n_head,
               "): the head size is d_model / n_head");
  ESPLAG_CHECK(n_head % n_kv_head == 0, "model.n_head (", n_head, ") must be a multiple of model.n_kv_head (",
               n_kv_head, ")");
  ESPLAG_CHECK(pos != PosKind::rope || head_dim() % 2 == 0, "model.pos rope needs an even head size (model.d_model / ",
               "model.n_head), got ", d_model, " / ", n_head, " = ", head_dim());
  // The widths of the fused linears are ints.
  const int64_t qkv = (int64_t(n_head) + 2 * int64_t(n_kv_head)) * head_dim();
  const int64_t fc = (mlp == MlpKind::swiglu ? 2 : 1) * int64_t(d_ff);
  ESPLAG_CHECK(qkv <= INT32_MAX, "model.d_model (", d_model, ") and model.n_kv_head (", n_kv_head,
               ") give a qkv width of ", qkv, ", more than ", INT32_MAX);
  ESPLAG_CHECK(fc <= INT32_MAX, "model.d_ff (", d_ff, ") gives an MLP width of ", fc, ", more than ", INT32_MAX);
}

int64_t ModelConfig::num_params() const {
  const int64_t C = d_model, V = vocab_size, F = fc_dim(), Q = qkv_dim();
  const int64_t norm_params = norm == NormKind::layernorm ? 2 * C : C;
  int64_t per_block = 2 * norm_params + C * Q + C * C + C * F + d_ff * C;
  if (bias) per_block += Q + C + F + C;
  int64_t total = V * C + n_layer * per_block + norm_params;
  if (pos == PosKind::learned) total += int64_t(max_seq_len) * C;
  if (!tie_embeddings) total += V * C;
  return total;
}

double ModelConfig::train_flops_per_token(int seq_len) const {
  // Matmul parameters (embeddings are lookups, but a tied or untied head is a matmul).
  const double C = d_model, F = fc_dim();
  const double matmul_params = n_layer * (C * qkv_dim() + C * C + C * F + d_ff * C) + double(vocab_size) * C;
  // Causal attention: QKᵀ and AV, 2 FLOPs per MAC, half the square on average, x3 for fwd+bwd.
  const double attn = n_layer * 2.0 * 2.0 * seq_len * C * 0.5 * 3.0;
  return 6.0 * matmul_params + attn;
}

ModelConfig model_preset(const std::string& name) {
  ModelConfig c;
  c.preset = name;
  if (name == "tiny") return c;  // the defaults above: ~0.4M parameters with a byte vocabulary
  if (name == "gpt2-124m" || name == "gpt2-350m") {
    c.vocab_size = 50257;
    c.max_seq_len = 1024;
    c.n_layer = name == "gpt2-124m" ? 12 : 24;
    c.n_head = c.n_kv_head = name == "gpt2-124m" ? 12 : 16;
    c.d_model = name == "gpt2-124m" ? 768 : 1024;
    c.d_ff = 4 * c.d_model;
    return c;
  }
  c.norm = NormKind::rmsnorm;
  c.pos = PosKind::rope;
  c.mlp = MlpKind::swiglu;
  c.tie_embeddings = false;
  c.bias = false;
  if (name == "llama-tiny") {  // a LLaMA-style counterpart of tiny, with grouped-query heads
    c.n_layer = 2;
    c.n_head = 4;
    c.n_kv_head = 2;
    c.d_model = 64;
    c.d_ff = 176;
    return c;
  }
  c.vocab_size = 32000;
  if (name == "llama-1b") {
    c.max_seq_len = 2048;
    c.n_layer = 16;
    c.n_head = c.n_kv_head = 16;
    c.d_model = 2048;
    c.d_ff = 5632;
    return c;
  }
  if (name == "llama-7b") {
    c.max_seq_len = 4096;
    c.n_layer = 32;
    c.n_head = c.n_kv_head = 32;
    c.d_model = 4096;
    c.d_ff = 11008;
    return c;
  }
  std::string known;
  for (const auto& n : model_preset_names()) known += (known.empty() ? "" : ", ") + n;
  fail("unknown model preset '", name, "' (known: ", known, ")");
}

std::vector<std::string> model_preset_names() {
  return {"tiny", "llama-tiny", "gpt2-124m", "gpt2-350m", "llama-1b", "llama-7b"};
}

std::string to_string(NormKind k) { return k == NormKind::layernorm ? "layernorm" : "rmsnorm"; }
std::string to_string(PosKind k) { return k == PosKind::learned ? "learned" : "rope"; }
std::string to_string(MlpKind k) {
  return k == MlpKind::gelu ? "gelu" : k == MlpKind::swiglu ? "swiglu" : "relu2";
}
NormKind norm_kind_from(const std::string& s) {
  if (s == "layernorm") return NormKind::layernorm;
  if (s == "rmsnorm") return NormKind::rmsnorm;
  fail("model.norm must be layernorm or rmsnorm, got '", s, "'");
}
PosKind pos_kind_from(const std::string& s) {
  if (s == "learned") return PosKind::learned;
  if (s == "rope") return PosKind::rope;
  fail("model.pos must be learned or rope, got '", s, "'");
}
MlpKind mlp_kind_from(const std::string& s) {
  if (s == "gelu") return MlpKind::gelu;
  if (s == "swiglu") return MlpKind::swiglu;
  if (s == "relu2") return MlpKind::relu2;
  fail("model.mlp must be gelu, swiglu or relu2, got '", s, "'");
}

}  // namespace esplag
