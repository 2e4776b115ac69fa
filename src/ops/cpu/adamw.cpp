#include "ops/adamw.h"

#include <cstdint>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"

namespace esplag::cpu {

namespace {
// Chunk of the gradient summed by one task. A constant (not derived from the thread
// count) so that the order of the floating-point additions never changes.
constexpr int64_t kNormChunk = 1 << 14;
}  // namespace

template <typename T>
void adamw_step(T* param, const T* grad, T* m, T* v, int64_t n, double lr, double beta1, double beta2, double eps,
                double weight_decay, int64_t step, double grad_scale) {
  ESPLAG_CHECK(n >= 0, "adamw_step: negative element count ", n);
  ESPLAG_CHECK(step >= 1, "adamw_step: step is 1-based (the bias corrections divide by 1 - beta^step), got ", step);
  ESPLAG_CHECK(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1, "adamw_step: betas must lie in [0, 1), got beta1=",
               beta1, ", beta2=", beta2);
  ESPLAG_CHECK(lr >= 0 && eps >= 0 && weight_decay >= 0, "adamw_step: lr, eps and weight_decay must be >= 0, got lr=",
               lr, ", eps=", eps, ", weight_decay=", weight_decay);
  ESPLAG_CHECK(std::isfinite(grad_scale), "adamw_step: grad_scale is ", grad_scale);
  if (n == 0) return;
  ESPLAG_CHECK(param && grad && m && v, "adamw_step: null buffer for ", n, " elements");

  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  parallel_for(
      n,
      [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const double g = static_cast<double>(grad[i]) * grad_scale;
          const double mi = beta1 * static_cast<double>(m[i]) + (1.0 - beta1) * g;
          const double vi = beta2 * static_cast<double>(v[i]) + (1.0 - beta2) * g * g;
          const double p = static_cast<double>(param[i]);
          const double update = (mi / bc1) / (std::sqrt(vi / bc2) + eps) + weight_decay * p;
          m[i] = static_cast<T>(mi);
          v[i] = static_cast<T>(vi);
          param[i] = static_cast<T>(p - lr * update);
        }
      },
      1 << 14);
}

template <typename T>
double global_grad_norm_squared(const T* grad, int64_t n) {
  ESPLAG_CHECK(n >= 0, "global_grad_norm_squared: negative element count ", n);
  if (n == 0) return 0.0;
  ESPLAG_CHECK(grad != nullptr, "global_grad_norm_squared: null gradient for ", n, " elements");
  const int64_t chunks = (n + kNormChunk - 1) / kNormChunk;
  std::vector<double> partial(static_cast<size_t>(chunks));
  parallel_for(
      chunks,
      [&](int64_t c0, int64_t c1) {
        for (int64_t c = c0; c < c1; ++c) {
          const int64_t begin = c * kNormChunk, end = std::min(n, begin + kNormChunk);
          // Four interleaved accumulators break the dependency chain of one running sum;
          // their combination order is fixed, so the result still is.
          double acc[4] = {0, 0, 0, 0};
          int64_t i = begin;
          for (; i + 4 <= end; i += 4)
            for (int k = 0; k < 4; ++k) {
              const double g = static_cast<double>(grad[i + k]);
              acc[k] += g * g;
            }
          for (; i < end; ++i) {
            const double g = static_cast<double>(grad[i]);
            acc[0] += g * g;
          }
          partial[static_cast<size_t>(c)] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
        }
      },
      2);
  double total = 0.0;
  for (double p : partial) total += p;
  return total;
}

double clip_scale(double norm, double max_norm) {
  if (!(max_norm > 0)) return 1.0;
  ESPLAG_CHECK(std::isfinite(norm) && norm >= 0, "clip_scale: gradient norm must be finite and non-negative, got ",
               norm);
  return std::min(1.0, max_norm / (norm + 1e-6));
}

template void adamw_step<float>(float*, const float*, float*, float*, int64_t, double, double, double, double, double,
                                int64_t, double);
template void adamw_step<double>(double*, const double*, double*, double*, int64_t, double, double, double, double,
                                 double, int64_t, double);
template double global_grad_norm_squared<float>(const float*, int64_t);
template double global_grad_norm_squared<double>(const double*, int64_t);

}  // namespace esplag::cpu
