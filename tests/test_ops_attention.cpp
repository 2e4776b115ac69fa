// Causal grouped-query attention and rotary embeddings against independent fp64
// references: a naive attention that materialises repeated K/V heads and a full masked
// score matrix, a complex-number rotation for RoPE, and central finite differences for
// every gradient.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <complex>
#include <limits>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "core/rng.h"
#include "gradcheck.h"
#include "ops/attention.h"

namespace esplag {
namespace {

using testing::dot;
using testing::expect_close;
using testing::numeric_grad;
using testing::randn;

struct Shape4 {
  int B, T, NH, NKV, HD;
  int C() const { return (NH + 2 * NKV) * HD; }
  size_t qkv_size() const { return static_cast<size_t>(B) * T * C(); }
  size_t out_size() const { return static_cast<size_t>(B) * T * NH * HD; }
  size_t att_size() const { return static_cast<size_t>(B) * NH * T * T; }
};

struct NaiveResult {
  std::vector<double> out, att;
};

// Plain multi-head attention after copying key/value head h / (NH/NKV) into a private
// K and V for every query head h; the causal mask is applied as -inf scores.
NaiveResult naive_attention(const std::vector<double>& qkv, const Shape4& s) {
  const int C = s.C(), group = s.NH / s.NKV;
  const size_t per_head = static_cast<size_t>(s.B) * s.NH * s.T * s.HD;
  std::vector<double> Q(per_head), K(per_head), V(per_head);
  auto hidx = [&](int b, int h, int t, int d) { return ((static_cast<size_t>(b) * s.NH + h) * s.T + t) * s.HD + d; };
  for (int b = 0; b < s.B; ++b)
    for (int t = 0; t < s.T; ++t)
      for (int h = 0; h < s.NH; ++h)
        for (int d = 0; d < s.HD; ++d) {
          const size_t row = (static_cast<size_t>(b) * s.T + t) * C;
          const int kv = h / group;
          Q[hidx(b, h, t, d)] = qkv[row + h * s.HD + d];
          K[hidx(b, h, t, d)] = qkv[row + (s.NH + kv) * s.HD + d];
          V[hidx(b, h, t, d)] = qkv[row + (s.NH + s.NKV + kv) * s.HD + d];
        }
  NaiveResult r{std::vector<double>(s.out_size()), std::vector<double>(s.att_size())};
  std::vector<double> score(s.T);
  for (int b = 0; b < s.B; ++b)
    for (int h = 0; h < s.NH; ++h)
      for (int t = 0; t < s.T; ++t) {
        double mx = -INFINITY;
        for (int j = 0; j < s.T; ++j) {
          double d = 0;
          for (int e = 0; e < s.HD; ++e) d += Q[hidx(b, h, t, e)] * K[hidx(b, h, j, e)];
          score[j] = j > t ? -INFINITY : d / std::sqrt(static_cast<double>(s.HD));
          mx = std::max(mx, score[j]);
        }
        double sum = 0;
        for (int j = 0; j < s.T; ++j) sum += std::exp(score[j] - mx);
        for (int j = 0; j < s.T; ++j) {
          const double p = std::exp(score[j] - mx) / sum;
          r.att[((static_cast<size_t>(b) * s.NH + h) * s.T + t) * s.T + j] = p;
          for (int e = 0; e < s.HD; ++e)
            r.out[(static_cast<size_t>(b) * s.T + t) * s.NH * s.HD + h * s.HD + e] += p * V[hidx(b, h, j, e)];
        }
      }
  return r;
}

template <typename T>
std::vector<T> cast(const std::vector<double>& v) {
  return std::vector<T>(v.begin(), v.end());
}
template <typename T>
std::vector<double> widen(const std::vector<T>& v) {
  return std::vector<double>(v.begin(), v.end());
}

// Runs the op in precision T on NaN-poisoned outputs and returns them widened to double.
template <typename T>
NaiveResult run_forward(const std::vector<double>& qkv, const Shape4& s) {
  std::vector<T> q = cast<T>(qkv);
  std::vector<T> out(s.out_size(), std::numeric_limits<T>::quiet_NaN());
  std::vector<T> att(s.att_size(), std::numeric_limits<T>::quiet_NaN());
  cpu::attention_forward(out.data(), att.data(), q.data(), s.B, s.T, s.NH, s.NKV, s.HD);
  return {widen(out), widen(att)};
}

class AttentionShapes : public ::testing::TestWithParam<Shape4> {};

TEST_P(AttentionShapes, ForwardMatchesNaiveReference) {
  const Shape4 s = GetParam();
  Rng rng(11 + s.NKV);
  const std::vector<double> qkv = randn(s.qkv_size(), rng);
  const NaiveResult want = naive_attention(qkv, s);

  const NaiveResult d = run_forward<double>(qkv, s);
  expect_close(d.out, want.out, 1e-12, 1e-12, "fp64 out");
  expect_close(d.att, want.att, 1e-12, 1e-12, "fp64 att");

  // fp32 inputs are rounded too, so the reference is recomputed from the rounded inputs.
  const NaiveResult want_f = naive_attention(widen(cast<float>(qkv)), s);
  const NaiveResult f = run_forward<float>(qkv, s);
  expect_close(f.out, want_f.out, 1e-5, 1e-6, "fp32 out");
  expect_close(f.att, want_f.att, 1e-5, 1e-6, "fp32 att");

  // Strictly above the diagonal is exactly zero; every causal row sums to one.
  for (int bh = 0; bh < s.B * s.NH; ++bh)
    for (int t = 0; t < s.T; ++t) {
      double sum = 0;
      for (int j = 0; j < s.T; ++j) {
        const double p = d.att[(static_cast<size_t>(bh) * s.T + t) * s.T + j];
        if (j > t) EXPECT_EQ(p, 0.0) << "row " << t << " col " << j;
        sum += p;
      }
      EXPECT_NEAR(sum, 1.0, 1e-14);
    }
}

TEST_P(AttentionShapes, BackwardMatchesFiniteDifferences) {
  const Shape4 s = GetParam();
  Rng rng(23 + s.NKV);
  std::vector<double> qkv = randn(s.qkv_size(), rng);
  const std::vector<double> r = randn(s.out_size(), rng);  // loss = Σ out · r

  std::vector<double> out(s.out_size()), att(s.att_size());
  auto loss = [&] {
    cpu::attention_forward(out.data(), att.data(), qkv.data(), s.B, s.T, s.NH, s.NKV, s.HD);
    return dot(out, r);
  };
  const std::vector<double> want = numeric_grad(qkv, loss, 1e-5);

  loss();  // att for the unperturbed input
  // Backward adds: start from a non-zero buffer and compare the increment.
  const std::vector<double> base = randn(s.qkv_size(), rng);
  std::vector<double> dqkv = base;
  cpu::attention_backward(dqkv.data(), r.data(), qkv.data(), att.data(), s.B, s.T, s.NH, s.NKV, s.HD);
  for (size_t i = 0; i < dqkv.size(); ++i) dqkv[i] -= base[i];
  expect_close(dqkv, want, 1e-6, 1e-8, "dqkv");

  // fp32 backward against the fp64 one on the same (rounded) inputs.
  std::vector<float> qf = cast<float>(qkv), rf = cast<float>(r);
  std::vector<float> of(s.out_size()), af(s.att_size()), df(s.qkv_size(), 0.f);
  cpu::attention_forward(of.data(), af.data(), qf.data(), s.B, s.T, s.NH, s.NKV, s.HD);
  cpu::attention_backward(df.data(), rf.data(), qf.data(), af.data(), s.B, s.T, s.NH, s.NKV, s.HD);
  std::vector<double> q64 = widen(qf), r64 = widen(rf), d64(s.qkv_size(), 0.0);
  cpu::attention_forward(out.data(), att.data(), q64.data(), s.B, s.T, s.NH, s.NKV, s.HD);
  cpu::attention_backward(d64.data(), r64.data(), q64.data(), att.data(), s.B, s.T, s.NH, s.NKV, s.HD);
  expect_close(widen(df), d64, 1e-4, 1e-5, "fp32 dqkv");
}

INSTANTIATE_TEST_SUITE_P(Heads, AttentionShapes,
                         ::testing::Values(Shape4{2, 5, 4, 4, 6},   // multi-head
                                           Shape4{2, 5, 4, 2, 6},   // grouped-query
                                           Shape4{2, 5, 4, 1, 6},   // multi-query
                                           Shape4{1, 4, 3, 1, 5}),  // odd head size
                         [](const auto& info) {
                           const Shape4& s = info.param;
                           return "NH" + std::to_string(s.NH) + "_NKV" + std::to_string(s.NKV) + "_HD" +
                                  std::to_string(s.HD);
                         });

// T=2, one head of size 1 (scale 1): q1 = 1, k = (0, ln 3) gives weights (1/4, 3/4) at t=1.
TEST(Attention, HandComputedTwoTokens) {
  const double ln3 = std::log(3.0);
  // per token [q | k | v]
  const std::vector<double> qkv = {0.7, 0.0, 2.0, /* t=1 */ 1.0, ln3, 6.0};
  std::vector<double> out(2, NAN), att(4, NAN);
  cpu::attention_forward(out.data(), att.data(), qkv.data(), 1, 2, 1, 1, 1);
  EXPECT_DOUBLE_EQ(out[0], 2.0);
  EXPECT_DOUBLE_EQ(out[1], 0.25 * 2.0 + 0.75 * 6.0);
  EXPECT_DOUBLE_EQ(att[0], 1.0);
  EXPECT_EQ(att[1], 0.0);
  EXPECT_DOUBLE_EQ(att[2], 0.25);
  EXPECT_DOUBLE_EQ(att[3], 0.75);
}

TEST(Attention, FutureTokensDoNotChangeEarlierOutputs) {
  const Shape4 s{2, 6, 4, 2, 4};
  Rng rng(5);
  std::vector<double> qkv = randn(s.qkv_size(), rng);
  const NaiveResult before = run_forward<double>(qkv, s);
  const int t0 = 3;
  for (int b = 0; b < s.B; ++b)
    for (int t = t0; t < s.T; ++t)
      for (int c = 0; c < s.C(); ++c) qkv[(static_cast<size_t>(b) * s.T + t) * s.C() + c] += 1.0 + rng.normal();
  const NaiveResult after = run_forward<double>(qkv, s);
  for (int b = 0; b < s.B; ++b)
    for (int t = 0; t < s.T; ++t)
      for (int c = 0; c < s.NH * s.HD; ++c) {
        const size_t i = (static_cast<size_t>(b) * s.T + t) * s.NH * s.HD + c;
        if (t < t0) EXPECT_EQ(after.out[i], before.out[i]) << "b " << b << " t " << t << " c " << c;
      }
  // Sanity: the change is visible from t0 on, so the comparison above can fail.
  EXPECT_NE(after.out[static_cast<size_t>(t0) * s.NH * s.HD], before.out[static_cast<size_t>(t0) * s.NH * s.HD]);
}

// ---- RoPE ----

// x[i] + i·x[i+HD/2] multiplied by e^{i·t·θ^(-2i/HD)} for every q and k head.
std::vector<double> complex_rope(const std::vector<double>& qkv, const Shape4& s, double theta) {
  std::vector<double> y = qkv;
  const int half = s.HD / 2;
  for (int b = 0; b < s.B; ++b)
    for (int t = 0; t < s.T; ++t)
      for (int h = 0; h < s.NH + s.NKV; ++h)
        for (int i = 0; i < half; ++i) {
          const size_t p = (static_cast<size_t>(b) * s.T + t) * s.C() + h * s.HD + i;
          const std::complex<double> z(qkv[p], qkv[p + half]);
          const std::complex<double> w = z * std::polar(1.0, t * std::pow(theta, -2.0 * i / s.HD));
          y[p] = w.real();
          y[p + half] = w.imag();
        }
  return y;
}

TEST(Rope, MatchesComplexRotationAndLeavesValuesAlone) {
  const Shape4 s{2, 7, 4, 2, 8};
  const double theta = 10000.0;
  Rng rng(3);
  const std::vector<double> x = randn(s.qkv_size(), rng);
  const std::vector<double> want = complex_rope(x, s, theta);

  std::vector<double> y = x;
  cpu::rope_forward(y.data(), s.B, s.T, s.NH, s.NKV, s.HD, theta);
  expect_close(y, want, 1e-13, 1e-13, "fp64 rope");

  std::vector<float> yf = cast<float>(x);
  cpu::rope_forward(yf.data(), s.B, s.T, s.NH, s.NKV, s.HD, theta);
  expect_close(widen(yf), want, 1e-5, 1e-6, "fp32 rope");

  for (int bt = 0; bt < s.B * s.T; ++bt) {
    const size_t row = static_cast<size_t>(bt) * s.C();
    const bool first = bt % s.T == 0;
    for (int c = 0; c < s.C(); ++c) {
      // v untouched, and position 0 is the identity rotation: both bit-exact.
      if (c >= (s.NH + s.NKV) * s.HD || first) EXPECT_EQ(y[row + c], x[row + c]) << "bt " << bt << " c " << c;
    }
  }
}

// Rows pos0.. of every sequence, rotated on their own from pos0, are bit for bit those
// rows of the whole sequence rotated from 0 (what incremental generation relies on).
template <typename T>
void expect_rope_from_start_matches_longer_sequence() {
  const Shape4 s{2, 9, 4, 2, 8};
  const double theta = 10000.0;
  Rng rng(11);
  const std::vector<T> x = cast<T>(randn(s.qkv_size(), rng, 3.0));
  std::vector<T> whole = x;
  cpu::rope_forward(whole.data(), s.B, s.T, s.NH, s.NKV, s.HD, theta);
  for (const int pos0 : {0, 1, 5, 8})
    for (int n = 1; pos0 + n <= s.T; n += 3) {
      std::vector<T> part(static_cast<size_t>(s.B) * n * s.C()), want(part.size());
      for (int b = 0; b < s.B; ++b) {
        const size_t from = (static_cast<size_t>(b) * s.T + pos0) * s.C(), to = static_cast<size_t>(b) * n * s.C();
        std::copy_n(x.begin() + from, n * s.C(), part.begin() + to);
        std::copy_n(whole.begin() + from, n * s.C(), want.begin() + to);
      }
      cpu::rope_forward(part.data(), s.B, n, s.NH, s.NKV, s.HD, theta, pos0);
      for (size_t i = 0; i < part.size(); ++i)
        ASSERT_EQ(part[i], want[i]) << "pos0 " << pos0 << " n " << n << " element " << i;
    }
}

TEST(Rope, FromAStartPositionEqualsTheRowsOfALongerSequence) {
  expect_rope_from_start_matches_longer_sequence<float>();
  expect_rope_from_start_matches_longer_sequence<double>();
  std::vector<float> buf(64);
  EXPECT_THROW(cpu::rope_forward(buf.data(), 1, 1, 2, 2, 4, 10000.0, -1), Error);
}

TEST(Rope, BackwardIsAdjointAndNormsArePreserved) {
  const Shape4 s{2, 9, 6, 3, 10};
  const double theta = 500.0;
  Rng rng(8);
  const std::vector<double> x = randn(s.qkv_size(), rng), y = randn(s.qkv_size(), rng);
  std::vector<double> rx = x, ry = y;
  cpu::rope_forward(rx.data(), s.B, s.T, s.NH, s.NKV, s.HD, theta);
  cpu::rope_backward(ry.data(), s.B, s.T, s.NH, s.NKV, s.HD, theta);
  EXPECT_NEAR(dot(rx, y), dot(x, ry), 1e-11 * std::sqrt(dot(x, x) * dot(y, y)));

  // Rotation preserves every head's norm; backward undoes forward.
  for (size_t h = 0; h < x.size() / s.HD; ++h) {
    double n0 = 0, n1 = 0;
    for (int d = 0; d < s.HD; ++d) {
      n0 += x[h * s.HD + d] * x[h * s.HD + d];
      n1 += rx[h * s.HD + d] * rx[h * s.HD + d];
    }
    EXPECT_NEAR(n1, n0, 1e-12 * n0) << "head row " << h;
  }
  std::vector<double> back = rx;
  cpu::rope_backward(back.data(), s.B, s.T, s.NH, s.NKV, s.HD, theta);
  expect_close(back, x, 1e-12, 1e-12, "rope_backward(rope_forward(x))");
}

TEST(Rope, ComposedWithAttentionMatchesFiniteDifferences) {
  const Shape4 s{2, 5, 4, 2, 6};
  const double theta = 100.0;  // small base: every pair rotates noticeably within 5 steps
  Rng rng(31);
  std::vector<double> x = randn(s.qkv_size(), rng);
  const std::vector<double> r = randn(s.out_size(), rng);
  std::vector<double> rotated(s.qkv_size()), out(s.out_size()), att(s.att_size());
  auto loss = [&] {
    rotated = x;
    cpu::rope_forward(rotated.data(), s.B, s.T, s.NH, s.NKV, s.HD, theta);
    cpu::attention_forward(out.data(), att.data(), rotated.data(), s.B, s.T, s.NH, s.NKV, s.HD);
    return dot(out, r);
  };
  const std::vector<double> want = numeric_grad(x, loss, 1e-5);
  loss();
  std::vector<double> dx(s.qkv_size(), 0.0);
  cpu::attention_backward(dx.data(), r.data(), rotated.data(), att.data(), s.B, s.T, s.NH, s.NKV, s.HD);
  cpu::rope_backward(dx.data(), s.B, s.T, s.NH, s.NKV, s.HD, theta);
  expect_close(dx, want, 1e-6, 1e-8, "d loss / d x through rope + attention");
}

// ---- threading and errors ----

TEST(Attention, ResultsDoNotDependOnThreadCount) {
  // Big enough that every op splits its work across two threads.
  const Shape4 s{2, 33, 4, 2, 8};
  Rng rng(77);
  const std::vector<float> x = cast<float>(randn(s.qkv_size(), rng));
  const std::vector<float> r = cast<float>(randn(s.out_size(), rng));
  struct Outputs {
    std::vector<float> rotated, out, att, dqkv;
  };
  auto run_all = [&] {
    Outputs o{x, std::vector<float>(s.out_size()), std::vector<float>(s.att_size()),
              std::vector<float>(s.qkv_size(), 0.f)};
    cpu::rope_forward(o.rotated.data(), s.B, s.T, s.NH, s.NKV, s.HD, 10000.0);
    cpu::attention_forward(o.out.data(), o.att.data(), o.rotated.data(), s.B, s.T, s.NH, s.NKV, s.HD);
    cpu::attention_backward(o.dqkv.data(), r.data(), o.rotated.data(), o.att.data(), s.B, s.T, s.NH, s.NKV, s.HD);
    cpu::rope_backward(o.dqkv.data(), s.B, s.T, s.NH, s.NKV, s.HD, 10000.0);
    return o;
  };
  const int saved = num_threads();
  set_num_threads(1);
  const Outputs one = run_all();
  set_num_threads(2);
  const Outputs two = run_all();
  set_num_threads(3);
  const Outputs three = run_all();
  set_num_threads(saved);
  EXPECT_EQ(one.rotated, two.rotated);
  EXPECT_EQ(one.out, two.out);
  EXPECT_EQ(one.att, two.att);
  EXPECT_EQ(one.dqkv, two.dqkv);
  EXPECT_EQ(one.out, three.out);
  EXPECT_EQ(one.dqkv, three.dqkv);
}

TEST(Attention, RejectsBadHeadCounts) {
  std::vector<float> buf(1024);
  float* p = buf.data();
  EXPECT_THROW(cpu::attention_forward(p, p, p, 1, 2, 4, 3, 4), Error);  // 4 % 3 != 0
  EXPECT_THROW(cpu::attention_backward(p, p, p, p, 1, 2, 4, 3, 4), Error);
  EXPECT_THROW(cpu::attention_forward(p, p, p, 1, 2, 0, 1, 4), Error);
  EXPECT_THROW(cpu::attention_forward(p, p, p, 1, 2, 2, 2, 0), Error);
  EXPECT_THROW(cpu::rope_forward(p, 1, 2, 4, 3, 4, 10000.0), Error);
  EXPECT_THROW(cpu::rope_forward(p, 1, 2, 4, 2, 5, 10000.0), Error);  // odd head size
  EXPECT_THROW(cpu::rope_backward(p, 1, 2, 4, 2, 5, 10000.0), Error);
  EXPECT_THROW(cpu::rope_forward(p, 1, 2, 4, 2, 4, 0.0), Error);
  try {
    cpu::attention_forward(p, p, p, 1, 2, 6, 4, 4);
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("NH=6"), std::string::npos) << msg;
    EXPECT_NE(msg.find("NKV=4"), std::string::npos) << msg;
  }
}

}  // namespace
}  // namespace esplag
