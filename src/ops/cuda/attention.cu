// Causal grouped-query attention, flash-attention style (see ops/gpu_attention.h).
//
// Tensor-core path (HD ∈ {32, 64, 128}): 4 warps per block, each warp owning 16 rows of
// the block's tile; mma.sync m16n8k16 with bf16 operands and fp32 accumulators. Tiles
// are copied to shared memory row-major with cp.async, the tile a loop walks
// double-buffered so the next one loads while this one is used, and every operand
// fragment is read with ldmatrix (.trans for the operands needed the other way round:
// V for P·V, K for dS·K, Q and dO for the dK / dV products). Products whose left operand
// was just computed (P, dS) take it straight from the accumulators: the m16n8
// accumulator layout of two adjacent column tiles is the m16k16 operand layout. Rows are
// padded by 8 elements, which puts the 8 rows of one ldmatrix in distinct banks.
//
// Scores are kept in log2 units (scaled by log2(e) / sqrt(HD)) so exp2f does the
// exponentials; the saved log-sum-exp is in natural-log units.
//
// Generic path (any HD up to kAttentionMaxHeadDim): one warp per row, lanes over the head
// dimension, fp32 throughout, dot products as butterfly sums.
//
// Host side: attention_forward / attention_backward first ask whether the call goes to
// cuDNN's fused SDPA (attention_cudnn.cu; AttentionPath in ops/gpu_attention.h says when),
// and run these kernels otherwise.
//
// Masking: a key tile row beyond T is loaded as zeros (never garbage, since 0 · NaN would
// poison a sum), and probabilities above the diagonal or of query rows beyond T are
// exactly 0.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <set>
#include <string>

#include "core/error.h"
#include "ops/cuda/common.cuh"
#include "ops/gpu_attention.h"

namespace esplag::gpu {

namespace {

using detail::aligned16;
using detail::to_bf;
using detail::to_f;
using detail::warp_sum;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr unsigned kFull = 0xffffffffu;

// ---------------------------------------------------------------------------------------
// Tensor-core building blocks

constexpr int kTcThreads = 128;  // 4 warps

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // lo in the low half: the lower column
  return *reinterpret_cast<uint32_t*>(&v);
}

// d += a · b for one m16n8k16 tile. Fragments (g = lane / 4, t = lane % 4):
//   a: {(g, 2t..2t+1), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..)}   [row, k]
//   b: {(2t..2t+1, g), (2t+8.., g)}                                  [k, col]
//   d: {(g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)}                  [row, col]
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 b16 matrices from shared memory; lane l gives the address of row l % 8 of
// matrix l / 8 and receives, of each matrix, (row l/4, columns 2(l%4)..+1), or with
// .trans (rows 2(l%4)..+1, column l/4): exactly the mma operand pieces.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p))
               : "memory");
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p))
               : "memory");
}

// The A fragment of rows [0, 16) and columns [k0, k0 + 16) of a matrix stored [row][k].
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const bf16* s, int ld, int k0, int lane) {
  ldsm_x4(a, s + (lane & 15) * ld + k0 + 8 * (lane >> 4));
}
// B fragments (b0, b1 of column tiles n0 and n0 + 8) for k step [k0, k0 + 16), from B
// stored [n][k] (k contiguous) ...
__device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], const bf16* s, int ld, int n0, int k0, int lane) {
  ldsm_x4(b, s + (n0 + (lane & 7) + 8 * (lane >> 4)) * ld + k0 + 8 * ((lane >> 3) & 1));
}
// ... or from B stored [k][n] (n contiguous), transposed by ldmatrix.
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], const bf16* s, int ld, int n0, int k0, int lane) {
  ldsm_x4_t(b, s + (k0 + (lane & 15)) * ld + n0 + 8 * (lane >> 4));
}

// acc (16 × 8·NT) += A (16 × 16·KS) · B. A in shared memory [row][k] (kAs) or in
// registers (per k step); B in shared memory [n][k] (kBnk) or [k][n].
template <int NT, int KS, bool kBnk>
__device__ __forceinline__ void mma_s(float (&acc)[NT][4], const bf16* As, int lda, const bf16* Bs, int ldb,
                                      int lane) {
  static_assert(NT % 2 == 0, "column tiles come in pairs");
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    uint32_t a[4];
    load_a(a, As, lda, ks * 16, lane);
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t b[4];
      if constexpr (kBnk)
        load_b_nk(b, Bs, ldb, np * 16, ks * 16, lane);
      else
        load_b_kn(b, Bs, ldb, np * 16, ks * 16, lane);
      mma16816(acc[2 * np], a, b[0], b[1]);
      mma16816(acc[2 * np + 1], a, b[2], b[3]);
    }
  }
}
template <int NT, int KS, bool kBnk>
__device__ __forceinline__ void mma_r(float (&acc)[NT][4], const uint32_t (&a)[KS][4], const bf16* Bs, int ldb,
                                      int lane) {
  static_assert(NT % 2 == 0, "column tiles come in pairs");
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t b[4];
      if constexpr (kBnk)
        load_b_nk(b, Bs, ldb, np * 16, ks * 16, lane);
      else
        load_b_kn(b, Bs, ldb, np * 16, ks * 16, lane);
      mma16816(acc[2 * np], a[ks], b[0], b[1]);
      mma16816(acc[2 * np + 1], a[ks], b[2], b[3]);
    }
  }
}

// Accumulators of a 16 × 16·KS tile (2·KS column tiles) as A fragments of k steps.
template <int KS>
__device__ __forceinline__ void acc_to_a(uint32_t (&a)[KS][4], const float (&c)[2 * KS][4]) {
#pragma unroll
  for (int k = 0; k < KS; ++k) {
    a[k][0] = pack_bf16(c[2 * k][0], c[2 * k][1]);
    a[k][1] = pack_bf16(c[2 * k][2], c[2 * k][3]);
    a[k][2] = pack_bf16(c[2 * k + 1][0], c[2 * k + 1][1]);
    a[k][3] = pack_bf16(c[2 * k + 1][2], c[2 * k + 1][3]);
  }
}

template <int N, int M>
__device__ __forceinline__ void zero(float (&x)[N][M]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < M; ++j) x[i][j] = 0.f;
}

// Asynchronous copies (cp.async): a source size of 0 fills the destination with zeros,
// which is how rows beyond T become zero rows.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 4 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Rows [row0, row0 + ROWS) of a [T, ·] slice (row r at src + r·ld, D columns) into
// shared memory dst[r][c] (leading dimension ldd), asynchronously; rows at or beyond T
// are zeros. Consecutive threads copy consecutive 16-byte pieces of a row.
template <int ROWS, int D>
__device__ __forceinline__ void load_tile(bf16* dst, int ldd, const bf16* src, int64_t ld, int row0, int T) {
  constexpr int kChunks = D / 8;
  for (int i = threadIdx.x; i < ROWS * kChunks; i += kTcThreads) {
    const int r = i / kChunks, c = (i % kChunks) * 8;
    const bool ok = row0 + r < T;
    cp_async16(dst + r * ldd + c, ok ? src + static_cast<int64_t>(row0 + r) * ld + c : src, ok);
  }
}

// ROWS fp32 values src[row0 ..] into dst, zeros beyond T, asynchronously.
template <int ROWS>
__device__ __forceinline__ void load_vec(float* dst, const float* src, int row0, int T) {
  for (int i = threadIdx.x; i < ROWS; i += kTcThreads) {
    const bool ok = row0 + i < T;
    cp_async4(dst + i, ok ? src + row0 + i : src, ok);
  }
}

template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

// Blocks of a causal kernel differ in work by up to the number of tiles. The grid is
// (head, batch, tile) with the tile index slowest and counted from the heaviest, so the
// blocks are issued heaviest first and the short ones fill in the tail.

// ---------------------------------------------------------------------------------------
// Forward, tensor cores. Block: 64 query rows of one (b, h); loops over key tiles of 64
// up to the diagonal, the next tile's K and V loading while this one is used.

template <int D>
struct FwdTile {
  static constexpr int BM = 64, BN = 64, LD = D + 8;
  static constexpr size_t kSmem = sizeof(bf16) * (size_t(BM) + 4 * size_t(BN)) * LD;
};

template <int D>
__global__ void __launch_bounds__(kTcThreads)
    attn_fwd_tc_kernel(bf16* out, float* lse, const bf16* qkv, int T, int NH, int NKV, float scale_log2) {
  using F = FwdTile<D>;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* Qs = reinterpret_cast<bf16*>(smem);
  bf16* Ks = Qs + F::BM * F::LD;       // [2][BN][LD]
  bf16* Vs = Ks + 2 * F::BN * F::LD;   // [2][BN][LD]

  const int qb = gridDim.z - 1 - blockIdx.z, h = blockIdx.x, b = blockIdx.y;
  const int kvh = h / (NH / NKV);
  const int64_t C = static_cast<int64_t>(NH + 2 * NKV) * D;
  const bf16* base = qkv + static_cast<int64_t>(b) * T * C;
  const bf16* kg = base + static_cast<int64_t>(NH + kvh) * D;
  const bf16* vg = base + static_cast<int64_t>(NH + NKV + kvh) * D;
  const int q0 = qb * F::BM;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;

  const int last_key = min(T, q0 + F::BM) - 1;  // no row of this block sees a later key
  const int ntiles = last_key / F::BN + 1;
  load_tile<F::BM, D>(Qs, F::LD, base + static_cast<int64_t>(h) * D, C, q0, T);
  load_tile<F::BN, D>(Ks, F::LD, kg, C, 0, T);
  load_tile<F::BN, D>(Vs, F::LD, vg, C, 0, T);
  cp_async_commit();

  const int row[2] = {q0 + warp * 16 + (lane >> 2), q0 + warp * 16 + (lane >> 2) + 8};
  uint32_t qa[D / 16][4];
  float o[D / 8][4];
  zero(o);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

  for (int kt = 0; kt < ntiles; ++kt) {
    const int buf = kt & 1, k0 = kt * F::BN;
    if (kt + 1 < ntiles) {  // the other buffer was released by the barrier ending the last iteration
      load_tile<F::BN, D>(Ks + (buf ^ 1) * F::BN * F::LD, F::LD, kg, C, k0 + F::BN, T);
      load_tile<F::BN, D>(Vs + (buf ^ 1) * F::BN * F::LD, F::LD, vg, C, k0 + F::BN, T);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (kt == 0) {
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) load_a(qa[ks], Qs + warp * 16 * F::LD, F::LD, ks * 16, lane);
    }
    const bf16* Kb = Ks + buf * F::BN * F::LD;
    const bf16* Vb = Vs + buf * F::BN * F::LD;

    float s[F::BN / 8][4];
    zero(s);
    mma_r<F::BN / 8, D / 16, true>(s, qa, Kb, F::LD, lane);
#pragma unroll
    for (int nt = 0; nt < F::BN / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = k0 + nt * 8 + 2 * t + (e & 1);
        s[nt][e] = key > row[e >> 1] ? -INFINITY : s[nt][e] * scale_log2;
      }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = m[r];
#pragma unroll
      for (int nt = 0; nt < F::BN / 8; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(kFull, mx, 2));
      const float ref = mx == -INFINITY ? 0.f : mx;  // a row with nothing visible yet stays empty
      const float alpha = exp2f(m[r] - ref);
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < F::BN / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float p = exp2f(s[nt][2 * r + e] - ref);
          s[nt][2 * r + e] = p;
          sum += p;
        }
      l[r] = l[r] * alpha + sum;
      m[r] = mx;
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        o[dt][2 * r] *= alpha;
        o[dt][2 * r + 1] *= alpha;
      }
    }

    uint32_t pa[F::BN / 16][4];
    acc_to_a<F::BN / 16>(pa, s);
    mma_r<D / 8, F::BN / 16, false>(o, pa, Vb, F::LD, lane);  // V is [key][d] = [k][n]
    __syncthreads();  // this buffer is refilled two iterations on
  }

  const int64_t oc = static_cast<int64_t>(NH) * D;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    // The four lanes of a quad hold different columns of the same row; xor pairs add
    // commutatively, so all four end with the same bits.
    l[r] += __shfl_xor_sync(kFull, l[r], 1);
    l[r] += __shfl_xor_sync(kFull, l[r], 2);
    if (row[r] >= T) continue;
    const float inv = 1.f / l[r];
    bf16* op = out + (static_cast<int64_t>(b) * T + row[r]) * oc + static_cast<int64_t>(h) * D + 2 * t;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
      *reinterpret_cast<__nv_bfloat162*>(op + dt * 8) =
          __floats2bfloat162_rn(o[dt][2 * r] * inv, o[dt][2 * r + 1] * inv);
    if (t == 0) lse[(static_cast<int64_t>(b) * NH + h) * T + row[r]] = (m[r] + log2f(l[r])) * kLn2;
  }
}

// ---------------------------------------------------------------------------------------
// Backward preprocessing: delta[b, h, t] = Σ_d dout · out (the softmax Jacobian's
// rank-one term, Σ_j p_j dp_j). One warp per (b, t, h).

constexpr int kRowWarps = 8;
constexpr int kRowThreads = 32 * kRowWarps;

__global__ void __launch_bounds__(kRowThreads)
    attn_delta_kernel(float* delta, const bf16* dout, const bf16* out, int B, int T, int NH, int HD) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (r >= static_cast<int64_t>(B) * T * NH) return;
  const int h = static_cast<int>(r % NH);
  const int64_t bt = r / NH;
  const int t = static_cast<int>(bt % T), b = static_cast<int>(bt / T);
  const bf16* go = dout + r * HD;  // [B, T, NH·HD] rows are (b, t, h)
  const bf16* o = out + r * HD;
  float s = 0.f;
  for (int d = lane; d < HD; d += 32) s += to_f(go[d]) * to_f(o[d]);
  s = warp_sum(s);
  if (lane == 0) delta[(static_cast<int64_t>(b) * NH + h) * T + t] = s;
}

// ---------------------------------------------------------------------------------------
// Backward, tensor cores: dQ. Block: 64 query rows of one (b, h); loops over key tiles up
// to the diagonal (double-buffered). Per tile: S = Q Kᵀ, P = exp2(S - lse),
// dP = dO Vᵀ, dS = P (dP - delta), dQ += dS K.

template <int D>
struct DqTile {
  static constexpr int BM = 64, BN = D == 128 ? 32 : 64, LD = D + 8;
  static constexpr size_t kSmem = sizeof(bf16) * (2 * size_t(BM) + 4 * size_t(BN)) * LD;
};

template <int D>
__global__ void __launch_bounds__(kTcThreads)
    attn_bwd_dq_tc_kernel(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* delta, int T,
                          int NH, int NKV, float scale, float scale_log2) {
  using F = DqTile<D>;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* Qs = reinterpret_cast<bf16*>(smem);
  bf16* dOs = Qs + F::BM * F::LD;
  bf16* Ks = dOs + F::BM * F::LD;     // [2][BN][LD]
  bf16* Vs = Ks + 2 * F::BN * F::LD;  // [2][BN][LD]

  const int qb = gridDim.z - 1 - blockIdx.z, h = blockIdx.x, b = blockIdx.y;
  const int kvh = h / (NH / NKV);
  const int64_t C = static_cast<int64_t>(NH + 2 * NKV) * D, oc = static_cast<int64_t>(NH) * D;
  const bf16* base = qkv + static_cast<int64_t>(b) * T * C;
  const bf16* kg = base + static_cast<int64_t>(NH + kvh) * D;
  const bf16* vg = base + static_cast<int64_t>(NH + NKV + kvh) * D;
  const int q0 = qb * F::BM;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;

  const int last_key = min(T, q0 + F::BM) - 1;
  const int ntiles = last_key / F::BN + 1;
  load_tile<F::BM, D>(Qs, F::LD, base + static_cast<int64_t>(h) * D, C, q0, T);
  load_tile<F::BM, D>(dOs, F::LD, dout + static_cast<int64_t>(b) * T * oc + static_cast<int64_t>(h) * D, oc, q0, T);
  load_tile<F::BN, D>(Ks, F::LD, kg, C, 0, T);
  load_tile<F::BN, D>(Vs, F::LD, vg, C, 0, T);
  cp_async_commit();

  const int row[2] = {q0 + warp * 16 + (lane >> 2), q0 + warp * 16 + (lane >> 2) + 8};
  float lse2[2], dl[2];
  const int64_t stat = (static_cast<int64_t>(b) * NH + h) * T;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    lse2[r] = row[r] < T ? lse[stat + row[r]] * kLog2e : 0.f;
    dl[r] = row[r] < T ? delta[stat + row[r]] : 0.f;
  }
  float dq[D / 8][4];
  zero(dq);

  for (int kt = 0; kt < ntiles; ++kt) {
    const int buf = kt & 1, k0 = kt * F::BN;
    if (kt + 1 < ntiles) {
      load_tile<F::BN, D>(Ks + (buf ^ 1) * F::BN * F::LD, F::LD, kg, C, k0 + F::BN, T);
      load_tile<F::BN, D>(Vs + (buf ^ 1) * F::BN * F::LD, F::LD, vg, C, k0 + F::BN, T);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const bf16* Kb = Ks + buf * F::BN * F::LD;
    const bf16* Vb = Vs + buf * F::BN * F::LD;

    float s[F::BN / 8][4], dp[F::BN / 8][4];
    zero(s);
    zero(dp);
    mma_s<F::BN / 8, D / 16, true>(s, Qs + warp * 16 * F::LD, F::LD, Kb, F::LD, lane);
    mma_s<F::BN / 8, D / 16, true>(dp, dOs + warp * 16 * F::LD, F::LD, Vb, F::LD, lane);
#pragma unroll
    for (int nt = 0; nt < F::BN / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1, key = k0 + nt * 8 + 2 * t + (e & 1);
        const float p = key > row[r] ? 0.f : exp2f(s[nt][e] * scale_log2 - lse2[r]);
        s[nt][e] = p * (dp[nt][e] - dl[r]);
      }
    uint32_t da[F::BN / 16][4];
    acc_to_a<F::BN / 16>(da, s);
    mma_r<D / 8, F::BN / 16, false>(dq, da, Kb, F::LD, lane);  // K is [key][d] = [k][n]
    __syncthreads();
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (row[r] >= T) continue;
    bf16* p = dqkv + (static_cast<int64_t>(b) * T + row[r]) * C + static_cast<int64_t>(h) * D + 2 * t;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
      *reinterpret_cast<__nv_bfloat162*>(p + dt * 8) =
          __floats2bfloat162_rn(dq[dt][2 * r] * scale, dq[dt][2 * r + 1] * scale);
  }
}

// ---------------------------------------------------------------------------------------
// Backward, tensor cores: dK and dV. Block: 64 keys of one (b, kv head); walks the
// group's query heads and, for each, the query tiles from the diagonal to T (one
// sequence of tiles, double-buffered). Each warp owns 16 keys, so the products are
// transposed: Sᵀ = K Qᵀ, Pᵀ, dV += Pᵀ dO, dPᵀ = V dOᵀ, dSᵀ = Pᵀ (dPᵀ - delta), dK += dSᵀ Q.

template <int D>
struct DkvTile {
  static constexpr int BN = 64, BM = D == 128 ? 32 : 64, LD = D + 8;
  static constexpr size_t kSmem =
      sizeof(bf16) * (2 * size_t(BN) + 4 * size_t(BM)) * LD + sizeof(float) * 4 * BM;
};

template <int D>
__global__ void __launch_bounds__(kTcThreads)
    attn_bwd_dkv_tc_kernel(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* delta,
                           int T, int NH, int NKV, float scale, float scale_log2) {
  using F = DkvTile<D>;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* Ks = reinterpret_cast<bf16*>(smem);
  bf16* Vs = Ks + F::BN * F::LD;
  bf16* Qs = Vs + F::BN * F::LD;       // [2][BM][LD]
  bf16* dOs = Qs + 2 * F::BM * F::LD;  // [2][BM][LD]
  float* lses = reinterpret_cast<float*>(dOs + 2 * F::BM * F::LD);  // [2][BM]
  float* dls = lses + 2 * F::BM;                                     // [2][BM]

  const int kb = blockIdx.z, kvh = blockIdx.x, b = blockIdx.y;
  const int group = NH / NKV;
  const int64_t C = static_cast<int64_t>(NH + 2 * NKV) * D, oc = static_cast<int64_t>(NH) * D;
  const bf16* base = qkv + static_cast<int64_t>(b) * T * C;
  const bf16* dob = dout + static_cast<int64_t>(b) * T * oc;
  const int k0 = kb * F::BN;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;

  // Query tiles q_first, q_first + BM, ... < T for each head of the group.
  const int q_first = k0 - k0 % F::BM;
  const int per_head = (T - q_first + F::BM - 1) / F::BM;
  const int ntiles = group * per_head;
  auto issue = [&](int i, int buf) {
    const int h = kvh * group + i / per_head, q0 = q_first + (i % per_head) * F::BM;
    const int64_t stat = (static_cast<int64_t>(b) * NH + h) * T;
    load_tile<F::BM, D>(Qs + buf * F::BM * F::LD, F::LD, base + static_cast<int64_t>(h) * D, C, q0, T);
    load_tile<F::BM, D>(dOs + buf * F::BM * F::LD, F::LD, dob + static_cast<int64_t>(h) * D, oc, q0, T);
    load_vec<F::BM>(lses + buf * F::BM, lse + stat, q0, T);
    load_vec<F::BM>(dls + buf * F::BM, delta + stat, q0, T);
  };
  load_tile<F::BN, D>(Ks, F::LD, base + static_cast<int64_t>(NH + kvh) * D, C, k0, T);
  load_tile<F::BN, D>(Vs, F::LD, base + static_cast<int64_t>(NH + NKV + kvh) * D, C, k0, T);
  issue(0, 0);
  cp_async_commit();

  const int key[2] = {k0 + warp * 16 + (lane >> 2), k0 + warp * 16 + (lane >> 2) + 8};
  float dk[D / 8][4], dv[D / 8][4];
  zero(dk);
  zero(dv);

  for (int i = 0; i < ntiles; ++i) {
    const int buf = i & 1, q0 = q_first + (i % per_head) * F::BM;
    if (i + 1 < ntiles) {
      issue(i + 1, buf ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const bf16* Qb = Qs + buf * F::BM * F::LD;
    const bf16* dOb = dOs + buf * F::BM * F::LD;
    const float* lb = lses + buf * F::BM;
    const float* db = dls + buf * F::BM;

    float st[F::BM / 8][4], dpt[F::BM / 8][4];
    zero(st);
    zero(dpt);
    mma_s<F::BM / 8, D / 16, true>(st, Ks + warp * 16 * F::LD, F::LD, Qb, F::LD, lane);
    mma_s<F::BM / 8, D / 16, true>(dpt, Vs + warp * 16 * F::LD, F::LD, dOb, F::LD, lane);
#pragma unroll
    for (int nt = 0; nt < F::BM / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qi = nt * 8 + 2 * t + (e & 1), q = q0 + qi;
        const float p = (key[e >> 1] > q || q >= T) ? 0.f : exp2f(st[nt][e] * scale_log2 - lb[qi] * kLog2e);
        st[nt][e] = p;
        dpt[nt][e] = p * (dpt[nt][e] - db[qi]);
      }
    uint32_t pa[F::BM / 16][4];
    acc_to_a<F::BM / 16>(pa, st);
    mma_r<D / 8, F::BM / 16, false>(dv, pa, dOb, F::LD, lane);  // dO is [q][d] = [k][n]
    acc_to_a<F::BM / 16>(pa, dpt);
    mma_r<D / 8, F::BM / 16, false>(dk, pa, Qb, F::LD, lane);   // Q is [q][d] = [k][n]
    __syncthreads();
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (key[r] >= T) continue;
    bf16* row = dqkv + (static_cast<int64_t>(b) * T + key[r]) * C;
    bf16* pk = row + static_cast<int64_t>(NH + kvh) * D + 2 * t;
    bf16* pv = row + static_cast<int64_t>(NH + NKV + kvh) * D + 2 * t;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      *reinterpret_cast<__nv_bfloat162*>(pk + dt * 8) =
          __floats2bfloat162_rn(dk[dt][2 * r] * scale, dk[dt][2 * r + 1] * scale);
      *reinterpret_cast<__nv_bfloat162*>(pv + dt * 8) = __floats2bfloat162_rn(dv[dt][2 * r], dv[dt][2 * r + 1]);
    }
  }
}

// ---------------------------------------------------------------------------------------
// Generic path: one warp per row, lane l owns head dimensions l, l + 32, ... (at most
// kChunks of them); every dot product is a butterfly sum, so all lanes agree.

constexpr int kChunks = kAttentionMaxHeadDim / 32;

struct Dims {
  int T, NH, NKV, HD;
  int64_t C, oc;
};

__device__ __forceinline__ float dot_row(const float (&x)[kChunks], const bf16* y, int HD, int lane) {
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int d = lane + 32 * i;
    if (d < HD) s += x[i] * to_f(y[d]);
  }
  return warp_sum(s);
}

__device__ __forceinline__ void load_row(float (&x)[kChunks], const bf16* y, int HD, int lane) {
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int d = lane + 32 * i;
    x[i] = d < HD ? to_f(y[d]) : 0.f;
  }
}

__device__ __forceinline__ void store_row(bf16* y, const float (&x)[kChunks], float scale, int HD, int lane) {
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int d = lane + 32 * i;
    if (d < HD) y[d] = to_bf(x[i] * scale);
  }
}

// Rows ordered (b, h, t).
__global__ void __launch_bounds__(kRowThreads)
    attn_fwd_generic_kernel(bf16* out, float* lse, const bf16* qkv, int64_t rows, Dims s, float scale) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  const int t = static_cast<int>(r % s.T), h = static_cast<int>((r / s.T) % s.NH);
  const int64_t b = r / (static_cast<int64_t>(s.T) * s.NH);
  const int kvh = h / (s.NH / s.NKV);
  const bf16* base = qkv + b * s.T * s.C;
  const int64_t koff = static_cast<int64_t>(s.NH + kvh) * s.HD, voff = static_cast<int64_t>(s.NH + s.NKV + kvh) * s.HD;
  float q[kChunks], acc[kChunks];
  load_row(q, base + t * s.C + static_cast<int64_t>(h) * s.HD, s.HD, lane);
#pragma unroll
  for (int i = 0; i < kChunks; ++i) acc[i] = 0.f;
  float m = -INFINITY, l = 0.f;
  for (int j = 0; j <= t; ++j) {
    const float sc = dot_row(q, base + j * s.C + koff, s.HD, lane) * scale;
    const float mn = fmaxf(m, sc);
    const float alpha = expf(m - mn), p = expf(sc - mn);
    l = l * alpha + p;
    const bf16* v = base + j * s.C + voff;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int d = lane + 32 * i;
      if (d < s.HD) acc[i] = acc[i] * alpha + p * to_f(v[d]);
    }
    m = mn;
  }
  store_row(out + (b * s.T + t) * s.oc + static_cast<int64_t>(h) * s.HD, acc, 1.f / l, s.HD, lane);
  if (lane == 0) lse[r] = m + logf(l);
}

// dQ, rows ordered (b, h, t).
__global__ void __launch_bounds__(kRowThreads)
    attn_bwd_dq_generic_kernel(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* delta,
                               int64_t rows, Dims s, float scale) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  const int t = static_cast<int>(r % s.T), h = static_cast<int>((r / s.T) % s.NH);
  const int64_t b = r / (static_cast<int64_t>(s.T) * s.NH);
  const int kvh = h / (s.NH / s.NKV);
  const bf16* base = qkv + b * s.T * s.C;
  const int64_t koff = static_cast<int64_t>(s.NH + kvh) * s.HD, voff = static_cast<int64_t>(s.NH + s.NKV + kvh) * s.HD;
  float q[kChunks], go[kChunks], dq[kChunks];
  load_row(q, base + t * s.C + static_cast<int64_t>(h) * s.HD, s.HD, lane);
  load_row(go, dout + (b * s.T + t) * s.oc + static_cast<int64_t>(h) * s.HD, s.HD, lane);
#pragma unroll
  for (int i = 0; i < kChunks; ++i) dq[i] = 0.f;
  const float lr = lse[r], dr = delta[r];
  for (int j = 0; j <= t; ++j) {
    const bf16* k = base + j * s.C + koff;
    const float p = expf(dot_row(q, k, s.HD, lane) * scale - lr);
    const float ds = p * (dot_row(go, base + j * s.C + voff, s.HD, lane) - dr);
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int d = lane + 32 * i;
      if (d < s.HD) dq[i] += ds * to_f(k[d]);
    }
  }
  store_row(dqkv + (b * s.T + t) * s.C + static_cast<int64_t>(h) * s.HD, dq, scale, s.HD, lane);
}

// dK and dV, rows ordered (b, kv head, key j); each visits the group's heads, then t ≥ j.
__global__ void __launch_bounds__(kRowThreads)
    attn_bwd_dkv_generic_kernel(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* delta,
                                int64_t rows, Dims s, float scale) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  const int j = static_cast<int>(r % s.T), kvh = static_cast<int>((r / s.T) % s.NKV);
  const int64_t b = r / (static_cast<int64_t>(s.T) * s.NKV);
  const int group = s.NH / s.NKV;
  const bf16* base = qkv + b * s.T * s.C;
  const int64_t koff = static_cast<int64_t>(s.NH + kvh) * s.HD, voff = static_cast<int64_t>(s.NH + s.NKV + kvh) * s.HD;
  float k[kChunks], v[kChunks], dk[kChunks], dv[kChunks];
  load_row(k, base + j * s.C + koff, s.HD, lane);
  load_row(v, base + j * s.C + voff, s.HD, lane);
#pragma unroll
  for (int i = 0; i < kChunks; ++i) dk[i] = dv[i] = 0.f;
  for (int hh = 0; hh < group; ++hh) {
    const int h = kvh * group + hh;
    const int64_t stat = (b * s.NH + h) * s.T;
    for (int t = j; t < s.T; ++t) {
      const bf16* q = base + t * s.C + static_cast<int64_t>(h) * s.HD;
      const bf16* go = dout + (b * s.T + t) * s.oc + static_cast<int64_t>(h) * s.HD;
      const float p = expf(dot_row(k, q, s.HD, lane) * scale - lse[stat + t]);
      const float ds = p * (dot_row(v, go, s.HD, lane) - delta[stat + t]);
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
        const int d = lane + 32 * i;
        if (d < s.HD) {
          dv[i] += p * to_f(go[d]);
          dk[i] += ds * to_f(q[d]);
        }
      }
    }
  }
  bf16* row = dqkv + (b * s.T + j) * s.C;
  store_row(row + koff, dk, scale, s.HD, lane);
  store_row(row + voff, dv, 1.f, s.HD, lane);
}

// ---------------------------------------------------------------------------------------
// Host side

void check_shape(const char* op, int B, int T, int NH, int NKV, int HD) {
  ESPLAG_CHECK(B >= 0 && T >= 0, op, ": batch and sequence length must be non-negative, got B=", B, " T=", T);
  ESPLAG_CHECK(NH > 0 && NKV > 0 && HD > 0, op, ": head counts and head size must be positive, got NH=", NH,
               " NKV=", NKV, " HD=", HD);
  ESPLAG_CHECK(NH % NKV == 0, op, ": query heads NH=", NH, " must be a multiple of key/value heads NKV=", NKV);
  ESPLAG_CHECK(HD <= kAttentionMaxHeadDim, op, ": head size HD=", HD, " exceeds the supported maximum ",
               kAttentionMaxHeadDim);
  ESPLAG_CHECK(B <= 65535 && T <= (1 << 21), op, ": B=", B, " and T=", T,
               " exceed the grid limits (B at most 65535, T at most 2^21)");
}

bool use_tensor_cores(AttentionPath path, int HD, std::initializer_list<const void*> ptrs) {
  if (path == AttentionPath::generic || !attention_tensor_core_head_dim(HD)) return false;
  for (const void* p : ptrs)
    if (!aligned16(p)) return false;
  return true;
}

// ---------------------------------------------------------------------------------------
// Choosing between cuDNN and our kernels

bool is_cudnn(AttentionPath p) { return p == AttentionPath::cudnn || p == AttentionPath::cudnn_nondeterministic; }

// cuDNN's SDPA wants head sizes that are multiples of 8 (16-byte rows) up to 256; other
// sizes go to our kernels without a word, like misaligned buffers.
bool cudnn_head_dim(int HD) { return HD % 8 == 0 && HD <= 256; }

void warn_once(const std::string& message) {
  static std::mutex mutex;
  static std::set<std::string> seen;
  std::lock_guard<std::mutex> lock(mutex);
  if (seen.insert(message).second) std::fprintf(stderr, "esplag: warning: %s\n", message.c_str());
}

std::string shape_text(int B, int T, int NH, int NKV, int HD) {
  return "B=" + std::to_string(B) + " T=" + std::to_string(T) + " NH=" + std::to_string(NH) +
         " NKV=" + std::to_string(NKV) + " HD=" + std::to_string(HD);
}

// Whether the call goes to cuDNN. For the cudnn paths anything in the way is an Error; for
// automatic, reasons a user would want to know about (cuDNN missing or refusing the shape,
// workspace too small) are warned about once, silent ones (head size, alignment) are not.
// `backward` picks the plan whose workspace the call needs.
bool take_cudnn(const char* op, AttentionPath path, int B, int T, int NH, int NKV, int HD,
                std::initializer_list<const void*> ptrs, size_t workspace_bytes, bool backward) {
  if (path != AttentionPath::automatic && !is_cudnn(path)) return false;
  const bool must = is_cudnn(path);
  const std::string shape = shape_text(B, T, NH, NKV, HD);
  auto refuse = [&](const std::string& why, bool warn) {
    ESPLAG_CHECK(!must, op, " (cudnn) ", shape, ": ", why);
    if (warn) warn_once(std::string(op) + " " + shape + ": " + why + "; running the native kernels instead");
    return false;
  };
  if (!cudnn_head_dim(HD)) return refuse("cuDNN needs a head size that is a multiple of 8 up to 256", false);
  if (!attention_cudnn_available()) {
    // One warning for the whole process: it is the same for every shape.
    ESPLAG_CHECK(!must, op, " (cudnn): ", attention_cudnn_status());
    warn_once("cuDNN attention unavailable: " + attention_cudnn_status() + "; attention runs on the native kernels");
    return false;
  }
  for (const void* p : ptrs)
    if (!aligned16(p)) return refuse("cuDNN needs 16-byte aligned buffers", false);
  size_t fwd_ws = 0, bwd_ws = 0;
  const bool deterministic = path != AttentionPath::cudnn_nondeterministic;
  const std::string why = detail::cudnn_attention_support(B, T, NH, NKV, HD, deterministic, &fwd_ws, &bwd_ws);
  if (!why.empty()) return refuse(why, true);
  const size_t need = backward ? bwd_ws : fwd_ws;
  if (workspace_bytes < need)
    return refuse("cuDNN's plan needs " + std::to_string(need) + " bytes of workspace, " +
                      std::to_string(workspace_bytes) + " given (size it with attention_workspace_bytes)",
                  true);
  return true;
}

// Run cuDNN; true when it ran. An execution failure under automatic falls back (the
// native kernels then overwrite every output) with a warning; under cudnn it throws.
template <typename Run>
bool run_cudnn(const char* op, AttentionPath path, int B, int T, int NH, int NKV, int HD, Run run) {
  try {
    run();
    return true;
  } catch (const Error& e) {
    if (is_cudnn(path)) throw;
    warn_once(std::string(op) + " " + shape_text(B, T, NH, NKV, HD) + ": " + e.what() +
              "; running the native kernels instead");
    return false;
  }
}

template <int D>
void launch_forward_tc(bf16* out, float* lse, const bf16* qkv, int B, int T, int NH, int NKV, float scale_log2,
                       cudaStream_t stream) {
  using F = FwdTile<D>;
  allow_smem(attn_fwd_tc_kernel<D>, F::kSmem);
  const dim3 grid(NH, B, detail::blocks_for(T, F::BM));
  attn_fwd_tc_kernel<D><<<grid, kTcThreads, F::kSmem, stream>>>(out, lse, qkv, T, NH, NKV, scale_log2);
  CUDA_CHECK_LAUNCH("attention_forward (tensor cores)");
}

template <int D>
void launch_backward_tc(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* delta, int B,
                        int T, int NH, int NKV, float scale, float scale_log2, cudaStream_t stream) {
  using Q = DqTile<D>;
  using KV = DkvTile<D>;
  allow_smem(attn_bwd_dq_tc_kernel<D>, Q::kSmem);
  allow_smem(attn_bwd_dkv_tc_kernel<D>, KV::kSmem);
  const dim3 grid_kv(NKV, B, detail::blocks_for(T, KV::BN));
  attn_bwd_dkv_tc_kernel<D>
      <<<grid_kv, kTcThreads, KV::kSmem, stream>>>(dqkv, dout, qkv, lse, delta, T, NH, NKV, scale, scale_log2);
  CUDA_CHECK_LAUNCH("attention_backward dK/dV (tensor cores)");
  const dim3 grid_q(NH, B, detail::blocks_for(T, Q::BM));
  attn_bwd_dq_tc_kernel<D>
      <<<grid_q, kTcThreads, Q::kSmem, stream>>>(dqkv, dout, qkv, lse, delta, T, NH, NKV, scale, scale_log2);
  CUDA_CHECK_LAUNCH("attention_backward dQ (tensor cores)");
}

}  // namespace

bool attention_tensor_core_head_dim(int HD) { return HD == 32 || HD == 64 || HD == 128; }

const char* attention_path_name(AttentionPath path) {
  switch (path) {
    case AttentionPath::automatic: return "automatic";
    case AttentionPath::generic: return "generic";
    case AttentionPath::native: return "native";
    case AttentionPath::cudnn: return "cudnn";
    case AttentionPath::cudnn_nondeterministic: return "cudnn_nondeterministic";
  }
  return "?";
}

AttentionPath attention_resolve_path(int B, int T, int NH, int NKV, int HD, AttentionPath path) {
  check_shape("attention_resolve_path", B, T, NH, NKV, HD);
  if (path == AttentionPath::generic || path == AttentionPath::native) return path;
  const bool must = is_cudnn(path);
  if (!cudnn_head_dim(HD) || !attention_cudnn_available()) {
    ESPLAG_CHECK(!must, "attention (cudnn) ", shape_text(B, T, NH, NKV, HD), ": ",
                 cudnn_head_dim(HD) ? attention_cudnn_status()
                                    : std::string("cuDNN needs a head size that is a multiple of 8 up to 256"));
    return AttentionPath::native;
  }
  if (B == 0 || T == 0) return must ? path : AttentionPath::cudnn;  // nothing to run, nothing to build
  const bool deterministic = path != AttentionPath::cudnn_nondeterministic;
  const std::string why = detail::cudnn_attention_support(B, T, NH, NKV, HD, deterministic, nullptr, nullptr);
  ESPLAG_CHECK(why.empty() || !must, "attention (cudnn) ", shape_text(B, T, NH, NKV, HD), ": ", why);
  if (!why.empty()) return AttentionPath::native;
  return must ? path : AttentionPath::cudnn;
}

size_t attention_workspace_bytes(int B, int T, int NH, int NKV, int HD, AttentionPath path) {
  size_t bytes = attention_backward_scratch_bytes(B, T, NH);
  const AttentionPath resolved = attention_resolve_path(B, T, NH, NKV, HD, path);
  if (is_cudnn(resolved) && B > 0 && T > 0) {
    size_t fwd = 0, bwd = 0;
    const std::string why = detail::cudnn_attention_support(
        B, T, NH, NKV, HD, resolved != AttentionPath::cudnn_nondeterministic, &fwd, &bwd);
    ESPLAG_CHECK(why.empty(), "attention_workspace_bytes: ", why);
    bytes = std::max(bytes, std::max(fwd, bwd));
  }
  return bytes;
}

void attention_forward(bf16* out, float* lse, const bf16* qkv, int B, int T, int NH, int NKV, int HD,
                       cudaStream_t stream, AttentionPath path) {
  attention_forward(out, lse, qkv, B, T, NH, NKV, HD, nullptr, 0, stream, path);
}

void attention_forward(bf16* out, float* lse, const bf16* qkv, int B, int T, int NH, int NKV, int HD, void* workspace,
                       size_t workspace_bytes, cudaStream_t stream, AttentionPath path) {
  check_shape("attention_forward", B, T, NH, NKV, HD);
  if (B == 0 || T == 0) return;
  ESPLAG_CHECK(out && lse && qkv, "attention_forward: out, lse and qkv must not be null");
  if (!workspace) workspace_bytes = 0;
  if (take_cudnn("attention_forward", path, B, T, NH, NKV, HD, {out, lse, qkv}, workspace_bytes, false) &&
      run_cudnn("attention_forward", path, B, T, NH, NKV, HD, [&] {
        detail::cudnn_attention_forward(out, lse, qkv, B, T, NH, NKV, HD, workspace, workspace_bytes, stream);
      }))
    return;
  const double scale = 1.0 / std::sqrt(static_cast<double>(HD));
  if (use_tensor_cores(path, HD, {out, qkv})) {
    const float sl2 = static_cast<float>(scale * 1.4426950408889634);
    switch (HD) {
      case 32: launch_forward_tc<32>(out, lse, qkv, B, T, NH, NKV, sl2, stream); return;
      case 64: launch_forward_tc<64>(out, lse, qkv, B, T, NH, NKV, sl2, stream); return;
      case 128: launch_forward_tc<128>(out, lse, qkv, B, T, NH, NKV, sl2, stream); return;
    }
  }
  const Dims d{T, NH, NKV, HD, static_cast<int64_t>(NH + 2 * NKV) * HD, static_cast<int64_t>(NH) * HD};
  const int64_t rows = static_cast<int64_t>(B) * NH * T;
  attn_fwd_generic_kernel<<<detail::blocks_for(rows, kRowWarps), kRowThreads, 0, stream>>>(out, lse, qkv, rows, d,
                                                                                          static_cast<float>(scale));
  CUDA_CHECK_LAUNCH("attention_forward (generic)");
}

size_t attention_backward_scratch_bytes(int B, int T, int NH) {
  return sizeof(float) * static_cast<size_t>(B) * static_cast<size_t>(T) * static_cast<size_t>(NH);
}

void attention_backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out, const float* lse, int B,
                        int T, int NH, int NKV, int HD, void* scratch, size_t scratch_bytes, cudaStream_t stream,
                        AttentionPath path) {
  check_shape("attention_backward", B, T, NH, NKV, HD);
  if (B == 0 || T == 0) return;
  ESPLAG_CHECK(dqkv && dout && qkv && out && lse, "attention_backward: buffers must not be null");
  const size_t need = attention_backward_scratch_bytes(B, T, NH);
  ESPLAG_CHECK(scratch && scratch_bytes >= need, "attention_backward: scratch of ", scratch_bytes,
               " bytes is too small, need ", need, " (attention_backward_scratch_bytes)");
  if (take_cudnn("attention_backward", path, B, T, NH, NKV, HD, {dqkv, dout, qkv, out, lse}, scratch_bytes, true) &&
      run_cudnn("attention_backward", path, B, T, NH, NKV, HD, [&] {
        detail::cudnn_attention_backward(dqkv, dout, qkv, out, lse, B, T, NH, NKV, HD,
                                         path != AttentionPath::cudnn_nondeterministic, scratch, scratch_bytes,
                                         stream);
      }))
    return;
  float* delta = static_cast<float*>(scratch);
  const int64_t drows = static_cast<int64_t>(B) * T * NH;
  attn_delta_kernel<<<detail::blocks_for(drows, kRowWarps), kRowThreads, 0, stream>>>(delta, dout, out, B, T, NH, HD);
  CUDA_CHECK_LAUNCH("attention_backward (delta)");

  const double scale = 1.0 / std::sqrt(static_cast<double>(HD));
  if (use_tensor_cores(path, HD, {dqkv, dout, qkv})) {
    const float s = static_cast<float>(scale), sl2 = static_cast<float>(scale * 1.4426950408889634);
    switch (HD) {
      case 32: launch_backward_tc<32>(dqkv, dout, qkv, lse, delta, B, T, NH, NKV, s, sl2, stream); return;
      case 64: launch_backward_tc<64>(dqkv, dout, qkv, lse, delta, B, T, NH, NKV, s, sl2, stream); return;
      case 128: launch_backward_tc<128>(dqkv, dout, qkv, lse, delta, B, T, NH, NKV, s, sl2, stream); return;
    }
  }
  const Dims d{T, NH, NKV, HD, static_cast<int64_t>(NH + 2 * NKV) * HD, static_cast<int64_t>(NH) * HD};
  const int64_t kv_rows = static_cast<int64_t>(B) * NKV * T, q_rows = static_cast<int64_t>(B) * NH * T;
  attn_bwd_dkv_generic_kernel<<<detail::blocks_for(kv_rows, kRowWarps), kRowThreads, 0, stream>>>(
      dqkv, dout, qkv, lse, delta, kv_rows, d, static_cast<float>(scale));
  CUDA_CHECK_LAUNCH("attention_backward dK/dV (generic)");
  attn_bwd_dq_generic_kernel<<<detail::blocks_for(q_rows, kRowWarps), kRowThreads, 0, stream>>>(
      dqkv, dout, qkv, lse, delta, q_rows, d, static_cast<float>(scale));
  CUDA_CHECK_LAUNCH("attention_backward dQ (generic)");
}

}  // namespace esplag::gpu
