// The norms' device pieces (LayerNorm and RMSNorm): the backward's row sums, which norm.cu's
// and fused_step.cu's backward kernels share, and the forward kernel, fused with the residual
// add, with what it does with its output left to a sink: norm.cu's stores the bf16 values,
// fp8_norm.cu's their fp8 codes. One warp per row: the row is read with 16-byte loads when C is a
// multiple of 8 and the pointers are aligned (scalar loads otherwise), statistics are warp
// butterfly sums in fp32, and the row is re-read from L1/L2 for each pass instead of being
// held in registers, so any C works.
#pragma once

#include "ops/cuda/common.cuh"
#include "ops/cuda/pending_scale.cuh"

namespace esplag::gpu::detail {

constexpr int kNormRowsPerBlock = 8;
constexpr int kNormThreads = 32 * kNormRowsPerBlock;

// Loads the eight elements at column c (vector path) or element c (scalar path) of the
// row; kVec callers step c by 8 * 32, scalar callers by 32.
template <bool kVec>
__device__ __forceinline__ int load_n(float (&f)[kPack], const bf16* row, int c, int C) {
  if constexpr (kVec) {
    load8(f, row + c);
    return kPack;
  } else {
    f[0] = to_f(row[c]);
    return 1;
  }
}

template <bool kVec>
__device__ __forceinline__ void store_n(bf16* row, int c, const float (&f)[kPack]) {
  if constexpr (kVec)
    store8(row + c, f);
  else
    row[c] = to_bf(f[0]);
}

// The backward's row sums of n values at one column: sg += Σ g, sgx += Σ g·x̂ (LayerNorm,
// x̂ = (x - mean)·rstd) or sgx += Σ g·x (RMSNorm), g = dout·w.
template <bool kRms>
__device__ __forceinline__ void add_row_sums(float& sg, float& sgx, const float (&d)[kPack], const float (&x)[kPack],
                                             const float (&w)[kPack], float m, float r, int n) {
  for (int k = 0; k < n; ++k) {
    const float g = d[k] * w[k];
    if constexpr (kRms) {
      sgx += g * x[k];
    } else {
      sg += g;
      sgx += g * ((x[k] - m) * r);
    }
  }
}

// The norm's output at x, in fp32: LayerNorm (x - mean)·rstd·w + bias, RMSNorm x·rstd·w.
template <bool kRms>
__device__ __forceinline__ float norm_output(float x, float mean, float rstd, float w, float bias) {
  if constexpr (kRms)
    return x * rstd * w;
  else
    return (x - mean) * rstd * w + bias;
}

// x = bf16(a + b) (written to res; b scaled by b_scale as it is read) or a; LayerNorm:
// y = (x - mean) rstd w + bias, RMSNorm: y = x rstd w; rstd = rsqrt(var(x) + eps), or
// rsqrt(mean(x²) + eps). The sink: begin() before any row, put(row offset, c, y, n) for the
// n values of y at column c of a row (in fp32, before any rounding), finish() after; every
// thread of the block calls begin and finish, so a sink may synchronise the block there.
template <bool kVec, bool kRms, class Sink>
__global__ void __launch_bounds__(kNormThreads)
    norm_forward_kernel(Sink sink, float* mean, float* rstd, bf16* res, const bf16* a, const bf16* b,
                        PendingScale b_scale, const bf16* weight, const bf16* bias, int N, int C, float eps) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kNormRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  sink.begin();
  if (row < N) {  // whole warps skip the rows past N
    const int64_t off = row * C;
    const int first = kVec ? lane * kPack : lane, step = kVec ? 32 * kPack : 32;
    const bf16* x = a + off;
    float s = 0.f;
    if (b) {
      const PendingFactor scaled(b_scale);
      bf16* r = res + off;
      for (int c = first; c < C; c += step) {
        float va[kPack], vb[kPack];
        const int n = load_n<kVec>(va, a + off, c, C);
        load_n<kVec>(vb, b + off, c, C);
        for (int k = 0; k < n; ++k) {
          va[k] = to_f(to_bf(va[k] + scaled(vb[k])));  // the norm sees exactly what is stored
          s += kRms ? va[k] * va[k] : va[k];
        }
        store_n<kVec>(r, c, va);
      }
      x = r;  // each lane re-reads only what it wrote itself
    } else {
      for (int c = first; c < C; c += step) {
        float v[kPack];
        const int n = load_n<kVec>(v, x, c, C);
        for (int k = 0; k < n; ++k) s += kRms ? v[k] * v[k] : v[k];
      }
    }
    s = warp_sum(s);
    float m = 0.f, r;
    if constexpr (kRms) {
      r = rsqrtf(s / C + eps);
    } else {
      m = s / C;
      float var = 0.f;  // two passes: Σ(x - m)² does not cancel like Σx² - C m²
      for (int c = first; c < C; c += step) {
        float v[kPack];
        const int n = load_n<kVec>(v, x, c, C);
        for (int k = 0; k < n; ++k) {
          const float d = v[k] - m;
          var += d * d;
        }
      }
      var = warp_sum(var);
      r = rsqrtf(var / C + eps);
    }
    for (int c = first; c < C; c += step) {
      float v[kPack], w[kPack], bi[kPack];
      const int n = load_n<kVec>(v, x, c, C);
      load_n<kVec>(w, weight, c, C);
      if (!kRms && bias) load_n<kVec>(bi, bias, c, C);
      for (int k = 0; k < n; ++k) v[k] = norm_output<kRms>(v[k], m, r, w[k], !kRms && bias ? bi[k] : 0.f);
      sink.put(off, c, v, n);
    }
    if (lane == 0) {
      if (mean && !kRms) mean[row] = m;
      if (rstd) rstd[row] = r;
    }
  }
  sink.finish();
}

}  // namespace esplag::gpu::detail
