#include "sparse/transposable.h"

#include <algorithm>
#include <bit>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "sparse/double_prune.h"
#include "sparse/magnitude.h"

namespace esplag::cpu {

using sparse_detail::magnitude;
using sparse_detail::ranks_before;

namespace {

void check_tiles(const char* what, int64_t rows, int64_t cols) {
  ESPLAG_CHECK(rows >= 0 && cols >= 0 && rows % 4 == 0 && cols % 4 == 0, what,
               ": rows and cols must be multiples of 4 (4×4 tiles), got [", rows, ", ", cols, "]");
}

template <typename T>
void load_tile(const T* w, int64_t cols, int64_t tr, int64_t tc, double* mag) {
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < 4; ++c) mag[r * 4 + c] = magnitude(w[(tr + r) * cols + tc + c]);
}

void store_tile(uint8_t* mask, int64_t cols, int64_t tr, int64_t tc, uint32_t bits) {
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < 4; ++c) mask[(tr + r) * cols + tc + c] = (bits >> (r * 4 + c)) & 1u;
}

uint32_t greedy_tile(const double* mag) {
  int order[16];
  for (int i = 0; i < 16; ++i) order[i] = i;
  std::sort(order, order + 16, [&](int a, int b) { return ranks_before(mag[a], a, mag[b], b); });
  int row_count[4] = {0, 0, 0, 0}, col_count[4] = {0, 0, 0, 0};
  uint32_t bits = 0;
  for (int i : order) {
    const int r = i / 4, c = i % 4;
    if (row_count[r] < 2 && col_count[c] < 2) {
      ++row_count[r];
      ++col_count[c];
      bits |= 1u << i;
    }
  }
  return bits;
}

template <size_t K>
uint32_t best_pattern(const std::array<uint16_t, K>& patterns, const double* mag) {
  double best = -1.0;
  uint32_t best_bits = patterns[0];
  for (uint16_t p : patterns) {
    double s = 0.0;
    for (uint32_t b = p; b; b &= b - 1) s += mag[std::countr_zero(b)];
    if (s > best) best = s, best_bits = p;
  }
  return best_bits;
}

uint32_t exact_tile(const double* mag) { return best_pattern(transposable_tile_maximal_patterns(), mag); }
uint32_t exact_full_tile(const double* mag) { return best_pattern(transposable_tile_patterns(), mag); }

int row_count(uint32_t bits, int r) { return std::popcount((bits >> (4 * r)) & 0xFu); }
int col_count(uint32_t bits, int c) { return std::popcount((bits >> c) & 0x1111u); }

template <typename T, typename TileFn>
Mask tile_mask(const T* w, int64_t rows, int64_t cols, TileFn fn) {
  Mask mask(static_cast<size_t>(rows * cols));
  parallel_for(
      rows / 4,
      [&](int64_t t0, int64_t t1) {
        double mag[16];
        for (int64_t t = t0; t < t1; ++t)
          for (int64_t tc = 0; tc < cols; tc += 4) {
            load_tile(w, cols, t * 4, tc, mag);
            store_tile(mask.data(), cols, t * 4, tc, fn(mag));
          }
      },
      4);
  return mask;
}

double density(const Mask& m) {
  if (m.empty()) return 1.0;
  int64_t kept = 0;
  for (uint8_t b : m) kept += b != 0;
  return static_cast<double>(kept) / static_cast<double>(m.size());
}

}  // namespace

const std::array<uint16_t, 90>& transposable_tile_patterns() {
  static const std::array<uint16_t, 90> patterns = [] {
    std::array<uint16_t, 90> out{};
    const auto& maximal = transposable_tile_maximal_patterns();
    std::copy(maximal.begin(), maximal.begin() + 90, out.begin());
    return out;
  }();
  return patterns;
}

const std::array<uint16_t, 186>& transposable_tile_maximal_patterns() {
  static const std::array<uint16_t, 186> patterns = [] {
    std::vector<uint16_t> full, seven;
    for (uint32_t bits = 0; bits < (1u << 16); ++bits) {
      bool allowed = true, maximal = true;
      for (int i = 0; i < 4; ++i) allowed = allowed && row_count(bits, i) <= 2 && col_count(bits, i) <= 2;
      if (!allowed) continue;
      for (int i = 0; i < 16 && maximal; ++i)
        if (!(bits >> i & 1u) && row_count(bits, i / 4) < 2 && col_count(bits, i % 4) < 2) maximal = false;
      if (!maximal) continue;
      (std::popcount(bits) == 8 ? full : seven).push_back(static_cast<uint16_t>(bits));
    }
    ESPLAG_CHECK(full.size() == 90 && seven.size() == 96, "transposable_tile_maximal_patterns: found ", full.size(),
                 " full and ", seven.size(), " 7-kept patterns, expected 90 and 96");
    std::array<uint16_t, 186> out{};
    std::copy(full.begin(), full.end(), out.begin());
    std::copy(seven.begin(), seven.end(), out.begin() + 90);
    return out;
  }();
  return patterns;
}

template <typename T>
Mask transposable_mask_greedy(const T* w, int64_t rows, int64_t cols) {
  check_tiles("transposable_mask_greedy", rows, cols);
  return tile_mask(w, rows, cols, greedy_tile);
}

template <typename T>
Mask transposable_mask_exact(const T* w, int64_t rows, int64_t cols) {
  check_tiles("transposable_mask_exact", rows, cols);
  transposable_tile_maximal_patterns();  // built once, before the workers read it
  return tile_mask(w, rows, cols, exact_tile);
}

template <typename T>
Mask transposable_mask_exact_full(const T* w, int64_t rows, int64_t cols) {
  check_tiles("transposable_mask_exact_full", rows, cols);
  transposable_tile_patterns();
  return tile_mask(w, rows, cols, exact_full_tile);
}

template <typename T>
double kept_magnitude_fraction(const T* w, const uint8_t* mask, int64_t count) {
  double kept = 0.0, total = 0.0;
  for (int64_t i = 0; i < count; ++i) {
    const double a = std::fabs(static_cast<double>(w[i]));
    total += a;
    if (mask[i]) kept += a;
  }
  return total > 0.0 ? kept / total : 1.0;
}

template <typename T>
MaskQuality mask_quality_report(const T* w, int64_t rows, int64_t cols) {
  check_tiles("mask_quality_report", rows, cols);
  const int64_t n = rows * cols;
  MaskQuality q;
  const DoublePrunedMasks dp = double_prune_masks(w, rows, cols);
  const Mask greedy = transposable_mask_greedy(w, rows, cols);
  const Mask exact = transposable_mask_exact(w, rows, cols);
  const Mask exact_full = transposable_mask_exact_full(w, rows, cols);
  q.row_24 = kept_magnitude_fraction(w, dp.forward.data(), n);
  q.double_pruned = kept_magnitude_fraction(w, dp.backward.data(), n);
  q.transposable_greedy = kept_magnitude_fraction(w, greedy.data(), n);
  q.transposable_exact = kept_magnitude_fraction(w, exact.data(), n);
  q.transposable_exact_full = kept_magnitude_fraction(w, exact_full.data(), n);
  q.density_row_24 = density(dp.forward);
  q.density_double_pruned = density(dp.backward);
  q.density_transposable_greedy = density(greedy);
  q.density_transposable_exact = density(exact);
  q.density_transposable_exact_full = density(exact_full);
  return q;
}

#define ESPLAG_SPARSE_TRANSPOSABLE(T)                                          \
  template Mask transposable_mask_greedy<T>(const T*, int64_t, int64_t);       \
  template Mask transposable_mask_exact<T>(const T*, int64_t, int64_t);        \
  template Mask transposable_mask_exact_full<T>(const T*, int64_t, int64_t);   \
  template double kept_magnitude_fraction<T>(const T*, const uint8_t*, int64_t); \
  template MaskQuality mask_quality_report<T>(const T*, int64_t, int64_t);
ESPLAG_SPARSE_TRANSPOSABLE(float)
ESPLAG_SPARSE_TRANSPOSABLE(double)
#undef ESPLAG_SPARSE_TRANSPOSABLE

}  // namespace esplag::cpu
