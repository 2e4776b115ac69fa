// AdamW (Loshchilov & Hutter) with decoupled weight decay and bias correction, the
// global gradient norm used for clipping, and the clipping factor.
#pragma once
#include <cstdint>

namespace esplag::cpu {

// One AdamW step on n parameters, in place. step is 1-based (the bias corrections
// need t >= 1). Per element, with g = grad * grad_scale:
//   m = beta1 m + (1 - beta1) g          v = beta2 v + (1 - beta2) g^2
//   m_hat = m / (1 - beta1^t)            v_hat = v / (1 - beta2^t)
//   param -= lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * param)
// The weight decay uses the parameter before this step's update (PyTorch's AdamW).
// grad_scale folds gradient clipping (clip_scale) or loss-scale removal into the step
// without a separate pass over the gradients. Arithmetic is done in double per element.
template <typename T>
void adamw_step(T* param, const T* grad, T* m, T* v, int64_t n, double lr, double beta1, double beta2, double eps,
                double weight_decay, int64_t step, double grad_scale = 1.0);

// Sum of grad[i]^2 in double. The order of the additions is fixed (partial sums over
// fixed-size chunks, then the partials in chunk order), so the result is bit-identical
// for any thread count.
template <typename T>
double global_grad_norm_squared(const T* grad, int64_t n);

// The factor that brings a gradient of norm `norm` down to `max_norm`:
// min(1, max_norm / (norm + 1e-6)). max_norm <= 0 disables clipping (returns 1).
// Throws when clipping is enabled and norm is negative or not finite.
double clip_scale(double norm, double max_norm);

}  // namespace esplag::cpu
