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

// One 64×64 tile of W per block, staged in shared memory; warps 0-1 write the layout of W
// (op N), warps 2-3 that of Wᵀ (op T). A work item is two rows of op(W) (a and a + 8 of a
// 16-row block, which share the metadata bytes) over 32 columns: 2×16 values (two 32-byte
// runs) and one 8-byte metadata store.
//
// The expansion of one group of 4 of a row-wise 2:4 weight from its two kept values (the
// word x0 | x1 << 16) and its nibble (bit j = position j kept): element j in bits 16j.
__device__ inline uint64_t expand_group(uint32_t kept, unsigned nibble) {
  uint64_t v = 0;
  int k = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j)
    if ((nibble >> j) & 1u && k < 2) v |= uint64_t((kept >> (16 * k++)) & 0xFFFFu) << (16 * j);
  return v;
}

// The elements of a group whose nibble bit is clear zeroed.
__device__ inline uint64_t mask_group(uint64_t v, unsigned nibble) {
  uint64_t keep = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j)
    if ((nibble >> j) & 1u) keep |= uint64_t(0xFFFFu) << (16 * j);
  return v & keep;
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

enum class Source { dense, dense_pruned, kept, mvue_of_transpose };

// With Source::dense_pruned, the staged tile is first pruned in place with the
// transposable greedy mask of each of its 4×4 tiles (gpu::transposable_24's rule and bits:
// sparsify_device.h), and the pruned tile is written to `pruned` when that is not null:
// the runtime 2:4 of a weight and both its compressed copies in one read of W.
//
// With Source::kept, w holds a row-wise 2:4 weight W1's kept values [rows, cols/2] and the
// masks come as 4×4 tile bits ([rows/4, cols/4]): W1 (fwd_tiles) is staged for the layout
// of op N, W2 = W1 ⊙ bwd_tiles in a second tile for the layout of op T (slope's two
// compressed copies from its stored kept values).
//
// With Source::mvue_of_transpose, w is a dense gradient G staged as is, only the layout of
// op T is written (launched with 64 threads, all on it), and each group of 4 along K (4
// rows of one column of G) goes through the MVUE 2:4 for `seed` before the selection: its
// output has at most two non-zeros, so "the first two non-zeros" are the MVUE's kept
// values. Group index: the row of op(W) times K/4 plus the group along K, the numbering
// of cpu::mvue_24_bf16 on Gᵀ.
template <Source From>
__global__ void compress_layout_kernel(const uint16_t* __restrict__ w, int64_t rows, int64_t cols,
                                       uint8_t* __restrict__ dst_n, uint8_t* __restrict__ dst_t,
                                       uint16_t* __restrict__ pruned, const uint16_t* __restrict__ fwd_tiles,
                                       const uint16_t* __restrict__ bwd_tiles, const uint64_t* __restrict__ seed_ptr) {
  constexpr int kStride = kTile + 2;  // odd word stride: column reads hit distinct banks
  constexpr int kWordStride = kStride / 2;
  constexpr bool kKept = From == Source::kept;
  __shared__ __align__(16) uint16_t tile[kTile * kStride];
  __shared__ __align__(16) uint16_t tile2[kKept ? kTile * kStride : 2];
  // Pairs of columns as words (every even column starts a 4-byte aligned word).
  uint32_t* const words = reinterpret_cast<uint32_t*>(tile);
  const int64_t r0 = int64_t(blockIdx.y) * kTile, c0 = int64_t(blockIdx.x) * kTile;
  if constexpr (kKept) {
    uint32_t* const words2 = reinterpret_cast<uint32_t*>(tile2);
    const int64_t groups = cols / 4;
    for (int i = threadIdx.x; i < kTile * kTile / 4; i += blockDim.x) {
      const int r = i / (kTile / 4), g = i % (kTile / 4);  // a group of 4 of the tile's row r
      const int64_t gr = r0 + r, gg = c0 / 4 + g;
      const uint32_t kept = *reinterpret_cast<const uint32_t*>(w + gr * (cols / 2) + 2 * gg);
      const int shift = int(gr % 4) * 4;
      const unsigned f = (fwd_tiles[(gr / 4) * groups + gg] >> shift) & 15u;
      const unsigned b = (bwd_tiles[(gr / 4) * groups + gg] >> shift) & 15u;
      const uint64_t w1 = expand_group(kept, f), w2 = mask_group(w1, b);
      uint32_t* at = words + r * kWordStride + 2 * g;
      at[0] = uint32_t(w1);
      at[1] = uint32_t(w1 >> 32);
      uint32_t* at2 = words2 + r * kWordStride + 2 * g;
      at2[0] = uint32_t(w2);
      at2[1] = uint32_t(w2 >> 32);
    }
  } else {
    for (int i = threadIdx.x; i < kTile * kTile / 8; i += blockDim.x) {
      const int r = i / (kTile / 8), c8 = i % (kTile / 8);
      const uint4 v = *reinterpret_cast<const uint4*>(w + (r0 + r) * cols + c0 + c8 * 8);
      uint32_t* row = words + r * kWordStride + c8 * 4;  // a warp's 32 stores hit 32 banks
      row[0] = v.x;
      row[1] = v.y;
      row[2] = v.z;
      row[3] = v.w;
    }
  }
  __syncthreads();
  if constexpr (From == Source::dense_pruned) {
    using namespace sparsify_detail;
    for (int t = threadIdx.x; t < (kTile / 4) * (kTile / 4); t += blockDim.x) {
      const int tr = t / (kTile / 4), tc = t % (kTile / 4);
      uint32_t* at = words + 4 * tr * kWordStride + 2 * tc;
      PackedTile pt;
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        pt.lo[r] = at[r * kWordStride];
        pt.hi[r] = at[r * kWordStride + 1];
      }
      pt = prune_tile(pt, greedy_mask(pt));
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        at[r * kWordStride] = pt.lo[r];
        at[r * kWordStride + 1] = pt.hi[r];
        if (pruned)
          *reinterpret_cast<uint2*>(pruned + (r0 + 4 * tr + r) * cols + c0 + 4 * tc) = make_uint2(pt.lo[r], pt.hi[r]);
      }
    }
    __syncthreads();
  }
  constexpr bool kMvue = From == Source::mvue_of_transpose;
  const bool transposed = kMvue || threadIdx.x >= 64;
  uint8_t* dst = transposed ? dst_t : dst_n;
  if (!dst) return;
  const uint16_t* const staged = kKept && transposed ? tile2 : tile;
  const int item = threadIdx.x % 64;  // (sub-block s, 32-column chunk ch, row a)
  const int a = item % 8, ch = (item / 8) % 2, s = item / 16;
  const int64_t M = transposed ? cols : rows, K = transposed ? rows : cols;
  const int64_t op_r0 = transposed ? c0 : r0, op_c0 = transposed ? r0 : c0;
  // The 16 nibbles, row a's at bits 4g and row a + 8's at bits 32 + 4g: a register, not an
  // array (a value-indexed array would live in local memory).
  uint64_t nibs = 0;
  // MVUE: the seed is read from device memory, so that a captured CUDA graph draws anew
  // at every replay when the caller advances it there.
  uint64_t seed = 0;
  if constexpr (kMvue) seed = *seed_ptr;
#pragma unroll 1
  for (int half = 0; half < 2; ++half) {
    const int lr = s * 16 + half * 8 + a;  // tile-local row of op(W)
    uint32_t packed[8];
#pragma unroll
    for (int g = 0; g < 8; ++g) {
      uint64_t v = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int lk = ch * 32 + g * 4 + j;  // tile-local column of op(W)
        v |= uint64_t(transposed ? staged[lk * kStride + lr] : staged[lr * kStride + lk]) << (16 * j);
      }
      uint16_t x0, x1;
      unsigned nib;
      if constexpr (kMvue) {
        const uint64_t group = uint64_t(op_r0 + lr) * uint64_t(K / 4) + uint64_t((op_c0 + ch * 32) / 4 + g);
        nib = mvue_pick_group(v, sparse_detail::mvue_uniform24(seed, group), &x0, &x1);
      } else {
        nib = pick_group(v, &x0, &x1);
      }
      nibs |= uint64_t(nib) << (32 * half + 4 * g);
      packed[g] = uint32_t(x0) | (uint32_t(x1) << 16);
    }
    uint4* out = reinterpret_cast<uint4*>(dst + ((op_r0 + lr) * (K / 2) + (op_c0 + ch * 32) / 2) * 2);
    out[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    out[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
  }
  // byte a·8 + q·4 + h·2 + t holds group j = 2(q + 2t) + h: low nibble row a, high row a + 8
  uint2 m = make_uint2(0u, 0u);
#pragma unroll
  for (int b = 0; b < 8; ++b) {
    const int q = b / 4, h = (b / 2) % 2, t = b % 2;
    const int j = 2 * (q + 2 * t) + h;
    const uint32_t byte = uint32_t(((nibs >> (4 * j)) & 15u) | (((nibs >> (32 + 4 * j)) & 15u) << 4)) << (8 * (b % 4));
    if (b < 4)
      m.x |= byte;
    else
      m.y |= byte;
  }
  const int64_t R = op_r0 + s * 16;  // first row of the 16-row block
  const int64_t g0 = (op_c0 + ch * 32) / 4;
  const int64_t off = M * K + (R / 64) * 8 * K + (g0 / 8) * 256 + ((R % 64) / 16) * 64 + a * 8;
  *reinterpret_cast<uint2*>(dst + off) = m;
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
      <<<grid, 128, 0, stream>>>(reinterpret_cast<const uint16_t*>(w), rows, cols, static_cast<uint8_t*>(dst_n),
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
      <<<grid, 128, 0, stream>>>(reinterpret_cast<const uint16_t*>(w), rows, cols, static_cast<uint8_t*>(dst_n),
                                 static_cast<uint8_t*>(dst_t), reinterpret_cast<uint16_t*>(pruned), nullptr, nullptr,
                                 nullptr);
  CUDA_CHECK_LAUNCH("compress_layout_kernel (pruning)");
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
      <<<grid, 128, 0, stream>>>(reinterpret_cast<const uint16_t*>(values), rows, cols, static_cast<uint8_t*>(dst_n),
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
      <<<grid, 64, 0, stream>>>(reinterpret_cast<const uint16_t*>(g), rows, cols, nullptr,
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
// or S [out, tokens] for weight_grad); backward_data applies op T to it, the others op N.
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
  static std::map<std::tuple<int, int64_t, int64_t, int>, bool> decided;
  const SparseGemm24Problem& p = g.problem();
  // The writer produces 16-bit values only.
  if (!cusparselt_available() || p.dtype != SparseDtype::bf16) return false;
  const auto key = std::make_tuple(int(p.product), p.structured_rows(), p.structured_cols(), int(p.weight_operand));
  std::lock_guard<std::mutex> lock(mu);
  const auto it = decided.find(key);
  if (it != decided.end()) return it->second;
  const bool ok = check_problem(g);
  decided[key] = ok;
  return ok;
}

}  // namespace esplag::gpu
