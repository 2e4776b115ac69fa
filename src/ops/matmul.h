// Linear layer: out = inp · Wᵀ + bias, W stored [OC, C] (PyTorch's nn.Linear layout).
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
