// AdamW, the global gradient norm and the clipping factor: three steps worked out by
// hand (exact decimal arithmetic) for a few scalars, random inputs against an
// independently written long-double reference in PyTorch's formulation, grad_scale,
// float against double, and bit-identical results for any thread count.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "core/rng.h"
#include "ops/adamw.h"

using namespace esplag;

namespace {

struct Hyper {
  double lr, beta1, beta2, eps, wd;
};

// PyTorch's AdamW written differently from the library: decay applied first as a
// multiplicative shrink, the bias corrections folded into the step size and the
// denominator, everything in long double.
void reference_adamw(std::vector<long double>& p, std::vector<long double>& m, std::vector<long double>& v,
                     const std::vector<double>& grad, const Hyper& h, int t, double scale) {
  const long double bc1 = 1.0L - std::pow(static_cast<long double>(h.beta1), t);
  const long double bc2 = 1.0L - std::pow(static_cast<long double>(h.beta2), t);
  const long double step_size = h.lr / bc1;
  for (size_t i = 0; i < p.size(); ++i) {
    const long double g = static_cast<long double>(grad[i]) * scale;
    p[i] *= 1.0L - static_cast<long double>(h.lr) * h.wd;
    m[i] = m[i] * h.beta1 + g * (1.0L - h.beta1);
    v[i] = v[i] * h.beta2 + g * g * (1.0L - h.beta2);
    const long double denom = std::sqrt(v[i]) / std::sqrt(bc2) + h.eps;
    p[i] -= step_size * m[i] / denom;
  }
}

std::vector<double> randn(size_t n, Rng& rng, double scale = 1.0) {
  std::vector<double> x(n);
  for (auto& e : x) e = rng.normal() * scale;
  return x;
}

template <typename T>
std::vector<T> cast(const std::vector<double>& x) {
  return std::vector<T>(x.begin(), x.end());
}

// Restores the thread count a test changed.
struct ThreadGuard {
  int saved = num_threads();
  ~ThreadGuard() { set_num_threads(saved); }
};

}  // namespace

// lr 0.1, betas (0.9, 0.999), eps 1e-8, weight decay 0.01; three parameters over three
// steps. Step 1 for p = 1, g = 0.5:
//   m = 0.1 * 0.5 = 0.05, v = 0.001 * 0.25 = 0.00025, m_hat = 0.05 / 0.1 = 0.5,
//   v_hat = 0.00025 / 0.001 = 0.25, update = 0.5 / (0.5 + 1e-8) + 0.01 * 1 = 1.00999998,
//   p = 1 - 0.1 * 1.00999998 = 0.899000002 (to 1e-15).
// p = -2 with g = 0 only decays: p = -2 * 0.999^t. Later values were worked out in exact
// decimal arithmetic to 40 digits.
template <typename T>
void hand_computed_steps(double tol) {
  T p[3] = {1, -2, 0.5};
  T m[3] = {0, 0, 0}, v[3] = {0, 0, 0};
  const T grads[3][3] = {{0.5, 0, -1}, {-0.25, 0, 2}, {0.125, 0, 0.5}};
  const double expect_p[3][3] = {
      {0.8990000019999999600000008, -1.998, 0.5994999990000000099999999},
      {0.8714672987058461625993764, -1.996002, 0.5622901465289249117844929},
      {0.8365529176159481227377000, -1.994005998, 0.5201627367076970282852442}};
  const double expect_m[3][3] = {{0.05, 0, -0.1}, {0.02, 0, 0.11}, {0.0305, 0, 0.149}};
  const double expect_v[3][3] = {{0.00025, 0, 0.001}, {0.00031225, 0, 0.004999}, {0.00032756275, 0, 0.005244001}};
  for (int t = 1; t <= 3; ++t) {
    cpu::adamw_step<T>(p, grads[t - 1], m, v, 3, 0.1, 0.9, 0.999, 1e-8, 0.01, t);
    for (int i = 0; i < 3; ++i) {
      EXPECT_NEAR(p[i], expect_p[t - 1][i], tol) << "step " << t << " param " << i;
      EXPECT_NEAR(m[i], expect_m[t - 1][i], tol) << "step " << t << " m " << i;
      EXPECT_NEAR(v[i], expect_v[t - 1][i], tol * 1e-2) << "step " << t << " v " << i;
    }
  }
}

TEST(AdamW, HandComputedStepsDouble) { hand_computed_steps<double>(1e-14); }
TEST(AdamW, HandComputedStepsFloat) { hand_computed_steps<float>(1e-6); }

TEST(AdamW, WeightDecayAloneIsExactShrink) {
  // With zero gradients and moments, the Adam term is 0 / (0 + eps) = 0.
  std::vector<double> p = {3.0, -1.5, 0.0, 1e-3}, g(4, 0.0), m(4, 0.0), v(4, 0.0);
  const std::vector<double> p0 = p;
  cpu::adamw_step(p.data(), g.data(), m.data(), v.data(), 4, 0.5, 0.9, 0.99, 1e-8, 0.2, 1);
  for (int i = 0; i < 4; ++i) EXPECT_DOUBLE_EQ(p[i], p0[i] * (1 - 0.5 * 0.2));
  // Without weight decay and gradient nothing moves.
  cpu::adamw_step(p.data(), g.data(), m.data(), v.data(), 4, 0.5, 0.9, 0.99, 1e-8, 0.0, 2);
  for (int i = 0; i < 4; ++i) EXPECT_DOUBLE_EQ(p[i], p0[i] * 0.9);
}

TEST(AdamW, MatchesIndependentReference) {
  Rng rng(7);
  const size_t n = 1031;
  const Hyper h{3e-3, 0.8, 0.95, 1e-6, 0.1};
  const double scale = 0.37;
  std::vector<double> p = randn(n, rng), m(n, 0.0), v(n, 0.0);
  std::vector<long double> rp(p.begin(), p.end()), rm(n, 0.0L), rv(n, 0.0L);
  for (int t = 1; t <= 6; ++t) {
    const std::vector<double> g = randn(n, rng, t == 3 ? 1e-4 : 2.0);  // one step of tiny gradients: eps matters
    cpu::adamw_step(p.data(), g.data(), m.data(), v.data(), int64_t(n), h.lr, h.beta1, h.beta2, h.eps, h.wd, t,
                    scale);
    reference_adamw(rp, rm, rv, g, h, t, scale);
  }
  for (size_t i = 0; i < n; ++i) {
    EXPECT_NEAR(p[i], static_cast<double>(rp[i]), 1e-13 * (1 + std::fabs(p[i]))) << i;
    EXPECT_NEAR(m[i], static_cast<double>(rm[i]), 1e-14) << i;
    EXPECT_NEAR(v[i], static_cast<double>(rv[i]), 1e-14) << i;
  }
}

template <typename T>
void grad_scale_is_prescaling() {
  Rng rng(11);
  const size_t n = 257;
  const std::vector<T> p0 = cast<T>(randn(n, rng));
  std::vector<T> pa = p0, pb = p0, pc = p0, ma(n), va(n), mb(n), vb(n), mc(n), vc(n);
  for (int t = 1; t <= 3; ++t) {
    const std::vector<T> g = cast<T>(randn(n, rng));
    std::vector<T> g_half(n);
    for (size_t i = 0; i < n; ++i) g_half[i] = g[i] * T(0.5);  // exact: a power of two
    // eps = 0.1 is large enough that the scale is visible in the update.
    cpu::adamw_step(pa.data(), g.data(), ma.data(), va.data(), int64_t(n), 1e-2, 0.9, 0.999, 0.1, 0.05, t, 0.5);
    cpu::adamw_step(pb.data(), g_half.data(), mb.data(), vb.data(), int64_t(n), 1e-2, 0.9, 0.999, 0.1, 0.05, t);
    cpu::adamw_step(pc.data(), g.data(), mc.data(), vc.data(), int64_t(n), 1e-2, 0.9, 0.999, 0.1, 0.05, t);
  }
  EXPECT_EQ(std::memcmp(pa.data(), pb.data(), n * sizeof(T)), 0);
  EXPECT_EQ(std::memcmp(ma.data(), mb.data(), n * sizeof(T)), 0);
  EXPECT_EQ(std::memcmp(va.data(), vb.data(), n * sizeof(T)), 0);
  double diff = 0;
  for (size_t i = 0; i < n; ++i) diff = std::max(diff, std::fabs(double(pa[i]) - double(pc[i])));
  EXPECT_GT(diff, 1e-5) << "grad_scale had no effect";
}

TEST(AdamW, GradScaleEqualsPrescaledGradientDouble) { grad_scale_is_prescaling<double>(); }
TEST(AdamW, GradScaleEqualsPrescaledGradientFloat) { grad_scale_is_prescaling<float>(); }

TEST(AdamW, FloatTracksDouble) {
  Rng rng(3);
  const size_t n = 4099;
  const std::vector<double> p0 = randn(n, rng);
  std::vector<double> pd = p0, md(n), vd(n);
  std::vector<float> pf = cast<float>(p0), mf(n), vf(n);
  for (int t = 1; t <= 10; ++t) {
    const std::vector<double> g = randn(n, rng);
    const std::vector<float> gf = cast<float>(g);
    cpu::adamw_step(pd.data(), g.data(), md.data(), vd.data(), int64_t(n), 1e-2, 0.9, 0.95, 1e-8, 0.1, t, 0.8);
    cpu::adamw_step(pf.data(), gf.data(), mf.data(), vf.data(), int64_t(n), 1e-2, 0.9, 0.95, 1e-8, 0.1, t, 0.8);
  }
  double worst = 0, moved = 0;
  for (size_t i = 0; i < n; ++i) {
    worst = std::max(worst, std::fabs(pd[i] - pf[i]) / (1 + std::fabs(pd[i])));
    moved = std::max(moved, std::fabs(pd[i] - p0[i]));
  }
  EXPECT_LT(worst, 1e-6);
  EXPECT_GT(moved, 1e-2);  // the comparison is between parameters that actually changed
}

TEST(AdamW, RejectsInvalidArguments) {
  double p = 1, g = 1, m = 0, v = 0;
  EXPECT_THROW(cpu::adamw_step(&p, &g, &m, &v, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, 0), Error);
  EXPECT_THROW(cpu::adamw_step(&p, &g, &m, &v, 1, 1e-3, 1.0, 0.999, 1e-8, 0.0, 1), Error);
  EXPECT_THROW(cpu::adamw_step(&p, &g, &m, &v, 1, -1e-3, 0.9, 0.999, 1e-8, 0.0, 1), Error);
  EXPECT_THROW(cpu::adamw_step(&p, &g, &m, &v, -1, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1), Error);
  EXPECT_EQ(p, 1.0);  // untouched
  cpu::adamw_step<double>(nullptr, nullptr, nullptr, nullptr, 0, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1);  // empty is fine
}

TEST(GradNorm, SmallExact) {
  const float g[] = {3, -4};
  EXPECT_EQ(cpu::global_grad_norm_squared(g, 2), 25.0);
  const double d[] = {1, 2, 2, -0.5};
  EXPECT_EQ(cpu::global_grad_norm_squared(d, 4), 9.25);
  EXPECT_EQ(cpu::global_grad_norm_squared<double>(nullptr, 0), 0.0);
}

TEST(GradNorm, MatchesNaiveSum) {
  Rng rng(5);
  for (size_t n : {size_t(1), size_t(17), size_t(16384), size_t(16385), size_t(100003)}) {
    const std::vector<double> gd = randn(n, rng, 0.01);
    const std::vector<float> gf = cast<float>(gd);
    long double naive_d = 0, naive_f = 0;
    for (size_t i = 0; i < n; ++i) {
      naive_d += static_cast<long double>(gd[i]) * gd[i];
      naive_f += static_cast<long double>(gf[i]) * gf[i];
    }
    EXPECT_NEAR(cpu::global_grad_norm_squared(gd.data(), int64_t(n)), double(naive_d), 1e-12 * double(naive_d)) << n;
    EXPECT_NEAR(cpu::global_grad_norm_squared(gf.data(), int64_t(n)), double(naive_f), 1e-12 * double(naive_f)) << n;
  }
}

TEST(GradNorm, ThreadCountIndependent) {
  ThreadGuard guard;
  Rng rng(9);
  const size_t n = 300007;
  // Values of very different magnitudes make the sum sensitive to addition order.
  std::vector<float> g(n);
  for (size_t i = 0; i < n; ++i) g[i] = static_cast<float>(rng.normal() * std::pow(10.0, rng.below(9) - 4.0));
  set_num_threads(1);
  const double one = cpu::global_grad_norm_squared(g.data(), int64_t(n));
  for (int threads : {2, 3, 7}) {
    set_num_threads(threads);
    const double many = cpu::global_grad_norm_squared(g.data(), int64_t(n));
    EXPECT_EQ(std::memcmp(&one, &many, sizeof one), 0) << threads << " threads: " << many << " vs " << one;
  }
}

TEST(AdamW, ThreadCountIndependent) {
  ThreadGuard guard;
  Rng rng(13);
  const size_t n = 200003;
  const std::vector<float> p0 = cast<float>(randn(n, rng)), g = cast<float>(randn(n, rng));
  auto run = [&](int threads) {
    set_num_threads(threads);
    std::vector<float> p = p0, m(n), v(n);
    for (int t = 1; t <= 2; ++t)
      cpu::adamw_step(p.data(), g.data(), m.data(), v.data(), int64_t(n), 1e-3, 0.9, 0.999, 1e-8, 0.1, t, 0.9);
    return p;
  };
  const std::vector<float> one = run(1);
  for (int threads : {2, 5}) {
    const std::vector<float> many = run(threads);
    EXPECT_EQ(std::memcmp(one.data(), many.data(), n * sizeof(float)), 0) << threads << " threads";
  }
}

TEST(ClipScale, Values) {
  EXPECT_EQ(cpu::clip_scale(5.0, 0.0), 1.0);   // disabled
  EXPECT_EQ(cpu::clip_scale(5.0, -1.0), 1.0);  // disabled
  EXPECT_EQ(cpu::clip_scale(0.5, 1.0), 1.0);   // already below the limit
  EXPECT_EQ(cpu::clip_scale(0.0, 1.0), 1.0);
  EXPECT_DOUBLE_EQ(cpu::clip_scale(4.0, 1.0), 1.0 / (4.0 + 1e-6));
  EXPECT_DOUBLE_EQ(cpu::clip_scale(10.0, 2.5), 2.5 / (10.0 + 1e-6));
  // The clipped gradient's norm is just under max_norm.
  EXPECT_LT(cpu::clip_scale(3.0, 1.0) * 3.0, 1.0);
  EXPECT_GT(cpu::clip_scale(3.0, 1.0) * 3.0, 1.0 - 1e-6);
  EXPECT_THROW(cpu::clip_scale(std::numeric_limits<double>::quiet_NaN(), 1.0), Error);
  EXPECT_THROW(cpu::clip_scale(std::numeric_limits<double>::infinity(), 1.0), Error);
  EXPECT_THROW(cpu::clip_scale(-1.0, 1.0), Error);
}
