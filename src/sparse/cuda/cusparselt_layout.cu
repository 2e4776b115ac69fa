#include "sparse/cuda/cusparselt_layout.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "core/cuda_check.h"
#include "core/env.h"
#include "core/error.h"
#include "sparse/cuda/cusparselt.h"
#include "sparse/cuda/sparsify_device.h"
#include "sparse/mvue.h"

namespace esplag::gpu {

namespace {

constexpr int kTile = 64;  // the metadata's row band and the kernel's tile (both orientations)

// One group of 4 (bf16 bits, element j in bits 16j..16j+15 of g): the nibble
// idx0 | idx1 << 2 and the two stored values. The first two non-zeros (±0 counts as zero),
// padded by the lowest positions not taken. Bit operations only: no array is indexed by a
// value, so the device code keeps everything in registers.
__host__ __device__ inline unsigned pick_group(uint64_t g, uint16_t* out0, uint16_t* out1) {
  unsigned keep = 0;
  for (int j = 0; j < 4; ++j) keep |= ((g >> (16 * j)) & 0x7FFFu) ? 1u << j : 0u;
  const unsigned low = keep & (0u - keep);  // the lowest non-zero
  const unsigned rest = keep & ~low;
  keep = low | (rest & (0u - rest));       // at most the two lowest
  for (int pad = 0; pad < 2; ++pad)
    if ((keep & (keep - 1)) == 0) keep |= ~keep & (keep + 1) & 15u;  // fewer than 2: the lowest position not taken
  // keep has exactly two bits: idx0 the lower, idx1 the higher
  const unsigned idx0 = (keep & 1u) ? 0u : (keep & 2u) ? 1u : 2u;
  const unsigned idx1 = (keep & 8u) ? 3u : (keep & 4u) ? 2u : 1u;
  *out0 = uint16_t(g >> (16 * idx0));
  *out1 = uint16_t(g >> (16 * idx1));
  return idx0 | (idx1 << 2);
}

// Byte offset of row r's group g in the metadata (from the metadata's start), and whether
// it is the high nibble; the block formula of the header.
__host__ __device__ inline int64_t meta_offset(int64_t r, int64_t g, int64_t k, bool* high) {
  const int64_t ar = r % 16, j = g % 8;
  const int64_t a = ar % 8, h = j % 2, c = j / 2, q = c % 2, t = c / 2;
  *high = ar >= 8;
  return (r / 64) * 8 * k + (g / 8) * 256 + ((r % 64) / 16) * 64 + a * 8 + q * 4 + h * 2 + t;
}

// The MVUE 2:4 of one group g = (bf16 bits, element j in bits 16j..16j+15) and its
// selection, as pick_group would make it from the group cpu::mvue_24_bf16 writes (scaled
// kept values rounded to bf16 once, nearest even; unscaled kept values copied bit for bit;
// the others 0): returns the metadata nibble, *out0 / *out1 the stored values.
//
// The common case, a scaled group, is taken directly: the sampler then keeps exactly two
// values (u and u + 1 fall in two different intervals), both non-zero after the rounding
// (|a / p| >= |a| > 0), so pick_group would select exactly those two. Only groups that pass
// unscaled (at most two non-zeros, or a non-finite value) are written out and go through
// pick_group, which also pads groups of fewer than two non-zeros. Skipping the repacking
// and the selection for the common case matters: the pass is bound by integer work.
__device__ inline unsigned mvue_pick_group(uint64_t v, uint32_t u, uint16_t* out0, uint16_t* out1) {
  float a[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) a[j] = __uint_as_float(uint32_t((v >> (16 * j)) & 0xFFFFu) << 16);
  const sparse_detail::Mvue24Group g = sparse_detail::mvue_24_group(a, u);
  if (g.scaled) {
    const unsigned i0 = __ffs(g.keep) - 1, i1 = 31 - __clz(g.keep);
    float o0 = 0.f, o1 = 0.f;  // selected by comparisons: an indexed array would live in local memory
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (unsigned(j) == i0) o0 = g.out[j];
      if (unsigned(j) == i1) o1 = g.out[j];
    }
    *out0 = __bfloat16_as_ushort(__float2bfloat16_rn(o0));
    *out1 = __bfloat16_as_ushort(__float2bfloat16_rn(o1));
    return i0 | (i1 << 2);
  }
  uint64_t kept = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j)
    if ((g.keep >> j) & 1u) kept |= ((v >> (16 * j)) & 0xFFFFu) << (16 * j);
  return pick_group(kept, out0, out1);
}

enum class Source { dense, dense_pruned, dense_rows, kept, mvue_of_transpose };

// One 64×64 tile of W per block of 256 threads, one 4×4 tile of W per thread. A thread
// loads its tile straight from global memory (a warp reads 128 contiguous bytes per row),
// makes the tile that op N compresses and the one op T compresses (Source below), and
// derives each group's metadata nibble and two stored values with a few bit operations and
// one byte permutation per group (sparsify_device.h): no element is handled on its own,
// which is what bounds a writer that extracts groups element by element from shared
// memory. The block then stages the compressed values and nibbles of both orientations in
// shared memory and writes them out in 16-byte stores: per orientation, 64 rows of 64
// value bytes and one contiguous 512-byte run of metadata.
//
// Sources:
//   dense         W as loaded; each group keeps its first two non-zeros (pick_group's rule).
//   dense_pruned  W pruned with the transposable greedy mask of each 4×4 tile
//                 (gpu::transposable_24's rule and bits), written to `pruned` when that is
//                 not null: the runtime 2:4 of a weight and both compressed copies in one
//                 read of W.
//   dense_rows    W pruned row-wise, the two largest |w| of every 4 along a row
//                 (gpu::activation_24_rows's rule and bits), written to `pruned` when
//                 that is not null; op N only (the result is 2:4 along the rows alone).
//   kept          w holds a row-wise 2:4 weight W1's kept values [rows, cols/2], the masks
//                 come as 4×4 tile bits [rows/4, cols/4]: op N compresses W1 (fwd_tiles),
//                 op T W2 = W1 ⊙ bwd_tiles (slope's two copies from its stored kept values).
//   mvue_of_transpose  w is a dense gradient G; only op T is written, each group of 4
//                 along K (4 rows of one column of G) through the MVUE 2:4 for the seed at
//                 seed_ptr: its output has at most two non-zeros, so "the first two
//                 non-zeros" are the MVUE's kept values. Group index: the row of op(W)
//                 times K/4 plus the group along K, the numbering of cpu::mvue_24_bf16 on Gᵀ.
constexpr int kTiles = kTile / 4;                // 4×4 tiles per side of a block's tile
constexpr int kLayoutThreads = kTiles * kTiles;  // 256
constexpr int kValueStride = kTiles + 1;         // words per staged row: odd, fewer bank conflicts
constexpr int kNibbleStride = 20;                // bytes per staged row of 16 nibble bytes

// One orientation's compressed 64×64 tile: 64 rows of 16 value words (two bf16 per group)
// and of 16 nibbles (one byte each).
struct StagedLayout {
  uint32_t values[kTile * kValueStride];
  __align__(4) uint8_t nibbles[kTile * kNibbleStride];
};

// Bit 4r + c set where element (r, c) of the tile is non-zero (±0 counts as zero).
__device__ inline uint32_t nonzero_bits(const sparsify_detail::PackedTile& t) {
  uint32_t bits = 0;
#pragma unroll
  for (int r = 0; r < 4; ++r)
    bits |= uint32_t((t.lo[r] & 0x7FFFu) != 0) << (4 * r) | uint32_t((t.lo[r] & 0x7FFF0000u) != 0) << (4 * r + 1) |
            uint32_t((t.hi[r] & 0x7FFFu) != 0) << (4 * r + 2) | uint32_t((t.hi[r] & 0x7FFF0000u) != 0) << (4 * r + 3);
  return bits;
}

// pick_group's selection from a group's non-zero positions: the first two, padded by the
// lowest positions not taken, as the nibble idx0 | idx1 << 2.
__device__ inline uint32_t group_nibble(uint32_t nonzero) {
  const uint32_t low = nonzero & (0u - nonzero), rest = nonzero & ~low;
  return sparsify_detail::slot_nibble(low | (rest & (0u - rest)));
}

// The four groups of a tile's rows (rows of op(W)) into the staging: row r of the tile is
// staged row row0 + r, group `group` of it; bit 4r + c of `nonzero` says whether element
// (r, c) is non-zero.
__device__ inline void stage_rows(StagedLayout& st, const sparsify_detail::PackedTile& t, uint32_t nonzero, int row0,
                                  int group) {
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const uint32_t nib = group_nibble((nonzero >> (4 * r)) & 15u);
    st.values[(row0 + r) * kValueStride + group] = sparsify_detail::slot_values(t.lo[r], t.hi[r], nib);
    st.nibbles[(row0 + r) * kNibbleStride + group] = uint8_t(nib);
  }
}

// Writes one staged orientation: op(W) rows [op_r0, op_r0 + 64), groups from op_c0 / 4;
// M×K is op(W)'s shape. Every thread of the block takes part.
__device__ inline void store_layout(const StagedLayout& st, uint8_t* dst, int64_t M, int64_t K, int64_t op_r0,
                                    int64_t op_c0) {
  {  // values: row lr's 64 bytes as four 16-byte stores
    const int lr = threadIdx.x / 4, q = threadIdx.x % 4;
    const uint32_t* v = st.values + lr * kValueStride + 4 * q;
    *reinterpret_cast<uint4*>(dst + ((op_r0 + lr) * (K / 2) + op_c0 / 2) * 2 + 16 * q) =
        make_uint4(v[0], v[1], v[2], v[3]);
  }
  if (threadIdx.x < 32) {  // metadata: the block's 512 contiguous bytes, 16 per thread
    // 16 bytes = rows a and a + 1 (with a + 8 and a + 9 in the high nibbles) of one 16-row
    // block (sub) and 32-column chunk; byte a·8 + q·4 + h·2 + t holds group 2(q + 2t) + h.
    const int x = threadIdx.x, chunk = x / 16, sub = (x / 4) % 4, a0 = 2 * (x % 4);
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const uint8_t* lo_row = st.nibbles + (sub * 16 + a0 + i) * kNibbleStride + chunk * 8;
      const uint8_t* hi_row = lo_row + 8 * kNibbleStride;
      const uint32_t g03 = reinterpret_cast<const uint32_t*>(lo_row)[0] | reinterpret_cast<const uint32_t*>(hi_row)[0] << 4;
      const uint32_t g47 = reinterpret_cast<const uint32_t*>(lo_row)[1] | reinterpret_cast<const uint32_t*>(hi_row)[1] << 4;
      w[2 * i] = __byte_perm(g03, g47, 0x5140u);      // groups 0, 4, 1, 5
      w[2 * i + 1] = __byte_perm(g03, g47, 0x7362u);  // groups 2, 6, 3, 7
    }
    const int64_t off = M * K + (op_r0 / 64) * 8 * K + (op_c0 / 32 + chunk) * 256 + sub * 64 + a0 * 8;
    *reinterpret_cast<uint4*>(dst + off) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

template <Source From>
__global__ void __launch_bounds__(kLayoutThreads)
    compress_layout_kernel(const uint16_t* __restrict__ w, int64_t rows, int64_t cols, uint8_t* __restrict__ dst_n,
                           uint8_t* __restrict__ dst_t, uint16_t* __restrict__ pruned,
                           const uint16_t* __restrict__ fwd_tiles, const uint16_t* __restrict__ bwd_tiles,
                           const uint64_t* __restrict__ seed_ptr) {
  using namespace sparsify_detail;
  constexpr bool kMvue = From == Source::mvue_of_transpose;
  __shared__ StagedLayout staged_n, staged_t;
  const int tr = threadIdx.x / kTiles, tc = threadIdx.x % kTiles;
  const int64_t r0 = int64_t(blockIdx.y) * kTile, c0 = int64_t(blockIdx.x) * kTile;
  const int64_t gr = r0 + 4 * tr, gc = c0 + 4 * tc;  // the thread's tile in W
  PackedTile tile_n, tile_t;  // tile_t in W's orientation; transposed below
  uint32_t nonzero_n = 0, nonzero_t = 0;  // their non-zero elements (nonzero_bits), both in W's orientation
  if constexpr (From == Source::kept) {
    const int64_t at = (gr / 4) * (cols / 4) + gc / 4;
    const uint32_t bwd = bwd_tiles[at];
    tile_n = kept_tile(w, cols, gr, gc, fwd_tiles[at]);
    tile_t = prune_tile(tile_n, bwd);
    nonzero_n = nonzero_bits(tile_n);
    nonzero_t = nonzero_n & bwd;
  } else {
    tile_n = dense_tile(w, cols, gr, gc);
    nonzero_n = nonzero_bits(tile_n);
    if constexpr (From == Source::dense_pruned || From == Source::dense_rows) {
      const uint32_t keep = From == Source::dense_pruned ? greedy_mask(tile_n) : rows_top2_mask(tile_n);
      tile_n = prune_tile(tile_n, keep);
      nonzero_n &= keep;
      if (pruned) {
#pragma unroll
        for (int r = 0; r < 4; ++r)
          *reinterpret_cast<uint2*>(pruned + (gr + r) * cols + gc) = make_uint2(tile_n.lo[r], tile_n.hi[r]);
      }
    }
    tile_t = tile_n;
    nonzero_t = nonzero_n;
  }
  // op N: row 4·tr + r of the block's tile, group tc.
  if (!kMvue && dst_n) stage_rows(staged_n, tile_n, nonzero_n, 4 * tr, tc);
  // op T: the rows of op(W) are W's columns: row 4·tc + c, group tr.
  if (dst_t) {
    const PackedTile tt = transpose_tile(tile_t);
    if constexpr (kMvue) {
      const uint64_t seed = *seed_ptr;  // read on the device: a graph replay draws anew
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const uint64_t group = uint64_t(gc + c) * uint64_t(rows / 4) + uint64_t(gr / 4);
        uint16_t x0, x1;
        const unsigned nib = mvue_pick_group(uint64_t(tt.lo[c]) | uint64_t(tt.hi[c]) << 32,
                                             sparse_detail::mvue_uniform24(seed, group), &x0, &x1);
        const int row = 4 * tc + c;
        staged_t.values[row * kValueStride + tr] = uint32_t(x0) | uint32_t(x1) << 16;
        staged_t.nibbles[row * kNibbleStride + tr] = uint8_t(nib);
      }
    } else {
      stage_rows(staged_t, tt, transpose_tile_bits(nonzero_t), 4 * tc, tr);
    }
  }
  __syncthreads();
  if (!kMvue && dst_n) store_layout(staged_n, dst_n, rows, cols, r0, c0);
  if (dst_t) store_layout(staged_t, dst_t, cols, rows, c0, r0);
}

void check_shape(const char* who, int64_t rows, int64_t cols, const char* matrix = "W") {
  ESPLAG_CHECK(rows > 0 && cols > 0 && rows % kTile == 0 && cols % kTile == 0, who, ": ", matrix, " [", rows, ", ",
               cols, "]: the cuSPARSELt layout writer needs both dimensions positive multiples of ", kTile);
}

}  // namespace

size_t cusparselt24_layout_bytes(int64_t m, int64_t k) {
  if (m <= 0 || k <= 0 || m % kTile || k % kTile) return 0;
  return size_t(m) * size_t(k) + size_t(m) * size_t(k) / 8;
}

void cusparselt24_compress_host(const uint16_t* w, int64_t rows, int64_t cols, bool transposed, uint8_t* dst) {
  check_shape("cusparselt24_compress_host", rows, cols);
  const int64_t M = transposed ? cols : rows, K = transposed ? rows : cols;
  std::memset(dst, 0, cusparselt24_layout_bytes(M, K));
  uint16_t* values = reinterpret_cast<uint16_t*>(dst);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < K / 4; ++g) {
      uint64_t v = 0;
      for (int j = 0; j < 4; ++j) {
        const int64_t kk = 4 * g + j;
        v |= uint64_t(transposed ? w[kk * cols + r] : w[r * cols + kk]) << (16 * j);
      }
      uint16_t x0, x1;
      const unsigned nib = pick_group(v, &x0, &x1);
      values[r * (K / 2) + 2 * g] = x0;
      values[r * (K / 2) + 2 * g + 1] = x1;
      bool high = false;
      const int64_t off = meta_offset(r, g, K, &high);
      dst[M * K + off] |= uint8_t(high ? nib << 4 : nib);
    }
}

void cusparselt24_compress(const bf16* w, int64_t rows, int64_t cols, void* dst_n, void* dst_t, cudaStream_t stream) {
  check_shape("cusparselt24_compress", rows, cols);
  if (!dst_n && !dst_t) return;
  ESPLAG_CHECK(w != nullptr, "cusparselt24_compress: null W");
  for (const void* p : {static_cast<const void*>(w), static_cast<const void*>(dst_n), static_cast<const void*>(dst_t)})
    ESPLAG_CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0, "cusparselt24_compress: pointers must be 16-byte aligned");
  const dim3 grid(unsigned(cols / kTile), unsigned(rows / kTile));
  compress_layout_kernel<Source::dense>
      <<<grid, kLayoutThreads, 0, stream>>>(reinterpret_cast<const uint16_t*>(w), rows, cols, static_cast<uint8_t*>(dst_n),
                                 static_cast<uint8_t*>(dst_t), nullptr, nullptr, nullptr, nullptr);
  CUDA_CHECK_LAUNCH("compress_layout_kernel");
}

void cusparselt24_prune_compress(const bf16* w, int64_t rows, int64_t cols, bf16* pruned, void* dst_n, void* dst_t,
                                 cudaStream_t stream) {
  check_shape("cusparselt24_prune_compress", rows, cols);
  ESPLAG_CHECK(w != nullptr, "cusparselt24_prune_compress: null W");
  for (const void* p : {static_cast<const void*>(w), static_cast<const void*>(pruned),
                        static_cast<const void*>(dst_n), static_cast<const void*>(dst_t)})
    ESPLAG_CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0,
                 "cusparselt24_prune_compress: pointers must be 16-byte aligned");
  const dim3 grid(unsigned(cols / kTile), unsigned(rows / kTile));
  compress_layout_kernel<Source::dense_pruned>
      <<<grid, kLayoutThreads, 0, stream>>>(reinterpret_cast<const uint16_t*>(w), rows, cols, static_cast<uint8_t*>(dst_n),
                                 static_cast<uint8_t*>(dst_t), reinterpret_cast<uint16_t*>(pruned), nullptr, nullptr,
                                 nullptr);
  CUDA_CHECK_LAUNCH("compress_layout_kernel (pruning)");
}

void cusparselt24_prune_rows_compress(const bf16* w, int64_t rows, int64_t cols, bf16* pruned, void* dst_n,
                                      cudaStream_t stream) {
  check_shape("cusparselt24_prune_rows_compress", rows, cols, "X");
  ESPLAG_CHECK(w != nullptr, "cusparselt24_prune_rows_compress: null X");
  for (const void* p : {static_cast<const void*>(w), static_cast<const void*>(pruned), static_cast<const void*>(dst_n)})
    ESPLAG_CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0,
                 "cusparselt24_prune_rows_compress: pointers must be 16-byte aligned");
  const dim3 grid(unsigned(cols / kTile), unsigned(rows / kTile));
  compress_layout_kernel<Source::dense_rows><<<grid, kLayoutThreads, 0, stream>>>(
      reinterpret_cast<const uint16_t*>(w), rows, cols, static_cast<uint8_t*>(dst_n), nullptr,
      reinterpret_cast<uint16_t*>(pruned), nullptr, nullptr, nullptr);
  CUDA_CHECK_LAUNCH("compress_layout_kernel (row-wise pruning)");
}

void cusparselt24_compress_kept(const bf16* values, const uint16_t* forward_tiles, const uint16_t* backward_tiles,
                                int64_t rows, int64_t cols, void* dst_n, void* dst_t, cudaStream_t stream) {
  check_shape("cusparselt24_compress_kept", rows, cols);
  if (!dst_n && !dst_t) return;
  ESPLAG_CHECK(values && forward_tiles && backward_tiles, "cusparselt24_compress_kept: null input");
  ESPLAG_CHECK(reinterpret_cast<uintptr_t>(values) % 4 == 0 && reinterpret_cast<uintptr_t>(dst_n) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(dst_t) % 16 == 0,
               "cusparselt24_compress_kept: values must be 4-byte aligned, the layouts 16-byte aligned");
  const dim3 grid(unsigned(cols / kTile), unsigned(rows / kTile));
  compress_layout_kernel<Source::kept>
      <<<grid, kLayoutThreads, 0, stream>>>(reinterpret_cast<const uint16_t*>(values), rows, cols, static_cast<uint8_t*>(dst_n),
                                 static_cast<uint8_t*>(dst_t), nullptr, forward_tiles, backward_tiles, nullptr);
  CUDA_CHECK_LAUNCH("compress_layout_kernel (kept values)");
}

void cusparselt24_compress_mvue_t(const bf16* g, int64_t rows, int64_t cols, const uint64_t* seed, void* dst_t,
                                  cudaStream_t stream) {
  check_shape("cusparselt24_compress_mvue_t", rows, cols, "the gradient");
  ESPLAG_CHECK(g != nullptr && dst_t != nullptr && seed != nullptr,
               "cusparselt24_compress_mvue_t: null gradient, layout or seed");
  ESPLAG_CHECK(reinterpret_cast<uintptr_t>(g) % 16 == 0 && reinterpret_cast<uintptr_t>(dst_t) % 16 == 0,
               "cusparselt24_compress_mvue_t: pointers must be 16-byte aligned");
  const dim3 grid(unsigned(cols / kTile), unsigned(rows / kTile));
  compress_layout_kernel<Source::mvue_of_transpose>
      <<<grid, kLayoutThreads, 0, stream>>>(reinterpret_cast<const uint16_t*>(g), rows, cols, nullptr,
                                static_cast<uint8_t*>(dst_t), nullptr, nullptr, nullptr, seed);
  CUDA_CHECK_LAUNCH("compress_layout_kernel (MVUE of the transpose)");
}

namespace {

// A random W [rows, cols], 2:4 along both dimensions (each 4×4 tile keeps columns s + r and
// s + r + 1 mod 4 of its row r, s random per tile), kept values non-zero and distinct in
// their group, so that the library has a single choice of positions.
std::vector<uint16_t> random_transposable(int64_t rows, int64_t cols, uint64_t seed) {
  std::vector<uint16_t> w(size_t(rows * cols), 0);
  uint64_t s = seed;
  auto next = [&]() {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return uint32_t(s >> 33);
  };
  for (int64_t tr = 0; tr < rows / 4; ++tr)
    for (int64_t tc = 0; tc < cols / 4; ++tc) {
      const int shift = int(next() % 4);
      for (int r = 0; r < 4; ++r)
        for (int e = 0; e < 2; ++e) {
          const int c = (shift + r + e) % 4;
          // sign, exponent 120..134, random mantissa: a normal bf16, never zero
          const uint32_t x = next();
          const uint16_t bits = uint16_t(((x & 1u) << 15) | ((120u + (x >> 1) % 15u) << 7) | ((x >> 8) & 0x7Fu));
          w[size_t((tr * 4 + r) * cols + tc * 4 + c)] = bits;
        }
    }
  return w;
}

// The structured operand is the row-major rows × cols matrix of the problem (W [out, in],
// S [out, tokens] for weight_grad, Xs [tokens, in] for activation_forward); backward_data
// applies op T to it, the others op N.
bool check_problem(const SparseGemm24& g) {
  const SparseGemm24Problem& p = g.problem();
  if (p.weight_operand != SparseOperand::a) return false;
  if (!env_flag("ESPLAG_CUSPARSELT_OWN_LAYOUT", true)) return false;
  const bool transposed = p.product == SparseProduct::backward_data;
  const int64_t rows = p.structured_rows(), cols = p.structured_cols();
  const int64_t M = transposed ? cols : rows, K = transposed ? rows : cols;
  const size_t bytes = cusparselt24_layout_bytes(M, K);
  if (bytes == 0 || bytes != g.compressed_bytes()) return false;
  const std::vector<uint16_t> w = random_transposable(rows, cols, 0x5eed24ull + uint64_t(rows * 131 + cols));
  void *dw = nullptr, *dlib = nullptr, *down = nullptr, *dscratch = nullptr;
  bool same = false;
  const size_t n = w.size() * 2;
  const size_t scratch = std::max<size_t>(g.compress_scratch_bytes(), 16);
  if (cudaMalloc(&dw, n) == cudaSuccess && cudaMalloc(&dlib, bytes) == cudaSuccess &&
      cudaMalloc(&down, bytes) == cudaSuccess && cudaMalloc(&dscratch, scratch) == cudaSuccess) {
    CUDA_CHECK(cudaMemcpy(dw, w.data(), n, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemset(dlib, 0x5A, bytes));
    CUDA_CHECK(cudaMemset(down, 0xA5, bytes));
    g.compress(dlib, static_cast<const bf16*>(dw), dscratch, scratch, nullptr);
    cusparselt24_compress(static_cast<const bf16*>(dw), rows, cols, transposed ? nullptr : down,
                          transposed ? down : nullptr, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<uint8_t> a(bytes), b(bytes);
    CUDA_CHECK(cudaMemcpy(a.data(), dlib, bytes, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(b.data(), down, bytes, cudaMemcpyDeviceToHost));
    same = a == b;
  } else {
    cudaGetLastError();  // out of memory: keep the library's compression
  }
  for (void* q : {dw, dlib, down, dscratch})
    if (q) cudaFree(q);
  return same;
}

}  // namespace

bool cusparselt24_layout_matches(const SparseGemm24& g) {
  static std::mutex mu;
  static std::map<std::tuple<int, int, int64_t, int64_t, int>, bool> decided;
  const SparseGemm24Problem& p = g.problem();
  if (!cusparselt_available()) return false;
  const auto key = std::make_tuple(int(p.dtype), int(p.product), p.structured_rows(), p.structured_cols(),
                                   int(p.weight_operand));
  std::lock_guard<std::mutex> lock(mu);
  const auto it = decided.find(key);
  if (it != decided.end()) return it->second;
  const bool ok = p.dtype == SparseDtype::e4m3 ? cusparselt24_e4m3_layout_agrees(g) : check_problem(g);
  decided[key] = ok;
  return ok;
}

}  // namespace esplag::gpu
