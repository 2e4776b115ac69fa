// N:M, unstructured and V:N:M magnitude masks against brute-force / sorting references.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "core/rng.h"
#include "sparse/masks.h"
#include "sparse/pattern.h"

using namespace esplag;

namespace {

std::vector<float> gaussian(int64_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = static_cast<float>(rng.normal());
  return v;
}

// Small integers: many exact ties in |w|.
std::vector<float> tied(int64_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = static_cast<float>(static_cast<int>(rng.below(7)) - 3);
  return v;
}

// Indices of `idx` sorted by |w| descending, equal |w| by ascending index (stable sort of
// an ascending list).
std::vector<int64_t> ranked(const float* w, std::vector<int64_t> idx) {
  std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return std::fabs(w[a]) > std::fabs(w[b]); });
  return idx;
}

}  // namespace

TEST(NmMask, KeepsTheBestSubsetOfEveryGroupByBruteForce) {
  const int nms[][2] = {{2, 4}, {1, 4}, {3, 4}, {1, 2}, {2, 8}, {1, 8}, {3, 7}, {5, 9}, {4, 16}, {8, 16}, {15, 16}};
  uint64_t seed = 1;
  for (const auto& nm : nms) {
    const int n = nm[0], m = nm[1];
    for (int trial = 0; trial < 3; ++trial, ++seed) {
      Rng shape_rng(seed * 7919);
      const int64_t rows = 1 + shape_rng.below(m >= 12 ? 3 : 6);
      const int64_t cols = m * (1 + shape_rng.below(m >= 12 ? 2 : 5));
      const auto w = gaussian(rows * cols, seed);
      const auto mask = cpu::nm_mask(w.data(), rows, cols, n, m);
      ASSERT_EQ(static_cast<int64_t>(mask.size()), rows * cols);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < cols; g += m) {
          const float* gw = w.data() + r * cols + g;
          // Best subset of size n by exhaustive search (Gaussian values: unique maximum).
          uint32_t best_bits = 0;
          double best = -1.0;
          for (uint32_t bits = 0; bits < (1u << m); ++bits) {
            if (std::popcount(bits) != n) continue;
            double s = 0.0;
            for (int i = 0; i < m; ++i)
              if (bits >> i & 1u) s += std::fabs(static_cast<double>(gw[i]));
            if (s > best) best = s, best_bits = bits;
          }
          uint32_t got = 0;
          for (int i = 0; i < m; ++i) got |= static_cast<uint32_t>(mask[r * cols + g + i] != 0) << i;
          EXPECT_EQ(got, best_bits) << n << ":" << m << " row " << r << " group " << g / m;
        }
      EXPECT_TRUE(cpu::check_pattern(mask.data(), rows, cols, SparsityPattern::nm(n, m)).ok);
    }
  }
}

TEST(NmMask, BreaksTiesByLowerIndex) {
  const float w[16] = {1, -1, 1, 0.5f,  //
                       0, 0, 0, 0,      //
                       2, 3, 3, -3,     //
                       -0.0f, 0, 4, 0};
  const auto mask = cpu::nm_mask(w, 1, 16, 2, 4);
  const std::vector<uint8_t> expect = {1, 1, 0, 0, 1, 1, 0, 0, 0, 1, 1, 0, 1, 0, 1, 0};
  EXPECT_EQ(mask, expect);
  // NaN ranks above everything, so it is kept.
  const float nan_w[4] = {5, std::numeric_limits<float>::quiet_NaN(), 1, 6};
  const auto nmask = cpu::nm_mask(nan_w, 1, 4, 2, 4);
  EXPECT_EQ(nmask, (std::vector<uint8_t>{0, 1, 0, 1}));
  // Random ties: the kept set is the first n of the stable magnitude order.
  const int64_t rows = 9, cols = 48;
  const auto t = tied(rows * cols, 5);
  for (int m : {4, 6, 16}) {
    const int n = m / 2 - 1;
    const auto tm = cpu::nm_mask(t.data(), rows, cols, n, m);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < cols; g += m) {
        std::vector<int64_t> idx(m);
        std::iota(idx.begin(), idx.end(), r * cols + g);
        const auto order = ranked(t.data(), idx);
        for (int i = 0; i < m; ++i) EXPECT_EQ(tm[order[i]], i < n ? 1 : 0) << m << " " << r << " " << g;
      }
  }
}

TEST(NmMask, FloatAndDoubleAgreeAndThreadCountDoesNotMatter) {
  const int64_t rows = 64, cols = 128;
  const auto w = gaussian(rows * cols, 11);
  std::vector<double> wd(w.begin(), w.end());
  const int saved = num_threads();
  set_num_threads(1);
  const auto one = cpu::nm_mask(w.data(), rows, cols, 2, 4);
  set_num_threads(3);
  const auto three = cpu::nm_mask(w.data(), rows, cols, 2, 4);
  const auto vnm3 = cpu::vnm_mask(w.data(), rows, cols, 16, 8);
  set_num_threads(1);
  const auto vnm1 = cpu::vnm_mask(w.data(), rows, cols, 16, 8);
  set_num_threads(saved);
  EXPECT_EQ(one, three);
  EXPECT_EQ(vnm1, vnm3);
  EXPECT_EQ(one, cpu::nm_mask(wd.data(), rows, cols, 2, 4));
  EXPECT_EQ(vnm1, cpu::vnm_mask(wd.data(), rows, cols, 16, 8));
}

TEST(NmMask, RejectsBadArguments) {
  const float w[8] = {};
  EXPECT_THROW(cpu::nm_mask(w, 1, 6, 2, 4), Error);
  EXPECT_THROW(cpu::nm_mask(w, 1, 8, 4, 4), Error);
  EXPECT_THROW(cpu::nm_mask(w, 1, 8, 0, 4), Error);
}

TEST(UnstructuredMask, KeepsExactlyTheLargestWithStableTies) {
  uint64_t seed = 100;
  for (int64_t count : {1, 2, 7, 100, 1001, 4096}) {
    for (double s : {0.0, 0.1, 0.37, 0.5, 0.9, 0.999, 1.0}) {
      for (int kind = 0; kind < 2; ++kind, ++seed) {
        const auto w = kind == 0 ? gaussian(count, seed) : tied(count, seed);
        const auto mask = cpu::unstructured_mask(w.data(), count, s);
        const int64_t keep = std::llround((1.0 - s) * static_cast<double>(count));
        std::vector<int64_t> idx(count);
        std::iota(idx.begin(), idx.end(), 0);
        const auto order = ranked(w.data(), idx);
        int64_t kept = 0;
        for (int64_t i = 0; i < count; ++i) {
          kept += mask[order[i]];
          ASSERT_EQ(mask[order[i]], i < keep ? 1 : 0) << "count " << count << " s " << s << " kind " << kind;
        }
        EXPECT_EQ(kept, keep);
      }
    }
  }
  const float w[1] = {1};
  EXPECT_THROW(cpu::unstructured_mask(w, 1, 1.5), Error);
  EXPECT_TRUE(cpu::unstructured_mask(w, 0, 0.5).empty());
}

TEST(VnmMask, SelectsTheFourHeaviestColumnsThenTwoPerRow) {
  const int vms[][2] = {{16, 4}, {16, 5}, {16, 8}, {32, 8}, {16, 16}, {64, 10}, {128, 16}};
  uint64_t seed = 300;
  for (const auto& vm : vms) {
    const int v = vm[0], m = vm[1];
    for (int trial = 0; trial < 2; ++trial, ++seed) {
      Rng shape_rng(seed);
      const int64_t rows = v * (1 + shape_rng.below(v >= 64 ? 1 : 3));
      const int64_t cols = m * (1 + shape_rng.below(4));
      const auto w = trial == 0 ? gaussian(rows * cols, seed) : tied(rows * cols, seed);
      const auto mask = cpu::vnm_mask(w.data(), rows, cols, v, m);
      ASSERT_TRUE(cpu::check_pattern(mask.data(), rows, cols, SparsityPattern::vnm(v, 2, m)).ok);
      for (int64_t r0 = 0; r0 < rows; r0 += v)
        for (int64_t g = 0; g < cols; g += m) {
          std::vector<double> sums(m, 0.0);
          for (int64_t r = r0; r < r0 + v; ++r)
            for (int j = 0; j < m; ++j) sums[j] += std::fabs(static_cast<double>(w[r * cols + g + j]));
          std::vector<int> cidx(m);
          std::iota(cidx.begin(), cidx.end(), 0);
          std::stable_sort(cidx.begin(), cidx.end(), [&](int a, int b) { return sums[a] > sums[b]; });
          std::vector<int> chosen(cidx.begin(), cidx.begin() + 4);
          std::sort(chosen.begin(), chosen.end());
          // Property: no unchosen column has a larger block sum than a chosen one.
          for (int j = 0; j < m; ++j)
            if (!std::binary_search(chosen.begin(), chosen.end(), j)) {
              for (int c : chosen) EXPECT_GE(sums[c], sums[j]);
            }
          for (int64_t r = r0; r < r0 + v; ++r) {
            std::vector<int64_t> idx;
            for (int c : chosen) idx.push_back(r * cols + g + c);
            const auto order = ranked(w.data(), idx);
            for (int j = 0; j < m; ++j) {
              const int64_t e = r * cols + g + j;
              const bool expect = e == order[0] || e == order[1];
              ASSERT_EQ(mask[e] != 0, expect) << v << ":2:" << m << " row " << r << " col " << g + j;
            }
          }
        }
    }
  }
}

TEST(VnmMask, RejectsBadShapes) {
  std::vector<float> w(32 * 8);
  EXPECT_THROW(cpu::vnm_mask(w.data(), 24, 8, 16, 8), Error);
  EXPECT_THROW(cpu::vnm_mask(w.data(), 16, 12, 16, 8), Error);
  EXPECT_THROW(cpu::vnm_mask(w.data(), 16, 3 * 6, 16, 3), Error);
}

TEST(MakeMask, DispatchesOnThePatternAndNamesTheTensor) {
  const int64_t rows = 32, cols = 16;
  const auto w = gaussian(rows * cols, 9);
  EXPECT_EQ(cpu::make_mask(w.data(), rows, cols, SparsityPattern::dense()), cpu::Mask(rows * cols, 1));
  EXPECT_EQ(cpu::make_mask(w.data(), rows, cols, SparsityPattern::parse("2:4")), cpu::nm_mask(w.data(), rows, cols, 2, 4));
  EXPECT_EQ(cpu::make_mask(w.data(), rows, cols, SparsityPattern::parse("16:2:8")),
            cpu::vnm_mask(w.data(), rows, cols, 16, 8));
  EXPECT_EQ(cpu::make_mask(w.data(), rows, cols, SparsityPattern::unstructured(0.8)),
            cpu::unstructured_mask(w.data(), rows * cols, 0.8));
  try {
    cpu::make_mask(w.data(), rows, cols, SparsityPattern::parse("64:2:8"), "layers.3.attn.proj.weight");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'layers.3.attn.proj.weight'"), std::string::npos) << e.what();
  }
}

TEST(ApplyMask, ZeroesPrunedValues) {
  std::vector<float> w = {1, 2, 3, 4, 5};
  const std::vector<uint8_t> m = {1, 0, 1, 0, 0};
  cpu::apply_mask(w.data(), m.data(), 5);
  EXPECT_EQ(w, (std::vector<float>{1, 0, 3, 0, 0}));
  // Masked weights satisfy the pattern they were masked with.
  const auto g = gaussian(16 * 32, 4);
  auto a = g;
  const auto mask = cpu::nm_mask(a.data(), 16, 32, 1, 8);
  cpu::apply_mask(a.data(), mask.data(), a.size());
  EXPECT_TRUE(cpu::check_pattern(a.data(), 16, 32, SparsityPattern::parse("1:8")).ok);
  EXPECT_FALSE(cpu::check_pattern(g.data(), 16, 32, SparsityPattern::parse("1:8")).ok);
}

TEST(TileBits, RoundTripsAndPlacesEachElement) {
  const int64_t rows = 8, cols = 12;
  cpu::Mask m(rows * cols, 0);
  m[0] = 1;                 // tile (0, 0), element (0, 0): bit 0
  m[1 * cols + 6] = 1;      // tile (0, 1), element (1, 2): bit 6
  m[7 * cols + 11] = 1;     // tile (1, 2), element (3, 3): bit 15
  const auto bits = cpu::tile_bits(m, rows, cols);
  EXPECT_EQ(bits, (std::vector<uint16_t>{1, 1u << 6, 0, 0, 0, 1u << 15}));
  EXPECT_EQ(cpu::mask_from_tile_bits(bits, rows, cols), m);
  const auto g = gaussian(rows * cols, 3);
  const auto nm = cpu::nm_mask(g.data(), rows, cols, 2, 4);
  EXPECT_EQ(cpu::mask_from_tile_bits(cpu::tile_bits(nm, rows, cols), rows, cols), nm);
  EXPECT_THROW(cpu::tile_bits(m, rows, cols - 2), Error);
  EXPECT_THROW(cpu::mask_from_tile_bits(bits, rows, cols + 4), Error);
}
