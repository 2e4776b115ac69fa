// Transposable 2:4 masks (greedy and exact), SLoPe double pruning, and the kept-magnitude
// table of docs/sparsity-formats.md (printed by MaskQuality.GaussianTable).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdio>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "sparse/double_prune.h"
#include "sparse/masks.h"
#include "sparse/transposable.h"

using namespace esplag;

namespace {

std::vector<float> gaussian(int64_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = static_cast<float>(rng.normal());
  return v;
}

std::vector<float> tied(int64_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = static_cast<float>(static_cast<int>(rng.below(5)) - 2);
  return v;
}

uint32_t tile_bits(const cpu::Mask& mask, int64_t cols, int64_t tr, int64_t tc) {
  uint32_t bits = 0;
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < 4; ++c) bits |= static_cast<uint32_t>(mask[(tr + r) * cols + tc + c] != 0) << (r * 4 + c);
  return bits;
}

bool counts_at_most(uint32_t bits, int limit, bool exactly) {
  for (int i = 0; i < 4; ++i) {
    const int row = std::popcount((bits >> (4 * i)) & 0xFu), col = std::popcount((bits >> i) & 0x1111u);
    if (row > limit || col > limit) return false;
    if (exactly && (row != limit || col != limit)) return false;
  }
  return true;
}

double tile_sum(const float* w, int64_t cols, int64_t tr, int64_t tc, uint32_t bits) {
  double s = 0.0;
  for (int i = 0; i < 16; ++i)
    if (bits >> i & 1u) s += std::fabs(static_cast<double>(w[(tr + i / 4) * cols + tc + i % 4]));
  return s;
}

}  // namespace

TEST(Transposable, ThereAre90FullAnd186MaximalTilePatterns) {
  const auto& p = cpu::transposable_tile_patterns();
  const auto& maximal = cpu::transposable_tile_maximal_patterns();
  int count = 0;
  for (uint32_t bits = 0; bits < (1u << 16); ++bits) count += counts_at_most(bits, 2, true);
  EXPECT_EQ(count, 90);
  for (size_t i = 0; i < p.size(); ++i) {
    EXPECT_TRUE(counts_at_most(p[i], 2, true)) << std::hex << p[i];
    if (i > 0) {
      EXPECT_LT(p[i - 1], p[i]);
    }
    EXPECT_EQ(maximal[i], p[i]);
  }
  // Every allowed mask (at most 2 per row and column) lies inside one of the 186.
  for (uint32_t bits = 0; bits < (1u << 16); ++bits) {
    if (!counts_at_most(bits, 2, false)) continue;
    bool covered = false;
    for (uint16_t m : maximal) covered = covered || (bits & ~uint32_t{m}) == 0;
    ASSERT_TRUE(covered) << std::hex << bits;
  }
  for (size_t i = 90; i < maximal.size(); ++i) {
    EXPECT_EQ(std::popcount(maximal[i]), 7);
    EXPECT_TRUE(counts_at_most(maximal[i], 2, false));
    if (i > 90) {
      EXPECT_LT(maximal[i - 1], maximal[i]);
    }
  }
}

TEST(Transposable, ValidityAndExactBeatsGreedyOnEveryTile) {
  int64_t tiles = 0, greedy_beats_full = 0;
  uint64_t seed = 20;
  for (int trial = 0; trial < 8; ++trial, ++seed) {
    Rng shape_rng(seed);
    const int64_t rows = 4 * (1 + shape_rng.below(12)), cols = 4 * (1 + shape_rng.below(12));
    const auto w = trial % 2 ? tied(rows * cols, seed) : gaussian(rows * cols, seed);
    const auto greedy = cpu::transposable_mask_greedy(w.data(), rows, cols);
    const auto exact = cpu::transposable_mask_exact(w.data(), rows, cols);
    const auto full = cpu::transposable_mask_exact_full(w.data(), rows, cols);
    for (int64_t tr = 0; tr < rows; tr += 4)
      for (int64_t tc = 0; tc < cols; tc += 4) {
        const uint32_t g = tile_bits(greedy, cols, tr, tc), e = tile_bits(exact, cols, tr, tc),
                       f = tile_bits(full, cols, tr, tc);
        EXPECT_TRUE(counts_at_most(g, 2, false)) << std::hex << g;
        EXPECT_TRUE(counts_at_most(e, 2, false)) << std::hex << e;
        EXPECT_GE(std::popcount(e), 7);
        EXPECT_TRUE(counts_at_most(f, 2, true)) << std::hex << f;
        const double se = tile_sum(w.data(), cols, tr, tc, e), sg = tile_sum(w.data(), cols, tr, tc, g),
                     sf = tile_sum(w.data(), cols, tr, tc, f);
        EXPECT_GE(se, sg);
        EXPECT_GE(se, sf);
        ++tiles;
        greedy_beats_full += sg > sf;
      }
    // Both W and Wᵀ are 2:4 along their rows.
    std::vector<uint8_t> et(exact.size());
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) et[c * rows + r] = exact[r * cols + c];
    EXPECT_TRUE(cpu::check_pattern(exact.data(), rows, cols, SparsityPattern::nm(2, 4)).ok);
    EXPECT_TRUE(cpu::check_pattern(et.data(), cols, rows, SparsityPattern::nm(2, 4)).ok);
    EXPECT_GE(cpu::kept_magnitude_fraction(w.data(), exact.data(), rows * cols),
              cpu::kept_magnitude_fraction(w.data(), greedy.data(), rows * cols));
  }
  std::printf("greedy keeps more than exact_full on %lld of %lld tiles\n", static_cast<long long>(greedy_beats_full),
              static_cast<long long>(tiles));
}

TEST(Transposable, ExactEqualsBruteForceOverAll65536Masks) {
  for (uint64_t seed = 50; seed < 62; ++seed) {
    const auto w = seed % 3 == 2 ? tied(16, seed) : gaussian(16, seed);
    double best = -1.0, best_full = -1.0;
    for (uint32_t bits = 0; bits < (1u << 16); ++bits) {
      if (counts_at_most(bits, 2, false)) best = std::max(best, tile_sum(w.data(), 4, 0, 0, bits));
      if (counts_at_most(bits, 2, true)) best_full = std::max(best_full, tile_sum(w.data(), 4, 0, 0, bits));
    }
    const auto exact = cpu::transposable_mask_exact(w.data(), 4, 4);
    const auto full = cpu::transposable_mask_exact_full(w.data(), 4, 4);
    EXPECT_NEAR(tile_sum(w.data(), 4, 0, 0, tile_bits(exact, 4, 0, 0)), best, 1e-12 * best) << "seed " << seed;
    EXPECT_NEAR(tile_sum(w.data(), 4, 0, 0, tile_bits(full, 4, 0, 0)), best_full, 1e-12 * best) << "seed " << seed;
  }
}

TEST(Transposable, ForcingEightPerTileCanLoseToGreedy) {
  // Large values on the off-diagonal of the top-left 3×3 block and at (3,3): the greedy
  // (and the exact) mask keeps those 7 (70); any mask with exactly 2 per row and column
  // must drop one of them for two 1s (62).
  const float w[16] = {1, 10, 10, 1,  //
                       10, 1, 10, 1,  //
                       10, 10, 1, 1,  //
                       1, 1, 1, 10};
  const auto g = cpu::transposable_mask_greedy(w, 4, 4);
  const auto e = cpu::transposable_mask_exact(w, 4, 4);
  const auto f = cpu::transposable_mask_exact_full(w, 4, 4);
  EXPECT_EQ(tile_bits(g, 4, 0, 0), 0x8356u);
  EXPECT_EQ(tile_bits(e, 4, 0, 0), 0x8356u);
  EXPECT_DOUBLE_EQ(tile_sum(w, 4, 0, 0, tile_bits(g, 4, 0, 0)), 70.0);
  EXPECT_DOUBLE_EQ(tile_sum(w, 4, 0, 0, tile_bits(f, 4, 0, 0)), 62.0);
  EXPECT_EQ(std::popcount(tile_bits(f, 4, 0, 0)), 8);
}

TEST(Transposable, GreedyFollowsLargestValuesOrderAndMayKeepSeven) {
  // Visiting order 16, 15, ... : (0,0) (0,1) (1,0) (2,1) (1,2) (2,2) fill columns 0-2, so
  // row 3 can only keep (3,3): 7 kept.
  const float w[16] = {16, 15, 1, 2,  //
                       14, 0.5f, 12, 3,  //
                       0.25f, 13, 11, 4,  //
                       5, 6, 7, 10};
  const auto g = cpu::transposable_mask_greedy(w, 4, 4);
  const std::vector<uint8_t> expect = {1, 1, 0, 0,  //
                                       1, 0, 1, 0,  //
                                       0, 1, 1, 0,  //
                                       0, 0, 0, 1};
  EXPECT_EQ(g, expect);
  // Here a full pattern reaches the same 91: (0,0) (0,1) (1,0) (1,2) (2,1) (2,3) (3,2) (3,3).
  const auto e = cpu::transposable_mask_exact(w, 4, 4);
  EXPECT_TRUE(counts_at_most(tile_bits(e, 4, 0, 0), 2, true));
  EXPECT_DOUBLE_EQ(tile_sum(w, 4, 0, 0, tile_bits(e, 4, 0, 0)), 91.0);
  EXPECT_DOUBLE_EQ(tile_sum(w, 4, 0, 0, tile_bits(g, 4, 0, 0)), 91.0);
  // Ties: all equal values are visited in row-major order.
  const float ones[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  // (0,0) (0,1) (1,0) (1,1) fill columns 0-1, rows 2-3 take columns 2-3.
  EXPECT_EQ(tile_bits(cpu::transposable_mask_greedy(ones, 4, 4), 4, 0, 0), 0xCC33u);
}

TEST(Transposable, RejectsShapesThatAreNotTiles) {
  std::vector<float> w(48);
  EXPECT_THROW(cpu::transposable_mask_greedy(w.data(), 4, 12 - 2), Error);
  EXPECT_THROW(cpu::transposable_mask_exact(w.data(), 6, 8), Error);
}

TEST(DoublePrune, BackwardIsColumn24SubsetOfForward) {
  uint64_t seed = 70;
  for (int trial = 0; trial < 6; ++trial, ++seed) {
    Rng shape_rng(seed);
    const int64_t rows = 4 * (1 + shape_rng.below(10)), cols = 4 * (1 + shape_rng.below(10));
    const auto w = trial % 2 ? tied(rows * cols, seed) : gaussian(rows * cols, seed);
    const auto dp = cpu::double_prune_masks(w.data(), rows, cols);
    EXPECT_EQ(dp.forward, cpu::nm_mask(w.data(), rows, cols, 2, 4));
    // W1 = W ⊙ forward; backward must be forward ∧ (column 2:4 of W1 ranking forward-kept first).
    for (int64_t c = 0; c < cols; ++c)
      for (int64_t r0 = 0; r0 < rows; r0 += 4) {
        std::vector<int> kept_fwd;
        for (int i = 0; i < 4; ++i)
          if (dp.forward[(r0 + i) * cols + c]) kept_fwd.push_back(i);
        int kept_bwd = 0;
        for (int i = 0; i < 4; ++i) {
          const int64_t e = (r0 + i) * cols + c;
          if (dp.backward[e]) {
            ++kept_bwd;
            EXPECT_TRUE(dp.forward[e]);
            // No forward-kept value it displaced has larger |w| (or equal with lower row).
            for (int j : kept_fwd)
              if (!dp.backward[(r0 + j) * cols + c]) {
                const float a = std::fabs(w[e]), b = std::fabs(w[(r0 + j) * cols + c]);
                EXPECT_TRUE(a > b || (a == b && i < j));
              }
          }
        }
        EXPECT_EQ(kept_bwd, std::min<int>(2, static_cast<int>(kept_fwd.size())));
      }
    // Refreshing the backward mask from the same forward mask gives the same result.
    EXPECT_EQ(cpu::double_prune_backward_mask(w.data(), dp.forward.data(), rows, cols), dp.backward);
  }
}

TEST(DoublePrune, ExpectedDensityIs13Over32) {
  // Over all 6^4 row-2:4 patterns of a 4×4 tile (equally likely for i.i.d. rows), the
  // column pruning keeps min(k, 2) of the k kept values of each column.
  const int pats[6] = {0x3, 0x5, 0x6, 0x9, 0xA, 0xC};
  int64_t total = 0;
  for (int a = 0; a < 6; ++a)
    for (int b = 0; b < 6; ++b)
      for (int c = 0; c < 6; ++c)
        for (int d = 0; d < 6; ++d) {
          const int rows[4] = {pats[a], pats[b], pats[c], pats[d]};
          for (int col = 0; col < 4; ++col) {
            int k = 0;
            for (int r = 0; r < 4; ++r) k += rows[r] >> col & 1;
            total += std::min(k, 2);
          }
        }
  EXPECT_EQ(total * 32, 13 * 1296 * 16);  // mean density 13/32 = 0.40625

  // Measured on a Gaussian 512×512 matrix. Per column group of 4 rows the kept count
  // min(K, 2), K ~ Binomial(4, 1/2), has mean 1.625 and variance 0.359; over 65536
  // groups the density's standard deviation is at most sqrt(0.359/65536)/4 = 5.9e-4
  // (rows sharing a column group are negatively correlated, which only lowers it), so
  // 3e-3 is a 5-sigma bound.
  const int64_t n = 512;
  const auto w = gaussian(n * n, 2024);
  const auto dp = cpu::double_prune_masks(w.data(), n, n);
  int64_t kept = 0, fwd = 0;
  for (size_t i = 0; i < dp.backward.size(); ++i) kept += dp.backward[i], fwd += dp.forward[i];
  EXPECT_EQ(fwd * 2, n * n);
  const double density = static_cast<double>(kept) / static_cast<double>(n * n);
  EXPECT_NEAR(density, 0.40625, 3e-3);
  std::printf("double-pruned density on Gaussian 512x512 (seed 2024): %.5f (expected 13/32 = 0.40625)\n", density);
}

TEST(ColumnNmMask, IsRowNmOfTheTranspose) {
  const int64_t rows = 24, cols = 10;
  const auto w = gaussian(rows * cols, 77);
  std::vector<float> wt(w.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) wt[c * rows + r] = w[r * cols + c];
  for (auto nm : {std::pair{2, 4}, std::pair{1, 8}, std::pair{5, 12}}) {
    if (rows % nm.second) continue;
    const auto colm = cpu::column_nm_mask(w.data(), rows, cols, nm.first, nm.second);
    const auto rowm = cpu::nm_mask(wt.data(), cols, rows, nm.first, nm.second);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) EXPECT_EQ(colm[r * cols + c], rowm[c * rows + r]);
  }
  EXPECT_THROW(cpu::column_nm_mask(w.data(), rows, cols, 2, 5), Error);
}

// E[sum of the 2 largest of 4 i.i.d. |z|] / E[sum of all 4], z ~ N(0, 1): the expected
// values of the order statistics of the half-normal, integrated numerically (0.744497).
constexpr double kRow24Gaussian = 0.744497;

TEST(MaskQuality, GaussianTable) {
  // The table of docs/sparsity-formats.md: three Gaussian 1024×1024 matrices, seeds 1-3.
  const int64_t n = 1024;
  std::printf("%-5s %-9s %-9s %-9s %-9s %-9s | %-8s %-8s %-8s %-8s %-8s\n", "seed", "row2:4", "t-greedy",
              "t-exact", "t-full", "dbl-prune", "d-row", "d-greedy", "d-exact", "d-full", "d-dbl");
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    const auto w = gaussian(n * n, seed);
    const auto q = cpu::mask_quality_report(w.data(), n, n);
    std::printf("%-5llu %-9.5f %-9.5f %-9.5f %-9.5f %-9.5f | %-8.5f %-8.5f %-8.5f %-8.5f %-8.5f\n",
                static_cast<unsigned long long>(seed), q.row_24, q.transposable_greedy, q.transposable_exact,
                q.transposable_exact_full, q.double_pruned, q.density_row_24, q.density_transposable_greedy,
                q.density_transposable_exact, q.density_transposable_exact_full, q.density_double_pruned);
    EXPECT_GE(q.row_24, q.transposable_exact);  // row 2:4 is the unconstrained optimum per row group
    EXPECT_GE(q.transposable_exact, q.transposable_greedy);
    EXPECT_GE(q.transposable_exact, q.transposable_exact_full);
    EXPECT_GT(q.transposable_greedy, q.double_pruned);
    EXPECT_EQ(q.density_row_24, 0.5);
    EXPECT_LE(q.density_transposable_exact, 0.5);
    EXPECT_GT(q.density_transposable_exact, 7.0 / 16.0);
    EXPECT_EQ(q.density_transposable_exact_full, 0.5);
    EXPECT_LE(q.density_transposable_greedy, 0.5);
    if (seed == 1) {
      // How often each tile-level relation holds (quoted in the docs).
      const auto g = cpu::transposable_mask_greedy(w.data(), n, n);
      const auto e = cpu::transposable_mask_exact(w.data(), n, n);
      const auto f = cpu::transposable_mask_exact_full(w.data(), n, n);
      int64_t tiles = 0, g_over_f = 0, g_short = 0, e_short = 0, g_eq_e = 0;
      for (int64_t tr = 0; tr < n; tr += 4)
        for (int64_t tc = 0; tc < n; tc += 4) {
          const uint32_t gb = tile_bits(g, n, tr, tc), eb = tile_bits(e, n, tr, tc), fb = tile_bits(f, n, tr, tc);
          ++tiles;
          g_over_f += tile_sum(w.data(), n, tr, tc, gb) > tile_sum(w.data(), n, tr, tc, fb);
          g_short += std::popcount(gb) < 8;
          e_short += std::popcount(eb) < 8;
          g_eq_e += gb == eb;
        }
      std::printf("seed 1 tiles: %lld; greedy keeps < 8: %lld; exact keeps 7: %lld; greedy == exact: %lld; "
                  "greedy > exact_full: %lld\n",
                  static_cast<long long>(tiles), static_cast<long long>(g_short), static_cast<long long>(e_short),
                  static_cast<long long>(g_eq_e), static_cast<long long>(g_over_f));
      EXPECT_GT(g_over_f, 0);
    }
    // Row 2:4 of a Gaussian keeps E[top 2 of 4 |z|] / E[Σ 4 |z|] of the magnitude.
    EXPECT_NEAR(q.row_24, kRow24Gaussian, 2e-3);
  }
}
