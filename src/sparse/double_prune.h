// SLoPe double pruning (CPU reference). The forward weight W1 is W pruned row-wise 2:4
// (along cols, the reduction dimension of x·Wᵀ). The input-gradient GEMM dX = dY·W1
// reduces over rows, so its sparse operand W1ᵀ must be 2:4 along rows: W1 is pruned
// again, 2:4 in every group of 4 consecutive rows of each column. The backward copy keeps
// min(k, 2) of the k forward-kept values of each such group; for independent rows this
// is 13/32 = 40.625% of all values on average instead of 50%.
#pragma once
#include <cstdint>

#include "sparse/masks.h"

namespace esplag::cpu {

struct DoublePrunedMasks {
  Mask forward;   // row-wise 2:4 of W, layout [rows, cols]
  Mask backward;  // subset of `forward`, also 2:4 along rows in every column; layout [rows, cols]
};

// rows and cols must be multiples of 4.
template <typename T>
DoublePrunedMasks double_prune_masks(const T* w, int64_t rows, int64_t cols);

// The backward mask for a given forward mask (the periodic refresh of SLoPe): in every
// column, of each group of 4 consecutive rows keep the 2 forward-kept values of largest
// |w| (ties: lower row). Values the forward mask prunes are never kept.
template <typename T>
Mask double_prune_backward_mask(const T* w, const uint8_t* forward, int64_t rows, int64_t cols);

// N:M along rows: in every column, of each group of m consecutive rows keep the n largest
// |w| (ties: lower row). Requires rows % m == 0.
template <typename T>
Mask column_nm_mask(const T* w, int64_t rows, int64_t cols, int n, int m);

}  // namespace esplag::cpu
