#include "sparse/double_prune.h"

#include <functional>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "sparse/magnitude.h"

namespace esplag::cpu {

using sparse_detail::magnitude;
using sparse_detail::ranks_before;

namespace {

// Column-wise n:m with a per-value rank key; key < 0 marks values that may never be kept.
Mask column_top(int64_t rows, int64_t cols, int n, int m, const std::function<double(int64_t)>& key) {
  Mask mask(static_cast<size_t>(rows * cols), 0);
  parallel_for(
      rows / m,
      [&](int64_t g0, int64_t g1) {
        double mag[SparsityPattern::kMaxM];
        for (int64_t g = g0; g < g1; ++g)
          for (int64_t c = 0; c < cols; ++c) {
            const int64_t r0 = g * m;
            for (int i = 0; i < m; ++i) mag[i] = key((r0 + i) * cols + c);
            for (int kept = 0; kept < n; ++kept) {
              int best = -1;
              for (int i = 0; i < m; ++i) {
                if (mag[i] < 0 || mask[(r0 + i) * cols + c]) continue;
                if (best < 0 || ranks_before(mag[i], i, mag[best], best)) best = i;
              }
              if (best < 0) break;
              mask[(r0 + best) * cols + c] = 1;
            }
          }
      },
      4);
  return mask;
}

}  // namespace

template <typename T>
Mask column_nm_mask(const T* w, int64_t rows, int64_t cols, int n, int m) {
  ESPLAG_CHECK(n > 0 && n < m && m <= SparsityPattern::kMaxM, "column_nm_mask: need 0 < N < M <= 16, got ", n, ":",
               m);
  ESPLAG_CHECK(rows >= 0 && cols >= 0 && rows % m == 0, "column_nm_mask: rows (", rows,
               ") is not a multiple of M = ", m);
  return column_top(rows, cols, n, m, [&](int64_t i) { return magnitude(w[i]); });
}

template <typename T>
Mask double_prune_backward_mask(const T* w, const uint8_t* forward, int64_t rows, int64_t cols) {
  ESPLAG_CHECK(rows >= 0 && cols >= 0 && rows % 4 == 0 && cols % 4 == 0,
               "double_prune_backward_mask: rows and cols must be multiples of 4, got [", rows, ", ", cols, "]");
  return column_top(rows, cols, 2, 4, [&](int64_t i) { return forward[i] ? magnitude(w[i]) : -1.0; });
}

template <typename T>
DoublePrunedMasks double_prune_masks(const T* w, int64_t rows, int64_t cols) {
  ESPLAG_CHECK(rows >= 0 && cols >= 0 && rows % 4 == 0 && cols % 4 == 0,
               "double_prune_masks: rows and cols must be multiples of 4, got [", rows, ", ", cols, "]");
  DoublePrunedMasks out;
  out.forward = nm_mask(w, rows, cols, 2, 4);
  out.backward = double_prune_backward_mask(w, out.forward.data(), rows, cols);
  return out;
}

#define ESPLAG_SPARSE_DOUBLE_PRUNE(T)                                                        \
  template DoublePrunedMasks double_prune_masks<T>(const T*, int64_t, int64_t);              \
  template Mask double_prune_backward_mask<T>(const T*, const uint8_t*, int64_t, int64_t);   \
  template Mask column_nm_mask<T>(const T*, int64_t, int64_t, int, int);
ESPLAG_SPARSE_DOUBLE_PRUNE(float)
ESPLAG_SPARSE_DOUBLE_PRUNE(double)
#undef ESPLAG_SPARSE_DOUBLE_PRUNE

}  // namespace esplag::cpu
