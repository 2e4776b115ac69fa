// sparse_dw of the 2:4 kinds semi_sparse and slope (MvueWeightGrad in
// model/linear_semi_sparse.h): the weight gradient is the product of S = MVUE(dYᵀ)
// (sparse/mvue.h) and X, bit for bit the float computation of the reference; the bias
// gradient and dX do not change; the estimate is unbiased; every backward takes the next
// draw of the layer's seed sequence, which survives state() / load_state() and rebuilds;
// a micro-batch of N % 4 != 0 tokens is refused.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/op_trace.h"
#include "core/rng.h"
#include "linear_test_util.h"
#include "model/linear_kinds.h"
#include "model/linear_semi_sparse.h"
#include "model/linear_slope.h"
#include "ops/matmul.h"
#include "sparse/mvue.h"
#include "sparse/mvue_seed.h"
#include "test_util.h"

using namespace esplag;
using esplag::testing::contains;
using esplag::testing::error_of;
using esplag::testing::randv;
template <typename T>
using Buffers = esplag::testing::LayerBuffers<T>;

namespace {

constexpr uint64_t kRunSeed = 1337;

template <typename T>
std::unique_ptr<Linear<T>> make(Buffers<T>& f, const std::string& kind, bool sparse_dw,
                                 const Linear<T>* previous = nullptr) {
  LinearOptions o;
  o.kind = kind;
  o.mask_change_freq = 10;
  o.sparse_dw = sparse_dw;
  o.seed = kRunSeed;
  return make_linear(f.p, o, previous);
}

template <typename T>
void zero_grads(Linear<T>& l, Buffers<T>& f) {
  std::fill(f.dw.begin(), f.dw.end(), T(0));
  std::fill(f.db.begin(), f.db.end(), T(0));
  for (auto& op : l.owned_params()) std::fill(op.grad, op.grad + shape_numel(op.shape), T(0));
}

// The weight gradient as the layer stores it: the flat dW (semi_sparse), or the kept
// values' gradient (slope).
template <typename T>
std::vector<T> weight_grad(Linear<T>& l, const Buffers<T>& f) {
  if (l.kind() == "slope") {
    const OwnedParam<T> v = l.owned_params().at(0);
    return std::vector<T>(v.grad, v.grad + shape_numel(v.shape));
  }
  return f.dw;
}

// The reference of the brief: S = cpu::mvue_24(dYᵀ [out, N], seed), then dW = S·X with
// cpu::linear_backward (Sᵀ as its `dout`), the MVUE on float (a double layer rounds dYᵀ
// to float and widens S). For slope, W1's kept positions of that dW.
template <typename T>
std::vector<T> expected_weight_grad(Linear<T>& l, const std::vector<T>& dy, const std::vector<T>& x, int N,
                                    uint64_t draw) {
  const auto& p = l.params();
  const int O = p.out_features, C = p.in_features;
  std::vector<float> g(size_t(O) * N);
  for (int o = 0; o < O; ++o)
    for (int n = 0; n < N; ++n) g[size_t(o) * N + n] = static_cast<float>(dy[size_t(n) * O + o]);
  std::vector<float> s(g.size());
  cpu::mvue_24(g.data(), s.data(), nullptr, O, N, mvue_draw_seed(sparse_dw_seed(kRunSeed, p.name), draw));
  std::vector<T> st(g.size());
  for (int o = 0; o < O; ++o)
    for (int n = 0; n < N; ++n) st[size_t(n) * O + o] = static_cast<T>(s[size_t(o) * N + n]);
  std::vector<T> dw(size_t(O) * C, T(0));
  cpu::linear_backward(static_cast<T*>(nullptr), dw.data(), static_cast<T*>(nullptr), st.data(), x.data(), p.weight,
                       N, C, O);
  const auto* slope = dynamic_cast<const SlopeLinear<T>*>(&l);
  if (!slope) return dw;
  const linear_detail::SlotIndex slots = linear_detail::slot_index(slope->forward_weight());
  std::vector<T> kept(size_t(O) * C / 2);
  linear_detail::gather(kept.data(), slots, dw.data(), static_cast<const uint8_t*>(nullptr));
  return kept;
}

template <typename T>
bool bit_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

double rel_error(const std::vector<double>& a, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - ref[i]) * (a[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / den);
}

template <typename T>
void check_exact_product(const std::string& kind) {
  SCOPED_TRACE(kind + (sizeof(T) == 4 ? " float" : " double"));
  constexpr int O = 16, C = 12, N = 24;
  Buffers<T> fa(O, C, 5), fb(O, C, 5);
  auto dense_dw = make(fa, kind, false);
  auto sparse = make(fb, kind, true);
  const auto x = randv<T>(size_t(N) * C, 6), dy = randv<T>(size_t(N) * O, 7);
  std::vector<T> dxa(size_t(N) * C, T(0)), dxb(size_t(N) * C, T(0));
  dense_dw->backward(dxa.data(), dy.data(), x.data(), N);
  sparse->backward(dxb.data(), dy.data(), x.data(), N);

  const std::vector<T> got = weight_grad(*sparse, fb);
  EXPECT_TRUE(bit_equal(got, expected_weight_grad(*sparse, dy, x, N, 0))) << "dW is not S·X of draw 0";
  EXPECT_FALSE(bit_equal(got, weight_grad(*dense_dw, fa))) << "sparse_dw left dW as the dense product";
  EXPECT_TRUE(bit_equal(fa.db, fb.db)) << "the bias gradient changed";
  EXPECT_TRUE(bit_equal(dxa, dxb)) << "dX changed";
}

}  // namespace

TEST(SparseDw, WeightGradientIsTheProductOfTheMvueAndX) {
  for (const char* kind : {"semi_sparse", "slope"}) {
    check_exact_product<float>(kind);
    check_exact_product<double>(kind);
  }
}

TEST(SparseDw, TheMvueIsItsOwnProfiledOpAndTheProductASparseGemm) {
  for (const char* kind : {"semi_sparse", "slope"}) {
    SCOPED_TRACE(kind);
    Buffers<float> f(16, 12, 5);
    auto l = make(f, kind, true);
    const auto x = randv<float>(8 * 12, 6), dy = randv<float>(8 * 16, 7);
    std::vector<float> dx(8 * 12, 0.0f);
    OpRecorder rec;
    set_op_tracer(&rec);
    l->backward(dx.data(), dy.data(), x.data(), 8);
    set_op_tracer(nullptr);
    std::map<std::string, OpCategory> ops;
    for (const auto& r : rec.records()) ops[r.name] = r.category;
    ASSERT_TRUE(ops.count("blocks.0.mlp.fc.bwd.dw.mvue"));
    EXPECT_EQ(ops["blocks.0.mlp.fc.bwd.dw.mvue"], OpCategory::other);
    ASSERT_TRUE(ops.count("blocks.0.mlp.fc.bwd.dw"));
    EXPECT_EQ(ops["blocks.0.mlp.fc.bwd.dw"], OpCategory::sparse_gemm);
    EXPECT_EQ(ops["blocks.0.mlp.fc.bwd.dx"], OpCategory::sparse_gemm);
  }
}

// E[S] = dYᵀ, so the mean of many draws approaches the dense gradient: with 64 draws its
// error is about 1/8 of one draw's.
TEST(SparseDw, MeanOverDrawsApproachesTheDenseGradient) {
  for (const char* kind : {"semi_sparse", "slope"}) {
    SCOPED_TRACE(kind);
    constexpr int O = 16, C = 16, N = 32, kDraws = 64;
    Buffers<float> fd(O, C, 9), fs(O, C, 9);
    auto dense_dw = make(fd, kind, false);
    auto sparse = make(fs, kind, true);
    const auto x = randv<float>(size_t(N) * C, 10), dy = randv<float>(size_t(N) * O, 11);
    dense_dw->backward(nullptr, dy.data(), x.data(), N);
    const std::vector<float> dense = weight_grad(*dense_dw, fd);
    const std::vector<double> ref(dense.begin(), dense.end());
    std::vector<double> mean(ref.size(), 0.0), first;
    for (int k = 0; k < kDraws; ++k) {
      zero_grads(*sparse, fs);
      sparse->backward(nullptr, dy.data(), x.data(), N);
      const std::vector<float> g = weight_grad(*sparse, fs);
      if (k == 0) first.assign(g.begin(), g.end());
      for (size_t i = 0; i < g.size(); ++i) mean[i] += double(g[i]) / kDraws;
    }
    const double one = rel_error(first, ref), avg = rel_error(mean, ref);
    EXPECT_GT(one, 0.05) << "a single draw is not noisy: is the MVUE applied?";
    EXPECT_LT(avg, 0.5 * one) << "one draw " << one << ", mean of " << kDraws << " draws " << avg;
  }
}

TEST(SparseDw, EveryBackwardTakesTheNextDrawAndStateContinuesTheSequence) {
  for (const char* kind : {"semi_sparse", "slope"}) {
    SCOPED_TRACE(kind);
    constexpr int O = 8, C = 8, N = 16;
    Buffers<float> fa(O, C, 3), fb(O, C, 3);
    auto a = make(fa, kind, true);
    const auto x = randv<float>(size_t(N) * C, 4), dy = randv<float>(size_t(N) * O, 5);
    std::vector<std::vector<float>> grads;
    for (uint64_t k = 0; k < 3; ++k) {
      zero_grads(*a, fa);
      a->backward(nullptr, dy.data(), x.data(), N);
      grads.push_back(weight_grad(*a, fa));
      EXPECT_TRUE(bit_equal(grads.back(), expected_weight_grad(*a, dy, x, N, k))) << "draw " << k;
    }
    EXPECT_FALSE(bit_equal(grads[0], grads[1]));
    EXPECT_FALSE(bit_equal(grads[1], grads[2]));

    // A fresh layer given a's state continues with draw 3.
    const auto state = a->state();
    ASSERT_TRUE(state.count("blocks.0.mlp.fc.weight.sparse_dw_draws"));
    auto b = make(fb, kind, true);
    b->load_state(state);
    zero_grads(*a, fa);
    zero_grads(*b, fb);
    a->backward(nullptr, dy.data(), x.data(), N);
    b->backward(nullptr, dy.data(), x.data(), N);
    EXPECT_TRUE(bit_equal(weight_grad(*a, fa), weight_grad(*b, fb)));
    EXPECT_TRUE(bit_equal(weight_grad(*b, fb), expected_weight_grad(*b, dy, x, N, 3)));

    // A rebuild from a layer with sparse_dw goes on with its count (slope continuing slope,
    // or taking over from semi_sparse); a layer without sparse_dw has no draws to save.
    auto c = make(fa, "slope", true, a.get());
    const auto* sc = dynamic_cast<const SlopeLinear<float>*>(c.get());
    ASSERT_NE(sc, nullptr);
    EXPECT_EQ(sc->weight_grad().draws(), 4u);
    EXPECT_EQ(sc->weight_grad().base_seed(), sparse_dw_seed(kRunSeed, "blocks.0.mlp.fc.weight"));
    auto plain = make(fa, kind, false);
    EXPECT_FALSE(plain->state().count("blocks.0.mlp.fc.weight.sparse_dw_draws"));
  }
}

TEST(SparseDw, DrawsDifferBetweenLayersAndRunSeeds) {
  EXPECT_NE(sparse_dw_seed(1, "blocks.0.mlp.fc.weight"), sparse_dw_seed(1, "blocks.1.mlp.fc.weight"));
  EXPECT_NE(sparse_dw_seed(1, "blocks.0.mlp.fc.weight"), sparse_dw_seed(2, "blocks.0.mlp.fc.weight"));
  EXPECT_NE(sparse_dw_seed(1, "blocks.0.mlp.fc.weight"), layer_seed(1, "blocks.0.mlp.fc.weight"));
  EXPECT_NE(mvue_draw_seed(5, 0), mvue_draw_seed(5, 1));
  EXPECT_NE(mvue_draw_seed(5, 1), mvue_draw_seed(6, 0));
  EXPECT_EQ(mvue_draw_seed(5, 3),
            sparse_detail::mvue_mix(sparse_detail::mvue_mix(5) + 3));  // the GPU layer's definition
}

TEST(SparseDw, Errors) {
  for (const char* kind : {"semi_sparse", "slope"}) {
    SCOPED_TRACE(kind);
    Buffers<float> f(8, 8, 1);
    auto l = make(f, kind, true);
    const auto x = randv<float>(6 * 8, 2), dy = randv<float>(6 * 8, 3);
    const std::string e = error_of([&] { l->backward(nullptr, dy.data(), x.data(), 6); });
    EXPECT_TRUE(contains(e, "linear 'blocks.0.mlp.fc.weight'")) << e;
    EXPECT_TRUE(contains(e, "sparse_dw needs the tokens of a micro-batch")) << e;
    EXPECT_TRUE(contains(e, "multiple of 4")) << e;
    EXPECT_TRUE(contains(e, "got 6")) << e;

    // The draw count is part of the state: a state without it is refused.
    auto plain = make(f, kind, false);
    const std::string m = error_of([&] { l->load_state(plain->state()); });
    EXPECT_TRUE(contains(m, "blocks.0.mlp.fc.weight.sparse_dw_draws")) << m;
  }
  Buffers<float> f(8, 8, 1);
  const std::string k = error_of([&] { make(f, "masked", true); });
  EXPECT_TRUE(contains(k, "linear 'blocks.0.mlp.fc.weight': sparse_dw")) << k;
  EXPECT_TRUE(contains(k, "an option of the kinds semi_sparse and slope, not of masked")) << k;
}
