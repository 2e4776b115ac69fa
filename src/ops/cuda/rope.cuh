// RoPE's angles and rotation as device functions, shared by the kernels that rotate
// (rope.cu for training, decode_attention.cu for generation), so that they agree bit for bit.
#pragma once

#include "ops/cuda/common.cuh"

namespace esplag::gpu::detail {

// cos and sin of the angle pos · theta^(-2i/HD) of pair i, in fp64 (positions reach the
// thousands, where an fp32 angle is already off in its last bits before the cosine is
// taken), rounded to fp32.
__device__ __forceinline__ float2 rope_cos_sin(double pos, int i, int HD, double theta) {
  const double angle = pos * pow(theta, -2.0 * i / HD);
  double sd, cd;
  sincos(angle, &sd, &cd);
  return {static_cast<float>(cd), static_cast<float>(sd)};
}

// The pair (a, b) = (x[i], x[i + HD/2]) rotated by the angle of cosine c and sine s (the
// backward passes -s). Rounded as written: each kernel gets the same fused multiply-adds,
// whatever the compiler would contract around it.
__device__ __forceinline__ float2 rope_rotate(float a, float b, float c, float s) {
  return {__fmaf_rn(a, c, -__fmul_rn(b, s)), __fmaf_rn(b, c, __fmul_rn(a, s))};
}

}  // namespace esplag::gpu::detail
