#include "sparse/masks.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <numeric>

#include "core/error.h"
#include "core/parallel.h"
#include "sparse/magnitude.h"

namespace esplag::cpu {

using sparse_detail::magnitude;
using sparse_detail::ranks_before;

namespace {

// Marks in keep[0..m) the n best-ranked of mag[0..m) (m <= 16), by insertion into a
// sorted top-n list: the rank order is total, so the result is unique.
void keep_top(const double* mag, int m, int n, uint8_t* keep) {
  std::array<int, SparsityPattern::kMaxM> top{};
  int count = 0;
  for (int i = 0; i < m; ++i) {
    int pos = count;
    while (pos > 0 && ranks_before(mag[i], i, mag[top[pos - 1]], top[pos - 1])) --pos;
    if (pos >= n) continue;
    const int last = std::min(count, n - 1);
    for (int j = last; j > pos; --j) top[j] = top[j - 1];
    top[pos] = i;
    count = std::min(count + 1, n);
  }
  for (int i = 0; i < m; ++i) keep[i] = 0;
  for (int j = 0; j < count; ++j) keep[top[j]] = 1;
}

template <typename T>
bool nonzero(T x) {
  return x != T(0);  // NaN counts as a non-zero
}

}  // namespace

template <typename T>
Mask nm_mask(const T* w, int64_t rows, int64_t cols, int n, int m) {
  ESPLAG_CHECK(n > 0 && n < m && m <= SparsityPattern::kMaxM, "nm_mask: need 0 < N < M <= 16, got ", n, ":", m);
  ESPLAG_CHECK(rows >= 0 && cols >= 0 && cols % m == 0, "nm_mask: cols (", cols, ") is not a multiple of M = ", m);
  Mask mask(static_cast<size_t>(rows * cols));
  parallel_for(
      rows,
      [&](int64_t r0, int64_t r1) {
        double mag[SparsityPattern::kMaxM];
        for (int64_t r = r0; r < r1; ++r)
          for (int64_t g = 0; g < cols; g += m) {
            const T* src = w + r * cols + g;
            for (int i = 0; i < m; ++i) mag[i] = magnitude(src[i]);
            keep_top(mag, m, n, mask.data() + r * cols + g);
          }
      },
      16);
  return mask;
}

template <typename T>
Mask unstructured_mask(const T* w, int64_t count, double sparsity) {
  ESPLAG_CHECK(std::isfinite(sparsity) && sparsity >= 0.0 && sparsity <= 1.0,
               "unstructured_mask: sparsity must be in [0, 1], got ", sparsity);
  ESPLAG_CHECK(count >= 0, "unstructured_mask: negative count ", count);
  const int64_t keep = std::llround((1.0 - sparsity) * static_cast<double>(count));
  Mask mask(static_cast<size_t>(count), 0);
  if (keep == 0) return mask;
  if (keep >= count) {
    std::fill(mask.begin(), mask.end(), 1);
    return mask;
  }
  // The keep-th largest magnitude is the threshold: everything above it is kept, and of
  // the values equal to it the lowest indices fill the remaining slots. nth_element on one
  // copy of the magnitudes (in T: |x| is exact) needs no index array.
  std::vector<T> sorted(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) sorted[i] = static_cast<T>(magnitude(w[i]));
  std::nth_element(sorted.begin(), sorted.begin() + (keep - 1), sorted.end(), std::greater<T>());
  const double threshold = sorted[keep - 1];
  std::vector<T>().swap(sorted);
  int64_t kept = 0;
  for (int64_t i = 0; i < count; ++i)
    if (magnitude(w[i]) > threshold) mask[i] = 1, ++kept;
  for (int64_t i = 0; i < count && kept < keep; ++i)
    if (magnitude(w[i]) == threshold) mask[i] = 1, ++kept;
  return mask;
}

template <typename T>
Mask vnm_mask(const T* w, int64_t rows, int64_t cols, int v, int m) {
  constexpr int kSel = SparsityPattern::kVnmSelected;
  ESPLAG_CHECK(v > 0 && m >= kSel && m <= SparsityPattern::kMaxM, "vnm_mask: need V > 0 and 4 <= M <= 16, got V = ",
               v, ", M = ", m);
  ESPLAG_CHECK(rows >= 0 && rows % v == 0, "vnm_mask: rows (", rows, ") is not a multiple of V = ", v);
  ESPLAG_CHECK(cols >= 0 && cols % m == 0, "vnm_mask: cols (", cols, ") is not a multiple of M = ", m);
  Mask mask(static_cast<size_t>(rows * cols), 0);
  const int64_t row_blocks = rows / v;
  parallel_for(row_blocks, [&](int64_t b0, int64_t b1) {
    double sum[SparsityPattern::kMaxM];
    uint8_t sel[SparsityPattern::kMaxM];
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t g = 0; g < cols; g += m) {
        // Column sums in double, added row by row in order: deterministic and, for float
        // weights, exact enough that near-ties are decided by the true sums.
        std::fill(sum, sum + m, 0.0);
        for (int64_t r = b * v; r < (b + 1) * v; ++r)
          for (int j = 0; j < m; ++j) sum[j] += magnitude(w[r * cols + g + j]);
        keep_top(sum, m, kSel, sel);
        int cols4[kSel];
        for (int j = 0, k = 0; j < m; ++j)
          if (sel[j]) cols4[k++] = j;
        for (int64_t r = b * v; r < (b + 1) * v; ++r) {
          double mag4[kSel];
          uint8_t keep4[kSel];
          for (int k = 0; k < kSel; ++k) mag4[k] = magnitude(w[r * cols + g + cols4[k]]);
          keep_top(mag4, kSel, SparsityPattern::kVnmN, keep4);
          for (int k = 0; k < kSel; ++k) mask[r * cols + g + cols4[k]] = keep4[k];
        }
      }
  });
  return mask;
}

template <typename T>
Mask make_mask(const T* w, int64_t rows, int64_t cols, const SparsityPattern& p, const std::string& tensor_name) {
  check_divisible(p, rows, cols, tensor_name);
  switch (p.kind) {
    case SparsityPattern::Kind::dense: return Mask(static_cast<size_t>(rows * cols), 1);
    case SparsityPattern::Kind::unstructured: return unstructured_mask(w, rows * cols, p.sparsity);
    case SparsityPattern::Kind::nm: return nm_mask(w, rows, cols, p.n, p.m);
    case SparsityPattern::Kind::vnm: return vnm_mask(w, rows, cols, p.v, p.m);
  }
  fail("make_mask: unknown pattern kind for tensor '", tensor_name, "'");
}

template <typename T>
void apply_mask(T* w, const uint8_t* mask, int64_t count) {
  for (int64_t i = 0; i < count; ++i)
    if (!mask[i]) w[i] = T(0);
}

template <typename T>
PatternCheck check_pattern(const T* w, int64_t rows, int64_t cols, const SparsityPattern& p) {
  PatternCheck res;
  res.total = rows * cols;
  for (int64_t i = 0; i < res.total; ++i) res.nonzeros += nonzero(w[i]);
  res.density = res.total ? static_cast<double>(res.nonzeros) / static_cast<double>(res.total) : 1.0;
  const auto broken = [&](const std::string& why) {
    if (res.violations++ == 0) res.detail = why;
    res.ok = false;
  };
  switch (p.kind) {
    case SparsityPattern::Kind::dense: break;
    case SparsityPattern::Kind::unstructured: {
      const int64_t allowed = std::llround((1.0 - p.sparsity) * static_cast<double>(res.total));
      if (res.nonzeros > allowed)
        broken(detail::concat(res.nonzeros, " non-zeros of ", res.total, ", at most ", allowed, " allowed at sparsity ",
                              p.sparsity));
      break;
    }
    case SparsityPattern::Kind::nm: {
      if (cols % p.m != 0) {
        broken(detail::concat("cols (", cols, ") is not a multiple of M = ", p.m));
        break;
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < cols; g += p.m) {
          int count = 0;
          for (int j = 0; j < p.m; ++j) count += nonzero(w[r * cols + g + j]);
          if (count > p.n)
            broken(detail::concat("row ", r, " columns ", g, "..", g + p.m - 1, " hold ", count,
                                  " non-zeros, at most ", p.n, " allowed"));
        }
      break;
    }
    case SparsityPattern::Kind::vnm: {
      if (cols % p.m != 0 || rows % p.v != 0) {
        broken(detail::concat("shape [", rows, ", ", cols, "] is not a multiple of [V, M] = [", p.v, ", ", p.m, "]"));
        break;
      }
      for (int64_t r0 = 0; r0 < rows; r0 += p.v)
        for (int64_t g = 0; g < cols; g += p.m) {
          uint32_t used = 0;  // columns of the block holding a non-zero
          int64_t bad_row = -1;
          int bad_count = 0;
          for (int64_t r = r0; r < r0 + p.v; ++r) {
            int count = 0;
            for (int j = 0; j < p.m; ++j)
              if (nonzero(w[r * cols + g + j])) used |= 1u << j, ++count;
            if (count > SparsityPattern::kVnmN && bad_row < 0) bad_row = r, bad_count = count;
          }
          const int ncols = std::popcount(used);
          if (bad_row >= 0)
            broken(detail::concat("block rows ", r0, "..", r0 + p.v - 1, " columns ", g, "..", g + p.m - 1, ": row ",
                                  bad_row, " holds ", bad_count, " non-zeros, at most 2 allowed"));
          else if (ncols > SparsityPattern::kVnmSelected)
            broken(detail::concat("block rows ", r0, "..", r0 + p.v - 1, " columns ", g, "..", g + p.m - 1,
                                  ": non-zeros in ", ncols, " columns, at most 4 allowed"));
        }
      break;
    }
  }
  return res;
}

namespace {
void check_tile_shape(const char* what, int64_t rows, int64_t cols) {
  ESPLAG_CHECK(rows >= 0 && cols >= 0 && rows % 4 == 0 && cols % 4 == 0, what, ": a ", rows, "x", cols,
               " mask does not tile into 4x4 tiles");
}
}  // namespace

std::vector<uint16_t> tile_bits(const Mask& mask, int64_t rows, int64_t cols) {
  check_tile_shape("tile_bits", rows, cols);
  ESPLAG_CHECK(int64_t(mask.size()) == rows * cols, "tile_bits: the mask holds ", mask.size(), " values, not ",
               rows, "x", cols);
  std::vector<uint16_t> t(static_cast<size_t>(rows / 4 * (cols / 4)), 0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      if (mask[r * cols + c]) t[(r / 4) * (cols / 4) + c / 4] |= uint16_t(1u << (4 * (r % 4) + c % 4));
  return t;
}

Mask mask_from_tile_bits(const std::vector<uint16_t>& bits, int64_t rows, int64_t cols) {
  check_tile_shape("mask_from_tile_bits", rows, cols);
  ESPLAG_CHECK(int64_t(bits.size()) == rows / 4 * (cols / 4), "mask_from_tile_bits: ", bits.size(),
               " tiles for a ", rows, "x", cols, " mask");
  Mask m(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      m[r * cols + c] = (bits[(r / 4) * (cols / 4) + c / 4] >> (4 * (r % 4) + c % 4)) & 1u;
  return m;
}

#define ESPLAG_SPARSE_MASKS(T)                                                                              \
  template Mask nm_mask<T>(const T*, int64_t, int64_t, int, int);                                          \
  template Mask unstructured_mask<T>(const T*, int64_t, double);                                           \
  template Mask vnm_mask<T>(const T*, int64_t, int64_t, int, int);                                         \
  template Mask make_mask<T>(const T*, int64_t, int64_t, const SparsityPattern&, const std::string&);      \
  template void apply_mask<T>(T*, const uint8_t*, int64_t);
ESPLAG_SPARSE_MASKS(float)
ESPLAG_SPARSE_MASKS(double)
#undef ESPLAG_SPARSE_MASKS

template PatternCheck check_pattern<float>(const float*, int64_t, int64_t, const SparsityPattern&);
template PatternCheck check_pattern<double>(const double*, int64_t, int64_t, const SparsityPattern&);
template PatternCheck check_pattern<uint8_t>(const uint8_t*, int64_t, int64_t, const SparsityPattern&);

}  // namespace esplag::cpu
