// SwiGLU's value and gradients, used by the activation kernels (ops/cuda/activation.cu,
// ops/cuda/fused_step.cu) and by SwiGLU's fp8 producers (ops/cuda/fp8_swiglu.cu), so that
// they agree bit for bit.
#pragma once

namespace esplag::gpu::detail {

// σ(x) from the fast exponential and division (ex2.approx, rcp.approx): a few fp32 ulps off
// the IEEE expf and quotient, far below the bf16 rounding every use of it ends in, and a
// few instructions where those take several each (SwiGLU's fp8 producers are bound by
// instructions: docs/fp8.md). Saturates as σ does: 0 once e^-x overflows (x < -88), 1 once
// it underflows.
__device__ __forceinline__ float sigmoidf(float x) { return __fdividef(1.f, 1.f + __expf(-x)); }
__device__ __forceinline__ float swiglu_value(float g, float u) { return g * sigmoidf(g) * u; }

// The backward at gate g, up u and output gradient d, from one sigmoid: d · ∂/∂gate (with
// d silu/dg = σ(1 + g(1 - σ))), d · ∂/∂up = d · silu(g), and the value again (swiglu_value's
// bits).
struct SwigluBackward {
  float gate, up, value;
};
__device__ __forceinline__ SwigluBackward swiglu_backward_at(float g, float u, float d) {
  const float sg = sigmoidf(g), silu = g * sg;
  return {d * u * (sg * (1.f + g * (1.f - sg))), d * silu, silu * u};
}

}  // namespace esplag::gpu::detail
