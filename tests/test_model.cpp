// Whole-model checks: the explicit backward of the transformer against finite
// differences in fp64, for the GPT-2 and the LLaMA flavour (RoPE, GQA, SwiGLU, RMSNorm).
#include <gtest/gtest.h>

#include "gradcheck.h"
#include "model/transformer.h"
#include "test_util.h"

using namespace esplag;
using esplag::testing::expect_close;

namespace {

ModelConfig small_config(const std::string& flavour) {
  ModelConfig c = model_preset(flavour == "gpt2" ? "tiny" : "llama-tiny");
  c.vocab_size = 11;
  c.max_seq_len = 6;
  c.n_layer = 2;
  c.d_model = 8;
  c.n_head = 2;
  c.n_kv_head = flavour == "llama" ? 1 : 2;
  c.d_ff = 12;
  c.init_std = 0.3;  // large enough that every path carries a visible gradient
  return c;
}

void check_model_gradients(const ModelConfig& cfg) {
  Transformer<double> model(cfg);
  model.init_weights(7);
  const int B = 2, T = 5;
  Rng rng(3);
  std::vector<int32_t> x(B * T), y(B * T);
  for (auto& t : x) t = static_cast<int32_t>(rng.below(cfg.vocab_size));
  for (auto& t : y) t = static_cast<int32_t>(rng.below(cfg.vocab_size));

  model.zero_grad();
  const double loss = model.forward_backward(x.data(), y.data(), B, T, 1.0);
  EXPECT_NEAR(loss, model.forward_loss(x.data(), y.data(), B, T), 1e-12);
  std::vector<double> analytic(model.grads(), model.grads() + model.num_params());

  std::vector<double> theta(model.params(), model.params() + model.num_params());
  auto f = [&]() {
    std::copy(theta.begin(), theta.end(), model.params());
    return model.forward_loss(x.data(), y.data(), B, T);
  };
  const std::vector<double> numeric = esplag::testing::numeric_grad(theta, f, 1e-5);
  for (const auto& info : model.param_infos()) {
    std::vector<double> a(analytic.begin() + info.offset, analytic.begin() + info.offset + info.numel);
    std::vector<double> n(numeric.begin() + info.offset, numeric.begin() + info.offset + info.numel);
    expect_close(a, n, 1e-5, 1e-8, info.name.c_str());
  }
}

}  // namespace

TEST(Model, Gpt2FlavourGradientsMatchFiniteDifferences) { check_model_gradients(small_config("gpt2")); }

TEST(Model, LlamaFlavourGradientsMatchFiniteDifferences) { check_model_gradients(small_config("llama")); }

TEST(Model, Relu2MlpGradientsMatchFiniteDifferences) {
  ModelConfig c = small_config("gpt2");
  c.mlp = MlpKind::relu2;
  check_model_gradients(c);
}

TEST(Model, LossScaleScalesGradientsAndAccumulates) {
  const ModelConfig cfg = small_config("llama");
  Transformer<double> model(cfg);
  model.init_weights(1);
  std::vector<int32_t> x = {1, 2, 3, 4}, y = {2, 3, 4, 5};
  model.zero_grad();
  model.forward_backward(x.data(), y.data(), 1, 4, 1.0);
  std::vector<double> g1(model.grads(), model.grads() + model.num_params());
  model.zero_grad();
  model.forward_backward(x.data(), y.data(), 1, 4, 0.5);
  model.forward_backward(x.data(), y.data(), 1, 4, 0.5);
  std::vector<double> g2(model.grads(), model.grads() + model.num_params());
  expect_close(g2, g1, 1e-12, 1e-15, "two half-scaled micro-batches equal one full");
}

TEST(Model, FloatAgreesWithDouble) {
  const ModelConfig cfg = small_config("gpt2");
  Transformer<double> md(cfg);
  Transformer<float> mf(cfg);
  md.init_weights(5);
  mf.init_weights(5);
  std::vector<int32_t> x = {1, 2, 3, 4, 5, 6}, y = {2, 3, 4, 5, 6, 7};
  EXPECT_NEAR(md.forward_loss(x.data(), y.data(), 1, 6), mf.forward_loss(x.data(), y.data(), 1, 6), 1e-5);
}

TEST(Model, InitialLossIsNearUniform) {
  ModelConfig cfg = model_preset("tiny");
  cfg.vocab_size = 257;
  Transformer<float> model(cfg);
  model.init_weights(1337);
  Rng rng(1);
  std::vector<int32_t> x(4 * 32), y(4 * 32);
  for (auto& t : x) t = static_cast<int32_t>(rng.below(257));
  for (auto& t : y) t = static_cast<int32_t>(rng.below(257));
  EXPECT_NEAR(model.forward_loss(x.data(), y.data(), 4, 32), std::log(257.0), 0.1);
}

TEST(Model, RejectsBadShapesAndTokens) {
  ModelConfig cfg = small_config("gpt2");
  cfg.n_head = 3;  // 8 is not a multiple of 3
  EXPECT_THROW(Transformer<float>{cfg}, Error);
  Transformer<float> model(small_config("gpt2"));
  std::vector<int32_t> x = {1, 2, 99}, y = {1, 2, 3};
  EXPECT_THROW(model.forward_loss(x.data(), y.data(), 1, 3), Error);
  std::vector<int32_t> long_x(7, 1);
  EXPECT_THROW(model.forward_loss(long_x.data(), long_x.data(), 1, 7), Error);  // beyond max_seq_len
}

TEST(Model, PresetsHaveTheDocumentedShapes) {
  ModelConfig g = model_preset("gpt2-124m");
  EXPECT_NEAR(g.num_params() / 1e6, 124.4, 0.5);
  ModelConfig l = model_preset("llama-1b");
  EXPECT_EQ(l.d_model, 2048);
  EXPECT_EQ(l.n_layer, 16);
  EXPECT_EQ(l.d_ff, 5632);
  EXPECT_EQ(l.vocab_size, 32000);
  EXPECT_THROW(model_preset("gpt5"), Error);
  for (const auto& name : model_preset_names()) {
    ModelConfig c = model_preset(name);
    if (c.vocab_size == 0) c.vocab_size = 257;
    EXPECT_NO_THROW(c.validate()) << name;
  }
}

TEST(Model, ReplaceLinearRequiresTheSameLayer) {
  Transformer<float> model(small_config("gpt2"));
  const auto names = model.linear_names();
  ASSERT_EQ(names.size(), 8u);
  EXPECT_EQ(model.linear(names[0]).kind(), "dense");
  auto other = std::make_unique<DenseLinear<float>>(model.linear_params(names[1]));
  EXPECT_THROW(model.replace_linear(names[0], std::move(other)), Error);
  model.replace_linear(names[0], std::make_unique<DenseLinear<float>>(model.linear_params(names[0])));
  EXPECT_THROW(model.linear("blocks.9.mlp.fc.weight"), Error);
}

// The gradient buffer is zeros that take memory only once written: a model that never runs
// backward on the host (GPU training) does not hold a second copy of its size. Measured as
// the process's resident memory (Linux), on a model of 40M parameters (160 MB a buffer).
TEST(Model, GradientsTakeMemoryOnlyOnceWritten) {
  using esplag::testing::resident_mib;
  if (resident_mib() < 0) GTEST_SKIP() << "no /proc/self/statm";
  ModelConfig c = model_preset("tiny");
  c.vocab_size = 65536;
  c.d_model = 512;
  c.n_head = 8;
  c.n_kv_head = 8;
  c.d_ff = 2048;
  c.n_layer = 2;
  const double before = resident_mib();
  Transformer<float> model(c);
  const double buffer_mib = double(model.num_params()) * sizeof(float) / double(1 << 20);
  ASSERT_GT(buffer_mib, 128.0);
  const double built = resident_mib() - before;
  EXPECT_LT(built, 1.5 * buffer_mib) << "the parameters take " << buffer_mib << " MiB";
  EXPECT_EQ(model.grads()[model.num_params() - 1], 0.f);
  model.zero_grad();  // writes every gradient: now both buffers are resident
  EXPECT_GT(resident_mib() - before, 1.8 * buffer_mib) << "the measurement itself does not see the gradients";
}
