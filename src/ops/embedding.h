// Token embedding plus optional learned position embedding.
#pragma once
#include <cstdint>

namespace esplag::cpu {

// out[b,t,:] = wte[tokens[b,t],:] + (wpe ? wpe[t,:] : 0).   out: [B*T, C]
template <typename T>
void embedding_forward(T* out, const int32_t* tokens, const T* wte, const T* wpe, int B, int Tlen, int C);

// dwte[tokens[b,t],:] += dout[b,t,:];  dwpe[t,:] += dout[b,t,:] (if dwpe).
template <typename T>
void embedding_backward(T* dwte, T* dwpe, const T* dout, const int32_t* tokens, int B, int Tlen, int C);

}  // namespace esplag::cpu
