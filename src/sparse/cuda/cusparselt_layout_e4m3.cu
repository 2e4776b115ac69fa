// cuSPARSELt's compressed layout of 8-bit (e4m3) 2:4 operands written directly
// (sparse/cuda/cusparselt_layout.h, "8-bit operands"): the per-step fp8 preparation of slope
// (from its kept values) and of semi_sparse (from its transposable prune) casts and
// compresses both weight copies itself instead of casting them and running
// cusparseLtSpMMACompress twice.
#include <algorithm>
#include <vector>

#include "core/cuda_check.h"
#include "core/env.h"
#include "core/error.h"
#include "ops/cuda/fp8_codes.cuh"
#include "sparse/cuda/cusparselt.h"
#include "sparse/cuda/cusparselt_layout.h"
#include "sparse/cuda/sparsify_device.h"

namespace esplag::gpu {

namespace {

constexpr int kTile = 64;                      // a block's tile of W, as the 16-bit writer's
constexpr int kThreads = (kTile / 4) * (kTile / 4);  // one 4×4 tile of W per thread

// The metadata byte of row r < 64 and group g < 16 within a 64 × 64 tile's 512.
__host__ __device__ inline unsigned tile_meta_offset(unsigned r, unsigned g) {
  return (r / 16) * 128 + (r % 8) * 16 + ((g % 8) / 2) * 4 + (g / 8) * 2 + (r % 16) / 8;
}

__host__ __device__ inline int64_t meta_offset(int64_t r, int64_t g, int64_t k) {
  return (r / 64) * 8 * k + (g / 16) * 512 + tile_meta_offset(unsigned(r % 64), unsigned(g % 16));
}

// The positions a group stores, from its non-zero ones (bit j = code j non-zero): the first
// two, padded by the highest positions not taken, as a 4-bit set of exactly two.
__host__ __device__ constexpr unsigned stored_positions(unsigned nonzero) {
  const unsigned low = nonzero & (0u - nonzero), rest = nonzero & ~low;
  unsigned keep = low | (rest & (0u - rest));
  for (int pad = 0; pad < 2; ++pad)
    if ((keep & (keep - 1)) == 0) {
      const unsigned free = ~keep & 15u;
      keep |= free & 8u ? 8u : free & 4u ? 4u : free & 2u ? 2u : 1u;
    }
  return keep;
}

__host__ __device__ constexpr unsigned lowest(unsigned set) {
  return set & 1u ? 0u : set & 2u ? 1u : set & 4u ? 2u : 3u;
}
__host__ __device__ constexpr unsigned highest(unsigned set) {
  return set & 8u ? 3u : set & 4u ? 2u : set & 2u ? 1u : 0u;
}

// The metadata nibble lowest | highest << 2 of stored_positions(n) for every set n of
// non-zero codes, at bits 4n: the device writer's lookup instead of the branches.
constexpr uint64_t stored_nibbles() {
  uint64_t t = 0;
  for (unsigned n = 0; n < 16; ++n) {
    const unsigned keep = stored_positions(n);
    t |= uint64_t(lowest(keep) | highest(keep) << 2) << (4 * n);
  }
  return t;
}
constexpr uint64_t kStoredNibbles = stored_nibbles();

void check_shape(const char* who, int64_t rows, int64_t cols) {
  ESPLAG_CHECK(rows > 0 && cols > 0 && rows % kTile == 0 && cols % kTile == 0, who, ": [", rows, ", ", cols,
               "] must be positive multiples of 64");
}

// The copies (either may be null) take 16-byte stores.
void check_destinations(const char* who, const void* dst_n, const void* dst_t) {
  ESPLAG_CHECK(reinterpret_cast<uintptr_t>(dst_n) % 16 == 0 && reinterpret_cast<uintptr_t>(dst_t) % 16 == 0, who,
               ": the compressed copies must be 16-byte aligned");
}

// Whether a bf16 magnitude (15 bits) is finite.
__device__ inline bool finite_magnitude(unsigned a) { return a < 0x7F80u; }

// The positions of a group's two kept values in its forward mask nibble (kept_tile's
// order): the nibble's lowest set bit and its next, each as a one-bit mask (0 if none).
struct KeptPositions {
  unsigned first, second;
  __device__ explicit KeptPositions(unsigned nib)
      : first(nib & (0u - nib)), second((nib ^ first) & (0u - (nib ^ first))) {}
};

// Largest finite |w| of W1's and of W2's values, as the bits of bf16 magnitudes (which order
// like the magnitudes): the block's maxima go out by atomicMax on them. The kept values are
// read as they lie, without the dense tiles: a group's two words are W1's values at the
// first two positions of its forward mask (kept_tile's order), W2's where the backward mask
// keeps those positions too. Thread x of block (bx, by) takes group 256·by + x of the four
// rows of tile row bx, which share one word of each mask.
constexpr int kAmaxThreads = 256;

__global__ void __launch_bounds__(kAmaxThreads)
    kept_amax_kernel(const uint32_t* __restrict__ values, const uint16_t* __restrict__ fwd_tiles,
                     const uint16_t* __restrict__ bwd_tiles, int64_t groups, unsigned* amax_n, unsigned* amax_t) {
  const int64_t g = int64_t(blockIdx.y) * kAmaxThreads + threadIdx.x, tile_row = blockIdx.x;
  unsigned mn = 0, mt = 0;
  if (g < groups) {
    uint32_t two[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) two[r] = values[(4 * tile_row + r) * groups + g];
    const unsigned f = fwd_tiles[tile_row * groups + g], b = bwd_tiles[tile_row * groups + g];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const unsigned nib = (f >> (4 * r)) & 15u, keep = (b >> (4 * r)) & nib;
      const KeptPositions at(nib);
      const unsigned a0 = two[r] & 0x7FFFu, a1 = (two[r] >> 16) & 0x7FFFu;
      const bool f0 = at.first && finite_magnitude(a0), f1 = at.second && finite_magnitude(a1);
      mn = max(mn, max(f0 ? a0 : 0u, f1 ? a1 : 0u));
      mt = max(mt, max(f0 && (keep & at.first) ? a0 : 0u, f1 && (keep & at.second) ? a1 : 0u));
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    mn = max(mn, __shfl_xor_sync(0xffffffffu, mn, o));
    mt = max(mt, __shfl_xor_sync(0xffffffffu, mt, o));
  }
  // Then across the block's warps: one atomic per tensor and block.
  __shared__ unsigned warp_n[kAmaxThreads / 32], warp_t[kAmaxThreads / 32];
  if (threadIdx.x % 32 == 0) {
    warp_n[threadIdx.x / 32] = mn;
    warp_t[threadIdx.x / 32] = mt;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kAmaxThreads / 32; ++w) {
      mn = max(mn, warp_n[w]);
      mt = max(mt, warp_t[w]);
    }
    if (mn) atomicMax(amax_n, mn << 16);
    if (mt) atomicMax(amax_t, mt << 16);
  }
}

// A block's share of one compressed copy of op(W) [M, K]: its tile's 64 rows of 32 bytes of
// values, and the 512 bytes of metadata the tile owns (one contiguous run of the layout:
// meta_offset of rows row0..row0 + 63 and groups g0..g0 + 15, row0 % 64 == g0 % 16 == 0).
// The threads write their 4×4 tiles here; the block then stores both with 16-byte stores,
// where a thread's own stores of the transposed copy would each touch 4 bytes of 16 rows.
struct StagedCopy {
  uint8_t values[kTile][kTile / 2];
  uint8_t meta[kTile * kTile / 8];
};

// The codes of a group's four values (bf16 bits: lo holds values 0 and 1, hi 2 and 3, the
// lower in the low half) at scale s.
__device__ inline uint32_t encode_group(uint32_t lo, uint32_t hi, float s) {
  return detail::fp8_encode4<false>(__uint_as_float(lo << 16), __uint_as_float(lo & 0xFFFF0000u),
                                    __uint_as_float(hi << 16), __uint_as_float(hi & 0xFFFF0000u), s);
}

// The four codes of a group of W1 or W2 from its two kept values (bf16 bits, the first in the
// low half: W1's values at the first two positions of the forward mask nibble `nib`, as
// kept_tile places them), cast at scale s: each at its position where `keep` (a subset of
// nib) holds it, 0 elsewhere, as the cast of the dense group would give. Only the two kept
// values are cast; a byte permutation places them.
__device__ inline uint32_t kept_group_codes(uint32_t two, unsigned nib, unsigned keep, float s) {
  const float x0 = __uint_as_float(two << 16), x1 = __uint_as_float(two & 0xFFFF0000u);
  const uint32_t c = isnan(x0) | isnan(x1) ? detail::fp8_encode2<false>(x0, x1, s)
                                           : detail::fp8_encode2_no_nan<false>(x0, x1, s);
  const KeptPositions at(nib);
  // Selector nibble 4 takes a zero byte; 0 and 1 the first and second kept code.
  unsigned select = 0x4444u;
  if (keep & at.first) select ^= 4u << (4 * (__ffs(at.first) - 1));
  if (keep & at.second) select ^= 5u << (4 * (__ffs(at.second) - 1));
  return __byte_perm(c, 0u, select);
}

// Four rows of codes of a 4×4 tile (byte j of rows[r]: column j) as the tile's local rows
// lr..lr + 3 and group lg of op(W): their two stored codes into the values and their
// nibbles into the metadata. The lanes holding groups lg and lg ^ 1 of the same rows are
// `partner` apart: the even group's lane writes their shared metadata byte.
// (The transposed copy's lanes store rows 4 apart, to one bank; swizzling the rows took more
// integer instructions than the conflicts cost: the kernel is bound by them.)
__device__ inline void stage_rows(StagedCopy& st, int lr, int lg, const uint32_t (&rows)[4], int partner) {
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const uint32_t codes = rows[r];
    // Bit 8j + 7 of `marks` is set where code j is not ±0 (no carry leaves a byte); the
    // multiply gathers those four bits into bits 24..27.
    const uint32_t marks = ((codes & 0x7F7F7F7Fu) + 0x7F7F7F7Fu) & 0x80808080u;
    const unsigned nonzero = ((marks >> 7) * 0x01020408u) >> 24;
    const unsigned nib = unsigned(kStoredNibbles >> (4 * nonzero)) & 15u;  // i0 | i1 << 2
    *reinterpret_cast<uint16_t*>(&st.values[lr + r][2 * lg]) =
        uint16_t(__byte_perm(codes, 0u, (nib & 3u) | (nib >> 2) << 4));  // codes i0, i1
    const unsigned other = __shfl_xor_sync(0xffffffffu, nib, partner);
    if (lg % 2 == 0) st.meta[tile_meta_offset(lr + r, lg)] = uint8_t(nib | other << 4);
  }
}

// The staged tile into op(W) [M, K] at rows row0.., groups g0.. by `threads` threads (t: this
// one's index among them).
__device__ inline void store_staged(uint8_t* dst, int64_t M, int64_t K, int64_t row0, int64_t g0,
                                   const StagedCopy& st, int t, int threads) {
  for (int i = t; i < kTile * 2; i += threads) {  // a row's 32 bytes as two 16-byte stores
    const int row = i / 2, half = i % 2;
    *reinterpret_cast<uint4*>(dst + (row0 + row) * (K / 2) + 2 * g0 + 16 * half) =
        *reinterpret_cast<const uint4*>(&st.values[row][16 * half]);
  }
  uint8_t* meta = dst + M * K / 2 + meta_offset(row0, g0, K);
  for (int i = t; i < int(sizeof st.meta / 16); i += threads)
    reinterpret_cast<uint4*>(meta)[i] = reinterpret_cast<const uint4*>(st.meta)[i];
}

// Kept: w is slope's stored form (kept values and the two tile masks; W2 = W1 ⊙ backward
// mask for dst_t, with its own scale); otherwise w is a dense W [rows, cols], 2:4 along both
// dimensions, for both with one scale (amax_n and amax_t the same; the masks are not read):
// the transposed copy's codes are the first copy's, transposed.
template <bool Kept>
__global__ void __launch_bounds__(kThreads)
    compress_e4m3_kernel(const uint16_t* __restrict__ w, const uint16_t* __restrict__ fwd_tiles,
                         const uint16_t* __restrict__ bwd_tiles, int64_t rows, int64_t cols, const float* amax_n,
                         const float* amax_t, float* inv_n, float* inv_t, uint8_t* __restrict__ dst_n,
                         uint8_t* __restrict__ dst_t) {
  using namespace sparsify_detail;
  __shared__ __align__(16) StagedCopy staged_n, staged_t;
  const float sn = detail::fp8_scale_of<false>(*amax_n), st = detail::fp8_scale_of<false>(*amax_t);
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
    *inv_n = __frcp_rn(sn);
    *inv_t = __frcp_rn(st);
  }
  const int tr = threadIdx.x / 16, tc = threadIdx.x % 16;  // lanes: tc fastest, two tr per warp
  const int64_t r0 = int64_t(blockIdx.y) * kTile, c0 = int64_t(blockIdx.x) * kTile;
  const int64_t gr = r0 + 4 * tr, gc = c0 + 4 * tc;
  uint32_t cn[4], ct[4];  // the tile's rows of codes: W1's (or W's) and W2's (or W's)
  if constexpr (Kept) {
    const int64_t at = (gr / 4) * (cols / 4) + gc / 4;
    const unsigned f = fwd_tiles[at], b = bwd_tiles[at];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const uint32_t two = *reinterpret_cast<const uint32_t*>(w + (gr + r) * (cols / 2) + gc / 2);
      const unsigned nib = (f >> (4 * r)) & 15u;
      if (dst_n) cn[r] = kept_group_codes(two, nib, nib, sn);
      if (dst_t) ct[r] = kept_group_codes(two, nib, (b >> (4 * r)) & nib, st);
    }
  } else {
    const PackedTile d = dense_tile(w, cols, gr, gc);
#pragma unroll
    for (int r = 0; r < 4; ++r) cn[r] = ct[r] = encode_group(d.lo[r], d.hi[r], sn);
  }
  if (dst_n) stage_rows(staged_n, 4 * tr, tc, cn, 1);  // group tc: neighbour lane tc ^ 1
  if (dst_t) {  // Wᵀ's local rows 4tc..4tc + 3, group tr: the lane of tr ^ 1, 16 lanes away
    detail::transpose4x4(ct);
    stage_rows(staged_t, 4 * tc, tr, ct, 16);
  }
  __syncthreads();
  // Half the block stores each copy (all of it where there is one).
  const int half = dst_n && dst_t ? kThreads / 2 : kThreads;
  const int i = int(threadIdx.x);
  if (dst_n && i < half) store_staged(dst_n, rows, cols, r0, c0 / 4, staged_n, i, half);
  if (dst_t && (dst_n ? i >= kThreads - half : true))
    store_staged(dst_t, cols, rows, c0, r0 / 4, staged_t, i - (kThreads - half), half);
}

// Random e4m3 codes [m, k]: per group two, one or no non-zero codes (mostly two), never NaN;
// the other positions 0, or -0 (0x80) in one group of 4, so the check also decides that the
// library counts -0 as zero, as our writers do.
std::vector<uint8_t> random_codes(int64_t m, int64_t k, uint64_t seed) {
  std::vector<uint8_t> w(size_t(m * k), 0);
  uint64_t s = seed;
  auto next = [&]() {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return uint32_t(s >> 33);
  };
  static const int kPairs[6][2] = {{0, 1}, {0, 2}, {0, 3}, {1, 2}, {1, 3}, {2, 3}};
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < k / 4; ++g) {
      const int* pair = kPairs[next() % 6];
      const uint32_t kind = next() % 8;  // 0: no non-zero, 1: one, else two
      if (next() % 4 == 0)
        for (int j = 0; j < 4; ++j) w[size_t(r * k + 4 * g + j)] = 0x80;
      for (int e = 0; e < 2; ++e) {
        if (kind == 0 || (kind == 1 && e == 1)) continue;
        const uint32_t x = next();
        w[size_t(r * k + 4 * g + pair[e])] = uint8_t((x & 0x80u) | (1u + (x >> 8) % 126u));  // 0x01..0x7E, either sign
      }
    }
  return w;
}

bool check_problem(const SparseGemm24& g) {
  const SparseGemm24Problem& p = g.problem();
  if (p.product != SparseProduct::forward || p.weight_operand != SparseOperand::a) return false;
  if (!env_flag("ESPLAG_CUSPARSELT_OWN_LAYOUT", true)) return false;
  const int64_t m = p.structured_rows(), k = p.structured_cols();
  const size_t bytes = cusparselt24_e4m3_layout_bytes(m, k);
  if (bytes == 0 || bytes != g.compressed_bytes()) return false;
  const std::vector<uint8_t> w = random_codes(m, k, 0xe4a3ull + uint64_t(m * 131 + k));
  std::vector<uint8_t> want(bytes);
  cusparselt24_compress_e4m3_host(w.data(), m, k, want.data());
  void *dw = nullptr, *dlib = nullptr, *dscratch = nullptr;
  bool same = false;
  const size_t scratch = std::max<size_t>(g.compress_scratch_bytes(), 16);
  if (cudaMalloc(&dw, w.size()) == cudaSuccess && cudaMalloc(&dlib, bytes) == cudaSuccess &&
      cudaMalloc(&dscratch, scratch) == cudaSuccess) {
    CUDA_CHECK(cudaMemcpy(dw, w.data(), w.size(), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemset(dlib, 0x5A, bytes));
    g.compress(dlib, dw, dscratch, scratch, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<uint8_t> got(bytes);
    CUDA_CHECK(cudaMemcpy(got.data(), dlib, bytes, cudaMemcpyDeviceToHost));
    same = got == want;
  } else {
    cudaGetLastError();  // out of memory: keep the library's compression
  }
  for (void* q : {dw, dlib, dscratch})
    if (q) cudaFree(q);
  return same;
}

}  // namespace

size_t cusparselt24_e4m3_layout_bytes(int64_t m, int64_t k) {
  if (m <= 0 || k <= 0 || m % kTile != 0 || k % kTile != 0) return 0;
  return size_t(m) * size_t(k) * 5 / 8;
}

void cusparselt24_compress_e4m3_host(const uint8_t* w, int64_t m, int64_t k, uint8_t* dst) {
  check_shape("cusparselt24_compress_e4m3_host", m, k);
  std::fill(dst, dst + cusparselt24_e4m3_layout_bytes(m, k), uint8_t(0));
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < k / 4; ++g) {
      const uint8_t* group = w + r * k + 4 * g;
      unsigned nonzero = 0;
      for (int j = 0; j < 4; ++j) nonzero |= (group[j] & 0x7Fu) ? 1u << j : 0u;
      const unsigned keep = stored_positions(nonzero), i0 = lowest(keep), i1 = highest(keep);
      dst[r * (k / 2) + 2 * g] = group[i0];
      dst[r * (k / 2) + 2 * g + 1] = group[i1];
      dst[m * k / 2 + meta_offset(r, g, k)] |= uint8_t((i0 | i1 << 2) << (4 * (g % 2)));
    }
}

void cusparselt24_compress_kept_e4m3(const bf16* values, const uint16_t* forward_tiles,
                                     const uint16_t* backward_tiles, int64_t rows, int64_t cols, float* amax_n,
                                     float* amax_t, float* inv_n, float* inv_t, void* dst_n, void* dst_t,
                                     cudaStream_t stream) {
  const char* who = "cusparselt24_compress_kept_e4m3";
  check_shape(who, rows, cols);
  ESPLAG_CHECK(values && forward_tiles && backward_tiles && amax_n && amax_t && inv_n && inv_t, who,
               ": null pointer");
  ESPLAG_CHECK(reinterpret_cast<uintptr_t>(values) % 4 == 0, who, ": the kept values must be 4-byte aligned");
  check_destinations(who, dst_n, dst_t);
  const dim3 grid(unsigned(cols / kTile), unsigned(rows / kTile));
  const auto* v = reinterpret_cast<const uint16_t*>(values);
  CUDA_CHECK(cudaMemsetAsync(amax_n, 0, sizeof(float), stream));
  CUDA_CHECK(cudaMemsetAsync(amax_t, 0, sizeof(float), stream));
  const int64_t groups = cols / 4;
  const dim3 amax_grid(unsigned(rows / 4), unsigned((groups + kAmaxThreads - 1) / kAmaxThreads));
  kept_amax_kernel<<<amax_grid, kAmaxThreads, 0, stream>>>(reinterpret_cast<const uint32_t*>(values), forward_tiles,
                                                           backward_tiles, groups,
                                                           reinterpret_cast<unsigned*>(amax_n),
                                                           reinterpret_cast<unsigned*>(amax_t));
  CUDA_CHECK_LAUNCH("kept_amax_kernel");
  compress_e4m3_kernel<true><<<grid, kThreads, 0, stream>>>(v, forward_tiles, backward_tiles, rows, cols, amax_n,
                                                             amax_t, inv_n, inv_t, static_cast<uint8_t*>(dst_n),
                                                             static_cast<uint8_t*>(dst_t));
  CUDA_CHECK_LAUNCH("compress_e4m3_kernel (kept)");
}

void cusparselt24_compress_e4m3(const bf16* w, int64_t rows, int64_t cols, const float* amax, float* inv,
                                void* dst_n, void* dst_t, cudaStream_t stream) {
  const char* who = "cusparselt24_compress_e4m3";
  check_shape(who, rows, cols);
  ESPLAG_CHECK(w && amax && inv, who, ": null pointer");
  ESPLAG_CHECK(reinterpret_cast<uintptr_t>(w) % 8 == 0, who, ": W must be 8-byte aligned");
  check_destinations(who, dst_n, dst_t);
  const dim3 grid(unsigned(cols / kTile), unsigned(rows / kTile));
  compress_e4m3_kernel<false><<<grid, kThreads, 0, stream>>>(reinterpret_cast<const uint16_t*>(w), nullptr, nullptr,
                                                              rows, cols, amax, amax, inv, inv,
                                                              static_cast<uint8_t*>(dst_n),
                                                              static_cast<uint8_t*>(dst_t));
  CUDA_CHECK_LAUNCH("compress_e4m3_kernel (dense)");
}

bool cusparselt24_e4m3_layout_agrees(const SparseGemm24& g) {
  return g.problem().dtype == SparseDtype::e4m3 && check_problem(g);
}

}  // namespace esplag::gpu
