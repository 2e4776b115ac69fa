// SwiGLU's value and gradients, one device function each, used by the activation kernels
// (ops/cuda/fused_step.cu) and by SwiGLU's fp8 producers (ops/cuda/fp8_swiglu.cu), so that
// they agree bit for bit.
#pragma once

namespace esplag::gpu::detail {

__device__ __forceinline__ float sigmoidf(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float swiglu_value(float g, float u) { return g * sigmoidf(g) * u; }
// d · ∂/∂gate of swiglu_value(g, u), with d silu/dg = σ(1 + g(1 - σ)).
__device__ __forceinline__ float swiglu_grad_gate(float g, float u, float d) {
  const float sg = sigmoidf(g);
  return d * u * (sg * (1.f + g * (1.f - sg)));
}
// d · ∂/∂up of swiglu_value(g, u): d · silu(g).
__device__ __forceinline__ float swiglu_grad_up(float g, float d) { return d * (g * sigmoidf(g)); }

}  // namespace esplag::gpu::detail
