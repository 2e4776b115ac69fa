// LayerNorm and RMSNorm over the last dimension, with the statistics that backward needs
// saved by forward (backward reads eps only through the saved rstd).
#pragma once

namespace esplag::cpu {

constexpr double kNormEps = 1e-5;  // the default of ModelConfig::norm_eps

// out = (x - mean) * rstd * weight + bias, rstd = 1/sqrt(var(x) + eps).  inp/out: [N, C]; mean, rstd: [N];
// bias may be null.
template <typename T>
void layernorm_forward(T* out, T* mean, T* rstd, const T* inp, const T* weight, const T* bias, int N, int C,
                       double eps = kNormEps);
template <typename T>
void layernorm_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight,
                        const T* mean, const T* rstd, int N, int C);

// out = x * rstd * weight, rstd = 1/sqrt(mean(x^2) + eps).
template <typename T>
void rmsnorm_forward(T* out, T* rstd, const T* inp, const T* weight, int N, int C, double eps = kNormEps);
template <typename T>
void rmsnorm_backward(T* dinp, T* dweight, const T* dout, const T* inp, const T* weight, const T* rstd, int N,
                      int C);

}  // namespace esplag::cpu
