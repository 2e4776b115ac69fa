// A gpu::PendingScale (ops/gpu_pending_scale.h) applied as values are loaded, by every op
// that takes one and by the pass that applies it in place (apply_pending_scale): one
// expression, so they all compute from the same bits.
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
  // Each of n values as the scalar form makes it, rounded two at a time (the same bits).
  template <int n>
  __device__ __forceinline__ void apply(float (&v)[n]) const {
    if (!on_) return;
#pragma unroll
    for (int k = 0; k < n; ++k) v[k] *= f_;
    round_to_bf16(v);
  }

 private:
  bool on_;
  float f_;
};

}  // namespace esplag::gpu::detail
