// MVUE 2:4 of a gradient (sparse/mvue.h): the 2:4 pattern, unbiasedness and inclusion
// probabilities checked statistically over many seeds, determinism, pass-through groups,
// non-finite values and the bf16 variant.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/parallel.h"
#include "core/rng.h"
#include "sparse/masks.h"
#include "sparse/mvue.h"

using namespace esplag;

namespace {

std::vector<float> gaussian(int64_t n, uint64_t seed, double scale = 1.0) {
  Rng rng(seed);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = static_cast<float>(scale * rng.normal());
  return v;
}

// The ideal inclusion probabilities of one group (mvue.h), in double.
void ideal_probabilities(const float* a, double* p) {
  double m[4], s = 0;
  int nz = 0, big = 0;
  for (int i = 0; i < 4; ++i) {
    m[i] = std::fabs(static_cast<double>(a[i]));
    s += m[i];
    nz += m[i] != 0;
    if (m[i] > m[big]) big = i;
  }
  for (int i = 0; i < 4; ++i) p[i] = m[i] != 0 ? 1.0 : 0.0;
  if (nz <= 2) return;
  if (2 * m[big] < s) {
    for (int i = 0; i < 4; ++i) p[i] = 2 * m[i] / s;
  } else {
    for (int i = 0; i < 4; ++i) p[i] = i == big ? 1.0 : m[i] / (s - m[big]);
  }
}

// Groups of every kind the sampler distinguishes, one row.
std::vector<float> varied_groups() {
  std::vector<float> v = gaussian(4 * 40, 11);
  const float fixed[][4] = {
      {10.0f, 1.0f, 0.5f, -0.25f},   // one value with p = 1 (capped)
      {-0.3f, 0.2f, 4.0f, 0.1f},     // capped, not in front
      {3.0f, 0.0f, -1.0f, 2.0f},     // three non-zeros
      {0.0f, -2.0f, 1.0f, 1.0f},     // three non-zeros, a tie
      {1.0f, -1.0f, 1.0f, -1.0f},    // all equal: p = 1/2 each
      {2.0f, 2.0f, 1.0f, 1.0f},      // 2·max = S/1.5
      {1.0f, 1.0f, 1.0f, 1e-3f},     // a small value next to three equal ones
      {0.5f, 0.5f, 0.25f, 0.25f},
  };
  for (const auto& g : fixed) v.insert(v.end(), g, g + 4);
  return v;
}

}  // namespace

TEST(Mvue24, KeepsExactlyTwoOfEveryGroupWithMoreThanTwoNonZeros) {
  const int64_t rows = 37, cols = 52;
  std::vector<float> in = gaussian(rows * cols, 3);
  for (int64_t i = 0; i < rows * cols; i += 7) in[i] = 0.0f;  // some groups with fewer non-zeros
  std::vector<float> out(in.size(), NAN);
  std::vector<uint8_t> mask(in.size(), 7);
  cpu::mvue_24(in.data(), out.data(), mask.data(), rows, cols, 42);
  const cpu::PatternCheck pc = cpu::check_pattern(out.data(), rows, cols, SparsityPattern::nm(2, 4));
  EXPECT_TRUE(pc.ok) << pc.detail;
  for (int64_t g = 0; g < rows * cols / 4; ++g) {
    int nz_in = 0, kept = 0;
    for (int i = 0; i < 4; ++i) {
      const int64_t k = 4 * g + i;
      nz_in += in[k] != 0.0f;
      ASSERT_TRUE(mask[k] == 0 || mask[k] == 1);
      kept += mask[k];
      if (!mask[k]) EXPECT_EQ(out[k], 0.0f) << k;
      if (mask[k] && in[k] != 0.0f) {
        EXPECT_NE(out[k], 0.0f) << k;
        EXPECT_EQ(std::signbit(out[k]), std::signbit(in[k])) << k;
        EXPECT_GE(std::fabs(out[k]), std::fabs(in[k])) << "dividing by p <= 1 never shrinks a value, at " << k;
      }
    }
    EXPECT_EQ(kept, std::min(nz_in, 2)) << "group " << g;
    if (nz_in <= 2)
      for (int i = 0; i < 4; ++i) EXPECT_EQ(out[4 * g + i], in[4 * g + i]) << "a 2:4 group passes unchanged";
  }
}

// Over K seeds, the mean output of every value must match its input and the inclusion
// frequency its probability. With z = (mean - a) / sqrt(Var/K) and Var = a²(1/p - 1), a
// correct sampler gives z ~ N(0, 1) (K·p >= 30 for the values tested, so the normal
// approximation holds): each |z| <= 5 fails with probability < 6e-7 per value, the mean of
// z² over ~170 values lies in [0.6, 1.4] with probability > 0.9999, and likewise each
// inclusion frequency within 5 standard deviations of p. A biased rescaling or wrong
// probabilities move z by many units (see the mutant checks at the end).
TEST(Mvue24, IsUnbiasedWithTheStatedInclusionProbabilities) {
  const std::vector<float> in = varied_groups();
  const int64_t cols = static_cast<int64_t>(in.size());
  const int K = 20000;
  std::vector<double> sum(in.size(), 0.0), kept(in.size(), 0.0);
  std::vector<float> out(in.size());
  for (int k = 0; k < K; ++k) {
    cpu::mvue_24(in.data(), out.data(), nullptr, 1, cols, 1000 + k);
    for (size_t i = 0; i < in.size(); ++i) {
      sum[i] += out[i];
      kept[i] += out[i] != 0.0f;
    }
  }
  double z2 = 0;
  int tested = 0, certain = 0;
  for (size_t g = 0; g < in.size() / 4; ++g) {
    double p[4];
    ideal_probabilities(&in[4 * g], p);
    for (int i = 0; i < 4; ++i) {
      const size_t k = 4 * g + i;
      const double a = in[k], mean = sum[k] / K, freq = kept[k] / K;
      if (p[i] == 1.0) {  // always kept, never rescaled
        ++certain;
        EXPECT_EQ(kept[k], K) << k;
        EXPECT_EQ(mean, a) << k;
        continue;
      }
      if (K * std::min(p[i], 1 - p[i]) < 30) continue;
      const double var = a * a * (1.0 / p[i] - 1.0);
      const double z = (mean - a) / std::sqrt(var / K);
      const double zf = (freq - p[i]) / std::sqrt(p[i] * (1 - p[i]) / K);
      EXPECT_LE(std::fabs(z), 5.0) << "value " << k << " = " << a << ": mean " << mean << ", p " << p[i];
      EXPECT_LE(std::fabs(zf), 5.0) << "value " << k << ": kept " << freq << " of the time, p " << p[i];
      z2 += z * z;
      ++tested;
    }
  }
  ASSERT_GE(tested, 150);
  EXPECT_GE(certain, 5) << "the capped case (p = 1) must be exercised";
  std::printf("MVUE 2:4 over %d seeds: %d values tested, mean z^2 = %.3f, %d values with p = 1\n", K, tested,
              z2 / tested, certain);
  EXPECT_GE(z2 / tested, 0.6);
  EXPECT_LE(z2 / tested, 1.4);

  // The test has power: the same statistics reject plausible mistakes.
  double biased_z = 0;  // keeping the two largest rescaled to the group's sum
  for (size_t g = 0; g < in.size() / 4; ++g) {
    double p[4];
    ideal_probabilities(&in[4 * g], p);
    for (int i = 0; i < 4; ++i) {
      const size_t k = 4 * g + i;
      if (p[i] == 1.0 || K * std::min(p[i], 1 - p[i]) < 30) continue;
      const double a = in[k], wrong_mean = (kept[k] / K) * a;  // forgot to divide by p
      biased_z = std::max(biased_z, std::fabs(wrong_mean - a) / std::sqrt(a * a * (1.0 / p[i] - 1.0) / K));
    }
  }
  EXPECT_GT(biased_z, 20.0) << "an estimator that does not rescale must fail the bound";
}

TEST(Mvue24, IsDeterministicForASeedAndIndependentOfThreads) {
  const int64_t rows = 64, cols = 96;
  const std::vector<float> in = gaussian(rows * cols, 5);
  std::vector<float> a(in.size()), b(in.size()), c(in.size());
  cpu::mvue_24(in.data(), a.data(), nullptr, rows, cols, 7);
  const int threads = num_threads();
  set_num_threads(1);
  cpu::mvue_24(in.data(), b.data(), nullptr, rows, cols, 7);
  set_num_threads(threads);
  cpu::mvue_24(in.data(), c.data(), nullptr, rows, cols, 8);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c) << "another seed must draw other samples";
  // In place.
  std::vector<float> inplace = in;
  cpu::mvue_24(inplace.data(), inplace.data(), nullptr, rows, cols, 7);
  EXPECT_EQ(inplace, a);
}

TEST(Mvue24, KeepsNonFiniteValuesUnscaled) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const std::vector<float> in = {1.0f, nan, 3.0f, 2.0f,  -inf, 1.0f, 2.0f, 5.0f,  nan, nan, nan, 1.0f,
                                 3e38f, 3e38f, 3e38f, 1.0f};  // the last group's Σ|a| overflows float
  std::vector<float> out(in.size());
  std::vector<uint8_t> mask(in.size());
  cpu::mvue_24(in.data(), out.data(), mask.data(), 1, 16, 1);
  EXPECT_EQ(std::vector<uint8_t>(mask.begin(), mask.begin() + 4), (std::vector<uint8_t>{0, 1, 1, 0}));
  EXPECT_TRUE(std::isnan(out[1]));
  EXPECT_EQ(out[2], 3.0f);
  EXPECT_EQ(std::vector<uint8_t>(mask.begin() + 4, mask.begin() + 8), (std::vector<uint8_t>{1, 0, 0, 1}));
  EXPECT_EQ(out[4], -inf);
  EXPECT_EQ(out[7], 5.0f);
  EXPECT_EQ(std::vector<uint8_t>(mask.begin() + 8, mask.begin() + 12), (std::vector<uint8_t>{1, 1, 0, 0}));
  EXPECT_EQ(std::vector<uint8_t>(mask.begin() + 12, mask.end()), (std::vector<uint8_t>{1, 1, 0, 0}));
  EXPECT_EQ(out[12], 3e38f);
}

TEST(Mvue24, Bf16VariantRoundsTheFloatResultOnce) {
  const int64_t rows = 16, cols = 40;
  std::vector<float> f = gaussian(rows * cols, 9, 1e-3);
  std::vector<uint16_t> bits(f.size());
  for (size_t i = 0; i < f.size(); ++i) {
    bits[i] = float_to_bf16(f[i]);
    f[i] = bf16_to_float(bits[i]);
  }
  bits[3] = 0x7fc1;  // a NaN with a payload: copied bit for bit
  f[3] = bf16_to_float(bits[3]);
  std::vector<float> out(f.size());
  std::vector<uint16_t> outb(f.size());
  std::vector<uint8_t> m1(f.size()), m2(f.size());
  cpu::mvue_24(f.data(), out.data(), m1.data(), rows, cols, 99);
  cpu::mvue_24_bf16(bits.data(), outb.data(), m2.data(), rows, cols, 99);
  EXPECT_EQ(m1, m2);
  EXPECT_EQ(outb[3], 0x7fc1);
  for (size_t i = 0; i < f.size(); ++i)
    if (i != 3) EXPECT_EQ(outb[i], float_to_bf16(out[i])) << i;
}

TEST(Mvue24, RejectsShapesThatAreNotGroupsOfFour) {
  std::vector<float> v(24);
  EXPECT_THROW(cpu::mvue_24(v.data(), v.data(), nullptr, 4, 6, 1), Error);
  EXPECT_THROW(cpu::mvue_24(v.data(), v.data(), nullptr, -1, 4, 1), Error);
  std::vector<uint16_t> b(24);
  try {
    cpu::mvue_24_bf16(b.data(), b.data(), nullptr, 2, 10, 1, "blocks.0.mlp.dout");
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("blocks.0.mlp.dout"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("multiple of 4"), std::string::npos) << e.what();
  }
  cpu::mvue_24(v.data(), v.data(), nullptr, 0, 8, 1);  // empty: nothing to do
}
