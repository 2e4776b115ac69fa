// Pointwise MLP activations.
#pragma once
#include <cstdint>

namespace esplag::cpu {

// GELU, tanh approximation (GPT-2): 0.5 x (1 + tanh(√(2/π)(x + 0.044715 x³))).
template <typename T>
void gelu_forward(T* out, const T* inp, int64_t n);
template <typename T>
void gelu_backward(T* dinp, const T* inp, const T* dout, int64_t n);

// SwiGLU: inp rows are [gate (H) | up (H)], out[n,h] = silu(gate) * up.  inp: [N, 2H], out: [N, H].
template <typename T>
void swiglu_forward(T* out, const T* inp, int64_t N, int H);
template <typename T>
void swiglu_backward(T* dinp, const T* inp, const T* dout, int64_t N, int H);

// ReLU²: out = max(x, 0)².
template <typename T>
void relu2_forward(T* out, const T* inp, int64_t n);
template <typename T>
void relu2_backward(T* dinp, const T* inp, const T* dout, int64_t n);

// Residual add: out = a + b (out may alias a or b).
template <typename T>
void residual_forward(T* out, const T* a, const T* b, int64_t n);

}  // namespace esplag::cpu
