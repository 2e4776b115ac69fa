// Device arithmetic shared by the AdamW kernels (ops/cuda/adamw.cu, ops/cuda/fused_step.cu,
// sparse/cuda/sparse_adamw.cu): one copy of the per-element update, of the gradient-clip
// factor and of the fp64 sum of the norm partials, so that the three kernels compute the
// same expressions in the same order and agree bit for bit.
#pragma once
#include <cuda_runtime.h>

namespace esplag::gpu::detail {

// cpu::adamw_step's update of one element: the moments, then the bias-corrected step with
// decoupled weight decay. inv_bc1 / inv_bc2 are 1 / (1 - beta^step).
__device__ __forceinline__ void adamw_element(float& p, float& m, float& v, float g, float lr, float beta1,
                                              float beta2, float eps, float inv_bc1, float inv_bc2, float wd) {
  m = beta1 * m + (1.f - beta1) * g;
  v = beta2 * v + (1.f - beta2) * g * g;
  const float mhat = m * inv_bc1, vhat = v * inv_bc2;
  p -= lr * (mhat / (sqrtf(vhat) + eps) + wd * p);
}

// cpu::clip_scale: the factor that brings a gradient of squared norm norm_sq to max_norm.
__device__ __forceinline__ float clip_factor(float norm_sq, float max_norm) {
  return fminf(1.f, max_norm / (sqrtf(norm_sq) + 1e-6f));
}

// The sum of partial[0, count) in fp64 by one block of kThreads threads: strided per-thread
// sums, then a fixed tree over `sh` (kThreads doubles of shared memory), so the additions
// happen in the same order on every run. Every thread gets the result.
template <int kThreads>
__device__ __forceinline__ double sum_partials_fp64(const float* partial, int count, double* sh) {
  double acc = 0.0;
  for (int i = threadIdx.x; i < count; i += kThreads) acc += partial[i];
  sh[threadIdx.x] = acc;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {  // fixed tree
    if (threadIdx.x < s) sh[threadIdx.x] += sh[threadIdx.x + s];
    __syncthreads();
  }
  return sh[0];
}

}  // namespace esplag::gpu::detail
