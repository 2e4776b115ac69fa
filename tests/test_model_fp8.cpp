// fp8 products of the Linear kinds (model/linear_precision.h): each kind in fp8 against the
// same products in fp32 with their operands quantised by hand (bit for bit), the model's
// precision reaching every layer, and a tiny model training in fp8 next to fp32.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "core/fp8.h"
#include "core/rng.h"
#include "model/linear_kinds.h"
#include "model/linear_lora.h"
#include "model/linear_masked.h"
#include "model/linear_semi_sparse.h"
#include "model/linear_slope.h"
#include "model/linear_vnm.h"
#include "model/transformer.h"
#include "ops/adamw.h"
#include "ops/matmul.h"
#include "sparse/compressed.h"

using namespace esplag;

namespace {

constexpr int kN = 8, kIn = 32, kOut = 16;

std::vector<float> randv(size_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(rng.normal());
  return v;
}

std::vector<float> qdq(const std::vector<float>& x, Fp8Format f) {
  std::vector<float> out(x.size());
  fp8_quantize_dequantize(out.data(), x.data(), int64_t(x.size()), f);
  return out;
}

LinearPrecision fp8(Fp8Format grad = Fp8Format::e5m2) { return {true, grad}; }

// One layer's weight, bias and gradients, and the layer of `kind` built on them in fp8.
struct Fp8Layer {
  std::vector<float> w = randv(size_t(kOut) * kIn, 1), b = randv(kOut, 2), dw, db;
  std::unique_ptr<Linear<float>> layer;

  Fp8Layer(const std::string& kind, Fp8Format grad) : dw(w.size(), 0.0f), db(b.size(), 0.0f) {
    LinearParams<float> p;
    p.name = "blocks.0.mlp.fc.weight";
    p.module = "blocks.0.mlp.fc";
    p.layer = 0;
    p.in_features = kIn;
    p.out_features = kOut;
    p.weight = w.data();
    p.bias = b.data();
    p.dweight = dw.data();
    p.dbias = db.data();
    p.precision = fp8(grad);
    LinearOptions o;
    o.kind = kind;
    if (kind == "masked") o.pattern = SparsityPattern::nm(2, 4);
    if (kind == "vnm") o.pattern = SparsityPattern::vnm(16, 2, 8);
    layer = make_linear(p, o);
  }
};

// What a layer computed and what the hand-built reference computes.
struct Products {
  std::vector<float> y, dx, dw, db;
};

// out = x·Wᵀ + b, dx = dY·W, dW = dYᵀ·X in fp32 on the given (already quantised) operands;
// db from the unquantised dY.
Products dense_products(const std::vector<float>& x, const std::vector<float>& w_fwd, const std::vector<float>& w_dx,
                        const std::vector<float>& dy, const std::vector<float>& dy_raw, const std::vector<float>& b) {
  Products r{std::vector<float>(size_t(kN) * kOut), std::vector<float>(size_t(kN) * kIn, 0.0f),
             std::vector<float>(size_t(kOut) * kIn, 0.0f), std::vector<float>(kOut, 0.0f)};
  cpu::linear_forward(r.y.data(), x.data(), w_fwd.data(), b.data(), kN, kIn, kOut);
  cpu::linear_backward(r.dx.data(), r.dw.data(), static_cast<float*>(nullptr), dy.data(), x.data(), w_dx.data(), kN,
                       kIn, kOut);
  cpu::linear_backward(static_cast<float*>(nullptr), static_cast<float*>(nullptr), r.db.data(), dy_raw.data(),
                       static_cast<const float*>(nullptr), static_cast<const float*>(nullptr), kN, kIn, kOut);
  return r;
}

Products run(Fp8Layer& l, const std::vector<float>& x, const std::vector<float>& dy) {
  Products r{std::vector<float>(size_t(kN) * kOut), std::vector<float>(size_t(kN) * kIn, 0.0f), {}, {}};
  l.layer->forward(r.y.data(), x.data(), kN);
  l.layer->backward(r.dx.data(), dy.data(), x.data(), kN);
  const auto owned = l.layer->owned_params();
  r.dw = owned.empty() ? l.dw : std::vector<float>(owned[0].grad, owned[0].grad + shape_numel(owned[0].shape));
  r.db = l.db;
  return r;
}

// The weight with the layer's mask applied, as its products multiply it.
std::vector<float> masked(const std::vector<float>& w, const std::vector<uint8_t>& mask) {
  std::vector<float> out(w.size());
  for (size_t i = 0; i < w.size(); ++i) out[i] = mask[i] ? w[i] : 0.0f;
  return out;
}

template <typename C>
C with_qdq_values(C c) {
  auto& v = linear_detail::stored_values(c);
  v = qdq(v, Fp8Format::e4m3);
  return c;
}

// The compressed kinds: forward and dX on their compressed weights, dW gathered at the slots.
template <typename C>
Products compressed_products(const C& fwd, const C& dx_weight, const std::vector<float>& qx,
                             const std::vector<float>& qdy, const std::vector<float>& dy,
                             const std::vector<float>& b) {
  Products r = dense_products(qx, std::vector<float>(size_t(kOut) * kIn), std::vector<float>(size_t(kOut) * kIn),
                              qdy, dy, b);
  const C qf = with_qdq_values(fwd), qb = with_qdq_values(dx_weight);
  std::fill(r.dx.begin(), r.dx.end(), 0.0f);
  if constexpr (std::is_same_v<C, CompressedVNM>) {
    cpu::linear_vnm(r.y.data(), qx.data(), qf, b.data(), kN);
    linear_detail::slot_linear_dx(r.dx.data(), qdy.data(), linear_detail::slot_index(qf),
                                  linear_detail::stored_values(qf).data(), kN);
  } else {
    cpu::linear_24(r.y.data(), qx.data(), qf, b.data(), kN);
    cpu::linear_24(r.dx.data(), qdy.data(), qb, static_cast<const float*>(nullptr), kN);
  }
  std::vector<float> values(linear_detail::stored_values(fwd).size(), 0.0f);
  linear_detail::gather_add(values.data(), linear_detail::slot_index(fwd), r.dw.data(),
                            static_cast<const uint8_t*>(nullptr));
  r.dw = values;
  return r;
}

Products reference(const std::string& kind, Fp8Layer& l, const std::vector<float>& x, const std::vector<float>& dy,
                   Fp8Format grad) {
  const Fp8Format e4 = Fp8Format::e4m3;
  const auto qx = qdq(x, e4), qdy = qdq(dy, grad);
  if (kind == "semi_sparse") {
    const auto ws = qdq(masked(l.w, static_cast<SemiSparseLinear<float>&>(*l.layer).mask()), e4);
    return dense_products(qx, ws, ws, qdy, dy, l.b);
  }
  if (kind == "semi_sparse_activation") {
    std::vector<float> xs(x.size());
    static_cast<SemiSparseActivationLinear<float>&>(*l.layer).sparsify_input(xs.data(), x.data(), kN);
    const auto qw = qdq(l.w, e4), qxs = qdq(xs, e4);
    Products r = dense_products(qxs, qw, qw, qdy, dy, l.b);
    return r;
  }
  if (kind == "vnm") {
    const auto& v = static_cast<VnmLinear<float>&>(*l.layer);
    return compressed_products(v.weight(), v.weight(), qx, qdy, dy, l.b);
  }
  if (kind == "slope") {
    const auto& s = static_cast<SlopeLinear<float>&>(*l.layer);
    return compressed_products(s.forward_weight(), s.backward_weight(), qx, qdy, dy, l.b);
  }
  const auto qw = qdq(l.w, e4);  // dense, masked (the flat weight holds the pruned zeros)
  Products r = dense_products(qx, qw, qw, qdy, dy, l.b);
  if (kind == "masked") r.dw = masked(r.dw, static_cast<MaskedLinear<float>&>(*l.layer).mask());
  return r;
}

class Fp8Kind : public ::testing::TestWithParam<std::string> {};

TEST_P(Fp8Kind, ProductsAreTheFp32ProductsOfHandQuantisedOperands) {
  const std::string kind = GetParam();
  const auto x = randv(size_t(kN) * kIn, 3), dy = randv(size_t(kN) * kOut, 4);
  for (Fp8Format grad : {Fp8Format::e5m2, Fp8Format::e4m3}) {
    Fp8Layer l(kind, grad);
    const Products ref = reference(kind, l, x, dy, grad);
    const Products got = run(l, x, dy);
    EXPECT_EQ(got.y, ref.y) << kind << " forward, gradient " << to_string(grad);
    EXPECT_EQ(got.dx, ref.dx) << kind << " dX";
    EXPECT_EQ(got.dw, ref.dw) << kind << " dW";
    EXPECT_EQ(got.db, ref.db) << kind << " bias gradient (exact sums of dY)";
    EXPECT_EQ(l.layer->fp8_saturated(), 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, Fp8Kind,
                         ::testing::Values("dense", "masked", "vnm", "semi_sparse", "semi_sparse_activation", "slope"));

TEST(Fp8Linear, FullPrecisionProductsAreUnchanged) {
  Fp8Layer l("dense", Fp8Format::e5m2);
  l.layer->set_precision({});
  const auto x = randv(size_t(kN) * kIn, 3), dy = randv(size_t(kN) * kOut, 4);
  const Products got = run(l, x, dy);
  const Products ref = dense_products(x, l.w, l.w, dy, dy, l.b);
  EXPECT_EQ(got.y, ref.y);
  EXPECT_EQ(got.dx, ref.dx);
  EXPECT_EQ(got.dw, ref.dw);
}

TEST(Fp8Linear, SaturatedCastsAreCounted) {
  Fp8Layer l("dense", Fp8Format::e5m2);
  auto x = randv(size_t(kN) * kIn, 3);
  x[5] = INFINITY;
  std::vector<float> y(size_t(kN) * kOut);
  l.layer->forward(y.data(), x.data(), kN);
  EXPECT_EQ(l.layer->fp8_saturated(), 1);
}

ModelConfig tiny_config() {
  ModelConfig c;
  c.vocab_size = 32;
  c.max_seq_len = 16;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_kv_head = 2;
  c.d_model = 32;
  c.d_ff = 64;
  return c;
}

TEST(Fp8Model, PrecisionReachesEveryLayerAndReplacedOnes) {
  Transformer<float> model(tiny_config());
  model.set_linear_precision(fp8(Fp8Format::e4m3));
  for (const auto& name : model.linear_names()) EXPECT_TRUE(model.linear(name).params().precision.fp8) << name;
  const std::string name = "blocks.1.mlp.fc.weight";
  LinearOptions o;
  o.kind = "masked";
  o.pattern = SparsityPattern::nm(2, 4);
  o.lora_rank = 4;
  o.lora_enabled = true;
  model.replace_linear(name, make_linear(model.linear_params(name), o, &model.linear(name)));
  auto& lora = static_cast<LoraLinear<float>&>(model.linear(name));
  EXPECT_EQ(lora.inner().params().precision, fp8(Fp8Format::e4m3));
  model.set_linear_precision({});
  EXPECT_FALSE(lora.inner().params().precision.fp8);
}

// A tiny model learning a fixed token cycle with AdamW; returns the loss of every step.
std::vector<double> train_losses(const LinearPrecision& precision, const std::string& kind, int steps) {
  Transformer<float> model(tiny_config());
  model.init_weights(7);
  model.set_linear_precision(precision);
  if (kind != "dense")
    for (const auto& name : model.linear_names()) {
      LinearOptions o;
      o.kind = kind;
      model.replace_linear(name, make_linear(model.linear_params(name), o, &model.linear(name)));
    }
  const int B = 4, T = 16;
  std::vector<int32_t> tokens(size_t(B) * (T + 1));
  Rng rng(11);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = int32_t((i * 7 + i / 5) % 32);
  std::vector<int32_t> in, tgt;
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t) {
      in.push_back(tokens[size_t(b) * (T + 1) + t]);
      tgt.push_back(tokens[size_t(b) * (T + 1) + t + 1]);
    }
  std::vector<std::vector<float>> m, v;
  std::vector<double> losses;
  for (int s = 1; s <= steps; ++s) {
    model.on_step_begin(s - 1);
    model.zero_grad();
    losses.push_back(model.forward_backward(in.data(), tgt.data(), B, T, 1.0));
    auto params = model.trainable_params();
    m.resize(params.size());
    v.resize(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      const int64_t n = shape_numel(params[i].shape);
      m[i].resize(size_t(n));
      v[i].resize(size_t(n));
      cpu::adamw_step(params[i].value, params[i].grad, m[i].data(), v[i].data(), n, 3e-3, 0.9, 0.95, 1e-8,
                      params[i].decay ? 0.01 : 0.0, s);
    }
    model.after_optimizer_step();
  }
  return losses;
}

class Fp8Training : public ::testing::TestWithParam<std::string> {};

TEST_P(Fp8Training, LossDecreasesAndStaysNearFp32) {
  const int steps = 40;
  const auto full = train_losses({}, GetParam(), steps);
  const auto f8 = train_losses(fp8(), GetParam(), steps);
  EXPECT_NE(full.back(), f8.back());  // the products did change
  EXPECT_LT(f8.back(), 0.5 * f8.front()) << GetParam();
  EXPECT_NEAR(f8.back(), full.back(), 0.05 * full.back()) << GetParam();
  // Deterministic: a second run is bit-identical (fp8 keeps no state between steps).
  EXPECT_EQ(train_losses(fp8(), GetParam(), 5), std::vector<double>(f8.begin(), f8.begin() + 5));
}

INSTANTIATE_TEST_SUITE_P(Kinds, Fp8Training, ::testing::Values("dense", "semi_sparse", "slope"));

}  // namespace
