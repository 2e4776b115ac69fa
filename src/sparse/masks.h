// Magnitude masks for the sparsity patterns of sparse/pattern.h (CPU reference).
//
// Weights are row-major [rows, cols]; structured groups run along cols (the reduction
// dimension K). A mask is one byte per weight, 1 = kept, 0 = pruned, same layout as the
// weight. Every mask ranks by |w| with ties broken by the lower index (within the group,
// or within the flattened tensor for unstructured) and NaN ranked as +inf, so masks are
// deterministic and identical on every thread count. Implemented for float and double.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "sparse/pattern.h"

namespace esplag::cpu {

using Mask = std::vector<uint8_t>;

// Keeps the n largest |w| of every group of m consecutive columns of each row.
// Requires 0 < n < m and cols % m == 0.
template <typename T>
Mask nm_mask(const T* w, int64_t rows, int64_t cols, int n, int m);

// Keeps exactly llround((1 - sparsity) * count) values, the largest |w|.
template <typename T>
Mask unstructured_mask(const T* w, int64_t count, double sparsity);

// VENOM V:2:M. For every block of v rows × m columns the 4 columns with the largest
// Σ_rows |w| are selected (ties: lower column), then every row of the block keeps its 2
// largest |w| among those 4 columns (2:4). Requires rows % v == 0, cols % m == 0, m >= 4.
template <typename T>
Mask vnm_mask(const T* w, int64_t rows, int64_t cols, int v, int m);

// The mask of `pattern` (dense: all ones). Throws naming `tensor_name` on bad shapes.
template <typename T>
Mask make_mask(const T* w, int64_t rows, int64_t cols, const SparsityPattern& pattern,
               const std::string& tensor_name = "weight");

// w[i] = 0 where mask[i] == 0 (in place).
template <typename T>
void apply_mask(T* w, const uint8_t* mask, int64_t count);

// A mask [rows, cols] as 4×4 tile bits, the form the GPU's 2:4 kernels take and give
// (sparse/cuda/sparsify.h): [rows/4, cols/4] uint16, bit 4·r + c = element (r, c) of the
// tile, 1 = kept. rows and cols must be multiples of 4 (else Error).
std::vector<uint16_t> tile_bits(const Mask& mask, int64_t rows, int64_t cols);
// The inverse; `bits` must hold [rows/4, cols/4] tiles (else Error).
Mask mask_from_tile_bits(const std::vector<uint16_t>& bits, int64_t rows, int64_t cols);

// Whether the non-zeros of a dense tensor fit a pattern (used by `esplag sparsity`).
struct PatternCheck {
  bool ok = true;
  int64_t total = 0;       // rows * cols
  int64_t nonzeros = 0;
  double density = 0.0;    // nonzeros / total (1 for an empty tensor)
  // Groups (N:M) or blocks (V:N:M) that break the pattern; for unstructured or a shape
  // that does not divide, 1 when broken.
  int64_t violations = 0;
  std::string detail;      // the first violation in words; empty when ok
};

// N:M: every group has at most n non-zeros. V:N:M: in every block the non-zeros lie in at
// most 4 columns and every row has at most 2. Unstructured: nonzeros <= llround((1-s)·total).
// Dense: always ok. A shape the pattern does not divide is reported, not thrown.
// Also instantiated for uint8_t, so that a Mask can be checked directly.
template <typename T>
PatternCheck check_pattern(const T* w, int64_t rows, int64_t cols, const SparsityPattern& pattern);

}  // namespace esplag::cpu
