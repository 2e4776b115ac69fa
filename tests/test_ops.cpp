// CPU reference ops: forward against independent naive fp64 formulas (outputs poisoned
// with NaN first, sizes that are not multiples of any tile), backward against central
// finite differences in fp64, accumulation (+=) semantics, null gradient pointers,
// float against double, and thread-count independence of the results.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <numbers>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "core/rng.h"
#include "gradcheck.h"
#include "ops/activation.h"
#include "ops/cross_entropy.h"
#include "ops/embedding.h"
#include "ops/matmul.h"
#include "ops/norm.h"

// Test hooks defined in ops/cpu/matmul.cpp: run the portable GEMM kernel even where the
// AVX2+FMA one would be chosen, so both are exercised on one machine.
namespace esplag::cpu::detail {
bool gemm_force_portable(bool on);
const char* gemm_kernel_name();
}  // namespace esplag::cpu::detail

using namespace esplag;
using esplag::testing::dot;
using esplag::testing::expect_close;
using esplag::testing::numeric_grad;
using esplag::testing::randn;

namespace {

using Vec = std::vector<double>;

template <typename T>
std::vector<T> to(const Vec& v) {
  return std::vector<T>(v.begin(), v.end());
}
template <typename T>
Vec from(const std::vector<T>& v) {
  return Vec(v.begin(), v.end());
}
template <typename T>
std::vector<T> poisoned(size_t n) {
  return std::vector<T>(n, std::numeric_limits<T>::quiet_NaN());
}
size_t sz(int64_t a, int64_t b = 1) { return static_cast<size_t>(a * b); }

double max_abs(const Vec& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}

// Float against double on the same inputs: ~1e-5 relative, measured against the size of
// the result (an element near zero carries the rounding of its larger terms).
void expect_float_matches(const Vec& f, const Vec& d, const char* what) {
  expect_close(f, d, 1e-5, 1e-5 * std::max(1.0, max_abs(d)), what);
}

// An analytic gradient accumulated twice onto `base` must be base + 2 · numeric.
void expect_grad_twice(const Vec& got, const Vec& base, const Vec& numeric, const char* what) {
  Vec want(base.size());
  for (size_t i = 0; i < base.size(); ++i) want[i] = base[i] + 2 * numeric[i];
  expect_close(got, want, 1e-6, 1e-6, what);
}

void expect_identical(const Vec& a, const Vec& b, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(double))) << what << " differs bitwise";
}

// Restores the thread count and GEMM kernel choice a test changed.
class OpsTest : public ::testing::Test {
 protected:
  void TearDown() override {
    if (num_threads() != threads_) set_num_threads(threads_);
    cpu::detail::gemm_force_portable(false);
  }
  int threads_ = num_threads();
};

// ---------------------------------------------------------------------------------------
// Linear

struct LinearRef {
  Vec out, dinp, dweight, dbias;
};

// Naive fp64: out = inp·Wᵀ + b; dinp = dout·W; dW = doutᵀ·inp; db = Σ_n dout.
LinearRef linear_ref(const Vec& inp, const Vec& w, const Vec* bias, const Vec& dout, int N, int C, int OC) {
  LinearRef r{Vec(sz(N, OC)), Vec(sz(N, C)), Vec(sz(OC, C)), Vec(sz(OC))};
  for (int n = 0; n < N; ++n)
    for (int o = 0; o < OC; ++o) {
      long double s = bias ? (*bias)[o] : 0.0;
      for (int c = 0; c < C; ++c) s += (long double)inp[sz(n) * C + c] * w[sz(o) * C + c];
      r.out[sz(n) * OC + o] = double(s);
    }
  for (int n = 0; n < N; ++n)
    for (int c = 0; c < C; ++c) {
      long double s = 0;
      for (int o = 0; o < OC; ++o) s += (long double)dout[sz(n) * OC + o] * w[sz(o) * C + c];
      r.dinp[sz(n) * C + c] = double(s);
    }
  for (int o = 0; o < OC; ++o) {
    for (int c = 0; c < C; ++c) {
      long double s = 0;
      for (int n = 0; n < N; ++n) s += (long double)dout[sz(n) * OC + o] * inp[sz(n) * C + c];
      r.dweight[sz(o) * C + c] = double(s);
    }
    long double s = 0;
    for (int n = 0; n < N; ++n) s += dout[sz(n) * OC + o];
    r.dbias[o] = double(s);
  }
  return r;
}

// Runs forward and backward in T. Gradients start from the given base values, so the
// result also shows that backward adds.
template <typename T>
LinearRef linear_run(const Vec& inp, const Vec& w, const Vec* bias, const Vec& dout, const LinearRef& base, int N,
                     int C, int OC) {
  auto ti = to<T>(inp), tw = to<T>(w), td = to<T>(dout);
  std::vector<T> tb = bias ? to<T>(*bias) : std::vector<T>{};
  auto out = poisoned<T>(sz(N, OC));
  cpu::linear_forward(out.data(), ti.data(), tw.data(), bias ? tb.data() : nullptr, N, C, OC);
  auto gi = to<T>(base.dinp), gw = to<T>(base.dweight), gb = to<T>(base.dbias);
  cpu::linear_backward(gi.data(), gw.data(), gb.data(), td.data(), ti.data(), tw.data(), N, C, OC);
  return {from(out), from(gi), from(gw), from(gb)};
}

void check_linear_shape(int N, int C, int OC, bool with_bias, uint64_t seed) {
  SCOPED_TRACE("N=" + std::to_string(N) + " C=" + std::to_string(C) + " OC=" + std::to_string(OC) +
               " kernel=" + cpu::detail::gemm_kernel_name());
  Rng rng(seed);
  const Vec inp = randn(sz(N, C), rng), w = randn(sz(OC, C), rng), b = randn(sz(OC), rng),
            dout = randn(sz(N, OC), rng);
  const LinearRef base{{}, randn(sz(N, C), rng), randn(sz(OC, C), rng), randn(sz(OC), rng)};
  const Vec* bias = with_bias ? &b : nullptr;
  const LinearRef ref = linear_ref(inp, w, bias, dout, N, C, OC);
  auto plus_base = [](Vec v, const Vec& base) {
    for (size_t i = 0; i < v.size(); ++i) v[i] += base[i];
    return v;
  };
  const Vec want_dinp = plus_base(ref.dinp, base.dinp), want_dw = plus_base(ref.dweight, base.dweight),
            want_db = plus_base(ref.dbias, base.dbias);

  const LinearRef d = linear_run<double>(inp, w, bias, dout, base, N, C, OC);
  expect_close(d.out, ref.out, 1e-12, 1e-12, "double out");
  expect_close(d.dinp, want_dinp, 1e-12, 1e-12, "double dinp");
  expect_close(d.dweight, want_dw, 1e-12, 1e-12, "double dweight");
  expect_close(d.dbias, want_db, 1e-12, 1e-12, "double dbias");

  const LinearRef f = linear_run<float>(inp, w, bias, dout, base, N, C, OC);
  expect_float_matches(f.out, d.out, "float out");
  expect_float_matches(f.dinp, d.dinp, "float dinp");
  expect_float_matches(f.dweight, d.dweight, "float dweight");
  expect_float_matches(f.dbias, d.dbias, "float dbias");
}

TEST_F(OpsTest, LinearMatchesReferenceOnAwkwardShapes) {
  // Shapes chosen against the blocking: MR = 6, NR = 4..16, KC = 256, MC = 120, NC = 2048,
  // and on both sides of the single-thread cut-off.
  const int shapes[][3] = {{7, 13, 5},   {1, 77, 33},   {37, 300, 29}, {130, 19, 270},
                           {5, 2100, 3}, {3, 5, 2100},  {61, 97, 131}, {131, 97, 61}};
  for (bool portable : {false, true}) {
    cpu::detail::gemm_force_portable(portable);
    for (int i = 0; i < 8; ++i)
      check_linear_shape(shapes[i][0], shapes[i][1], shapes[i][2], /*with_bias=*/i % 2 == 0, 100 + i);
  }
}

TEST_F(OpsTest, LinearDegenerateSizes) {
  // C = 0: out is the bias (or zeros); backward leaves dweight (empty) and adds nothing to
  // dinp (empty) but still sums dout into dbias.
  const int N = 3, OC = 4;
  std::vector<double> out(sz(N, OC), NAN), bias = {1, 2, 3, 4}, dout(sz(N, OC), 0.5), dbias(OC, 1.0);
  cpu::linear_forward(out.data(), static_cast<const double*>(nullptr), static_cast<const double*>(nullptr),
                      bias.data(), N, 0, OC);
  for (int n = 0; n < N; ++n)
    for (int o = 0; o < OC; ++o) EXPECT_EQ(out[sz(n) * OC + o], bias[o]);
  cpu::linear_forward(out.data(), static_cast<const double*>(nullptr), static_cast<const double*>(nullptr),
                      static_cast<const double*>(nullptr), N, 0, OC);
  for (double x : out) EXPECT_EQ(x, 0.0);
  cpu::linear_backward(static_cast<double*>(nullptr), static_cast<double*>(nullptr), dbias.data(), dout.data(),
                       static_cast<const double*>(nullptr), static_cast<const double*>(nullptr), N, 0, OC);
  for (double x : dbias) EXPECT_EQ(x, 2.5);
  // N = 0: nothing to write, gradients untouched.
  std::vector<double> w(12, 1.0), dw(12, 7.0);
  cpu::linear_backward(static_cast<double*>(nullptr), dw.data(), dbias.data(), static_cast<const double*>(nullptr),
                       static_cast<const double*>(nullptr), w.data(), 0, 3, 4);
  for (double x : dw) EXPECT_EQ(x, 7.0);
  EXPECT_THROW(cpu::linear_forward(out.data(), out.data(), w.data(), bias.data(), -1, 3, 4), Error);
}

TEST_F(OpsTest, LinearBackwardMatchesFiniteDifferences) {
  Rng rng(7);
  const int N = 4, C = 5, OC = 3;
  Vec inp = randn(sz(N, C), rng), w = randn(sz(OC, C), rng), b = randn(OC, rng);
  const Vec R = randn(sz(N, OC), rng);
  auto loss = [&] {
    Vec out(sz(N, OC));
    cpu::linear_forward(out.data(), inp.data(), w.data(), b.data(), N, C, OC);
    return dot(out, R);
  };
  const Vec gi0 = randn(inp.size(), rng), gw0 = randn(w.size(), rng), gb0 = randn(b.size(), rng);
  Vec gi = gi0, gw = gw0, gb = gb0;
  for (int rep = 0; rep < 2; ++rep)
    cpu::linear_backward(gi.data(), gw.data(), gb.data(), R.data(), inp.data(), w.data(), N, C, OC);
  expect_grad_twice(gi, gi0, numeric_grad(inp, loss), "dinp");
  expect_grad_twice(gw, gw0, numeric_grad(w, loss), "dweight");
  expect_grad_twice(gb, gb0, numeric_grad(b, loss), "dbias");
}

TEST_F(OpsTest, LinearBackwardAcceptsNullGradients) {
  Rng rng(8);
  const int N = 9, C = 11, OC = 7;
  const Vec inp = randn(sz(N, C), rng), w = randn(sz(OC, C), rng), dout = randn(sz(N, OC), rng);
  Vec gi(inp.size()), gw(w.size()), gb(OC);
  cpu::linear_backward(gi.data(), gw.data(), gb.data(), dout.data(), inp.data(), w.data(), N, C, OC);
  for (int mask = 0; mask < 8; ++mask) {
    Vec hi(inp.size()), hw(w.size()), hb(OC);
    cpu::linear_backward(mask & 1 ? hi.data() : nullptr, mask & 2 ? hw.data() : nullptr,
                         mask & 4 ? hb.data() : nullptr, dout.data(), inp.data(), w.data(), N, C, OC);
    SCOPED_TRACE("mask " + std::to_string(mask));
    expect_identical(hi, mask & 1 ? gi : Vec(inp.size()), "dinp");
    expect_identical(hw, mask & 2 ? gw : Vec(w.size()), "dweight");
    expect_identical(hb, mask & 4 ? gb : Vec(OC), "dbias");
  }
}

template <typename T>
LinearRef linear_with_threads(int threads, int N, int C, int OC, uint64_t seed) {
  set_num_threads(threads);
  Rng rng(seed);
  const Vec inp = randn(sz(N, C), rng), w = randn(sz(OC, C), rng), b = randn(OC, rng), dout = randn(sz(N, OC), rng);
  const LinearRef base{{}, Vec(sz(N, C), 0.25), Vec(sz(OC, C), -0.5), Vec(OC, 1.0)};
  return linear_run<T>(inp, w, &b, dout, base, N, C, OC);
}

TEST_F(OpsTest, LinearIdenticalForAnyThreadCount) {
  // Large enough to be split between threads, along rows for some products and along
  // columns for others.
  const int shapes[][3] = {{67, 131, 301}, {301, 131, 67}, {260, 97, 1000}};
  for (bool portable : {false, true}) {
    cpu::detail::gemm_force_portable(portable);
    for (auto& s : shapes) {
      SCOPED_TRACE(std::string(cpu::detail::gemm_kernel_name()) + " N=" + std::to_string(s[0]));
      const LinearRef one = linear_with_threads<float>(1, s[0], s[1], s[2], 5);
      for (int threads : {2, 3}) {
        const LinearRef many = linear_with_threads<float>(threads, s[0], s[1], s[2], 5);
        expect_identical(many.out, one.out, "out");
        expect_identical(many.dinp, one.dinp, "dinp");
        expect_identical(many.dweight, one.dweight, "dweight");
        expect_identical(many.dbias, one.dbias, "dbias");
      }
    }
  }
}

TEST_F(OpsTest, GemmKernelSelection) {
#if defined(__GNUC__) && defined(__x86_64__)
  const bool wide = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  EXPECT_STREQ(cpu::detail::gemm_kernel_name(), wide ? "avx2+fma" : "portable");
#endif
  cpu::detail::gemm_force_portable(true);
  EXPECT_STREQ(cpu::detail::gemm_kernel_name(), "portable");
}

// ---------------------------------------------------------------------------------------
// Embedding

TEST_F(OpsTest, EmbeddingForwardMatchesReference) {
  Rng rng(11);
  const int B = 3, T = 5, C = 13, V = 7;
  std::vector<int32_t> tok(sz(B, T));
  for (auto& t : tok) t = static_cast<int32_t>(rng.below(V));
  const Vec wte = randn(sz(V, C), rng), wpe = randn(sz(T, C), rng);
  for (bool with_pos : {true, false}) {
    Vec want(sz(B * T, C));
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < T; ++t)
        for (int c = 0; c < C; ++c)
          want[sz(b * T + t) * C + c] = wte[sz(tok[sz(b * T + t)]) * C + c] + (with_pos ? wpe[sz(t) * C + c] : 0);
    auto out = poisoned<double>(want.size());
    cpu::embedding_forward(out.data(), tok.data(), wte.data(), with_pos ? wpe.data() : nullptr, B, T, C);
    expect_close(out, want, 0, 0, "double");
    auto outf = poisoned<float>(want.size());
    const auto wtef = to<float>(wte), wpef = to<float>(wpe);
    cpu::embedding_forward(outf.data(), tok.data(), wtef.data(), with_pos ? wpef.data() : nullptr, B, T, C);
    expect_float_matches(from(outf), want, "float");
  }
  std::vector<int32_t> bad = tok;
  bad[4] = -2;
  Vec out(sz(B * T, C));
  EXPECT_THROW(cpu::embedding_forward(out.data(), bad.data(), wte.data(), wpe.data(), B, T, C), Error);
}

TEST_F(OpsTest, EmbeddingBackwardMatchesFiniteDifferences) {
  Rng rng(12);
  const int B = 2, T = 4, C = 5, V = 6;
  // Repeated tokens: their gradients must add up in one row of dwte.
  const std::vector<int32_t> tok = {1, 3, 1, 0, 3, 3, 5, 1};
  Vec wte = randn(sz(V, C), rng), wpe = randn(sz(T, C), rng);
  const Vec R = randn(sz(B * T, C), rng);
  auto loss = [&] {
    Vec out(R.size());
    cpu::embedding_forward(out.data(), tok.data(), wte.data(), wpe.data(), B, T, C);
    return dot(out, R);
  };
  const Vec g0 = randn(wte.size(), rng), p0 = randn(wpe.size(), rng);
  Vec gte = g0, gpe = p0;
  for (int rep = 0; rep < 2; ++rep) cpu::embedding_backward(gte.data(), gpe.data(), R.data(), tok.data(), B, T, C);
  expect_grad_twice(gte, g0, numeric_grad(wte, loss), "dwte");
  expect_grad_twice(gpe, p0, numeric_grad(wpe, loss), "dwpe");

  // Null position gradient (RoPE models) and the float version.
  Vec only_te = g0;
  cpu::embedding_backward(only_te.data(), static_cast<double*>(nullptr), R.data(), tok.data(), B, T, C);
  cpu::embedding_backward(only_te.data(), static_cast<double*>(nullptr), R.data(), tok.data(), B, T, C);
  expect_identical(only_te, gte, "dwte without dwpe");
  Vec only_pe = p0;
  cpu::embedding_backward(static_cast<double*>(nullptr), only_pe.data(), R.data(), tok.data(), B, T, C);
  cpu::embedding_backward(static_cast<double*>(nullptr), only_pe.data(), R.data(), tok.data(), B, T, C);
  expect_identical(only_pe, gpe, "dwpe without dwte");
  auto fte = to<float>(g0), fpe = to<float>(p0);
  const auto Rf = to<float>(R);
  for (int rep = 0; rep < 2; ++rep) cpu::embedding_backward(fte.data(), fpe.data(), Rf.data(), tok.data(), B, T, C);
  expect_float_matches(from(fte), gte, "float dwte");
  expect_float_matches(from(fpe), gpe, "float dwpe");
}

// ---------------------------------------------------------------------------------------
// LayerNorm and RMSNorm

struct NormOut {
  Vec out, mean, rstd;
};

NormOut layernorm_ref(const Vec& x, const Vec& w, const Vec* b, int N, int C, double eps = 1e-5) {
  NormOut r{Vec(x.size()), Vec(N), Vec(N)};
  for (int n = 0; n < N; ++n) {
    double m = 0, v = 0;
    for (int c = 0; c < C; ++c) m += x[sz(n) * C + c] / C;
    for (int c = 0; c < C; ++c) v += (x[sz(n) * C + c] - m) * (x[sz(n) * C + c] - m) / C;
    const double rs = 1 / std::sqrt(v + eps);
    for (int c = 0; c < C; ++c)
      r.out[sz(n) * C + c] = (x[sz(n) * C + c] - m) * rs * w[c] + (b ? (*b)[c] : 0);
    r.mean[n] = m;
    r.rstd[n] = rs;
  }
  return r;
}

template <typename T>
NormOut layernorm_run(const Vec& x, const Vec& w, const Vec* b, int N, int C, double eps = cpu::kNormEps) {
  auto tx = to<T>(x), tw = to<T>(w);
  std::vector<T> tb = b ? to<T>(*b) : std::vector<T>{};
  auto out = poisoned<T>(x.size()), mean = poisoned<T>(sz(N)), rstd = poisoned<T>(sz(N));
  cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), tx.data(), tw.data(), b ? tb.data() : nullptr, N, C,
                         eps);
  return {from(out), from(mean), from(rstd)};
}

TEST_F(OpsTest, LayerNormForwardMatchesReference) {
  Rng rng(21);
  const int N = 7, C = 13;
  Vec x = randn(sz(N, C), rng, 3.0);
  for (int c = 0; c < C; ++c) x[c] += 100;  // a row far from zero: the mean must not swamp it
  const Vec w = randn(C, rng), b = randn(C, rng);
  for (const Vec* bias : {&b, static_cast<const Vec*>(nullptr)}) {
    const NormOut ref = layernorm_ref(x, w, bias, N, C);
    const NormOut d = layernorm_run<double>(x, w, bias, N, C);
    expect_close(d.out, ref.out, 1e-12, 1e-12, "out");
    expect_close(d.mean, ref.mean, 1e-12, 1e-12, "mean");
    expect_close(d.rstd, ref.rstd, 1e-12, 1e-12, "rstd");
    const NormOut f = layernorm_run<float>(x, w, bias, N, C);
    // Row 0 sits at 100 ± 3: float's input rounding alone is ~4e-6 there.
    expect_close(f.out, d.out, 1e-5, 2e-5 * max_abs(d.out), "float out");
    expect_float_matches(f.mean, d.mean, "float mean");
    expect_float_matches(f.rstd, d.rstd, "float rstd");
  }
}

TEST_F(OpsTest, LayerNormBackwardMatchesFiniteDifferences) {
  Rng rng(22);
  const int N = 3, C = 7;
  Vec x = randn(sz(N, C), rng), w = randn(C, rng), b = randn(C, rng);
  const Vec R = randn(x.size(), rng);
  auto loss = [&] { return dot(layernorm_run<double>(x, w, &b, N, C).out, R); };
  const NormOut fw = layernorm_run<double>(x, w, &b, N, C);
  const Vec gx0 = randn(x.size(), rng), gw0 = randn(C, rng), gb0 = randn(C, rng);
  Vec gx = gx0, gw = gw0, gb = gb0;
  for (int rep = 0; rep < 2; ++rep)
    cpu::layernorm_backward(gx.data(), gw.data(), gb.data(), R.data(), x.data(), w.data(), fw.mean.data(),
                            fw.rstd.data(), N, C);
  expect_grad_twice(gx, gx0, numeric_grad(x, loss), "dinp");
  expect_grad_twice(gw, gw0, numeric_grad(w, loss), "dweight");
  expect_grad_twice(gb, gb0, numeric_grad(b, loss), "dbias");

  // Each gradient alone (the others null) equals its part of the full call.
  for (int mask = 0; mask < 8; ++mask) {
    Vec hx = gx0, hw = gw0, hb = gb0;
    for (int rep = 0; rep < 2; ++rep)
      cpu::layernorm_backward(mask & 1 ? hx.data() : nullptr, mask & 2 ? hw.data() : nullptr,
                              mask & 4 ? hb.data() : nullptr, R.data(), x.data(), w.data(), fw.mean.data(),
                              fw.rstd.data(), N, C);
    SCOPED_TRACE("mask " + std::to_string(mask));
    expect_identical(hx, mask & 1 ? gx : gx0, "dinp");
    expect_identical(hw, mask & 2 ? gw : gw0, "dweight");
    expect_identical(hb, mask & 4 ? gb : gb0, "dbias");
  }

  // Float.
  const NormOut ff = layernorm_run<float>(x, w, &b, N, C);
  auto fx = to<float>(gx0), fwt = to<float>(gw0), fb = to<float>(gb0);
  const auto xf = to<float>(x), wf = to<float>(w), Rf = to<float>(R), mf = to<float>(ff.mean),
             rf = to<float>(ff.rstd);
  for (int rep = 0; rep < 2; ++rep)
    cpu::layernorm_backward(fx.data(), fwt.data(), fb.data(), Rf.data(), xf.data(), wf.data(), mf.data(), rf.data(),
                            N, C);
  expect_float_matches(from(fx), gx, "float dinp");
  expect_float_matches(from(fwt), gw, "float dweight");
  expect_float_matches(from(fb), gb, "float dbias");
}

template <typename T>
NormOut rmsnorm_run(const Vec& x, const Vec& w, int N, int C, double eps = cpu::kNormEps) {
  auto tx = to<T>(x), tw = to<T>(w);
  auto out = poisoned<T>(x.size()), rstd = poisoned<T>(sz(N));
  cpu::rmsnorm_forward(out.data(), rstd.data(), tx.data(), tw.data(), N, C, eps);
  return {from(out), {}, from(rstd)};
}

TEST_F(OpsTest, RmsNormForwardMatchesReference) {
  Rng rng(23);
  const int N = 7, C = 13;
  const Vec x = randn(sz(N, C), rng, 2.0), w = randn(C, rng);
  Vec want(x.size()), want_rstd(N);
  for (int n = 0; n < N; ++n) {
    double ms = 0;
    for (int c = 0; c < C; ++c) ms += x[sz(n) * C + c] * x[sz(n) * C + c] / C;
    want_rstd[n] = 1 / std::sqrt(ms + 1e-5);
    for (int c = 0; c < C; ++c) want[sz(n) * C + c] = x[sz(n) * C + c] * want_rstd[n] * w[c];
  }
  const NormOut d = rmsnorm_run<double>(x, w, N, C);
  expect_close(d.out, want, 1e-12, 1e-12, "out");
  expect_close(d.rstd, want_rstd, 1e-12, 1e-12, "rstd");
  const NormOut f = rmsnorm_run<float>(x, w, N, C);
  expect_float_matches(f.out, d.out, "float out");
  expect_float_matches(f.rstd, d.rstd, "float rstd");
}

TEST_F(OpsTest, RmsNormBackwardMatchesFiniteDifferences) {
  Rng rng(24);
  const int N = 3, C = 7;
  Vec x = randn(sz(N, C), rng), w = randn(C, rng);
  const Vec R = randn(x.size(), rng);
  auto loss = [&] { return dot(rmsnorm_run<double>(x, w, N, C).out, R); };
  const NormOut fw = rmsnorm_run<double>(x, w, N, C);
  const Vec gx0 = randn(x.size(), rng), gw0 = randn(C, rng);
  Vec gx = gx0, gw = gw0;
  for (int rep = 0; rep < 2; ++rep)
    cpu::rmsnorm_backward(gx.data(), gw.data(), R.data(), x.data(), w.data(), fw.rstd.data(), N, C);
  expect_grad_twice(gx, gx0, numeric_grad(x, loss), "dinp");
  expect_grad_twice(gw, gw0, numeric_grad(w, loss), "dweight");

  for (int mask = 0; mask < 4; ++mask) {
    Vec hx = gx0, hw = gw0;
    for (int rep = 0; rep < 2; ++rep)
      cpu::rmsnorm_backward(mask & 1 ? hx.data() : nullptr, mask & 2 ? hw.data() : nullptr, R.data(), x.data(),
                            w.data(), fw.rstd.data(), N, C);
    SCOPED_TRACE("mask " + std::to_string(mask));
    expect_identical(hx, mask & 1 ? gx : gx0, "dinp");
    expect_identical(hw, mask & 2 ? gw : gw0, "dweight");
  }

  const NormOut ff = rmsnorm_run<float>(x, w, N, C);
  auto fx = to<float>(gx0), fwt = to<float>(gw0);
  const auto xf = to<float>(x), wf = to<float>(w), Rf = to<float>(R), rf = to<float>(ff.rstd);
  for (int rep = 0; rep < 2; ++rep)
    cpu::rmsnorm_backward(fx.data(), fwt.data(), Rf.data(), xf.data(), wf.data(), rf.data(), N, C);
  expect_float_matches(from(fx), gx, "float dinp");
  expect_float_matches(from(fwt), gw, "float dweight");
}

// A model's norm_eps: forward adds it under the square root, backward sees it through the
// saved rstd alone, so the gradient of a large-eps forward is still exact.
TEST_F(OpsTest, NormsUseTheGivenEps) {
  Rng rng(26);
  const int N = 3, C = 7;
  const double eps = 0.25;  // of the order of the rows' variance: a wrong eps shows at once
  Vec x = randn(sz(N, C), rng, 0.5), w = randn(C, rng), b = randn(C, rng);
  const Vec R = randn(x.size(), rng);
  const NormOut ln = layernorm_run<double>(x, w, &b, N, C, eps);
  expect_close(ln.out, layernorm_ref(x, w, &b, N, C, eps).out, 1e-12, 1e-12, "layernorm out");
  expect_close(ln.rstd, layernorm_ref(x, w, &b, N, C, eps).rstd, 1e-12, 1e-12, "layernorm rstd");
  Vec gx(x.size(), 0.0);
  cpu::layernorm_backward(gx.data(), static_cast<double*>(nullptr), static_cast<double*>(nullptr), R.data(), x.data(),
                          w.data(), ln.mean.data(), ln.rstd.data(), N, C);
  expect_close(gx, numeric_grad(x, [&] { return dot(layernorm_run<double>(x, w, &b, N, C, eps).out, R); }), 1e-6,
               1e-6, "layernorm dinp");

  const NormOut rms = rmsnorm_run<double>(x, w, N, C, eps);
  for (int n = 0; n < N; ++n) {
    double ms = 0;
    for (int c = 0; c < C; ++c) ms += x[sz(n) * C + c] * x[sz(n) * C + c] / C;
    EXPECT_NEAR(rms.rstd[n], 1 / std::sqrt(ms + eps), 1e-12) << "row " << n;
  }
  gx.assign(x.size(), 0.0);
  cpu::rmsnorm_backward(gx.data(), static_cast<double*>(nullptr), R.data(), x.data(), w.data(), rms.rstd.data(), N, C);
  expect_close(gx, numeric_grad(x, [&] { return dot(rmsnorm_run<double>(x, w, N, C, eps).out, R); }), 1e-6, 1e-6,
               "rmsnorm dinp");
}

TEST_F(OpsTest, NormsIdenticalForAnyThreadCount) {
  Rng rng(25);
  const int N = 97, C = 301;
  const Vec x = randn(sz(N, C), rng), w = randn(C, rng), b = randn(C, rng), R = randn(x.size(), rng);
  auto run = [&](int threads) {
    set_num_threads(threads);
    const NormOut fw = layernorm_run<double>(x, w, &b, N, C);
    Vec gx(x.size(), 0.5), gw(C, 0.5), gb(C, 0.5);
    cpu::layernorm_backward(gx.data(), gw.data(), gb.data(), R.data(), x.data(), w.data(), fw.mean.data(),
                            fw.rstd.data(), N, C);
    Vec all = fw.out;
    for (const Vec* v : {&gx, &gw, &gb}) all.insert(all.end(), v->begin(), v->end());
    return all;
  };
  const Vec one = run(1);
  expect_identical(run(3), one, "layernorm");
}

// ---------------------------------------------------------------------------------------
// Activations

// GPT-2's gelu, written out independently.
double gelu_ref(double x) { return 0.5 * x * (1 + std::tanh(std::sqrt(2 / std::numbers::pi) * (x + 0.044715 * x * x * x))); }

template <typename T>
Vec gelu_run(const Vec& x) {
  auto tx = to<T>(x);
  auto out = poisoned<T>(x.size());
  cpu::gelu_forward(out.data(), tx.data(), static_cast<int64_t>(x.size()));
  return from(out);
}

TEST_F(OpsTest, GeluForwardMatchesReferenceAndKnownValues) {
  Rng rng(31);
  Vec x = randn(37, rng, 3.0);
  x.push_back(0.0);
  Vec want(x.size());
  for (size_t i = 0; i < x.size(); ++i) want[i] = gelu_ref(x[i]);
  expect_close(gelu_run<double>(x), want, 1e-14, 1e-15, "double");
  expect_float_matches(gelu_run<float>(x), want, "float");
  // Values of the tanh approximation computed independently (not the erf GELU).
  const Vec known = gelu_run<double>({1.0, -0.5, 2.0});
  EXPECT_NEAR(known[0], 0.8411919906082768, 1e-15);
  EXPECT_NEAR(known[1], -0.15428599017485606, 1e-15);
  EXPECT_NEAR(known[2], 1.954597694087775, 1e-15);
}

TEST_F(OpsTest, GeluBackwardMatchesFiniteDifferences) {
  Rng rng(32);
  Vec x = randn(29, rng, 2.0);
  const Vec R = randn(x.size(), rng), g0 = randn(x.size(), rng);
  auto loss = [&] { return dot(gelu_run<double>(x), R); };
  const int64_t n = static_cast<int64_t>(x.size());
  Vec g = g0;
  for (int rep = 0; rep < 2; ++rep) cpu::gelu_backward(g.data(), x.data(), R.data(), n);
  expect_grad_twice(g, g0, numeric_grad(x, loss), "dinp");
  auto gf = to<float>(g0);
  const auto xf = to<float>(x), Rf = to<float>(R);
  for (int rep = 0; rep < 2; ++rep) cpu::gelu_backward(gf.data(), xf.data(), Rf.data(), n);
  expect_float_matches(from(gf), g, "float");
}

TEST_F(OpsTest, GeluBackwardIsFiniteForLargeInputs) {
  // cosh overflows for these in float: the derivative must still come out as 1 and 0.
  const std::vector<float> x = {30.f, 100.f, 1e4f, -30.f, -100.f, -1e4f};
  const std::vector<float> dout(x.size(), 1.f);
  std::vector<float> g(x.size(), 0.f);
  cpu::gelu_backward(g.data(), x.data(), dout.data(), static_cast<int64_t>(x.size()));
  for (size_t i = 0; i < x.size(); ++i) EXPECT_FLOAT_EQ(g[i], x[i] > 0 ? 1.f : 0.f) << "x = " << x[i];
}

template <typename T>
Vec swiglu_run(const Vec& x, int N, int H) {
  auto tx = to<T>(x);
  auto out = poisoned<T>(sz(N, H));
  cpu::swiglu_forward(out.data(), tx.data(), N, H);
  return from(out);
}

TEST_F(OpsTest, SwigluMatchesReferenceAndFiniteDifferences) {
  Rng rng(33);
  const int N = 5, H = 7;
  Vec x = randn(sz(N, 2 * H), rng, 2.0);
  x[3] = -800;  // exp(-x) overflows: silu must be -0, not NaN
  Vec want(sz(N, H));
  for (int n = 0; n < N; ++n)
    for (int h = 0; h < H; ++h) {
      const double g = x[sz(n) * 2 * H + h], u = x[sz(n) * 2 * H + H + h];
      want[sz(n) * H + h] = g / (1 + std::exp(-g)) * u;
    }
  const Vec d = swiglu_run<double>(x, N, H);
  expect_close(d, want, 1e-14, 1e-15, "double");
  expect_float_matches(swiglu_run<float>(x, N, H), d, "float");

  x[3] = 0.3;  // finite differences want a smooth neighbourhood
  const Vec R = randn(sz(N, H), rng), g0 = randn(x.size(), rng);
  auto loss = [&] { return dot(swiglu_run<double>(x, N, H), R); };
  Vec g = g0;
  for (int rep = 0; rep < 2; ++rep) cpu::swiglu_backward(g.data(), x.data(), R.data(), N, H);
  expect_grad_twice(g, g0, numeric_grad(x, loss), "dinp");
  auto gf = to<float>(g0);
  const auto xf = to<float>(x), Rf = to<float>(R);
  for (int rep = 0; rep < 2; ++rep) cpu::swiglu_backward(gf.data(), xf.data(), Rf.data(), N, H);
  expect_float_matches(from(gf), g, "float");
}

template <typename T>
Vec relu2_run(const Vec& x) {
  auto tx = to<T>(x);
  auto out = poisoned<T>(x.size());
  cpu::relu2_forward(out.data(), tx.data(), static_cast<int64_t>(x.size()));
  return from(out);
}

TEST_F(OpsTest, Relu2MatchesReferenceAndFiniteDifferences) {
  Rng rng(34);
  Vec x = randn(31, rng);
  Vec want(x.size());
  for (size_t i = 0; i < x.size(); ++i) want[i] = x[i] > 0 ? x[i] * x[i] : 0;
  expect_close(relu2_run<double>(x), want, 0, 0, "double");
  expect_float_matches(relu2_run<float>(x), want, "float");

  const Vec R = randn(x.size(), rng), g0 = randn(x.size(), rng);
  auto loss = [&] { return dot(relu2_run<double>(x), R); };
  const int64_t n = static_cast<int64_t>(x.size());
  Vec g = g0;
  for (int rep = 0; rep < 2; ++rep) cpu::relu2_backward(g.data(), x.data(), R.data(), n);
  expect_grad_twice(g, g0, numeric_grad(x, loss), "dinp");
  auto gf = to<float>(g0);
  const auto xf = to<float>(x), Rf = to<float>(R);
  for (int rep = 0; rep < 2; ++rep) cpu::relu2_backward(gf.data(), xf.data(), Rf.data(), n);
  expect_float_matches(from(gf), g, "float");
}

TEST_F(OpsTest, ActivationsLargeEnoughToSplitMatchSmallCalls) {
  // n above the parallel grain: every element is still computed exactly as alone.
  Rng rng(35);
  const int64_t n = 100003;
  const Vec x = randn(n, rng, 2.0), R = randn(n, rng);
  const Vec y = gelu_run<double>(x);
  Vec g(n, 0.0);
  cpu::gelu_backward(g.data(), x.data(), R.data(), n);
  for (int64_t i : {int64_t(0), n / 2, n - 1}) {
    double yi = NAN, gi = 0.0;
    cpu::gelu_forward(&yi, &x[i], 1);
    cpu::gelu_backward(&gi, &x[i], &R[i], 1);
    EXPECT_EQ(y[i], yi);
    EXPECT_EQ(g[i], gi);
  }
}

TEST_F(OpsTest, ResidualAddsAndMayAlias) {
  Rng rng(36);
  const Vec a = randn(23, rng), b = randn(23, rng);
  Vec want(a.size());
  for (size_t i = 0; i < a.size(); ++i) want[i] = a[i] + b[i];
  auto out = poisoned<double>(a.size());
  cpu::residual_forward(out.data(), a.data(), b.data(), 23);
  expect_close(out, want, 0, 0, "separate");
  Vec inplace = a;
  cpu::residual_forward(inplace.data(), inplace.data(), b.data(), 23);
  expect_close(inplace, want, 0, 0, "out aliases a");
  inplace = b;
  cpu::residual_forward(inplace.data(), a.data(), inplace.data(), 23);
  expect_close(inplace, want, 0, 0, "out aliases b");
  const auto af = to<float>(a), bf = to<float>(b);
  auto outf = poisoned<float>(a.size());
  cpu::residual_forward(outf.data(), af.data(), bf.data(), 23);
  expect_float_matches(from(outf), want, "float");
}

// ---------------------------------------------------------------------------------------
// Cross-entropy

template <typename T>
std::pair<Vec, Vec> ce_run(const Vec& logits, const std::vector<int32_t>& targets, int N, int V, double dloss,
                           bool want_grad = true) {
  auto tl = to<T>(logits);
  auto losses = poisoned<T>(sz(N)), dl = poisoned<T>(sz(N, V));
  cpu::softmax_cross_entropy(losses.data(), want_grad ? dl.data() : nullptr, tl.data(), targets.data(), N, V,
                             static_cast<T>(dloss));
  return {from(losses), want_grad ? from(dl) : Vec{}};
}

TEST_F(OpsTest, CrossEntropyMatchesReference) {
  Rng rng(41);
  const int N = 7, V = 13;
  const Vec logits = randn(sz(N, V), rng, 3.0);
  std::vector<int32_t> t(N);
  for (auto& x : t) x = static_cast<int32_t>(rng.below(V));
  t[0] = 0;
  t[1] = V - 1;
  const double dloss = 0.37;
  // Naive: probabilities without the max shift (the logits are small enough here).
  Vec want_loss(N), want_grad(sz(N, V));
  for (int n = 0; n < N; ++n) {
    double z = 0;
    for (int v = 0; v < V; ++v) z += std::exp(logits[sz(n) * V + v]);
    want_loss[n] = -std::log(std::exp(logits[sz(n) * V + t[n]]) / z);
    for (int v = 0; v < V; ++v)
      want_grad[sz(n) * V + v] = dloss * (std::exp(logits[sz(n) * V + v]) / z - (v == t[n] ? 1 : 0));
  }
  const auto [dl, dg] = ce_run<double>(logits, t, N, V, dloss);
  expect_close(dl, want_loss, 1e-12, 1e-13, "double losses");
  expect_close(dg, want_grad, 1e-12, 1e-13, "double dlogits");
  const auto [fl, fg] = ce_run<float>(logits, t, N, V, dloss);
  expect_float_matches(fl, dl, "float losses");
  expect_float_matches(fg, dg, "float dlogits");
  // Without a gradient buffer the losses are the same.
  expect_identical(ce_run<double>(logits, t, N, V, dloss, false).first, dl, "losses without dlogits");
}

TEST_F(OpsTest, CrossEntropyGradientMatchesFiniteDifferences) {
  Rng rng(42);
  const int N = 4, V = 11;
  Vec logits = randn(sz(N, V), rng, 2.0);
  const std::vector<int32_t> t = {3, 0, 10, 3};
  const double dloss = 1.7;
  auto loss = [&] {
    const Vec l = ce_run<double>(logits, t, N, V, dloss, false).first;
    double s = 0;
    for (double x : l) s += dloss * x;
    return s;
  };
  expect_close(ce_run<double>(logits, t, N, V, dloss).second, numeric_grad(logits, loss), 1e-6, 1e-7,
               "dlogits");
}

TEST_F(OpsTest, CrossEntropyIsStableForHugeLogits) {
  // Without the max shift exp overflows (float: beyond ~88) and every loss is NaN or inf.
  const int V = 3;
  const Vec logits = {1000, 1000, -1e4,  //
                      5e4, 5e4 - 1, -5e4};
  const std::vector<int32_t> t = {0, 1};
  const double want0 = std::log(2.0), want1 = 1 + std::log(1 + std::exp(-1.0));
  for (int pass = 0; pass < 2; ++pass) {
    const auto [l, g] = pass ? ce_run<float>(logits, t, 2, V, 1.0) : ce_run<double>(logits, t, 2, V, 1.0);
    EXPECT_NEAR(l[0], want0, 1e-6);
    EXPECT_NEAR(l[1], want1, 1e-6);
    EXPECT_NEAR(g[0], -0.5, 1e-6);
    EXPECT_NEAR(g[1], 0.5, 1e-6);
    EXPECT_EQ(g[2], 0.0);
    EXPECT_NEAR(g[4], 1 / (1 + std::exp(1.0)) - 1, 1e-6);
  }
}

TEST_F(OpsTest, CrossEntropyRejectsTargetsOutsideVocabulary) {
  const int N = 3, V = 5;
  const Vec logits(sz(N, V), 0.0);
  for (int32_t bad : {V, -1, 1 << 30}) {
    std::vector<int32_t> t = {0, bad, 4};
    try {
      ce_run<double>(logits, t, N, V, 1.0);
      ADD_FAILURE() << "target " << bad << " was accepted";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("row 1"), std::string::npos) << msg;
      EXPECT_NE(msg.find(std::to_string(bad)), std::string::npos) << msg;
    }
  }
}

}  // namespace
