// The Linear kinds (model/linear_kinds.h): forward against dense products with the effective
// weight, backward against finite differences (or, where the gradient is straight-through
// by design, against its documented definition and finite differences with the mask
// frozen), SLoPe's double-pruned backward and mask refresh, adapters, sparse AdamW,
// kernel replacement, state round trips and errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gradcheck.h"
#include "linear_test_util.h"
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
#include "sparse/double_prune.h"
#include "sparse/masks.h"
#include "sparse/transposable.h"
#include "test_util.h"

using namespace esplag;
using esplag::testing::dot;
using esplag::testing::expect_close;
using esplag::testing::numeric_grad;
using esplag::testing::randv;
template <typename T>
using Buffers = esplag::testing::LayerBuffers<T>;

namespace {

// Independent naive products in double.
std::vector<double> ref_forward(const std::vector<double>& x, const std::vector<double>& w, const double* b, int N,
                                int in, int out) {
  std::vector<double> y(size_t(N) * out);
  for (int n = 0; n < N; ++n)
    for (int o = 0; o < out; ++o) {
      double acc = b ? b[o] : 0.0;
      for (int c = 0; c < in; ++c) acc += x[n * in + c] * w[o * in + c];
      y[n * out + o] = acc;
    }
  return y;
}
std::vector<double> ref_dx(const std::vector<double>& dy, const std::vector<double>& w, int N, int in, int out) {
  std::vector<double> dx(size_t(N) * in, 0.0);
  for (int n = 0; n < N; ++n)
    for (int c = 0; c < in; ++c)
      for (int o = 0; o < out; ++o) dx[n * in + c] += dy[n * out + o] * w[o * in + c];
  return dx;
}
std::vector<double> ref_dw(const std::vector<double>& dy, const std::vector<double>& x, int N, int in, int out) {
  std::vector<double> dw(size_t(out) * in, 0.0);
  for (int o = 0; o < out; ++o)
    for (int c = 0; c < in; ++c)
      for (int n = 0; n < N; ++n) dw[o * in + c] += dy[n * out + o] * x[n * in + c];
  return dw;
}
std::vector<double> masked(const std::vector<double>& w, const std::vector<uint8_t>& m) {
  std::vector<double> r(w.size());
  for (size_t i = 0; i < w.size(); ++i) r[i] = m[i] ? w[i] : 0.0;
  return r;
}

template <typename T>
std::vector<T> effective(const Linear<T>& l) {
  std::vector<T> w(size_t(l.params().out_features) * l.params().in_features);
  l.dense_weight(w.data());
  return w;
}

template <typename T>
void zero_all_grads(Linear<T>& l, Buffers<T>& f) {
  std::fill(f.dw.begin(), f.dw.end(), T(0));
  std::fill(f.db.begin(), f.db.end(), T(0));
  for (auto& op : l.owned_params()) std::fill(op.grad, op.grad + shape_numel(op.shape), T(0));
}

template <typename T>
OwnedParam<T> owned(Linear<T>& l, const std::string& name) {
  for (auto& op : l.owned_params())
    if (op.name == name) return op;
  ADD_FAILURE() << "no owned parameter " << name;
  return {};
}

// One AdamW step over a kind's owned parameters (and the flat weight when the kind trains
// it), moments kept by name, then the kind's hook.
template <typename T>
struct MiniTrainer {
  std::map<std::string, std::vector<T>> m, v;
  double lr = 0.05, wd = 0.1;
  int64_t t = 0;
  void step(Linear<T>& l, Buffers<T>& f) {
    ++t;
    std::vector<OwnedParam<T>> ps = l.owned_params();
    if (l.trains_dense_weight()) ps.push_back({f.p.name, {int64_t(f.w.size())}, f.w.data(), f.dw.data(), true});
    ps.push_back({"bias", {int64_t(f.b.size())}, f.b.data(), f.db.data(), false});
    for (auto& p : ps) {
      const size_t n = size_t(shape_numel(p.shape));
      auto& mp = m[p.name];
      auto& vp = v[p.name];
      if (mp.size() != n) mp.assign(n, T(0)), vp.assign(n, T(0));
      cpu::adamw_step(p.value, p.grad, mp.data(), vp.data(), int64_t(n), lr, 0.9, 0.999, 1e-8, p.decay ? wd : 0.0,
                      t);
    }
    l.after_optimizer_step();
  }
};

// forward, then backward of loss = Σ out·r; returns dX.
template <typename T>
std::vector<T> run_backward(Linear<T>& l, Buffers<T>& f, const std::vector<T>& x, const std::vector<T>& r, int N) {
  std::vector<T> out(size_t(N) * f.p.out_features), dx(x.size(), T(0));
  zero_all_grads(l, f);
  l.forward(out.data(), x.data(), N);
  l.backward(dx.data(), r.data(), x.data(), N);
  return dx;
}

std::function<double()> loss_of(Linear<double>& l, std::vector<double>& x, const std::vector<double>& r, int N) {
  return [&l, &x, &r, N]() {
    std::vector<double> out(r.size());
    l.forward(out.data(), x.data(), N);
    return dot(out, r);
  };
}

bool is_transposable(const std::vector<uint8_t>& m, int rows, int cols) {
  for (int tr = 0; tr < rows; tr += 4)
    for (int tc = 0; tc < cols; tc += 4)
      for (int i = 0; i < 4; ++i) {
        int rsum = 0, csum = 0;
        for (int j = 0; j < 4; ++j) {
          rsum += m[(tr + i) * cols + tc + j];
          csum += m[(tr + j) * cols + tc + i];
        }
        if (rsum > 2 || csum > 2) return false;
      }
  return true;
}

}  // namespace

// --- factory ----------------------------------------------------------------------------------

TEST(LinearKinds, NamesAndUnknownKind) {
  const auto& names = linear_kind_names();
  EXPECT_EQ(names, (std::vector<std::string>{"dense", "masked", "semi_sparse", "semi_sparse_activation", "slope",
                                              "vnm"}));
  Buffers<float> f(8, 8, 1);
  LinearOptions o;
  o.kind = "sparse_magic";
  try {
    make_linear(f.p, o);
    FAIL() << "unknown kind accepted";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("sparse_magic"), std::string::npos) << msg;
    EXPECT_NE(msg.find("blocks.0.mlp.fc.weight"), std::string::npos) << msg;
    for (const auto& n : names) EXPECT_NE(msg.find(n), std::string::npos) << msg;
  }
}

TEST(LinearKinds, FactoryBuildsEveryKind) {
  Buffers<double> f(32, 16, 2);
  for (const auto& name : linear_kind_names()) {
    LinearOptions o;
    o.kind = name;
    o.pattern = name == "vnm" ? SparsityPattern::vnm(16, 2, 8) : SparsityPattern::nm(2, 4);
    auto l = make_linear(f.p, o);
    EXPECT_EQ(l->kind(), name);
    o.lora_rank = 2;
    o.lora_enabled = true;
    auto a = make_linear(f.p, o);
    EXPECT_EQ(a->kind(), name == "slope" ? "slope" : name + "+lora");
  }
}

TEST(LinearKinds, FactoryMaskedSparsity) {
  const int out = 16, in = 16;
  auto zeros_after = [&](double pattern_sparsity, double sparsity) {
    Buffers<float> f(out, in, 90);
    LinearOptions o;
    o.kind = "masked";
    o.pattern = SparsityPattern::unstructured(pattern_sparsity);
    o.sparsity = sparsity;
    auto l = make_linear(f.p, o);
    EXPECT_EQ(l->pattern(), "unstructured " + std::to_string(int(std::lround(100 * (sparsity > 0 ? sparsity : pattern_sparsity)))) + "%");
    return int(std::count(f.w.begin(), f.w.end(), 0.0f));
  };
  EXPECT_EQ(zeros_after(0.75, 0.0), 192) << "the pattern's sparsity when none is given";
  EXPECT_EQ(zeros_after(0.75, 0.25), 64) << "the given sparsity (a GMP ramp) otherwise";
}

TEST(LinearKinds, DimensionErrorsNameTheLayer) {
  Buffers<double> f(8, 6, 3);  // in = 6: no 2:4 along in
  Buffers<double> g(6, 8, 3);  // out = 6: no column 2:4 / transposable tiles
  for (const char* kind : {"semi_sparse", "semi_sparse_activation", "slope"})
    for (auto* b : {&f, &g}) {
      LinearOptions o;
      o.kind = kind;
      try {
        make_linear(b->p, o);
        ADD_FAILURE() << kind << " accepted [" << b->p.out_features << ", " << b->p.in_features << "]";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("blocks.0.mlp.fc.weight"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("multiples of 4"), std::string::npos) << e.what();
      }
    }
  LinearOptions o;
  o.kind = "vnm";
  o.pattern = SparsityPattern::vnm(16, 2, 8);
  Buffers<double> h(24, 16, 3);  // rows not a multiple of V = 16
  EXPECT_THROW(make_linear(h.p, o), Error);
  o.pattern = SparsityPattern::nm(1, 4);  // not V:2:M
  EXPECT_THROW(make_linear(f.p, o), Error);
  o.kind = "masked";
  o.pattern = SparsityPattern::nm(2, 4);
  EXPECT_THROW(make_linear(f.p, o), Error);
}

// --- masked -----------------------------------------------------------------------------------

TEST(LinearKinds, MaskedForwardAndGradients) {
  const int N = 3, out = 32, in = 16;
  for (const SparsityPattern& pat :
       {SparsityPattern::nm(2, 4), SparsityPattern::vnm(16, 2, 8), SparsityPattern::unstructured(0.6)}) {
    Buffers<double> f(out, in, 4);
    const std::vector<double> w0 = f.w;
    MaskedLinear<double> l(f.p, pat, pat.sparsity);
    const auto mask = cpu::make_mask(w0.data(), out, in, pat);
    EXPECT_EQ(l.mask(), mask) << pat.to_string();
    EXPECT_EQ(f.w, masked(w0, mask)) << "pruned weights are zeroed in the flat buffer";
    EXPECT_TRUE(cpu::check_pattern(f.w.data(), out, in, pat).ok);

    auto x = randv<double>(size_t(N) * in, 5);
    const auto r = randv<double>(size_t(N) * out, 6);
    std::vector<double> y(size_t(N) * out);
    l.forward(y.data(), x.data(), N);
    expect_close(y, ref_forward(x, masked(w0, mask), f.b.data(), N, in, out), 1e-12, 1e-12, "masked forward");
    const auto dx = run_backward<double>(l, f, x, r, N);
    expect_close(dx, numeric_grad(x, loss_of(l, x, r, N)), 1e-7, 1e-8, "masked dX");
    const auto dw = f.dw;
    const auto db = f.db;
    expect_close(db, numeric_grad(f.b, loss_of(l, x, r, N)), 1e-7, 1e-8, "masked dbias");
    // Finite differences over the kept entries; pruned entries get exactly no gradient.
    auto fd = numeric_grad(f.w, loss_of(l, x, r, N));
    for (size_t i = 0; i < mask.size(); ++i) {
      if (mask[i])
        EXPECT_NEAR(dw[i], fd[i], 1e-7 * (1 + std::abs(fd[i]))) << i;
      else
        EXPECT_EQ(dw[i], 0.0) << i;
    }
  }
}

TEST(LinearKinds, MaskedPatternSurvivesAdamWWithWeightDecay) {
  const int N = 4, out = 32, in = 16;
  for (const SparsityPattern& pat :
       {SparsityPattern::nm(2, 4), SparsityPattern::vnm(16, 2, 8), SparsityPattern::unstructured(0.75)}) {
    Buffers<float> f(out, in, 7);
    MaskedLinear<float> l(f.p, SparsityPattern::dense());
    // Moments as left by dense training before the mask arrived.
    std::vector<float> m = randv<float>(f.w.size(), 8, 0.1), v(f.w.size());
    for (size_t i = 0; i < v.size(); ++i) v[i] = m[i] * m[i] + 0.01f;
    l.set_mask(pat, pat.sparsity);
    ASSERT_TRUE(cpu::check_pattern(f.w.data(), out, in, pat).ok) << pat.to_string();
    ASSERT_TRUE(cpu::check_pattern(l.mask().data(), out, in, pat).ok) << pat.to_string();
    const auto x = randv<float>(size_t(N) * in, 9), r = randv<float>(size_t(N) * out, 10);
    run_backward<float>(l, f, x, r, N);
    cpu::adamw_step(f.w.data(), f.dw.data(), m.data(), v.data(), int64_t(f.w.size()), 0.1, 0.9, 0.999, 1e-8, 0.1, 3);
    // Without the hook the old moments revive pruned weights: the test can fail.
    EXPECT_FALSE(cpu::check_pattern(f.w.data(), out, in, pat).ok) << pat.to_string();
    l.after_optimizer_step();
    EXPECT_TRUE(cpu::check_pattern(f.w.data(), out, in, pat).ok) << pat.to_string();
    for (size_t i = 0; i < f.w.size(); ++i)
      if (!l.mask()[i]) EXPECT_EQ(f.w[i], 0.0f);
  }
}

TEST(LinearKinds, MaskedStateRoundTrip) {
  const int N = 3, out = 16, in = 16;
  Buffers<float> a(out, in, 11);
  MaskedLinear<float> la(a.p, SparsityPattern::unstructured(0.5), 0.5);
  const auto st = la.state();
  ASSERT_TRUE(st.count(a.p.name + ".mask"));
  // What a resumed run does: the layer is built on other (initial) weights, then the saved
  // flat weights and the state are loaded.
  Buffers<float> b(out, in, 12);
  MaskedLinear<float> lb(b.p, SparsityPattern::unstructured(0.5), 0.5);
  ASSERT_NE(lb.mask(), la.mask());
  std::copy(a.w.begin(), a.w.end(), b.w.begin());
  std::copy(a.b.begin(), a.b.end(), b.b.begin());
  lb.load_state(st);
  EXPECT_EQ(lb.mask(), la.mask());
  EXPECT_EQ(b.w, a.w);
  const auto x = randv<float>(size_t(N) * in, 13);
  std::vector<float> ya(size_t(N) * out), yb(ya.size());
  la.forward(ya.data(), x.data(), N);
  lb.forward(yb.data(), x.data(), N);
  EXPECT_EQ(ya, yb);
  // A mask that breaks the pattern is refused.
  auto bad = st;
  Tensor t = Tensor::zeros({out, in}, DType::u8, "m");
  std::fill(t.data<uint8_t>(), t.data<uint8_t>() + t.numel(), 1);
  bad[a.p.name + ".mask"] = t;
  EXPECT_THROW(lb.load_state(bad), Error);
}

// --- semi_sparse --------------------------------------------------------------------------

TEST(LinearKinds, SemiSparseStraightThrough) {
  const int N = 5, out = 16, in = 12;
  Buffers<double> f(out, in, 14);
  SemiSparseLinear<double> l(f.p);
  const auto mask = cpu::transposable_mask_greedy(f.w.data(), out, in);
  EXPECT_EQ(l.mask(), mask);
  EXPECT_TRUE(is_transposable(mask, out, in));
  const auto ws = masked(f.w, mask);
  EXPECT_EQ(effective(l), ws);
  auto x = randv<double>(size_t(N) * in, 15);
  const auto r = randv<double>(size_t(N) * out, 16);
  std::vector<double> y(size_t(N) * out);
  l.forward(y.data(), x.data(), N);
  expect_close(y, ref_forward(x, ws, f.b.data(), N, in, out), 1e-12, 1e-12, "semi_sparse forward");
  const auto dx = run_backward<double>(l, f, x, r, N);
  // dX through the same masked weight, which is also the exact derivative in X.
  expect_close(dx, ref_dx(r, ws, N, in, out), 1e-12, 1e-12, "semi_sparse dX = dY·(W⊙mask)");
  expect_close(dx, numeric_grad(x, loss_of(l, x, r, N)), 1e-7, 1e-8, "semi_sparse dX (FD)");
  // Straight-through dW: dense, pruned entries included.
  const auto dw_ste = ref_dw(r, x, N, in, out);
  expect_close(f.dw, dw_ste, 1e-12, 1e-12, "semi_sparse dW = dYᵀ·X");
  int pruned_nonzero = 0;
  for (size_t i = 0; i < mask.size(); ++i) pruned_nonzero += !mask[i] && f.dw[i] != 0.0;
  EXPECT_GT(pruned_nonzero, 0);
  // With the mask frozen, finite differences give dW on the kept entries.
  const auto dw = f.dw;
  auto wv = f.w;
  auto frozen = [&]() { return dot(ref_forward(x, masked(wv, mask), f.b.data(), N, in, out), r); };
  const auto fd = numeric_grad(wv, frozen);
  for (size_t i = 0; i < mask.size(); ++i)
    if (mask[i]) EXPECT_NEAR(dw[i], fd[i], 1e-7 * (1 + std::abs(fd[i]))) << i;
  expect_close(f.db, numeric_grad(f.b, loss_of(l, x, r, N)), 1e-7, 1e-8, "semi_sparse dbias");
}

TEST(LinearKinds, SemiSparseActivationStraightThrough) {
  const int out = 8, in = 16;
  for (ActivationSparsity how : {ActivationSparsity::row_24, ActivationSparsity::tile_24}) {
    const int N = 6;  // not a multiple of 4: tile mode pads
    Buffers<double> f(out, in, 17);
    SemiSparseActivationLinear<double> l(f.p, how);
    auto x = randv<double>(size_t(N) * in, 18);
    const auto r = randv<double>(size_t(N) * out, 19);
    std::vector<uint8_t> xm;
    if (how == ActivationSparsity::row_24) {
      xm = cpu::nm_mask(x.data(), N, in, 2, 4);
    } else {
      std::vector<double> padded(size_t(8) * in, 0.0);
      std::copy(x.begin(), x.end(), padded.begin());
      xm = cpu::transposable_mask_greedy(padded.data(), 8, in);
      EXPECT_TRUE(is_transposable(xm, 8, in));
      xm.resize(x.size());
    }
    const auto xs = masked(x, xm);
    std::vector<double> xs_layer(x.size());
    l.sparsify_input(xs_layer.data(), x.data(), N);
    EXPECT_EQ(xs_layer, xs);
    int kept = 0;
    for (auto k : xm) kept += k;
    if (how == ActivationSparsity::row_24) EXPECT_EQ(kept, N * in / 2);
    std::vector<double> y(size_t(N) * out);
    l.forward(y.data(), x.data(), N);
    expect_close(y, ref_forward(xs, f.w, f.b.data(), N, in, out), 1e-12, 1e-12, "activation forward");
    const auto dx = run_backward<double>(l, f, x, r, N);
    expect_close(dx, ref_dx(r, f.w, N, in, out), 1e-12, 1e-12, "activation dX = dY·W (straight through)");
    expect_close(f.dw, ref_dw(r, xs, N, in, out), 1e-12, 1e-12, "activation dW = dYᵀ·Xs");
    // The mask depends on X only, so finite differences in W and b are exact...
    const auto dw = f.dw, db = f.db;
    expect_close(dw, numeric_grad(f.w, loss_of(l, x, r, N)), 1e-7, 1e-8, "activation dW (FD)");
    expect_close(db, numeric_grad(f.b, loss_of(l, x, r, N)), 1e-7, 1e-8, "activation dbias (FD)");
    // ...and in X with the mask frozen they agree with dX on the kept activations.
    auto xv = x;
    auto frozen = [&]() { return dot(ref_forward(masked(xv, xm), f.w, f.b.data(), N, in, out), r); };
    const auto fd = numeric_grad(xv, frozen);
    for (size_t i = 0; i < xm.size(); ++i)
      if (xm[i]) EXPECT_NEAR(dx[i], fd[i], 1e-7 * (1 + std::abs(fd[i]))) << i;
  }
}

// --- slope ----------------------------------------------------------------------------------

TEST(LinearKinds, SlopeMasksStorageAndForward) {
  const int N = 3, out = 16, in = 16;
  Buffers<double> f(out, in, 20);
  const auto w0 = f.w;
  SlopeLinear<double> l(f.p, 100);
  const auto fwd = cpu::nm_mask(w0.data(), out, in, 2, 4);
  EXPECT_EQ(l.forward_mask(), fwd);
  const auto w1 = masked(w0, fwd);
  EXPECT_EQ(f.w, w1) << "flat weight holds W1";
  EXPECT_EQ(effective(l), w1);
  EXPECT_EQ(l.backward_mask(), cpu::double_prune_backward_mask(w1.data(), fwd.data(), out, in));
  EXPECT_TRUE(cpu::check_pattern(l.backward_mask().data(), out, in, SparsityPattern::nm(2, 4)).ok);
  int kept_bwd = 0;
  for (auto b : l.backward_mask()) kept_bwd += b;
  EXPECT_LT(kept_bwd, out * in / 2) << "double pruning keeps less than the forward mask";
  for (size_t i = 0; i < fwd.size(); ++i)
    if (l.backward_mask()[i]) EXPECT_TRUE(fwd[i]);
  // Stored compressed: the same layout the sparse layer produces for W1.
  const std::vector<float> w1f(w1.begin(), w1.end());
  const Compressed24 ref = cpu::compress_24(w1f.data(), out, in);
  EXPECT_EQ(l.forward_weight().meta, ref.meta);
  EXPECT_EQ(l.values().size(), size_t(out * in / 2));
  for (size_t i = 0; i < ref.values.size(); ++i) EXPECT_EQ(float(l.values()[i]), ref.values[i]);
  EXPECT_FALSE(l.trains_dense_weight());
  const auto ops = l.owned_params();
  ASSERT_EQ(ops.size(), 1u);
  EXPECT_EQ(ops[0].name, "blocks.0.mlp.fc.weight.values");
  EXPECT_EQ(ops[0].shape, (Shape{out, in / 2}));

  const auto x = randv<double>(size_t(N) * in, 21);
  std::vector<double> y(size_t(N) * out);
  l.forward(y.data(), x.data(), N);
  expect_close(y, ref_forward(x, w1, f.b.data(), N, in, out), 1e-12, 1e-12, "slope forward");
}

TEST(LinearKinds, SlopeBackwardUsesDoublePrunedCopy) {
  const int N = 4, out = 16, in = 12;
  Buffers<double> f(out, in, 22);
  SlopeLinear<double> l(f.p, 100);
  const auto w1 = f.w;
  const auto w2 = masked(w1, l.backward_mask());
  auto x = randv<double>(size_t(N) * in, 23);
  const auto r = randv<double>(size_t(N) * out, 24);
  const auto dx = run_backward<double>(l, f, x, r, N);
  expect_close(dx, ref_dx(r, w2, N, in, out), 1e-12, 1e-12, "slope dX = dY·W2");
  const auto with_w1 = ref_dx(r, w1, N, in, out);
  double diff = 0;
  for (size_t i = 0; i < dx.size(); ++i) diff = std::max(diff, std::abs(dx[i] - with_w1[i]));
  EXPECT_GT(diff, 1e-3) << "dX must not be dY·W1";
  // Gradient of the trained values: finite differences of the forward in the values.
  const auto dv = owned(l, f.p.name + ".values");
  const std::vector<double> grad(dv.grad, dv.grad + shape_numel(dv.shape));
  expect_close(grad, numeric_grad(l.values(), loss_of(l, x, r, N)), 1e-7, 1e-8, "slope d(values)");
  // ...which is dYᵀ·X at the kept positions, compressed.
  const auto dw = ref_dw(r, x, N, in, out);
  std::vector<double> want(grad.size());
  linear_detail::gather(want.data(), linear_detail::slot_index(l.forward_weight()), dw.data(),
                        static_cast<const uint8_t*>(nullptr));
  expect_close(grad, want, 1e-12, 1e-12, "slope d(values) = compress(dYᵀ·X)");
  EXPECT_EQ(f.dw, std::vector<double>(f.dw.size(), 0.0)) << "the flat gradient is not used";
  expect_close(f.db, numeric_grad(f.b, loss_of(l, x, r, N)), 1e-7, 1e-8, "slope dbias");
}

TEST(LinearKinds, SlopeRefreshesBackwardMaskEveryKSteps) {
  const int N = 4, out = 16, in = 16, k = 3;
  Buffers<double> f(out, in, 25);
  SlopeLinear<double> l(f.p, k);
  MiniTrainer<double> tr;
  tr.lr = 0.2;
  std::vector<uint8_t> expected = l.backward_mask();
  int refreshes = 0, changed = 0, stale = 0;
  for (int64_t step = 0; step < 10; ++step) {
    l.on_step_begin(step);
    const auto fresh = cpu::double_prune_backward_mask(f.w.data(), l.forward_mask().data(), out, in);
    if (step > 0 && step % k == 0) {
      ++refreshes;
      changed += fresh != expected;
      expected = fresh;
    } else {
      stale += fresh != expected;
    }
    ASSERT_EQ(l.backward_mask(), expected) << "step " << step;
    EXPECT_EQ(l.refresh_step(), step / k * k);
    const auto x = randv<double>(size_t(N) * in, 100 + step), r = randv<double>(size_t(N) * out, 200 + step);
    const auto dx = run_backward<double>(l, f, x, r, N);
    expect_close(dx, ref_dx(r, masked(f.w, expected), N, in, out), 1e-12, 1e-12, "dX with the current W2");
    tr.step(l, f);
    std::vector<double> w1(f.w.size());
    linear_detail::scatter(w1.data(), linear_detail::slot_index(l.forward_weight()), l.values().data());
    EXPECT_EQ(f.w, w1) << "flat weight synced after the optimizer step";
  }
  EXPECT_EQ(refreshes, 3);
  EXPECT_GT(changed, 0) << "training moved the weights enough to change the backward mask";
  EXPECT_GT(stale, 0) << "between refreshes the mask is kept although a fresh one differs";
  EXPECT_EQ(l.forward_mask(), cpu::nm_mask(std::vector<double>(f.w).data(), out, in, 2, 4))
      << "forward mask never changes (still the 2:4 of the trained W1)";
}

TEST(LinearKinds, SlopeLazyAdapterGradientsAndMergedForward) {
  const int N = 3, out = 16, in = 12, rank = 3;
  Buffers<double> f(out, in, 26);
  SlopeLinear<double> l(f.p, 100);
  auto x = randv<double>(size_t(N) * in, 27);
  const auto r = randv<double>(size_t(N) * out, 28);
  std::vector<double> before(size_t(N) * out), after(before.size());
  l.forward(before.data(), x.data(), N);
  l.enable_lora(rank, 5);
  EXPECT_EQ(l.lora_rank(), rank);
  l.forward(after.data(), x.data(), N);
  EXPECT_EQ(before, after) << "R starts at zero: enabling the adapter keeps the output";
  const auto names = l.owned_params();
  ASSERT_EQ(names.size(), 3u);
  EXPECT_EQ(names[1].name, "blocks.0.mlp.fc.lora_l");
  EXPECT_EQ(names[1].shape, (Shape{out, rank}));
  EXPECT_EQ(names[2].name, "blocks.0.mlp.fc.lora_r");
  EXPECT_EQ(names[2].shape, (Shape{rank, in}));
  // The lazy start: R's gradient is non-zero though R is zero.
  run_backward<double>(l, f, x, r, N);
  const auto dr0 = owned(l, "blocks.0.mlp.fc.lora_r");
  double dr_norm = 0;
  for (int64_t i = 0; i < shape_numel(dr0.shape); ++i) dr_norm += std::abs(dr0.grad[i]);
  EXPECT_GT(dr_norm, 0.0);

  l.lora_r() = randv<double>(l.lora_r().size(), 29, 0.5);
  // Forward against the dense product with the effective weight W1 + L·R.
  std::vector<double> y(size_t(N) * out);
  l.forward(y.data(), x.data(), N);
  expect_close(y, ref_forward(x, effective(l), f.b.data(), N, in, out), 1e-12, 1e-12, "slope+adapter forward");
  const auto dx = run_backward<double>(l, f, x, r, N);
  const std::vector<double> dl(owned(l, "blocks.0.mlp.fc.lora_l").grad,
                               owned(l, "blocks.0.mlp.fc.lora_l").grad + out * rank);
  const std::vector<double> dr(owned(l, "blocks.0.mlp.fc.lora_r").grad,
                               owned(l, "blocks.0.mlp.fc.lora_r").grad + rank * in);
  const auto dv = owned(l, f.p.name + ".values");
  const std::vector<double> dvals(dv.grad, dv.grad + shape_numel(dv.shape));
  expect_close(dl, numeric_grad(l.lora_l(), loss_of(l, x, r, N)), 1e-7, 1e-8, "d lora_l");
  expect_close(dr, numeric_grad(l.lora_r(), loss_of(l, x, r, N)), 1e-7, 1e-8, "d lora_r");
  expect_close(dvals, numeric_grad(l.values(), loss_of(l, x, r, N)), 1e-7, 1e-8, "d values with adapter");
  // dX: the double-pruned copy plus the adapter's exact term.
  std::vector<double> lr(size_t(out) * in, 0.0);
  for (int o = 0; o < out; ++o)
    for (int c = 0; c < in; ++c)
      for (int q = 0; q < rank; ++q) lr[o * in + c] += l.lora_l()[o * rank + q] * l.lora_r()[q * in + c];
  auto w2lr = masked(f.w, l.backward_mask());
  for (size_t i = 0; i < w2lr.size(); ++i) w2lr[i] += lr[i];
  expect_close(dx, ref_dx(r, w2lr, N, in, out), 1e-12, 1e-12, "slope+adapter dX = dY·(W2 + L·R)");
}

TEST(LinearKinds, SlopeMergedForwardEqualsTrainingForward) {
  const int N = 5, out = 16, in = 24;
  {
    Buffers<float> f(out, in, 30);
    SlopeLinear<float> l(f.p, 10);
    const auto x = randv<float>(size_t(N) * in, 31);
    std::vector<float> a(size_t(N) * out), b(a.size());
    l.forward(a.data(), x.data(), N);
    l.merged_forward(b.data(), x.data(), N);
    EXPECT_EQ(a, b) << "float, no adapter";
    l.enable_lora(4, 32);
    l.lora_r() = randv<float>(l.lora_r().size(), 33, 0.3);
    l.forward(a.data(), x.data(), N);
    l.merged_forward(b.data(), x.data(), N);
    EXPECT_EQ(a, b) << "float, adapter";
  }
  {
    Buffers<double> f(out, in, 34, /*bias=*/false);
    SlopeLinear<double> l(f.p, 10);
    l.enable_lora(2, 35);
    l.lora_r() = randv<double>(l.lora_r().size(), 36, 0.3);
    const auto x = randv<double>(size_t(N) * in, 37);
    std::vector<double> a(size_t(N) * out), b(a.size());
    l.forward(a.data(), x.data(), N);
    l.merged_forward(b.data(), x.data(), N);
    EXPECT_EQ(a, b) << "double, adapter, no bias";
  }
}

// A slope layer built on the host keeps what defines it (W1's values and metadata, W2ᵀ's
// metadata: 2.25 bytes per weight), not the CPU products' state (6 bytes per weight more),
// the dense work buffers of its construction (8 bytes per weight) nor a written gradient (2
// bytes): SlopeLinear::host_bytes counts 2.25 exactly (tests/test_slope_twin.cpp). Resident
// memory also sees what the allocator keeps of freed construction buffers and zeroes of the
// gradient's calloc where it reuses the heap (about 2 bytes per weight more here), so the
// bound only tells 2.25 from the 8.25 or more with the CPU products' state.
TEST(LinearKinds, SlopeLayerHoldsNoDenseWorkBuffersAfterConstruction) {
  using esplag::testing::resident_mib;
  if (resident_mib() < 0) GTEST_SKIP() << "no /proc/self/statm";
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "resident memory under AddressSanitizer includes its shadow and quarantine";
#endif
  const int out = 4096, in = 4096;
  const double weight_mib = double(out) * in / double(1 << 20);  // MiB per byte-per-weight
  Buffers<float> f(out, in, 5, false);
  const double before = resident_mib();
  auto l = std::make_unique<SlopeLinear<float>>(f.p, 10);
  const double held = resident_mib() - before;
  EXPECT_LT(held, 6 * weight_mib) << "bytes per weight: " << held / weight_mib;
  EXPECT_GT(held, 2 * weight_mib) << "the measurement misses the layer itself";
}

TEST(LinearKinds, SparseAdamWEqualsDenseAdamWRestrictedToMask) {
  const int N = 6, out = 16, in = 32;
  Buffers<float> f(out, in, 40);
  SlopeLinear<float> l(f.p, 2);
  const auto mask = l.forward_mask();
  std::vector<float> wd = f.w;  // dense reference: W1 with pruned entries held at 0
  std::vector<float> md(wd.size(), 0.f), vd(wd.size(), 0.f), ms(l.values().size(), 0.f), vs(ms.size(), 0.f);
  for (int64_t step = 0; step < 5; ++step) {
    l.on_step_begin(step);
    const auto x = randv<float>(size_t(N) * in, 300 + step), r = randv<float>(size_t(N) * out, 400 + step);
    run_backward<float>(l, f, x, r, N);
    std::vector<float> gd(wd.size(), 0.f);
    cpu::linear_backward(static_cast<float*>(nullptr), gd.data(), static_cast<float*>(nullptr), r.data(), x.data(),
                         wd.data(), N, in, out);
    cpu::apply_mask(gd.data(), mask.data(), int64_t(gd.size()));
    const auto v = owned(l, f.p.name + ".values");
    cpu::adamw_step(v.value, v.grad, ms.data(), vs.data(), int64_t(ms.size()), 0.01, 0.9, 0.95, 1e-8, 0.1, step + 1);
    cpu::adamw_step(wd.data(), gd.data(), md.data(), vd.data(), int64_t(wd.size()), 0.01, 0.9, 0.95, 1e-8, 0.1,
                    step + 1);
    l.after_optimizer_step();
    ASSERT_EQ(f.w, wd) << "step " << step;
    ASSERT_EQ(effective(l), wd) << "step " << step;
  }
  for (size_t i = 0; i < wd.size(); ++i)
    if (!mask[i]) EXPECT_EQ(md[i], 0.f);
}

TEST(LinearKinds, SlopeStateRoundTripIsBitExact) {
  const int N = 3, out = 16, in = 12;
  Buffers<double> a(out, in, 41);
  SlopeLinear<double> la(a.p, 2);
  la.enable_lora(2, 42);
  MiniTrainer<double> tr;
  tr.lr = 0.2;
  for (int64_t step = 0; step < 3; ++step) {
    la.on_step_begin(step);
    run_backward<double>(la, a, randv<double>(size_t(N) * in, 500 + step), randv<double>(size_t(N) * out, 600 + step),
                         N);
    tr.step(la, a);
  }
  Buffers<double> b(out, in, 43);  // other weights: other masks
  SlopeLinear<double> lb(b.p, 2);
  lb.enable_lora(2, 44);
  ASSERT_NE(lb.forward_mask(), la.forward_mask());
  // What a checkpoint restores: owned parameters by name, then the state.
  auto pa = la.owned_params(), pb = lb.owned_params();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    ASSERT_EQ(pa[i].name, pb[i].name);
    std::copy_n(pa[i].value, shape_numel(pa[i].shape), pb[i].value);
  }
  b.b = a.b;
  const auto st = la.state();
  for (const char* key : {".kind", ".meta", ".backward_meta", ".refresh_step"})
    EXPECT_TRUE(st.count(a.p.name + key)) << key;
  lb.load_state(st);
  EXPECT_EQ(lb.forward_mask(), la.forward_mask());
  EXPECT_EQ(lb.backward_mask(), la.backward_mask());
  EXPECT_EQ(lb.refresh_step(), la.refresh_step());
  EXPECT_EQ(b.w, a.w);
  for (int64_t step = 3; step < 6; ++step) {
    la.on_step_begin(step);
    lb.on_step_begin(step);
    EXPECT_EQ(lb.backward_mask(), la.backward_mask()) << step;
    const auto x = randv<double>(size_t(N) * in, 700 + step), r = randv<double>(size_t(N) * out, 800 + step);
    std::vector<double> ya(size_t(N) * out), yb(ya.size());
    la.forward(ya.data(), x.data(), N);
    lb.forward(yb.data(), x.data(), N);
    EXPECT_EQ(ya, yb) << step;
    EXPECT_EQ(run_backward<double>(la, a, x, r, N), run_backward<double>(lb, b, x, r, N)) << step;
  }
  // Corrupt metadata (indices 1, 1) and a state of another kind are refused.
  auto bad = st;
  Tensor meta = Tensor::zeros(st.at(a.p.name + ".meta").shape(), DType::u16, "meta");
  std::fill(meta.data<uint16_t>(), meta.data<uint16_t>() + meta.numel(), uint16_t(0x5555));
  bad[a.p.name + ".meta"] = meta;
  EXPECT_THROW(lb.load_state(bad), Error);
  Buffers<double> c(out, in, 45);
  MaskedLinear<double> lm(c.p, SparsityPattern::nm(2, 4));
  auto other = lm.state();
  other[a.p.name + ".meta"] = st.at(a.p.name + ".meta");
  other[a.p.name + ".backward_meta"] = st.at(a.p.name + ".backward_meta");
  other[a.p.name + ".refresh_step"] = st.at(a.p.name + ".refresh_step");
  EXPECT_THROW(lb.load_state(other), Error);
}

TEST(LinearKinds, SlopeFactoryContinuesAndStartsTheAdapterLazily) {
  const int N = 3, out = 16, in = 16;
  Buffers<double> f(out, in, 46);
  LinearOptions o;
  o.kind = "slope";
  o.mask_change_freq = 2;
  o.lora_rank = 2;  // planned, not yet enabled
  auto first = make_linear(f.p, o);
  auto* s1 = dynamic_cast<SlopeLinear<double>*>(first.get());
  ASSERT_NE(s1, nullptr);
  EXPECT_EQ(s1->lora_rank(), 0);
  MiniTrainer<double> tr;
  for (int64_t step = 0; step < 3; ++step) {
    first->on_step_begin(step);
    run_backward<double>(*first, f, randv<double>(size_t(N) * in, 900 + step),
                         randv<double>(size_t(N) * out, 950 + step), N);
    tr.step(*first, f);
  }
  const auto x = randv<double>(size_t(N) * in, 47);
  std::vector<double> y1(size_t(N) * out), y2(y1.size());
  first->forward(y1.data(), x.data(), N);
  o.lora_enabled = true;
  auto second = make_linear(f.p, o, first.get());
  auto* s2 = dynamic_cast<SlopeLinear<double>*>(second.get());
  ASSERT_NE(s2, nullptr);
  EXPECT_EQ(s2->lora_rank(), 2);
  EXPECT_EQ(s2->forward_mask(), s1->forward_mask());
  EXPECT_EQ(s2->backward_mask(), s1->backward_mask());
  EXPECT_EQ(s2->refresh_step(), s1->refresh_step());
  EXPECT_EQ(s2->values(), s1->values());
  second->forward(y2.data(), x.data(), N);
  EXPECT_EQ(y1, y2) << "starting the adapter keeps the function";
  // Rebuilding again with the adapter on keeps the trained adapter.
  s2->lora_r() = randv<double>(s2->lora_r().size(), 48);
  auto third = make_linear(f.p, o, second.get());
  EXPECT_EQ(dynamic_cast<SlopeLinear<double>*>(third.get())->lora_r(), s2->lora_r());
  EXPECT_EQ(dynamic_cast<SlopeLinear<double>*>(third.get())->lora_l(), s2->lora_l());
}

// --- vnm ------------------------------------------------------------------------------------

TEST(LinearKinds, VnmForwardGradientsAndStorage) {
  const int N = 3, out = 32, in = 16;
  for (const SparsityPattern& pat : {SparsityPattern::vnm(16, 2, 8), SparsityPattern::nm(2, 4), SparsityPattern::nm(2, 8)}) {
    Buffers<double> f(out, in, 50);
    const auto w0 = f.w;
    VnmLinear<double> l(f.p, pat);
    const auto mask = cpu::make_mask(w0.data(), out, in, pat);
    EXPECT_EQ(l.mask(), mask) << pat.to_string();
    EXPECT_EQ(effective(l), masked(w0, mask));
    EXPECT_EQ(f.w, masked(w0, mask)) << "flat weight holds the effective weight";
    EXPECT_EQ(l.pattern(), pat.to_string());
    EXPECT_FALSE(l.trains_dense_weight());
    const auto ops = l.owned_params();
    ASSERT_EQ(ops.size(), 1u);
    EXPECT_EQ(ops[0].shape, (Shape{out, in / pat.m * 2}));
    auto x = randv<double>(size_t(N) * in, 51);
    const auto r = randv<double>(size_t(N) * out, 52);
    std::vector<double> y(size_t(N) * out);
    l.forward(y.data(), x.data(), N);
    expect_close(y, ref_forward(x, masked(w0, mask), f.b.data(), N, in, out), 1e-12, 1e-12, "vnm forward");
    const auto dx = run_backward<double>(l, f, x, r, N);
    expect_close(dx, ref_dx(r, masked(w0, mask), N, in, out), 1e-12, 1e-12, "vnm dX = dY·W");
    expect_close(dx, numeric_grad(x, loss_of(l, x, r, N)), 1e-7, 1e-8, "vnm dX (FD)");
    const std::vector<double> dv(ops[0].grad, ops[0].grad + shape_numel(ops[0].shape));
    expect_close(dv, numeric_grad(l.values(), loss_of(l, x, r, N)), 1e-7, 1e-8, "vnm d(values)");
    expect_close(f.db, numeric_grad(f.b, loss_of(l, x, r, N)), 1e-7, 1e-8, "vnm dbias");
  }
}

TEST(LinearKinds, VnmStorageMatchesSparseLayerAndItsProduct) {
  const int N = 4, out = 32, in = 32;
  Buffers<float> f(out, in, 53);
  const auto w0 = f.w;
  VnmLinear<float> l(f.p, SparsityPattern::vnm(16, 2, 8));
  // Every kept value is non-zero, so the sparse layer's compressor picks the same slots.
  const CompressedVNM ref = cpu::compress_vnm(f.w.data(), out, in, 16, 8);
  EXPECT_EQ(l.weight().columns, ref.columns);
  EXPECT_EQ(l.weight().inner.meta, ref.inner.meta);
  EXPECT_EQ(l.weight().inner.values, ref.inner.values);
  const auto x = randv<float>(size_t(N) * in, 54);
  std::vector<float> y(size_t(N) * out), yr(y.size());
  l.forward(y.data(), x.data(), N);
  cpu::linear_vnm(yr.data(), x.data(), ref, f.b.data(), N);
  EXPECT_EQ(y, yr);
}

TEST(LinearKinds, VnmFromMaskedKeepsTheMask) {
  const int N = 3, out = 32, in = 16;
  Buffers<double> f(out, in, 55);
  LinearOptions o;
  o.kind = "masked";
  o.pattern = SparsityPattern::vnm(16, 2, 8);
  auto gmp = make_linear(f.p, o);
  MiniTrainer<double> tr;
  for (int step = 0; step < 2; ++step) {
    run_backward<double>(*gmp, f, randv<double>(size_t(N) * in, 56 + step), randv<double>(size_t(N) * out, 58 + step),
                         N);
    tr.step(*gmp, f);
  }
  const auto gmp_mask = dynamic_cast<MaskedLinear<double>*>(gmp.get())->mask();
  const auto x = randv<double>(size_t(N) * in, 60);
  std::vector<double> y_gmp(size_t(N) * out), y_vnm(y_gmp.size());
  gmp->forward(y_gmp.data(), x.data(), N);
  // The trained weights would give another magnitude mask; kernel replacement keeps GMP's.
  LinearOptions v;
  v.kind = "vnm";
  auto replaced = make_linear(f.p, v, gmp.get());
  auto* vl = dynamic_cast<VnmLinear<double>*>(replaced.get());
  ASSERT_NE(vl, nullptr);
  EXPECT_EQ(vl->mask(), gmp_mask);
  EXPECT_EQ(vl->sparsity_pattern(), o.pattern);
  replaced->forward(y_vnm.data(), x.data(), N);
  expect_close(y_vnm, y_gmp, 1e-12, 1e-12, "vnm after kernel replacement");
  // A mask of another pattern cannot be replaced by this V:N:M.
  v.pattern = SparsityPattern::vnm(32, 2, 8);
  EXPECT_THROW(make_linear(f.p, v, gmp.get()), Error);
}

TEST(LinearKinds, VnmStateRoundTripIsBitExact) {
  const int N = 3, out = 32, in = 16;
  Buffers<double> a(out, in, 61), b(out, in, 62);
  VnmLinear<double> la(a.p, SparsityPattern::vnm(16, 2, 8)), lb(b.p, SparsityPattern::vnm(16, 2, 8));
  MiniTrainer<double> tr;
  run_backward<double>(la, a, randv<double>(size_t(N) * in, 63), randv<double>(size_t(N) * out, 64), N);
  tr.step(la, a);
  ASSERT_NE(la.mask(), lb.mask());
  lb.values() = la.values();
  b.b = a.b;
  const auto st = la.state();
  for (const char* key : {".kind", ".pattern", ".columns", ".meta"}) EXPECT_TRUE(st.count(a.p.name + key)) << key;
  lb.load_state(st);
  EXPECT_EQ(lb.mask(), la.mask());
  EXPECT_EQ(b.w, a.w);
  const auto x = randv<double>(size_t(N) * in, 65), r = randv<double>(size_t(N) * out, 66);
  std::vector<double> ya(size_t(N) * out), yb(ya.size());
  la.forward(ya.data(), x.data(), N);
  lb.forward(yb.data(), x.data(), N);
  EXPECT_EQ(ya, yb);
  EXPECT_EQ(run_backward<double>(la, a, x, r, N), run_backward<double>(lb, b, x, r, N));
  VnmLinear<double> lc(b.p, SparsityPattern::nm(2, 8));
  EXPECT_THROW(lc.load_state(st), Error) << "another pattern";
}

// --- LoRA wrapper ---------------------------------------------------------------------------

TEST(LinearKinds, LoraWrapperGradients) {
  const int N = 3, out = 16, in = 12, rank = 2;
  for (const char* kind : {"dense", "masked", "vnm", "semi_sparse"}) {
    Buffers<double> f(out, in, 70);
    LinearOptions o;
    o.kind = kind;
    o.pattern = SparsityPattern::nm(2, 4);
    o.lora_rank = rank;
    o.lora_alpha = 4.0;
    o.lora_enabled = true;
    o.seed = 71;
    auto l = make_linear(f.p, o);
    auto* lw = dynamic_cast<LoraLinear<double>*>(l.get());
    ASSERT_NE(lw, nullptr) << kind;
    EXPECT_EQ(lw->kind(), std::string(kind) + "+lora");
    EXPECT_EQ(lw->pattern(), lw->inner().pattern());
    EXPECT_EQ(lw->scale(), 2.0);
    EXPECT_EQ(lw->trains_dense_weight(), lw->inner().trains_dense_weight());
    auto x = randv<double>(size_t(N) * in, 72);
    const auto r = randv<double>(size_t(N) * out, 73);
    std::vector<double> y0(size_t(N) * out), y1(y0.size());
    lw->inner().forward(y0.data(), x.data(), N);
    l->forward(y1.data(), x.data(), N);
    EXPECT_EQ(y0, y1) << kind << ": B starts at zero";
    lw->lora_b() = randv<double>(lw->lora_b().size(), 74, 0.5);
    l->forward(y1.data(), x.data(), N);
    expect_close(y1, ref_forward(x, effective(*l), f.b.data(), N, in, out), 1e-12, 1e-12, kind);
    const auto ops = l->owned_params();
    const std::string mod = "blocks.0.mlp.fc";
    ASSERT_GE(ops.size(), 2u);
    EXPECT_EQ(ops[ops.size() - 2].name, mod + ".lora_a");
    EXPECT_EQ(ops[ops.size() - 1].name, mod + ".lora_b");
    const auto dx = run_backward<double>(*l, f, x, r, N);
    const std::vector<double> da(owned(*l, mod + ".lora_a").grad, owned(*l, mod + ".lora_a").grad + rank * in);
    const std::vector<double> db(owned(*l, mod + ".lora_b").grad, owned(*l, mod + ".lora_b").grad + out * rank);
    expect_close(da, numeric_grad(lw->lora_a(), loss_of(*l, x, r, N)), 1e-7, 1e-8, "d lora_a");
    expect_close(db, numeric_grad(lw->lora_b(), loss_of(*l, x, r, N)), 1e-7, 1e-8, "d lora_b");
    if (std::string(kind) != "semi_sparse")  // straight-through dX is checked on the kind itself
      expect_close(dx, numeric_grad(x, loss_of(*l, x, r, N)), 1e-7, 1e-8, "lora dX");
    if (std::string(kind) == "dense") {
      const auto dw = f.dw;
      expect_close(dw, numeric_grad(f.w, loss_of(*l, x, r, N)), 1e-7, 1e-8, "dense+lora dW");
    }
  }
}

TEST(LinearKinds, LoraWrapperForwardsHooks) {
  const int N = 3, out = 16, in = 16;
  Buffers<float> f(out, in, 75);
  LinearOptions o;
  o.kind = "masked";
  o.pattern = SparsityPattern::nm(2, 4);
  o.lora_rank = 2;
  o.lora_enabled = true;
  auto l = make_linear(f.p, o);
  EXPECT_EQ(l->state().count(f.p.name + ".mask"), 1u) << "state is the inner kind's";
  MiniTrainer<float> tr;
  run_backward<float>(*l, f, randv<float>(size_t(N) * in, 76), randv<float>(size_t(N) * out, 77), N);
  tr.step(*l, f);
  EXPECT_TRUE(cpu::check_pattern(f.w.data(), out, in, o.pattern).ok) << "after_optimizer_step reached the inner kind";
  // A rebuild with the same rank keeps the trained adapter.
  auto* lw = dynamic_cast<LoraLinear<float>*>(l.get());
  lw->lora_b() = randv<float>(lw->lora_b().size(), 78);
  auto again = make_linear(f.p, o, l.get());
  EXPECT_EQ(dynamic_cast<LoraLinear<float>*>(again.get())->lora_b(), lw->lora_b());
  EXPECT_EQ(dynamic_cast<LoraLinear<float>*>(again.get())->lora_a(), lw->lora_a());
  // vnm inside a wrapper is built from the wrapped masked layer's mask.
  LinearOptions v = o;
  v.kind = "vnm";
  auto kr = make_linear(f.p, v, l.get());
  auto* kw = dynamic_cast<LoraLinear<float>*>(kr.get());
  ASSERT_NE(kw, nullptr);
  EXPECT_EQ(dynamic_cast<VnmLinear<float>&>(kw->inner()).mask(), dynamic_cast<MaskedLinear<float>&>(lw->inner()).mask());
  EXPECT_EQ(kw->lora_b(), lw->lora_b());
}

// --- every kind at once ---------------------------------------------------------------------

TEST(LinearKinds, EveryKindForwardIsTheDenseProductWithItsEffectiveWeight) {
  const int N = 4, out = 32, in = 16;
  for (const auto& name : linear_kind_names())
    for (bool adapter : {false, true}) {
      Buffers<double> f(out, in, 80);
      LinearOptions o;
      o.kind = name;
      o.pattern = name == "vnm" ? SparsityPattern::vnm(16, 2, 8) : SparsityPattern::unstructured(0.5);
      o.sparsity = 0.5;
      o.lora_rank = 2;
      o.lora_enabled = adapter;
      auto l = make_linear(f.p, o);
      for (auto& op : l->owned_params())  // non-zero adapters
        if (op.name.find("lora_b") != std::string::npos || op.name.find("lora_r") != std::string::npos)
          for (int64_t i = 0; i < shape_numel(op.shape); ++i) op.value[i] = 0.1 * double(i % 7) - 0.3;
      auto x = randv<double>(size_t(N) * in, 81);
      std::vector<double> y(size_t(N) * out);
      l->forward(y.data(), x.data(), N);
      std::vector<double> want = ref_forward(x, effective(*l), f.b.data(), N, in, out);
      if (name == "semi_sparse_activation") {
        // The kind prunes its own input; a wrapping adapter sees the dense one.
        const auto xs = masked(x, cpu::nm_mask(x.data(), N, in, 2, 4));
        auto delta = effective(*l);
        for (size_t i = 0; i < delta.size(); ++i) delta[i] -= f.w[i];
        want = ref_forward(xs, f.w, f.b.data(), N, in, out);
        const auto extra = ref_forward(x, delta, nullptr, N, in, out);
        for (size_t i = 0; i < want.size(); ++i) want[i] += extra[i];
      }
      expect_close(y, want, 1e-12, 1e-12, (name + (adapter ? "+adapter" : "")).c_str());
    }
}

// --- inside the model -----------------------------------------------------------------------

TEST(LinearKinds, KindsPlugIntoTheTransformer) {
  ModelConfig c = model_preset("tiny");
  c.vocab_size = 11;
  c.max_seq_len = 6;
  c.n_layer = 1;
  c.d_model = 16;
  c.n_head = 2;
  c.n_kv_head = 2;
  c.d_ff = 32;
  Transformer<float> model(c);
  model.init_weights(3);
  const std::map<std::string, LinearOptions> plan = [] {
    std::map<std::string, LinearOptions> m;
    LinearOptions a;
    a.kind = "masked";
    a.pattern = SparsityPattern::nm(2, 4);
    m["blocks.0.attn.qkv.weight"] = a;
    a.kind = "semi_sparse";
    m["blocks.0.attn.proj.weight"] = a;
    a.kind = "slope";
    a.lora_rank = 2;
    a.lora_enabled = true;
    m["blocks.0.mlp.fc.weight"] = a;
    LinearOptions v;
    v.kind = "vnm";
    v.pattern = SparsityPattern::vnm(16, 2, 8);
    m["blocks.0.mlp.proj.weight"] = v;
    return m;
  }();
  for (const auto& [name, o] : plan)
    model.replace_linear(name, make_linear(model.linear_params(name), o, &model.linear(name)));
  std::vector<std::string> names;
  for (const auto& p : model.trainable_params()) names.push_back(p.name);
  auto has = [&](const std::string& n) { return std::find(names.begin(), names.end(), n) != names.end(); };
  EXPECT_TRUE(has("blocks.0.attn.qkv.weight"));
  EXPECT_TRUE(has("blocks.0.attn.proj.weight"));
  EXPECT_FALSE(has("blocks.0.mlp.fc.weight"));
  EXPECT_TRUE(has("blocks.0.mlp.fc.weight.values"));
  EXPECT_TRUE(has("blocks.0.mlp.fc.lora_l"));
  EXPECT_TRUE(has("blocks.0.mlp.fc.lora_r"));
  EXPECT_FALSE(has("blocks.0.mlp.proj.weight"));
  EXPECT_TRUE(has("blocks.0.mlp.proj.weight.values"));

  const int B = 2, T = 5;
  std::vector<int32_t> x(B * T), y(B * T);
  Rng rng(4);
  for (auto& t : x) t = int32_t(rng.below(c.vocab_size));
  for (auto& t : y) t = int32_t(rng.below(c.vocab_size));
  std::map<std::string, std::vector<float>> m, v;
  double first = 0, last = 0;
  for (int64_t step = 0; step < 8; ++step) {
    model.on_step_begin(step);
    model.zero_grad();
    for (auto& p : model.trainable_params())
      for (int64_t i = 0; i < shape_numel(p.shape); ++i) ASSERT_EQ(p.grad[i], 0.0f) << p.name;
    const double loss = model.forward_backward(x.data(), y.data(), B, T, 1.0);
    ASSERT_TRUE(std::isfinite(loss));
    if (step == 0) first = loss;
    last = loss;
    for (auto& p : model.trainable_params()) {
      const size_t n = size_t(shape_numel(p.shape));
      if (m[p.name].size() != n) m[p.name].assign(n, 0.f), v[p.name].assign(n, 0.f);
      cpu::adamw_step(p.value, p.grad, m[p.name].data(), v[p.name].data(), int64_t(n), 1e-2, 0.9, 0.95, 1e-8,
                      p.decay ? 0.1 : 0.0, step + 1);
    }
    model.after_optimizer_step();
  }
  EXPECT_LT(last, first) << "training with every kind lowers the loss on a fixed batch";
  const auto check = [&](const std::string& name, const SparsityPattern& pat) {
    const Tensor w = model.param(name);
    EXPECT_TRUE(cpu::check_pattern(w.data<float>(), w.dim(0), w.dim(1), pat).ok) << name;
  };
  check("blocks.0.attn.qkv.weight", SparsityPattern::nm(2, 4));
  check("blocks.0.mlp.fc.weight", SparsityPattern::nm(2, 4));
  check("blocks.0.mlp.proj.weight", SparsityPattern::vnm(16, 2, 8));
}
