#include "interop/hf_config.h"

#include <cmath>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/json.h"

namespace esplag {

namespace {

using nlohmann::json;

// Typed reads of config.json fields, each Error naming the field and the file.
struct Fields {
  const json& js;
  const std::string& path;

  bool has(const char* key) const { return js.contains(key) && !js[key].is_null(); }
  int positive(const char* key) const {
    ESPLAG_CHECK(js.contains(key), path, ": field '", key, "' is missing");
    const json& v = js[key];
    ESPLAG_CHECK(v.is_number_integer() && v.get<int64_t>() > 0 && v.get<int64_t>() <= INT32_MAX, path, ": field '",
                 key, "' must be a positive integer, got ", v.dump());
    return v.get<int>();
  }
  int positive_or(const char* key, int fallback) const { return has(key) ? positive(key) : fallback; }
  double number_or(const char* key, double fallback) const {
    if (!has(key)) return fallback;
    ESPLAG_CHECK(js[key].is_number(), path, ": field '", key, "' must be a number, got ", js[key].dump());
    return js[key].get<double>();
  }
  bool flag_or(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    ESPLAG_CHECK(js[key].is_boolean(), path, ": field '", key, "' must be true or false, got ", js[key].dump());
    return js[key].get<bool>();
  }
  std::string text_or(const char* key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    ESPLAG_CHECK(js[key].is_string(), path, ": field '", key, "' must be a string, got ", js[key].dump());
    return js[key].get<std::string>();
  }
  // A setting esplag has no counterpart for: only `expected` computes what esplag computes.
  template <typename V>
  void require(const char* key, const V& value, const V& expected, const std::string& why) const {
    ESPLAG_CHECK(value == expected, path, ": field '", key, "' is ", json(value).dump(), ", but esplag supports only ",
                 json(expected).dump(), " (", why, ")");
  }
  // The norm epsilon, in the range model.norm_eps accepts.
  double norm_eps(const char* key, double fallback) const {
    const double eps = number_or(key, fallback);
    ESPLAG_CHECK(eps > 0 && eps <= ModelConfig::kMaxNormEps, path, ": field '", key, "' is ", eps,
                 ", but esplag's norm epsilon (model.norm_eps) must be in (0, ", ModelConfig::kMaxNormEps, "]");
    return eps;
  }
};

void parse_gpt2(const Fields& f, HfModelConfig& hf) {
  ModelConfig& m = hf.model;
  m = model_preset("tiny");
  m.vocab_size = f.positive("vocab_size");
  m.max_seq_len = f.positive("n_positions");
  m.n_layer = f.positive("n_layer");
  m.n_head = m.n_kv_head = f.positive("n_head");
  m.d_model = f.positive("n_embd");
  m.d_ff = f.positive_or("n_inner", 4 * m.d_model);
  m.tie_embeddings = f.flag_or("tie_word_embeddings", true);
  m.bias = true;
  hf.qkv_bias = hf.o_bias = hf.mlp_bias = true;
  const std::string act = f.text_or("activation_function", "gelu_new");
  ESPLAG_CHECK(act == "gelu_new" || act == "gelu_pytorch_tanh", f.path, ": field 'activation_function' is \"", act,
               "\", but esplag's GELU is the tanh approximation (gelu_new or gelu_pytorch_tanh)");
  m.norm_eps = f.norm_eps("layer_norm_epsilon", 1e-5);
  f.require("scale_attn_weights", f.flag_or("scale_attn_weights", true), true, "scores are scaled by 1/sqrt(head size)");
  f.require("scale_attn_by_inverse_layer_idx", f.flag_or("scale_attn_by_inverse_layer_idx", false), false,
            "no per-layer score scaling");
  f.require("add_cross_attention", f.flag_or("add_cross_attention", false), false, "decoder-only models");
}

void parse_llama(const Fields& f, HfModelConfig& hf) {
  ModelConfig& m = hf.model;
  m = model_preset("llama-tiny");
  m.vocab_size = f.positive("vocab_size");
  m.max_seq_len = f.positive("max_position_embeddings");
  m.n_layer = f.positive("num_hidden_layers");
  m.n_head = f.positive("num_attention_heads");
  m.n_kv_head = f.positive_or("num_key_value_heads", m.n_head);
  m.d_model = f.positive("hidden_size");
  m.d_ff = f.positive("intermediate_size");
  m.tie_embeddings = f.flag_or("tie_word_embeddings", false);
  m.rope_theta = f.number_or("rope_theta", 10000.0);
  ESPLAG_CHECK(m.rope_theta > 0 && std::isfinite(m.rope_theta), f.path, ": field 'rope_theta' must be positive, got ",
               m.rope_theta);
  ESPLAG_CHECK(m.d_model % m.n_head == 0, f.path, ": field 'hidden_size' (", m.d_model,
               ") must be a multiple of 'num_attention_heads' (", m.n_head, ")");
  if (f.has("head_dim"))
    ESPLAG_CHECK(f.positive("head_dim") == m.d_model / m.n_head, f.path, ": field 'head_dim' is ", f.positive("head_dim"),
                 ", but esplag's head size is hidden_size / num_attention_heads = ", m.d_model / m.n_head);
  const std::string act = f.text_or("hidden_act", "silu");
  ESPLAG_CHECK(act == "silu", f.path, ": field 'hidden_act' is \"", act, "\", but esplag's SwiGLU uses silu");
  m.norm_eps = f.norm_eps("rms_norm_eps", 1e-6);
  if (f.has("rope_scaling")) {
    const json& rs = f.js["rope_scaling"];
    const bool plain = rs.is_object() && rs.value("rope_type", rs.value("type", "")) == "default";
    ESPLAG_CHECK(plain, f.path, ": field 'rope_scaling' is ", rs.dump(),
                 ", but esplag's rotary embedding has no scaling (only null or {\"rope_type\": \"default\"})");
  }
  if (hf.model_type == "qwen2") {
    hf.qkv_bias = true;  // Qwen2's q/k/v projections always have biases, its others never
    f.require("use_sliding_window", f.flag_or("use_sliding_window", false), false, "full causal attention");
  } else {
    hf.qkv_bias = hf.o_bias = f.flag_or("attention_bias", false);
    hf.mlp_bias = f.flag_or("mlp_bias", false);
  }
  if (hf.model_type == "mistral" && f.has("sliding_window")) {
    ESPLAG_CHECK(f.js["sliding_window"].is_number_integer() && f.js["sliding_window"].get<int64_t>() >= m.max_seq_len,
                 f.path, ": field 'sliding_window' is ", f.js["sliding_window"].dump(),
                 ", but esplag's attention is full causal attention (only null, or a window of at least "
                 "max_position_embeddings = ", m.max_seq_len, ")");
  }
  m.bias = hf.qkv_bias || hf.o_bias || hf.mlp_bias;
}

}  // namespace

std::string to_string(HfFamily f) { return f == HfFamily::gpt2 ? "gpt2" : "llama"; }

HfModelConfig parse_hf_config(const std::string& json_text, const std::string& path) {
  const json js = parse_json(json_text, path);
  ESPLAG_CHECK(js.is_object(), path, " must hold a JSON object, it holds ", js.type_name());
  const Fields f{js, path};
  HfModelConfig hf;
  hf.model_type = f.text_or("model_type", "");
  ESPLAG_CHECK(!hf.model_type.empty(), path, ": field 'model_type' is missing");
  struct Known {
    const char* type;
    const char* architecture;
    HfFamily family;
  };
  static const Known known[] = {{"gpt2", "GPT2LMHeadModel", HfFamily::gpt2},
                                {"llama", "LlamaForCausalLM", HfFamily::llama},
                                {"mistral", "MistralForCausalLM", HfFamily::llama},
                                {"qwen2", "Qwen2ForCausalLM", HfFamily::llama}};
  const Known* k = nullptr;
  for (const auto& c : known)
    if (hf.model_type == c.type) k = &c;
  ESPLAG_CHECK(k, path, ": field 'model_type' is \"", hf.model_type,
               "\", which esplag does not import (supported: gpt2, llama, mistral, qwen2)");
  if (f.has("architectures")) {
    const json& a = js["architectures"];
    ESPLAG_CHECK(a.is_array() && a.size() == 1 && a[0].is_string(), path,
                 ": field 'architectures' must be a list of one name, got ", a.dump());
    ESPLAG_CHECK(a[0].get<std::string>() == k->architecture, path, ": field 'architectures' is ", a.dump(),
                 ", but esplag imports only the causal LM of model_type ", hf.model_type, " (", k->architecture, ")");
  }
  ESPLAG_CHECK(!f.has("quantization_config"), path,
               ": field 'quantization_config' is set, but esplag imports only unquantized weights");
  hf.family = k->family;
  if (hf.family == HfFamily::gpt2)
    parse_gpt2(f, hf);
  else
    parse_llama(f, hf);
  try {
    hf.model.validate();
  } catch (const Error& e) {
    fail(path, ": ", e.what());
  }
  return hf;
}

HfModelConfig hf_config_for(const ModelConfig& m) {
  HfModelConfig hf;
  hf.model = m;
  const bool gpt2 = m.norm == NormKind::layernorm && m.pos == PosKind::learned && m.mlp == MlpKind::gelu;
  const bool llama = m.norm == NormKind::rmsnorm && m.pos == PosKind::rope && m.mlp == MlpKind::swiglu;
  ESPLAG_CHECK(gpt2 || llama, "export --hf: the model (model.norm ", to_string(m.norm), ", model.pos ",
               to_string(m.pos), ", model.mlp ", to_string(m.mlp),
               ") is neither GPT-2-shaped (layernorm, learned, gelu) nor LLaMA-shaped (rmsnorm, rope, swiglu)");
  if (gpt2) {
    ESPLAG_CHECK(m.n_kv_head == m.n_head, "export --hf: GPT-2 has no grouped-query heads, but model.n_kv_head (",
                 m.n_kv_head, ") differs from model.n_head (", m.n_head, ")");
    hf.family = HfFamily::gpt2;
    hf.model_type = "gpt2";
    hf.qkv_bias = hf.o_bias = hf.mlp_bias = true;  // GPT-2 always has them: zeros when the model has none
  } else {
    hf.family = HfFamily::llama;
    hf.model_type = "llama";
    hf.qkv_bias = hf.o_bias = hf.mlp_bias = m.bias;
  }
  return hf;
}

std::string hf_config_json(const HfModelConfig& hf, int eot_token) {
  const ModelConfig& m = hf.model;
  json js;
  if (hf.family == HfFamily::gpt2) {
    js = {{"architectures", {"GPT2LMHeadModel"}},
          {"model_type", "gpt2"},
          {"activation_function", "gelu_new"},
          {"attn_pdrop", 0.0},
          {"embd_pdrop", 0.0},
          {"resid_pdrop", 0.0},
          {"initializer_range", m.init_std},
          {"layer_norm_epsilon", m.norm_eps},
          {"n_embd", m.d_model},
          {"n_head", m.n_head},
          {"n_inner", m.d_ff},
          {"n_layer", m.n_layer},
          {"n_positions", m.max_seq_len},
          {"n_ctx", m.max_seq_len},
          {"scale_attn_weights", true},
          {"scale_attn_by_inverse_layer_idx", false},
          {"reorder_and_upcast_attn", false},
          {"tie_word_embeddings", m.tie_embeddings},
          {"torch_dtype", "float32"},
          {"use_cache", true},
          {"vocab_size", m.vocab_size}};
  } else {
    js = {{"architectures", {"LlamaForCausalLM"}},
          {"model_type", "llama"},
          {"attention_bias", hf.qkv_bias},
          {"attention_dropout", 0.0},
          {"head_dim", m.head_dim()},
          {"hidden_act", "silu"},
          {"hidden_size", m.d_model},
          {"initializer_range", m.init_std},
          {"intermediate_size", m.d_ff},
          {"max_position_embeddings", m.max_seq_len},
          {"mlp_bias", hf.mlp_bias},
          {"num_attention_heads", m.n_head},
          {"num_hidden_layers", m.n_layer},
          {"num_key_value_heads", m.n_kv_head},
          {"pretraining_tp", 1},
          {"rms_norm_eps", m.norm_eps},
          {"rope_scaling", nullptr},
          {"rope_theta", m.rope_theta},
          {"tie_word_embeddings", m.tie_embeddings},
          {"torch_dtype", "float32"},
          {"use_cache", true},
          {"vocab_size", m.vocab_size}};
  }
  if (eot_token >= 0) js["bos_token_id"] = js["eos_token_id"] = eot_token;
  return js.dump(2) + "\n";
}

}  // namespace esplag
