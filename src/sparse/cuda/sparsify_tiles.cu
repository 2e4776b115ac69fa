// The 4×4-tile 2:4 kernels: transposable greedy (semi_sparse weights and tile_24
// activations) and SLoPe's double pruning. One thread per tile, 16×16 tiles (64×64
// values) per block of 256 threads:
//   - each thread reads its tile as four 8-byte rows; the 16 threads of a half-warp cover
//     128 contiguous bytes of a row, so loads and the outputs of the input's orientation
//     (dense 8-byte rows, 4-byte compressed pairs, metadata words) are coalesced;
//   - a metadata word holds the nibbles of 4 adjacent tiles, gathered with three shuffles;
//   - the transposed outputs are staged: every thread writes its pruned, transposed tile
//     into a 64×64 shared block, then takes the tile at its own (row, col) of that block,
//     so the transposed rows are written as contiguously as the others.
#include <cuda_runtime.h>

#include <cstdint>

#include "core/cuda_check.h"
#include "sparse/cuda/sparsify.h"
#include "sparse/cuda/sparsify_device.h"

namespace esplag::gpu {

namespace {

using namespace sparsify_detail;

constexpr int kBlockTiles = 16;                  // tiles per block side: 64×64 values
constexpr int kTileThreads = kBlockTiles * kBlockTiles;
constexpr int kStageStride = 4 * kBlockTiles + 4;  // bf16 per staged row: padding spreads banks, keeps 8-byte rows

enum class TileRule { greedy, double_prune };

struct TileArgs {
  const uint16_t* in = nullptr;
  int64_t rows = 0;       // multiple of 4 (the padded token count for activations)
  int64_t real_rows = 0;  // rows held in memory; rows past it read as 0 and are not written
  int64_t cols = 0;
  Sparse24Out a;  // input orientation, [real_rows, cols]
  Sparse24Out b;  // transposed, [cols, rows]
  uint16_t* mask_a = nullptr;  // [rows/4, cols/4]
  uint16_t* mask_b = nullptr;
};

// Writes one pruned tile (p: pruned values, keep: kept bits) at tile (tile_row, tile_col)
// of an output [out_rows, out_cols] (out_cols a multiple of 4). Every thread of the warp
// must call it (the metadata word is gathered by shuffles); row_ok / col_ok say whether
// this thread's tile exists.
__device__ __forceinline__ void emit_tile(const PackedTile& p, uint32_t keep, int64_t tile_row, int64_t tile_col,
                                          bool row_ok, bool col_ok, int64_t out_rows, int64_t out_cols,
                                          const Sparse24Out& o) {
  const bool ok = row_ok && col_ok;
  const int64_t r0 = 4 * tile_row;
  uint16_t* dense = o.dense ? reinterpret_cast<uint16_t*>(o.dense) + r0 * out_cols + 4 * tile_col : nullptr;
  uint16_t* values = o.values ? reinterpret_cast<uint16_t*>(o.values) + r0 * (out_cols / 2) + 2 * tile_col : nullptr;
  uint32_t nibbles = 0;  // row r's metadata nibble at bits 4r
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const uint32_t nib = slot_nibble((keep >> (4 * r)) & 15u);
    nibbles |= nib << (4 * r);
    if (ok && r0 + r < out_rows) {
      if (dense) *reinterpret_cast<uint64_t*>(dense + r * out_cols) = uint64_t(p.hi[r]) << 32 | p.lo[r];
      if (values) *reinterpret_cast<uint32_t*>(values + r * (out_cols / 2)) = slot_values(p.lo[r], p.hi[r], nib);
    }
  }
  if (o.meta) {
    // The 4 tiles of a metadata word are lanes l, l^1, l^2, l^3 (tile_col & 3 = lane & 3);
    // the lane of quarter q writes row q's word.
    const uint32_t mine = ok ? nibbles : 0u;
    const uint32_t a[4] = {mine, __shfl_xor_sync(0xffffffffu, mine, 1), __shfl_xor_sync(0xffffffffu, mine, 2),
                           __shfl_xor_sync(0xffffffffu, mine, 3)};
    const uint32_t q = static_cast<uint32_t>(tile_col & 3);
    const int64_t row = r0 + q, stride = (out_cols / 4 + 3) / 4;
    if (row_ok && (tile_col & ~int64_t(3)) < out_cols / 4 && row < out_rows)
      o.meta[row * stride + tile_col / 4] = static_cast<uint16_t>(gather_meta_word(q, a));
  }
}

// Register caps that keep 4 blocks (1024 threads) per SM.
template <TileRule Rule>
__global__ void __launch_bounds__(kTileThreads, 4) tile_sparsify_kernel(TileArgs p) {
  const int tx = threadIdx.x % kBlockTiles, ty = threadIdx.x / kBlockTiles;
  const int64_t tile_rows = p.rows / 4, tile_cols = p.cols / 4;
  const int64_t tr = int64_t(blockIdx.y) * kBlockTiles + ty, tc = int64_t(blockIdx.x) * kBlockTiles + tx;
  const bool row_ok = tr < tile_rows, col_ok = tc < tile_cols;

  PackedTile t;
  const uint16_t* src = p.in + 4 * tr * p.cols + 4 * tc;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    uint2 x = make_uint2(0u, 0u);
    if (row_ok && col_ok && 4 * tr + r < p.real_rows) x = *reinterpret_cast<const uint2*>(src + r * p.cols);
    t.lo[r] = x.x;
    t.hi[r] = x.y;
  }

  uint32_t keep_a, keep_b;
  if constexpr (Rule == TileRule::greedy) {
    keep_a = keep_b = greedy_mask(t);
  } else {
    keep_a = rows_top2_mask(t);
    keep_b = columns_top2_mask(t, keep_a);
  }
  if (row_ok && col_ok) {
    if (p.mask_a) p.mask_a[tr * tile_cols + tc] = static_cast<uint16_t>(keep_a);
    if (p.mask_b) p.mask_b[tr * tile_cols + tc] = static_cast<uint16_t>(keep_b);
  }
  const PackedTile pa = prune_tile(t, keep_a);
  emit_tile(pa, keep_a, tr, tc, row_ok, col_ok, p.real_rows, p.cols, p.a);
  if (!(p.b.dense || p.b.values || p.b.meta)) return;  // uniform over the grid

  // Stage the block transposed: tile (ty, tx), pruned by keep_b and transposed, becomes
  // tile (tx, ty) of the staged 64×64 block of the transposed output.
  __shared__ __align__(16) uint16_t stage[4 * kBlockTiles * kStageStride];
  __shared__ uint16_t stage_keep[kBlockTiles][kBlockTiles + 1];
  const PackedTile pt = transpose_tile(Rule == TileRule::greedy ? pa : prune_tile(t, keep_b));
#pragma unroll
  for (int c = 0; c < 4; ++c)
    *reinterpret_cast<uint2*>(stage + (4 * tx + c) * kStageStride + 4 * ty) = make_uint2(pt.lo[c], pt.hi[c]);
  stage_keep[tx][ty] = static_cast<uint16_t>(transpose_tile_bits(keep_b));
  __syncthreads();

  PackedTile tt;
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const uint2 x = *reinterpret_cast<const uint2*>(stage + (4 * ty + r) * kStageStride + 4 * tx);
    tt.lo[r] = x.x;
    tt.hi[r] = x.y;
  }
  const uint32_t keep_t = stage_keep[ty][tx];
  const int64_t ttr = int64_t(blockIdx.x) * kBlockTiles + ty, ttc = int64_t(blockIdx.y) * kBlockTiles + tx;
  emit_tile(tt, keep_t, ttr, ttc, ttr < tile_cols, ttc < tile_rows, p.cols, p.rows, p.b);
}

template <TileRule Rule>
void launch_tiles(const char* fn, const TileArgs& p, cudaStream_t stream) {
  if (p.rows == 0 || p.cols == 0) return;
  const int64_t gx = (p.cols / 4 + kBlockTiles - 1) / kBlockTiles, gy = (p.rows / 4 + kBlockTiles - 1) / kBlockTiles;
  ESPLAG_CHECK(gx <= 0x7fffffff && gy <= 65535, fn, ": shape [", p.rows, ", ", p.cols,
               "] is too large for one launch (at most 4194240 rows)");
  tile_sparsify_kernel<Rule><<<dim3(unsigned(gx), unsigned(gy)), kTileThreads, 0, stream>>>(p);
  CUDA_CHECK_LAUNCH(fn);
}

void check_tiles(const char* fn, const char* what, int64_t rows, int64_t cols) {
  ESPLAG_CHECK(rows >= 0 && cols >= 0 && rows % 4 == 0 && cols % 4 == 0, fn, ": ", what,
               " rows and cols must be multiples of 4 (4×4 tiles), got [", rows, ", ", cols, "]");
}

}  // namespace

void transposable_24(const bf16* w, int64_t rows, int64_t cols, const Sparse24Out& out, const Sparse24Out& out_t,
                     uint16_t* tile_mask, cudaStream_t stream) {
  const char* fn = "gpu::transposable_24";
  check_tiles(fn, "the weight's", rows, cols);
  check_input(fn, w, rows, cols);
  check_out(fn, "out", out);
  check_out(fn, "out_t", out_t);
  ESPLAG_CHECK(aligned_to(tile_mask, 2), fn, ": tile_mask must be 2-byte aligned");
  TileArgs p;
  p.in = reinterpret_cast<const uint16_t*>(w);
  p.rows = p.real_rows = rows;
  p.cols = cols;
  p.a = out;
  p.b = out_t;
  p.mask_a = tile_mask;
  launch_tiles<TileRule::greedy>(fn, p, stream);
}

void double_prune_24(const bf16* w, int64_t rows, int64_t cols, const Sparse24Out& forward,
                     const Sparse24Out& backward_t, uint16_t* forward_tile_mask, uint16_t* backward_tile_mask,
                     cudaStream_t stream) {
  const char* fn = "gpu::double_prune_24";
  check_tiles(fn, "the weight's", rows, cols);
  check_input(fn, w, rows, cols);
  check_out(fn, "forward", forward);
  check_out(fn, "backward_t", backward_t);
  ESPLAG_CHECK(aligned_to(forward_tile_mask, 2) && aligned_to(backward_tile_mask, 2), fn,
               ": tile masks must be 2-byte aligned");
  TileArgs p;
  p.in = reinterpret_cast<const uint16_t*>(w);
  p.rows = p.real_rows = rows;
  p.cols = cols;
  p.a = forward;
  p.b = backward_t;
  p.mask_a = forward_tile_mask;
  p.mask_b = backward_tile_mask;
  launch_tiles<TileRule::double_prune>(fn, p, stream);
}

void activation_24_tiles(const bf16* x, int64_t N, int64_t C, const Sparse24Out& out, const Sparse24Out& out_t,
                         cudaStream_t stream) {
  const char* fn = "gpu::activation_24_tiles";
  ESPLAG_CHECK(N >= 0 && C >= 0 && C % 4 == 0, fn, ": activations [", N, ", ", C,
               "]: the features must be a multiple of 4");
  check_input(fn, x, N, C);
  check_out(fn, "out", out);
  check_out(fn, "out_t", out_t);
  TileArgs p;
  p.in = reinterpret_cast<const uint16_t*>(x);
  p.rows = (N + 3) / 4 * 4;
  p.real_rows = N;
  p.cols = C;
  p.a = out;
  p.b = out_t;
  launch_tiles<TileRule::greedy>(fn, p, stream);
}

}  // namespace esplag::gpu
