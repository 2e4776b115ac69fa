// Transformer shape and flavour. One config covers GPT-2 style (LayerNorm, learned
// positions, GELU, tied embeddings, biases) and LLaMA style (RMSNorm, RoPE, SwiGLU,
// untied head, grouped-query attention, no biases).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace esplag {

enum class NormKind { layernorm, rmsnorm };
enum class PosKind { learned, rope };
enum class MlpKind { gelu, swiglu, relu2 };

struct ModelConfig {
  static constexpr double kMaxNormEps = 1e-2;
  std::string preset = "tiny";
  int vocab_size = 0;  // 0: taken from the dataset's meta.json
  int max_seq_len = 128;
  int n_layer = 3;
  int n_head = 4;
  int n_kv_head = 4;
  int d_model = 96;
  int d_ff = 384;
  NormKind norm = NormKind::layernorm;
  PosKind pos = PosKind::learned;
  MlpKind mlp = MlpKind::gelu;
  bool tie_embeddings = true;
  bool bias = true;
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;  // added to the variance (LayerNorm) or mean square (RMSNorm), in (0, kMaxNormEps]
  double init_std = 0.02;

  int head_dim() const { return d_model / n_head; }
  int qkv_dim() const { return (n_head + 2 * n_kv_head) * head_dim(); }
  // Width of the first MLP linear: SwiGLU needs gate and up halves.
  int fc_dim() const { return mlp == MlpKind::swiglu ? 2 * d_ff : d_ff; }
  // Throws Error naming the key (model.d_model, ...) when the shape is impossible.
  void validate() const;
  // The same, but for vocab_size (0 in a config: the dataset's vocabulary, filled in later).
  void validate_shape() const;
  int64_t num_params() const;
  // FLOPs of one training step per token (6·N for the matmuls + attention), for MFU.
  double train_flops_per_token(int seq_len) const;
};

// Named presets: tiny, gpt2-124m, gpt2-350m, llama-tiny, llama-1b, llama-7b.
ModelConfig model_preset(const std::string& name);
std::vector<std::string> model_preset_names();

std::string to_string(NormKind k);
std::string to_string(PosKind k);
std::string to_string(MlpKind k);
NormKind norm_kind_from(const std::string& s);
PosKind pos_kind_from(const std::string& s);
MlpKind mlp_kind_from(const std::string& s);

}  // namespace esplag
