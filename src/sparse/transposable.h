// Transposable 2:4 masks (CPU reference): within every 4×4 tile at most 2 values are
// kept in each row and in each column (exactly 2 for exact_full), so both W and Wᵀ are
// 2:4 along their reduction dimension and one mask serves the forward (x·Wᵀ) and the
// input-gradient (dY·W) GEMMs. rows and cols must be multiples of 4. Masks use the
// layout of sparse/masks.h (one byte per weight, 1 = kept).
#pragma once
#include <array>
#include <cstdint>

#include "sparse/masks.h"

namespace esplag::cpu {

// Per tile, the 16 values are visited by |w| descending (ties: lower row-major index
// inside the tile) and each is kept if its row and its column still hold fewer than 2
// kept values: the rule of PyTorch/xformers' LargestValuesGreedy. May keep fewer than 8.
template <typename T>
Mask transposable_mask_greedy(const T* w, int64_t rows, int64_t cols);

// The exact optimum: per tile, the mask with at most 2 kept per row and per column that
// maximises Σ|w| over kept values (sums in double). The search runs over the 186 maximal
// such masks (transposable_tile_maximal_patterns(): the 90 with exactly 2 per row and
// column, then the 96 with 7 kept, where one row and one column keep a single value
// that they share), since every allowed mask is a subset of one of them. Ties: the first
// in that order, so a full pattern wins over a 7-kept one of equal magnitude. Never keeps
// less magnitude than the greedy mask on any tile; keeps 7 in a tile where that is best.
template <typename T>
Mask transposable_mask_exact(const T* w, int64_t rows, int64_t cols);

// The best of the 90 patterns with exactly 2 kept per row and per column (always 50%
// dense; ties: first in transposable_tile_patterns() order). Forcing the 8th value can
// cost magnitude: on some tiles the greedy mask keeps more (docs/sparsity-formats.md).
template <typename T>
Mask transposable_mask_exact_full(const T* w, int64_t rows, int64_t cols);

// The 90 4×4 0/1 matrices with every row and column sum 2, bit (4·r + c) = element
// (r, c), in increasing numeric order.
const std::array<uint16_t, 90>& transposable_tile_patterns();
// The 186 maximal masks with row and column sums at most 2: the 90 above, then the 96
// with 7 kept, each group in increasing numeric order.
const std::array<uint16_t, 186>& transposable_tile_maximal_patterns();

// Σ_{kept} |w| / Σ |w| (1 when Σ |w| is 0), accumulated in double.
template <typename T>
double kept_magnitude_fraction(const T* w, const uint8_t* mask, int64_t count);

// Kept-magnitude fraction and density of the masks a method uses for its forward weight
// (and, for SLoPe, the backward copy) on one matrix.
struct MaskQuality {
  double row_24 = 0;                 // row-wise 2:4 (along cols)
  double transposable_greedy = 0;
  double transposable_exact = 0;       // optimum with at most 2 per row and column
  double transposable_exact_full = 0;  // optimum with exactly 2 per row and column
  double double_pruned = 0;          // SLoPe backward copy: row 2:4 then column 2:4
  double density_row_24 = 0;
  double density_transposable_greedy = 0;
  double density_transposable_exact = 0;
  double density_transposable_exact_full = 0;
  double density_double_pruned = 0;
};

template <typename T>
MaskQuality mask_quality_report(const T* w, int64_t rows, int64_t cols);

}  // namespace esplag::cpu
