// Hugging Face import and export (src/interop/) against the committed fixtures of
// tests/fixtures/hf, written by scripts/make-hf-fixtures.py: tiny GPT-2 and LLaMA-family
// directories as transformers saves them, with the logits of a token sequence computed by
// a numpy transcription of transformers' forward passes (rotate_half RoPE, repeat_kv).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "data/tokenizer.h"
#include "interop/hf_export.h"
#include "interop/hf_import.h"
#include "io/atomic_file.h"
#include "io/safetensors.h"
#include "train/checkpoint.h"
#include "test_util.h"

namespace esplag {
namespace {

namespace fs = std::filesystem;
using testing::contains;
using testing::error_of;
using testing::TempDir;

const std::string kFixtures = std::string(ESPLAG_SOURCE_DIR) + "/tests/fixtures/hf/";
const std::vector<std::string> kModels = {"gpt2", "gpt2-untied-f16", "llama-gqa", "llama-tied-bf16-sharded", "qwen2"};

// The logits of every position of the fixture's token sequence, one forward per prefix.
std::vector<double> all_logits(Transformer<float>& model, const std::vector<int32_t>& tokens) {
  const int V = model.config().vocab_size;
  std::vector<double> out;
  std::vector<float> last(V);
  for (size_t t = 1; t <= tokens.size(); ++t) {
    model.forward_last_logits(tokens.data(), 1, static_cast<int>(t), last.data());
    out.insert(out.end(), last.begin(), last.end());
  }
  return out;
}

struct Expected {
  std::vector<int32_t> tokens;
  std::vector<double> logits;
};

Expected expected(const std::string& name) {
  const auto f = load_safetensors(kFixtures + name + "/expected.safetensors");
  const Tensor& t = f.tensors.at("tokens");
  const Tensor& l = f.tensors.at("logits");
  return {{t.data<int32_t>(), t.data<int32_t>() + t.numel()}, {l.data<double>(), l.data<double>() + l.numel()}};
}

// The largest error relative to the logits' scale: float32 arithmetic against float64.
double max_error(const std::vector<double>& got, const std::vector<double>& want) {
  double scale = 1, err = 0;
  for (double w : want) scale = std::max(scale, std::fabs(w));
  for (size_t i = 0; i < want.size(); ++i) err = std::max(err, std::fabs(got[i] - want[i]));
  return err / scale;
}

// A copy of a fixture to damage (a new one at each call).
std::string copy_fixture(const TempDir& tmp, const std::string& name) {
  static int copies = 0;
  const std::string dst = tmp.file(name + "-" + std::to_string(++copies));
  fs::copy(kFixtures + name, dst, fs::copy_options::recursive);
  fs::remove(dst + "/expected.safetensors");
  return dst;
}

void edit_config(const std::string& dir, const std::function<void(nlohmann::json&)>& edit) {
  auto js = nlohmann::json::parse(read_file(dir + "/config.json"));
  edit(js);
  write_file_atomic(dir + "/config.json", js.dump(2));
}

void edit_weights(const std::string& file, const std::function<void(std::map<std::string, Tensor>&)>& edit) {
  auto f = load_safetensors(file);
  edit(f.tensors);
  std::vector<Tensor> ts;
  for (auto& [name, t] : f.tensors) {
    t.set_name(name);
    ts.push_back(t);
  }
  save_safetensors(file, ts, f.metadata);
}

TEST(HfImport, LogitsMatchTheTransformersReference) {
  for (const auto& name : kModels) {
    SCOPED_TRACE(name);
    HfModel hf = load_hf_model(kFixtures + name);
    const Expected e = expected(name);
    ASSERT_EQ(e.logits.size(), e.tokens.size() * hf.model->config().vocab_size);
    EXPECT_LT(max_error(all_logits(*hf.model, e.tokens), e.logits), 1e-5);
  }
}

TEST(HfImport, RunDirectoryLoadsWithTheSameLogits) {
  TempDir tmp;
  for (const auto& name : {"gpt2", "llama-tied-bf16-sharded"}) {
    SCOPED_TRACE(name);
    const std::string run = tmp.file(name);
    const HfImport r = import_hf(kFixtures + name, run);
    EXPECT_EQ(r.checkpoint, run + "/step-000000");
    EXPECT_EQ(r.tokenizer_note, "");
    EXPECT_TRUE(fs::exists(run + "/tokenizer.json") && fs::exists(run + "/config.yaml"));
    EXPECT_FALSE(fs::exists(r.checkpoint + "/optimizer.safetensors"));
    CheckpointContents info;
    auto model = load_model(resolve_checkpoint(run), &info);
    EXPECT_EQ(info.tokenizer, fs::absolute(run + "/tokenizer.json").lexically_normal().string());
    const Expected e = expected(name);
    EXPECT_LT(max_error(all_logits(*model, e.tokens), e.logits), 1e-5);
  }
  // An existing run is never mixed into.
  EXPECT_TRUE(contains(error_of([&] { import_hf(kFixtures + "gpt2", tmp.file("gpt2")); }), "is not empty"));
}

TEST(HfImport, NormEpsilonBecomesModelNormEpsAndExportsBack) {
  TempDir tmp;
  // qwen2's fixture has rms_norm_eps 1e-6 (its logits match in LogitsMatchTheTransformersReference).
  HfModel qwen = load_hf_model(kFixtures + "qwen2");
  EXPECT_EQ(qwen.model->config().norm_eps, 1e-6);
  export_hf(*qwen.model, "byte", tmp.file("qwen2-out"));
  EXPECT_EQ(nlohmann::json::parse(read_file(tmp.file("qwen2-out/config.json")))["rms_norm_eps"], 1e-6);
  EXPECT_EQ(load_hf_model(kFixtures + "gpt2").model->config().norm_eps, 1e-5);

  // Absent, each family's transformers default.
  const std::string llama = copy_fixture(tmp, "llama-gqa"), gpt2 = copy_fixture(tmp, "gpt2");
  edit_config(llama, [](nlohmann::json& js) { js.erase("rms_norm_eps"); });
  edit_config(gpt2, [](nlohmann::json& js) { js.erase("layer_norm_epsilon"); });
  EXPECT_EQ(load_hf_model(llama).model->config().norm_eps, 1e-6);
  EXPECT_EQ(load_hf_model(gpt2).model->config().norm_eps, 1e-5);

  // The model computes with it: a large epsilon moves the logits far beyond the tolerance.
  for (const std::string name : {"llama-gqa", "gpt2"}) {
    SCOPED_TRACE(name);
    const std::string dir = copy_fixture(tmp, name);
    edit_config(dir, [&](nlohmann::json& js) { js[name == "gpt2" ? "layer_norm_epsilon" : "rms_norm_eps"] = 1e-2; });
    HfModel hf = load_hf_model(dir);
    const Expected e = expected(name);
    EXPECT_GT(max_error(all_logits(*hf.model, e.tokens), e.logits), 1e-3);
  }
}

TEST(HfExport, NamesAndShapesAreTransformers) {
  // The unsharded f32 fixtures hold exactly what save_pretrained writes.
  TempDir tmp;
  for (const auto& name : {"gpt2", "gpt2-untied-f16", "llama-gqa"}) {
    SCOPED_TRACE(name);
    HfModel hf = load_hf_model(kFixtures + name);
    const std::string out = tmp.file(std::string(name) + "-out");
    const HfExport e = export_hf(*hf.model, kFixtures + name + "/tokenizer.json", out);
    EXPECT_EQ(e.tokenizer_note, "");
    const auto mine = read_safetensors_header(out + "/model.safetensors");
    const auto theirs = read_safetensors_header(kFixtures + name + "/model.safetensors");
    EXPECT_EQ(mine.metadata.at("format"), "pt");
    std::map<std::string, Shape> a, b;
    for (const auto& t : mine.tensors) a[t.name] = t.shape;
    for (const auto& t : theirs.tensors) b[t.name] = t.shape;
    EXPECT_EQ(a, b);
    EXPECT_EQ(read_file(out + "/tokenizer.json"), read_file(kFixtures + name + "/tokenizer.json"));
  }
}

TEST(HfExport, ReimportIsBitExact) {
  TempDir tmp;
  for (const auto& name : kModels) {
    SCOPED_TRACE(name);
    HfModel hf = load_hf_model(kFixtures + name);
    const std::string out = tmp.file(name + "-out");
    export_hf(*hf.model, "byte", out);
    HfModel back = load_hf_model(out);
    ASSERT_EQ(back.model->num_params(), hf.model->num_params());
    EXPECT_EQ(0, std::memcmp(back.model->params(), hf.model->params(), hf.model->num_params() * sizeof(float)));
    // The config round-trips too (Qwen2's partial biases come back as a LLaMA with all of them).
    EXPECT_EQ(to_yaml(TrainConfig{back.config.model, {}}), to_yaml(TrainConfig{hf.model->config(), {}}));
    EXPECT_EQ(back.config.model_type, "gpt2" == name.substr(0, 4) ? "gpt2" : "llama");
  }
}

TEST(HfExport, ByteTokenizerBecomesAByteLevelBpe) {
  TempDir tmp;
  HfModel hf = load_hf_model(kFixtures + "llama-gqa");
  export_hf(*hf.model, "byte", tmp.file("out"));
  const auto tok = load_tokenizer(tmp.file("out/tokenizer.json"));
  const std::string text = "In the beginning\n\xc3\xa9";
  EXPECT_EQ(tok->encode(text), ByteTokenizer().encode(text));
  EXPECT_EQ(tok->eot_token(), ByteTokenizer::kEot);
  const auto cfg = nlohmann::json::parse(read_file(tmp.file("out/config.json")));
  EXPECT_EQ(cfg["eos_token_id"], ByteTokenizer::kEot);
  EXPECT_EQ(cfg["architectures"][0], "LlamaForCausalLM");
  EXPECT_EQ(cfg["num_key_value_heads"], 1);
}

TEST(HfExport, ModelsWithoutAHfCounterpartAreRefused) {
  ModelConfig m = model_preset("tiny");
  m.vocab_size = 32;
  m.mlp = MlpKind::relu2;
  EXPECT_TRUE(contains(error_of([&] { hf_config_for(m); }), "model.mlp relu2"));
  m.mlp = MlpKind::gelu;
  m.n_kv_head = 2;
  EXPECT_TRUE(contains(error_of([&] { hf_config_for(m); }), "model.n_kv_head"));
}

TEST(HfImport, MissingExtraAndMisshapenTensorsAreNamed) {
  TempDir tmp;
  const std::string gpt2 = copy_fixture(tmp, "gpt2");
  edit_weights(gpt2 + "/model.safetensors", [](auto& t) { t.erase("transformer.h.1.mlp.c_fc.bias"); });
  EXPECT_TRUE(contains(error_of([&] { load_hf_model(gpt2); }), "tensor 'transformer.h.1.mlp.c_fc.bias' of the gpt2 "
                                                                 "model of this config.json is missing"));

  const std::string llama = copy_fixture(tmp, "llama-gqa");
  edit_weights(llama + "/model.safetensors",
               [](auto& t) { t["model.layers.0.self_attn.q_proj.bias"] = Tensor::zeros({16}, DType::f32); });
  EXPECT_TRUE(contains(error_of([&] { load_hf_model(llama); }), "tensor 'model.layers.0.self_attn.q_proj.bias' is not "
                                                                  "part of a llama model"));

  const std::string shape = copy_fixture(tmp, "qwen2");
  edit_weights(shape + "/model.safetensors",
               [](auto& t) { t["model.layers.1.self_attn.k_proj.weight"] = Tensor::zeros({16, 16}, DType::f32); });
  EXPECT_TRUE(contains(error_of([&] { load_hf_model(shape); }),
                       "tensor 'model.layers.1.self_attn.k_proj.weight' has shape [16, 16], but the qwen2 model of "
                       "this config.json needs [8, 16]"));

  const std::string dtype = copy_fixture(tmp, "llama-gqa");
  edit_weights(dtype + "/model.safetensors",
               [](auto& t) { t["model.norm.weight"] = Tensor::zeros({16}, DType::i32); });
  EXPECT_TRUE(contains(error_of([&] { load_hf_model(dtype); }), "tensor 'model.norm.weight' is stored as I32"));

  // A tied checkpoint may carry its head when it is the embedding, not otherwise.
  const std::string tied = copy_fixture(tmp, "gpt2");
  edit_weights(tied + "/model.safetensors", [](auto& t) { t["lm_head.weight"] = t.at("transformer.wte.weight"); });
  EXPECT_NO_THROW(load_hf_model(tied));
  edit_weights(tied + "/model.safetensors", [](auto& t) { t["lm_head.weight"] = Tensor::zeros({48, 16}, DType::f32); });
  EXPECT_TRUE(contains(error_of([&] { load_hf_model(tied); }), "'lm_head.weight' differs from the embedding"));

  // Old GPT-2 files: no "transformer." prefix, the attention mask buffers saved.
  const std::string old = copy_fixture(tmp, "gpt2");
  edit_weights(old + "/model.safetensors", [](auto& t) {
    std::map<std::string, Tensor> renamed;
    for (auto& [n, x] : t) renamed[n.substr(12)] = x;
    renamed["h.0.attn.bias"] = Tensor::zeros({1, 1, 32, 32}, DType::f32);
    t = renamed;
  });
  EXPECT_NO_THROW(load_hf_model(old));
}

TEST(HfImport, ShardIndexProblemsAreNamed) {
  TempDir tmp;
  const std::string dir = copy_fixture(tmp, "llama-tied-bf16-sharded");
  fs::remove(dir + "/model-00002-of-00002.safetensors");
  EXPECT_TRUE(contains(error_of([&] { load_hf_model(dir); }), "names the shard 'model-00002-of-00002.safetensors', "
                                                                "which is missing"));
  fs::remove(dir + "/model.safetensors.index.json");
  EXPECT_TRUE(contains(error_of([&] { load_hf_model(dir); }), "holds neither model.safetensors nor "
                                                                "model.safetensors.index.json"));
}

TEST(HfImport, UnsupportedConfigsNameTheField) {
  TempDir tmp;
  struct Case {
    std::string model, field;
    nlohmann::json value;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"llama-gqa", "model_type", "falcon", "field 'model_type' is \"falcon\", which esplag does not import"},
      {"llama-gqa", "rope_scaling", {{"rope_type", "linear"}, {"factor", 2.0}}, "field 'rope_scaling'"},
      {"llama-gqa", "rms_norm_eps", 0.5, "field 'rms_norm_eps' is 0.5, but esplag's norm epsilon (model.norm_eps) must "
                                         "be in (0, 0.01]"},
      {"gpt2", "layer_norm_epsilon", 0, "field 'layer_norm_epsilon' is 0, but esplag's norm epsilon"},
      {"llama-gqa", "hidden_act", "gelu", "field 'hidden_act' is \"gelu\""},
      {"llama-gqa", "head_dim", 4, "field 'head_dim' is 4"},
      {"llama-gqa", "architectures", {"LlamaForSequenceClassification"}, "field 'architectures'"},
      {"llama-gqa", "quantization_config", {{"quant_method", "gptq"}}, "field 'quantization_config'"},
      {"llama-gqa", "num_key_value_heads", 0, "field 'num_key_value_heads' must be a positive integer"},
      {"qwen2", "use_sliding_window", true, "field 'use_sliding_window' is true"},
      {"gpt2", "activation_function", "relu", "field 'activation_function' is \"relu\""},
      {"gpt2", "scale_attn_by_inverse_layer_idx", true, "field 'scale_attn_by_inverse_layer_idx' is true"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.field);
    const std::string dir = copy_fixture(tmp, c.model);
    edit_config(dir, [&](nlohmann::json& js) { js[c.field] = c.value; });
    const std::string err = error_of([&] { load_hf_model(dir); });
    EXPECT_TRUE(contains(err, dir + "/config.json: ")) << err;
    EXPECT_TRUE(contains(err, c.message)) << err;
    fs::remove_all(dir);
  }
  const std::string mistral = copy_fixture(tmp, "llama-gqa");
  edit_config(mistral, [](nlohmann::json& js) {
    js["model_type"] = "mistral";
    js["architectures"] = {"MistralForCausalLM"};
    js["sliding_window"] = 16;
  });
  EXPECT_TRUE(contains(error_of([&] { load_hf_model(mistral); }), "field 'sliding_window' is 16"));
  edit_config(mistral, [](nlohmann::json& js) { js["sliding_window"] = nullptr; });
  EXPECT_NO_THROW(load_hf_model(mistral));
}

}  // namespace
}  // namespace esplag
