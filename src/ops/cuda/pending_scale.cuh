// A gpu::PendingScale (ops/gpu_pending_scale.h) applied as values are loaded: the same fp32 product and
// rounding as the pass that scales a 2:4 product's output in place (sparse/cuda/cusparselt.cu),
// so the op that applies it computes from the same bits.
#pragma once

#include "ops/cuda/common.cuh"
#include "ops/gpu_pending_scale.h"

namespace esplag::gpu::detail {

class PendingFactor {
 public:
  __device__ __forceinline__ explicit PendingFactor(PendingScale p)
      : on_(p.a != nullptr), f_(on_ ? *p.a * *p.b : 1.f) {}
  // A stored bf16 value (as a float) scaled and rounded to bf16 again; untouched without a scale.
  __device__ __forceinline__ float operator()(float x) const { return on_ ? to_f(to_bf(x * f_)) : x; }
  template <int n>
  __device__ __forceinline__ void apply(float (&v)[n]) const {
    if (!on_) return;
#pragma unroll
    for (int k = 0; k < n; ++k) v[k] = to_f(to_bf(v[k] * f_));
  }

 private:
  bool on_;
  float f_;
};

}  // namespace esplag::gpu::detail
