#include "interop/hf_tensors.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace esplag {

namespace {

// A run of rows of an esplag parameter and the tensor transformers keeps them in.
struct Piece {
  std::string hf;          // the tensor's name; empty: rows the family does not have (zeros)
  int64_t rows = 0;        // esplag rows it fills (elements, for a vector)
  bool transpose = false;  // stored [in, out] (GPT-2's Conv1D)
};

struct Entry {
  std::string param;  // esplag name
  Shape shape;        // esplag shape
  std::vector<Piece> pieces;
};

int64_t cols_of(const Shape& s) { return s.size() == 2 ? s[1] : 1; }

// The Hugging Face shape of a piece of a parameter of shape `s`.
Shape hf_shape(const Piece& p, const Shape& s) {
  if (s.size() == 1) return {p.rows};
  return p.transpose ? Shape{s[1], p.rows} : Shape{p.rows, s[1]};
}

std::vector<Entry> gpt2_table(const ModelConfig& m) {
  const int64_t C = m.d_model, V = m.vocab_size, F = m.d_ff;
  const std::string t = "transformer.";
  std::vector<Entry> e = {{"embed.tokens.weight", {V, C}, {{t + "wte.weight", V}}},
                          {"embed.positions.weight", {m.max_seq_len, C}, {{t + "wpe.weight", m.max_seq_len}}}};
  for (int l = 0; l < m.n_layer; ++l) {
    const std::string b = "blocks." + std::to_string(l) + ".", h = t + "h." + std::to_string(l) + ".";
    auto linear = [&](const std::string& ours, const std::string& theirs, int64_t out, int64_t in) {
      e.push_back({b + ours + ".weight", {out, in}, {{h + theirs + ".weight", out, true}}});
      e.push_back({b + ours + ".bias", {out}, {{h + theirs + ".bias", out}}});
    };
    auto norm = [&](const std::string& ours, const std::string& theirs) {
      e.push_back({b + ours + ".weight", {C}, {{h + theirs + ".weight", C}}});
      e.push_back({b + ours + ".bias", {C}, {{h + theirs + ".bias", C}}});
    };
    norm("norm1", "ln_1");
    linear("attn.qkv", "attn.c_attn", 3 * C, C);
    linear("attn.proj", "attn.c_proj", C, C);
    norm("norm2", "ln_2");
    linear("mlp.fc", "mlp.c_fc", F, C);
    linear("mlp.proj", "mlp.c_proj", C, F);
  }
  e.push_back({"norm_f.weight", {C}, {{t + "ln_f.weight", C}}});
  e.push_back({"norm_f.bias", {C}, {{t + "ln_f.bias", C}}});
  if (!m.tie_embeddings) e.push_back({"lm_head.weight", {V, C}, {{"lm_head.weight", V}}});
  return e;
}

std::vector<Entry> llama_table(const HfModelConfig& hf) {
  const ModelConfig& m = hf.model;
  const int64_t C = m.d_model, V = m.vocab_size, F = m.d_ff, HD = m.head_dim();
  const int64_t NQ = m.n_head * HD, NK = m.n_kv_head * HD;
  std::vector<Entry> e = {{"embed.tokens.weight", {V, C}, {{"model.embed_tokens.weight", V}}}};
  for (int l = 0; l < m.n_layer; ++l) {
    const std::string b = "blocks." + std::to_string(l) + ".", h = "model.layers." + std::to_string(l) + ".";
    // One esplag linear from stacked projections; its bias (when the model has biases)
    // from theirs, or zeros where the family has none.
    auto linear = [&](const std::string& ours, std::vector<std::pair<std::string, int64_t>> parts, int64_t in,
                      bool has_bias) {
      Entry w{b + ours + ".weight", {0, in}, {}}, bias{b + ours + ".bias", {0}, {}};
      for (const auto& [name, rows] : parts) {
        w.pieces.push_back({h + name + ".weight", rows});
        bias.pieces.push_back({has_bias ? h + name + ".bias" : "", rows});
        w.shape[0] += rows;
      }
      bias.shape[0] = w.shape[0];
      e.push_back(w);
      if (m.bias) e.push_back(bias);
    };
    e.push_back({b + "norm1.weight", {C}, {{h + "input_layernorm.weight", C}}});
    linear("attn.qkv", {{"self_attn.q_proj", NQ}, {"self_attn.k_proj", NK}, {"self_attn.v_proj", NK}}, C, hf.qkv_bias);
    linear("attn.proj", {{"self_attn.o_proj", C}}, NQ, hf.o_bias);
    e.push_back({b + "norm2.weight", {C}, {{h + "post_attention_layernorm.weight", C}}});
    linear("mlp.fc", {{"mlp.gate_proj", F}, {"mlp.up_proj", F}}, C, hf.mlp_bias);
    linear("mlp.proj", {{"mlp.down_proj", C}}, F, hf.mlp_bias);
  }
  e.push_back({"norm_f.weight", {C}, {{"model.norm.weight", C}}});
  if (!m.tie_embeddings) e.push_back({"lm_head.weight", {V, C}, {{"lm_head.weight", V}}});
  return e;
}

std::vector<Entry> table(const HfModelConfig& hf) {
  return hf.family == HfFamily::gpt2 ? gpt2_table(hf.model) : llama_table(hf);
}

// Buffers, not weights, that older transformers versions saved with the model.
bool is_saved_buffer(const std::string& name) {
  auto ends = [&](const std::string& s) {
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  return ends(".attn.bias") || ends(".attn.masked_bias") || ends("rotary_emb.inv_freq");
}

bool floating(DType t) { return t == DType::f32 || t == DType::f64 || t == DType::bf16 || t == DType::f16; }

// GPT-2 checkpoints saved from GPT2Model (the original gpt2 upload among them) lack the
// "transformer." prefix.
std::string canonical_name(const HfModelConfig& hf, const std::string& name) {
  if (hf.family != HfFamily::gpt2) return name;
  for (const char* p : {"wte.", "wpe.", "h.", "ln_f."})
    if (name.rfind(p, 0) == 0) return "transformer." + name;
  return name;
}

}  // namespace

std::map<std::string, Tensor> esplag_params_from_hf(const HfModelConfig& hf, const std::map<std::string, Tensor>& in,
                                                    const std::string& where) {
  std::map<std::string, const Tensor*> tensors;
  for (const auto& [name, t] : in) {
    const std::string c = canonical_name(hf, name);
    ESPLAG_CHECK(!tensors.count(c), where, ": tensor '", name, "' is given twice (as '", c, "' too)");
    tensors[c] = &t;
  }
  const std::string kind = hf.model_type + " model of this config.json";
  std::map<std::string, bool> used;
  std::map<std::string, Tensor> out;
  for (const Entry& e : table(hf)) {
    Tensor dst = Tensor::zeros(e.shape, DType::f32, e.param);
    const int64_t cols = cols_of(e.shape);
    int64_t row = 0;
    for (const Piece& p : e.pieces) {
      if (!p.hf.empty()) {
        auto it = tensors.find(p.hf);
        ESPLAG_CHECK(it != tensors.end(), where, ": tensor '", p.hf, "' of the ", kind, " is missing");
        const Tensor& t = *it->second;
        ESPLAG_CHECK(floating(t.dtype()), where, ": tensor '", p.hf, "' is stored as ", dtype_safetensors(t.dtype()),
                     ", but weights must be F32, BF16, F16 or F64");
        const Shape want = hf_shape(p, e.shape);
        ESPLAG_CHECK(t.shape() == want, where, ": tensor '", p.hf, "' has shape ", shape_str(t.shape()), ", but the ",
                     kind, " needs ", shape_str(want));
        const Tensor f = t.to(DType::f32);
        const float* s = f.data<float>();
        float* d = dst.data<float>() + row * cols;
        if (p.transpose) {
          for (int64_t r = 0; r < p.rows; ++r)
            for (int64_t c = 0; c < cols; ++c) d[r * cols + c] = s[c * p.rows + r];
        } else {
          std::copy_n(s, p.rows * cols, d);
        }
        used[p.hf] = true;
      }
      row += p.rows;
    }
    out.emplace(e.param, dst);
  }
  for (const auto& [name, t] : tensors) {
    if (used.count(name) || is_saved_buffer(name)) continue;
    if (name == "lm_head.weight" && hf.model.tie_embeddings) {
      // Some writers save the tied head anyway: harmless when it is the embedding itself.
      const Tensor head = t->to(DType::f32);
      const Tensor& emb = out.at("embed.tokens.weight");
      const bool same = head.shape() == emb.shape() &&
                        std::memcmp(head.data<float>(), emb.data<float>(), emb.nbytes()) == 0;
      ESPLAG_CHECK(same, where, ": tensor 'lm_head.weight' differs from the embedding, but config.json ties them ",
                   "(tie_word_embeddings true)");
      continue;
    }
    fail(where, ": tensor '", name, "' is not part of a ", kind, " (an extra tensor: another architecture or option?)");
  }
  return out;
}

std::vector<Tensor> hf_tensors_from_esplag(const HfModelConfig& hf, const std::map<std::string, Tensor>& params) {
  std::vector<Tensor> out;
  for (const Entry& e : table(hf)) {
    auto it = params.find(e.param);
    const float* src = nullptr;
    const bool bias = e.param.size() > 5 && e.param.compare(e.param.size() - 5, 5, ".bias") == 0;
    ESPLAG_CHECK(it != params.end() || bias, "export --hf: the model has no parameter '", e.param, "'");
    if (it != params.end()) {
      ESPLAG_CHECK(it->second.shape() == e.shape && it->second.dtype() == DType::f32, "export --hf: parameter '",
                   e.param, "' has shape ", shape_str(it->second.shape()), ", expected ", shape_str(e.shape));
      src = it->second.data<float>();
    }
    const int64_t cols = cols_of(e.shape);
    int64_t row = 0;
    for (const Piece& p : e.pieces) {
      if (!p.hf.empty()) {
        Tensor t = Tensor::zeros(hf_shape(p, e.shape), DType::f32, p.hf);
        float* d = t.data<float>();
        const float* s = src ? src + row * cols : nullptr;
        if (s && p.transpose) {
          for (int64_t r = 0; r < p.rows; ++r)
            for (int64_t c = 0; c < cols; ++c) d[c * p.rows + r] = s[r * cols + c];
        } else if (s) {
          std::copy_n(s, p.rows * cols, d);
        }
        out.push_back(t);
      }
      row += p.rows;
    }
  }
  return out;
}

}  // namespace esplag
