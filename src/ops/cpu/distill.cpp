#include "ops/distill.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/error.h"
#include "core/parallel.h"

namespace esplag::cpu {

template <typename T>
void distill_cross_entropy(T* ce, T* kl, T* dlogits, const T* logits, const T* teacher, const int32_t* targets,
                           int64_t N, int V, double alpha, double temperature, T dloss) {
  ESPLAG_CHECK(V > 0, "distill_cross_entropy: vocabulary size must be positive, got ", V);
  ESPLAG_CHECK(alpha >= 0.0 && alpha <= 1.0, "distill_cross_entropy: alpha must be in [0, 1], got ", alpha);
  ESPLAG_CHECK(temperature > 0.0 && std::isfinite(temperature),
               "distill_cross_entropy: temperature must be positive, got ", temperature);
  // Validated up front: nothing may throw from inside a worker thread.
  for (int64_t n = 0; n < N; ++n)
    ESPLAG_CHECK(targets[n] >= 0 && targets[n] < V, "distill_cross_entropy: target ", targets[n], " at row ", n,
                 " is outside the vocabulary [0, ", V, ")");
  const T inv_temp = static_cast<T>(1.0 / temperature);
  // (1 - alpha)·dloss is dloss itself when alpha = 0: the cross-entropy part is then
  // softmax_cross_entropy's arithmetic exactly.
  const T dce = static_cast<T>(1.0 - alpha) * dloss;
  const T dkl = static_cast<T>(alpha * temperature) * dloss;
  parallel_for(
      N,
      [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; ++n) {
          const T* x = logits + n * V;
          const T* t = teacher + n * V;
          // Every softmax is shifted by its row maximum (see softmax_cross_entropy). Dividing by
          // a positive temperature keeps the order, so max(x / temperature) = max(x) / temperature.
          T m = x[0], mt = t[0];
          for (int v = 1; v < V; ++v) m = std::max(m, x[v]), mt = std::max(mt, t[v]);
          const T ms = m * inv_temp, mts = mt * inv_temp;
          double sum = 0, sum_s = 0, sum_t = 0;
          T* d = dlogits ? dlogits + n * V : nullptr;
          for (int v = 0; v < V; ++v) {
            const T e = std::exp(x[v] - m);
            if (d) d[v] = e;
            sum += e;
            sum_s += std::exp(x[v] * inv_temp - ms);
            sum_t += std::exp(t[v] * inv_temp - mts);
          }
          ce[n] = static_cast<T>(std::log(sum) - double(x[targets[n]] - m));
          // log q_T[v] - log p_T[v] = (t[v]/T - mts - log sum_t) - (x[v]/T - ms - log sum_s)
          const double log_ratio = std::log(sum_s) - std::log(sum_t);
          double k = 0;
          for (int v = 0; v < V; ++v) {
            const double a = double(t[v] * inv_temp - mts), b = double(x[v] * inv_temp - ms);
            k += std::exp(a) / sum_t * (a - b + log_ratio);
          }
          kl[n] = static_cast<T>(std::max(k, 0.0));  // >= 0 in exact arithmetic; rounding may dip below
          if (!d) continue;
          const T scale = static_cast<T>(1.0 / sum) * dce;
          for (int v = 0; v < V; ++v) d[v] *= scale;
          d[targets[n]] -= dce;
          if (alpha == 0.0) continue;
          const T inv_s = static_cast<T>(1.0 / sum_s), inv_t = static_cast<T>(1.0 / sum_t);
          for (int v = 0; v < V; ++v)
            d[v] += dkl * (std::exp(x[v] * inv_temp - ms) * inv_s - std::exp(t[v] * inv_temp - mts) * inv_t);
        }
      },
      4);
}

template void distill_cross_entropy<float>(float*, float*, float*, const float*, const float*, const int32_t*, int64_t,
                                           int, double, double, float);
template void distill_cross_entropy<double>(double*, double*, double*, const double*, const double*, const int32_t*,
                                            int64_t, int, double, double, double);

}  // namespace esplag::cpu
