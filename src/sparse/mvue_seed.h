// The seed sequence of a layer's MVUE draws (sparse dW: the weight gradient from the MVUE
// 2:4 of dYᵀ, sparse/mvue.h). One definition for the CPU reference (model/linear_semi_sparse.h,
// model/linear_slope.h) and the GPU layer (sparse/cuda/sparse_linear.h), so that the two
// draw the same kept positions for the same base seed and draw number.
#pragma once
#include <cstdint>

#include "sparse/mvue.h"

namespace esplag {

// The seed of draw number `draw` (0-based) of a layer whose base seed is `base`:
// splitmix64's finaliser of (finaliser(base) + draw), so that consecutive draws and layers
// with different bases get unrelated uniforms (mvue_uniform24 mixes the seed with each
// group's index).
ESPLAG_SPARSE_HD uint64_t mvue_draw_seed(uint64_t base, uint64_t draw) {
  return sparse_detail::mvue_mix(sparse_detail::mvue_mix(base) + draw);
}

}  // namespace esplag
