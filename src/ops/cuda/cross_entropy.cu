// Fused softmax cross-entropy, and distillation's loss, one block per row of logits.
//
// Pass 1 reads the row once with an online softmax (running max and rescaled sum per
// thread, fp32), combined across the block by butterfly reductions so every thread holds
// the same (max, sum). Pass 2 re-reads the row (from L2 for vocabulary-sized rows) and
// overwrites it with the gradient. Probabilities are never stored. The distillation
// kernel keeps three such (max, sum) pairs in pass 1 (the student's logits, at 1 and at the
// temperature, and the teacher's at the temperature) and sums the KL divergence in pass 2.
#include <cmath>

#include "core/error.h"
#include "ops/cuda/common.cuh"
#include "ops/gpu.h"

namespace esplag::gpu {

namespace {

using detail::kPack;
using detail::load8;
using detail::store8;
using detail::to_bf;
using detail::to_f;

constexpr int kThreads = 512;

struct MaxSum {
  float m, s;
};

__device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.f};
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};  // exp(-inf) = 0 for an empty side
}

// Symmetric combine in a butterfly: every lane ends with the same value.
__device__ __forceinline__ MaxSum warp_combine(MaxSum v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    MaxSum w{__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)};
    v = combine(v, w);
  }
  return v;
}

__device__ __forceinline__ void online_add(MaxSum& a, float x) {
  if (x > a.m) {
    a.s = a.s * expf(a.m - x) + 1.f;
    a.m = x;
  } else {
    a.s += expf(x - a.m);
  }
}

// Block-wide symmetric combine of one (max, sum) per thread; every thread gets the total.
// `sm`, `ss`: 32 floats of shared memory each, free on entry.
__device__ __forceinline__ MaxSum block_combine(MaxSum v, float* sm, float* ss) {
  v = warp_combine(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    sm[warp] = v.m;
    ss[warp] = v.s;
  }
  __syncthreads();
  MaxSum tot = lane < kThreads / 32 ? MaxSum{sm[lane], ss[lane]} : MaxSum{-INFINITY, 0.f};
  return warp_combine(tot);
}

template <bool kVec>
__global__ void __launch_bounds__(kThreads)
    cross_entropy_kernel(float* losses, bf16* logits, const int32_t* targets, int V, int Vp, float dloss,
                         bool write_dlogits) {
  __shared__ float sm[32], ss[32];
  const int64_t row = blockIdx.x;
  bf16* x = logits + row * Vp;
  const int target = targets[row];
  const bool valid = target >= 0 && target < V;
  const int first = kVec ? threadIdx.x * kPack : threadIdx.x, step = kVec ? kThreads * kPack : kThreads;
  MaxSum acc{-INFINITY, 0.f};
  for (int c = first; c < V; c += step) {
    if constexpr (kVec) {
      float v[kPack];
      load8(v, x + c);
#pragma unroll
      for (int k = 0; k < kPack; ++k)
        if (c + k < V) online_add(acc, v[k]);
    } else {
      online_add(acc, to_f(x[c]));
    }
  }
  // Read before pass 2 overwrites the row; the barriers below order it.
  const float xt = valid ? to_f(x[target]) : 0.f;
  const MaxSum tot = block_combine(acc, sm, ss);
  const float nan = __int_as_float(0x7fffffff);
  if (threadIdx.x == 0) losses[row] = valid ? logf(tot.s) - (xt - tot.m) : nan;
  if (!write_dlogits) return;
  const float scale = dloss / tot.s;
  for (int c = first; c < Vp; c += step) {
    if constexpr (kVec) {
      float v[kPack];
      load8(v, x + c);
#pragma unroll
      for (int k = 0; k < kPack; ++k) {
        const int col = c + k;
        v[k] = !valid ? nan : col < V ? expf(v[k] - tot.m) * scale - (col == target ? dloss : 0.f) : 0.f;
      }
      store8(x + c, v);
    } else {
      const float e = expf(to_f(x[c]) - tot.m) * scale;
      x[c] = to_bf(!valid ? nan : c < V ? e - (c == target ? dloss : 0.f) : 0.f);
    }
  }
}

// ops/distill.h's distill_cross_entropy on one row (see ops/gpu.h). Scalar loads: the
// kernel runs on the LM head's chunk once per step, beside three GEMMs of its size.
__global__ void __launch_bounds__(kThreads)
    distill_kernel(float* losses, float* ce, float* kl, bf16* logits, const bf16* teacher, const int32_t* targets,
                   int V, int Vp, float alpha, float inv_temp, float dce, float dkl, float kl_weight,
                   bool write_dlogits) {
  __shared__ float sm[32], ss[32], sk[32];
  const int64_t row = blockIdx.x;
  bf16* x = logits + row * Vp;
  const bf16* t = teacher + row * Vp;
  const int target = targets[row];
  const bool valid = target >= 0 && target < V;
  MaxSum p{-INFINITY, 0.f}, ps{-INFINITY, 0.f}, qs{-INFINITY, 0.f};  // softmax(x), of x/T, of t/T
  for (int c = threadIdx.x; c < V; c += kThreads) {
    const float xv = to_f(x[c]);
    online_add(p, xv);
    online_add(ps, xv * inv_temp);
    online_add(qs, to_f(t[c]) * inv_temp);
  }
  const float xt = valid ? to_f(x[target]) : 0.f;  // read before pass 2 overwrites the row
  p = block_combine(p, sm, ss);
  __syncthreads();
  ps = block_combine(ps, sm, ss);
  __syncthreads();
  qs = block_combine(qs, sm, ss);
  // KL(q_T || p_T) = Σ q_T · (log q_T - log p_T), with log q_T = a - log Σ_q, log p_T = b - log Σ_p.
  const float log_ratio = logf(ps.s) - logf(qs.s), inv_ps = 1.f / ps.s, inv_qs = 1.f / qs.s, inv_p = 1.f / p.s;
  const float nan = __int_as_float(0x7fffffff);
  float k = 0.f;
  for (int c = threadIdx.x; c < Vp; c += kThreads) {
    if (c >= V) {
      if (write_dlogits) x[c] = to_bf(0.f);
      continue;
    }
    const float xv = to_f(x[c]);
    const float a = to_f(t[c]) * inv_temp - qs.m, b = xv * inv_temp - ps.m;
    const float q = expf(a) * inv_qs;
    k += q * (a - b + log_ratio);
    if (write_dlogits) {
      const float d = dce * (expf(xv - p.m) * inv_p - (c == target ? 1.f : 0.f)) + dkl * (expf(b) * inv_ps - q);
      x[c] = to_bf(valid ? d : nan);
    }
  }
  k = detail::warp_sum(k);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) sk[warp] = k;
  __syncthreads();
  if (threadIdx.x != 0) return;
  float total = 0.f;
  for (int w = 0; w < kThreads / 32; ++w) total += sk[w];
  const float row_ce = valid ? logf(p.s) - (xt - p.m) : nan, row_kl = fmaxf(total, 0.f);
  ce[row] = row_ce;
  kl[row] = row_kl;
  losses[row] = (1.f - alpha) * row_ce + kl_weight * row_kl;
}

}  // namespace

void distill_cross_entropy(float* losses, float* ce, float* kl, bf16* logits, const bf16* teacher,
                           const int32_t* targets, int64_t N, int V, int Vp, double alpha, double temperature,
                           float dloss, bool write_dlogits, cudaStream_t stream) {
  ESPLAG_CHECK(N >= 0 && V > 0 && Vp >= V, "distill_cross_entropy: bad size N=", N, ", V=", V, ", Vp=", Vp);
  ESPLAG_CHECK(N <= 0x7fffffff, "distill_cross_entropy: N=", N, " rows in one call is too many");
  ESPLAG_CHECK(alpha >= 0.0 && alpha <= 1.0, "distill_cross_entropy: alpha must be in [0, 1], got ", alpha);
  ESPLAG_CHECK(temperature > 0.0 && std::isfinite(temperature),
               "distill_cross_entropy: temperature must be positive, got ", temperature);
  if (N == 0) return;
  const float dce = static_cast<float>(1.0 - alpha) * dloss, dkl = static_cast<float>(alpha * temperature) * dloss;
  distill_kernel<<<static_cast<unsigned>(N), kThreads, 0, stream>>>(
      losses, ce, kl, logits, teacher, targets, V, Vp, static_cast<float>(alpha), static_cast<float>(1.0 / temperature),
      dce, dkl, static_cast<float>(alpha * temperature * temperature), write_dlogits);
  CUDA_CHECK_LAUNCH("distill_cross_entropy");
}

void softmax_cross_entropy(float* losses, bf16* logits, const int32_t* targets, int64_t N, int V, int Vp,
                           float dloss, bool write_dlogits, cudaStream_t stream) {
  ESPLAG_CHECK(N >= 0 && V > 0 && Vp >= V, "softmax_cross_entropy: bad size N=", N, ", V=", V, ", Vp=", Vp);
  ESPLAG_CHECK(N <= 0x7fffffff, "softmax_cross_entropy: N=", N, " rows in one call is too many");
  if (N == 0) return;
  const bool vec = Vp % kPack == 0 && detail::aligned16(logits);
  const unsigned grid = static_cast<unsigned>(N);
  if (vec)
    cross_entropy_kernel<true><<<grid, kThreads, 0, stream>>>(losses, logits, targets, V, Vp, dloss, write_dlogits);
  else
    cross_entropy_kernel<false><<<grid, kThreads, 0, stream>>>(losses, logits, targets, V, Vp, dloss, write_dlogits);
  CUDA_CHECK_LAUNCH("softmax_cross_entropy");
}

}  // namespace esplag::gpu
