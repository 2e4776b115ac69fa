// Linear layer: out = inp · Wᵀ + bias, W stored [OC, C] (PyTorch's nn.Linear layout).
//
// All three products run on one cache-blocked, multi-threaded GEMM (cpu/matmul.cpp).
// Every output element is accumulated in order over the reduction dimension, starting
// from the bias (forward) or from the gradient's current value (backward), by a single
// thread: results are bit-identical for any thread count. On x86-64 CPUs with AVX2 and
// FMA a fused-multiply-add kernel is chosen at run time; elsewhere a portable one, whose
// results differ from it by rounding only.
#pragma once

namespace esplag::cpu {

// inp: [N, C], weight: [OC, C], bias: [OC] or null, out: [N, OC].
template <typename T>
void linear_forward(T* out, const T* inp, const T* weight, const T* bias, int N, int C, int OC);

// dinp += dout · W;  dweight += doutᵀ · inp;  dbias += Σ_n dout.  Any output may be null.
template <typename T>
void linear_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight, int N, int C,
                     int OC);

}  // namespace esplag::cpu
