// Delayed fp8 scaling (model/fp8_amax_history.h): the history's rule, a layer's casts of X
// and dY against hand-quantised operands before and after the first roll (weights keep
// current scaling), saturation above the history's amax, and the model's histories
// outliving a kind change.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/fp8.h"
#include "core/rng.h"
#include "model/fp8_amax_history.h"
#include "model/linear_kinds.h"
#include "model/transformer.h"
#include "ops/matmul.h"

using namespace esplag;

namespace {

constexpr int kN = 8, kIn = 32, kOut = 16;
constexpr auto kX = ProductOperand::input, kDy = ProductOperand::grad;

std::vector<float> randv(size_t n, uint64_t seed, float scale = 1.0f) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = scale * static_cast<float>(rng.normal());
  return v;
}

// x quantised with the scale of `amax` (core/fp8.h), as the products multiply it.
std::vector<float> qdq(const std::vector<float>& x, float amax) {
  std::vector<float> out(x.size());
  fp8_quantize_dequantize(out.data(), x.data(), int64_t(x.size()), Fp8Format::e4m3, amax);
  return out;
}

float amax_of(const std::vector<float>& x) { return fp8_amax(x.data(), int64_t(x.size())); }

}  // namespace

TEST(Fp8AmaxHistory, ScalesByTheLargestOfItsLastSteps) {
  Fp8AmaxHistory h(3);
  EXPECT_FALSE(h.warm());
  h.record(kX, 2.0f);
  h.record(kX, 5.0f);  // a second cast in the step (another micro-batch)
  h.record(kDy, 0.5f);
  h.roll();
  EXPECT_TRUE(h.warm());
  EXPECT_EQ(h.scale_amax(kX), 5.0f);
  EXPECT_EQ(h.scale_amax(kDy), 0.5f);
  for (float a : {1.0f, 3.0f, 4.0f}) {  // 5 leaves the history after three more steps
    h.record(kX, a);
    h.roll();
  }
  EXPECT_EQ(h.scale_amax(kX), 4.0f);
  EXPECT_EQ(h.scale_amax(kDy), 0.0f);  // no dY since: the grad's history ran out too
  EXPECT_THROW(h.record(ProductOperand::weight, 1.0f), Error);
}

TEST(Fp8AmaxHistory, ValuesRoundTripAndBadOnesAreRefused) {
  Fp8AmaxHistory h(2);
  h.record(kX, 3.0f);
  h.roll();
  h.record(kDy, 7.0f);
  const std::vector<float> v = h.values();
  ASSERT_EQ(v.size(), size_t(2 * Fp8AmaxHistory::values_per_operand(2)));
  EXPECT_EQ(v, (std::vector<float>{0.0f, 3.0f, 0.0f, 7.0f, 0.0f, 0.0f}));
  Fp8AmaxHistory back(2);
  back.set_values(v, "ckpt");
  EXPECT_TRUE(back.warm());
  EXPECT_EQ(back.values(), v);
  EXPECT_THROW(back.set_values({1, 2, 3}, "ckpt"), Error);
  EXPECT_THROW(back.set_values({0, 1, 2, 3, 4, -5}, "ckpt"), Error);
  EXPECT_THROW(back.set_values({0, 1, 2, 3, 4, NAN}, "ckpt"), Error);
  EXPECT_THROW(Fp8AmaxHistory(0), Error);
}

// A dense layer with delayed scaling: the first step's casts take each tensor's own amax (a
// current-scaling step, bit for bit), the next step's take the history's, and a value above
// it saturates. The weight keeps its own amax throughout.
TEST(Fp8DelayedScaling, LayerCastsFollowTheHistory) {
  std::vector<float> w = randv(size_t(kOut) * kIn, 1), dw(w.size(), 0.0f);
  Fp8AmaxHistory history(4);
  LinearParams<float> p;
  p.name = "blocks.0.mlp.fc.weight";
  p.in_features = kIn;
  p.out_features = kOut;
  p.weight = w.data();
  p.dweight = dw.data();
  p.precision = {true, Fp8Format::e4m3, Fp8Scaling::delayed, 4};
  p.fp8_history = &history;
  std::unique_ptr<Linear<float>> layer = make_linear(p, LinearOptions{});
  const std::vector<float> wq = qdq(w, amax_of(w));

  auto expect_step = [&](const std::vector<float>& x, const std::vector<float>& dy, float x_amax, float dy_amax) {
    std::vector<float> y(size_t(kN) * kOut), dx(size_t(kN) * kIn, 0.0f), ref_y(y.size()), ref_dx(dx.size(), 0.0f);
    std::fill(dw.begin(), dw.end(), 0.0f);
    std::vector<float> ref_dw(dw.size(), 0.0f);
    layer->forward(y.data(), x.data(), kN);
    layer->backward(dx.data(), dy.data(), x.data(), kN);
    const std::vector<float> xq = qdq(x, x_amax), dyq = qdq(dy, dy_amax);
    cpu::linear_forward(ref_y.data(), xq.data(), wq.data(), static_cast<const float*>(nullptr), kN, kIn, kOut);
    cpu::linear_backward(ref_dx.data(), ref_dw.data(), static_cast<float*>(nullptr), dyq.data(), xq.data(), wq.data(),
                         kN, kIn, kOut);
    EXPECT_EQ(y, ref_y);
    EXPECT_EQ(dx, ref_dx);
    EXPECT_EQ(dw, ref_dw);
  };
  const auto x1 = randv(size_t(kN) * kIn, 2), dy1 = randv(size_t(kN) * kOut, 3, 1e-3f);
  expect_step(x1, dy1, amax_of(x1), amax_of(dy1));
  EXPECT_EQ(layer->fp8_saturated(), 0);
  history.roll();
  // Twice as large: scaled by step 1's amaxes, so the values above them saturate.
  const auto x2 = randv(size_t(kN) * kIn, 4, 2.0f), dy2 = randv(size_t(kN) * kOut, 5, 2e-3f);
  expect_step(x2, dy2, amax_of(x1), amax_of(dy1));
  EXPECT_GT(layer->fp8_saturated(), 0);
  history.roll();
  EXPECT_EQ(history.scale_amax(kX), amax_of(x2));
  EXPECT_EQ(history.scale_amax(kDy), amax_of(dy2));
}

// The model's histories belong to the layer's place, not to its kind: a layer made masked
// keeps the history of the dense one it replaced; evaluations leave them alone; a new
// history length starts them over.
TEST(Fp8DelayedScaling, ModelHistoriesOutliveKindChanges) {
  ModelConfig c = model_preset("tiny");
  c.vocab_size = 32;
  c.n_layer = 1;
  Transformer<float> model(c);
  model.init_weights(7);
  model.set_linear_precision({true, Fp8Format::e4m3, Fp8Scaling::delayed, 8});
  std::vector<int32_t> tokens(16), targets(16);
  for (int i = 0; i < 16; ++i) tokens[size_t(i)] = i % 32, targets[size_t(i)] = (i * 7) % 32;
  model.forward_backward(tokens.data(), targets.data(), 1, 16, 1.0);
  model.roll_fp8_histories();
  const std::string fc = "blocks.0.mlp.fc.weight";
  const std::vector<float> before = model.fp8_histories()[2].values();
  EXPECT_GT(model.fp8_histories()[2].scale_amax(kX), 0.0f);
  model.forward_loss(tokens.data(), targets.data(), 1, 16);  // an evaluation records nothing
  EXPECT_EQ(model.fp8_histories()[2].values(), before);
  model.forward_backward(tokens.data(), targets.data(), 1, 16, 1.0);  // a training step does
  EXPECT_NE(model.fp8_histories()[2].values(), before);
  model.roll_fp8_histories();
  const std::vector<float> rolled = model.fp8_histories()[2].values();
  LinearOptions o;
  o.kind = "masked";
  o.pattern = SparsityPattern::nm(2, 4);
  model.replace_linear(fc, make_linear(model.linear_params(fc), o));
  EXPECT_EQ(model.fp8_histories()[2].values(), rolled);
  EXPECT_EQ(model.linear(fc).params().fp8_history, &model.fp8_histories()[2]);
  model.set_linear_precision({true, Fp8Format::e4m3, Fp8Scaling::delayed, 4});
  EXPECT_FALSE(model.fp8_histories()[2].warm());
  EXPECT_EQ(model.fp8_histories()[2].length(), 4);
}
