// Runtime 2:4 sparsification on the GPU (namespace esplag::gpu): the CUDA counterparts of
// the CPU masks of sparse/transposable.h, sparse/masks.h (2:4), sparse/double_prune.h and
// sparse/mvue.h, on bf16 tensors, producing the pruned tensor and/or its compressed form
// in one pass. Each kernel agrees with its CPU reference bit for bit: same ranking (|x|,
// NaN as +inf, ties by lower index), same greedy order, same sampling.
//
// Outputs. A Sparse24Out names where one 2:4 result goes; every pointer may be null (that
// form is not written):
//   dense   [rows, cols] bf16: kept values in place, the others 0 ("dense with zeros");
//   values  [rows, cols/2] bf16 and
//   meta    [rows, ceil(cols/16)] uint16: the compressed 2:4 of sparse/compressed.h
//           (Compressed24T): per group of 4 the two stored positions, ascending, as one
//           nibble; nibbles past the last group of a row are 0. The stored positions are
//           the kept ones, padded with the lowest positions not kept when a group keeps
//           fewer than two (the transposable greedy can), whose stored value is 0: what
//           model/linear_kinds.h's compress_24_masked builds from the same mask, so the
//           metadata is the mask.
// A "transposed" Sparse24Out receives the same for the transposed tensor, [cols, rows].
// Tile masks ([rows/4, cols/4] uint16, bit 4·r + c = element (r, c) of the 4×4 tile, 1 =
// kept, in the orientation of the input) may be null too.
//
// Requirements (each violated one throws esplag::Error naming the function and the
// shape): the shapes below; the input and dense outputs 8-byte aligned, values 4-byte,
// meta and masks 2-byte (a DeviceArena gives 256). Outputs must not overlap each other or
// the input, except that a `dense` output of the input's orientation may be the input
// itself (pruning in place). Launches are asynchronous on `stream` and checked.
//
// Only for the CUDA build (ESPLAG_CUDA=ON).
#pragma once

#ifndef ESPLAG_HAVE_CUDA
#error "sparse/cuda/sparsify.h is only available in the CUDA build (configure with -DESPLAG_CUDA=ON)"
#endif

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace esplag::gpu {

using bf16 = __nv_bfloat16;

struct Sparse24Out {
  bf16* dense = nullptr;
  bf16* values = nullptr;
  uint16_t* meta = nullptr;
  bool any() const { return dense || values || meta; }
};

// semi_sparse: the transposable greedy 2:4 of W [rows, cols] (cpu::transposable_mask_greedy:
// per 4×4 tile, values by |w| descending, each kept while its row and its column hold fewer
// than 2), written as W pruned (`out`, [rows, cols]) and Wᵀ pruned (`out_t`, [cols, rows]),
// both 2:4 along their rows. rows and cols must be multiples of 4.
void transposable_24(const bf16* w, int64_t rows, int64_t cols, const Sparse24Out& out, const Sparse24Out& out_t,
                     uint16_t* tile_mask, cudaStream_t stream);

// slope: the double pruning of cpu::double_prune_masks. W1 = W pruned row-wise 2:4
// (`forward`, [rows, cols]); W2 = W1 pruned again 2:4 down every column (groups of 4 rows),
// written transposed (`backward_t` = W2ᵀ, [cols, rows], 2:4 along its rows: the operand of
// the input-gradient GEMM). Tile masks of both (in W's orientation) optional. rows and cols
// must be multiples of 4.
void double_prune_24(const bf16* w, int64_t rows, int64_t cols, const Sparse24Out& forward,
                     const Sparse24Out& backward_t, uint16_t* forward_tile_mask, uint16_t* backward_tile_mask,
                     cudaStream_t stream);

// semi_sparse_activation, row_24: the two largest |x| of every 4 consecutive features of
// each row of X [N, C] (cpu::nm_mask(x, N, C, 2, 4)). C must be a multiple of 4; any N.
void activation_24_rows(const bf16* x, int64_t N, int64_t C, const Sparse24Out& out, cudaStream_t stream);

// semi_sparse_activation, tile_24: the transposable greedy mask over 4×4 tiles of X [N, C]
// with the tokens padded by zero rows to N4 = ceil(N/4)·4, as SemiSparseActivationLinear
// does (model/linear_semi_sparse.h). `out` is [N, C]; `out_t` is Xsᵀ [C, N4] (the padded
// columns hold 0), 2:4 along the tokens for the weight-gradient GEMM. C must be a multiple
// of 4; any N.
void activation_24_tiles(const bf16* x, int64_t N, int64_t C, const Sparse24Out& out, const Sparse24Out& out_t,
                         cudaStream_t stream);

// The MVUE 2:4 of a gradient G [rows, cols] for `seed` (cpu::mvue_24_bf16, sparse/mvue.h):
// unbiased, deterministic for a seed. cols must be a multiple of 4; any rows.
void mvue_24(const bf16* g, int64_t rows, int64_t cols, uint64_t seed, const Sparse24Out& out, cudaStream_t stream);

}  // namespace esplag::gpu
