// Fused softmax cross-entropy, one block per row of logits.
//
// Pass 1 reads the row once with an online softmax (running max and rescaled sum per
// thread, fp32), combined across the block by butterfly reductions so every thread holds
// the same (max, sum). Pass 2 re-reads the row (from L2 for vocabulary-sized rows) and
// overwrites it with the gradient. Probabilities are never stored.
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
  acc = warp_combine(acc);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    sm[warp] = acc.m;
    ss[warp] = acc.s;
  }
  __syncthreads();
  MaxSum tot = lane < kThreads / 32 ? MaxSum{sm[lane], ss[lane]} : MaxSum{-INFINITY, 0.f};
  tot = warp_combine(tot);
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

}  // namespace

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
