#include "ops/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "core/error.h"
#include "core/parallel.h"

namespace esplag::cpu {

template <typename T>
void softmax_cross_entropy(T* losses, T* dlogits, const T* logits, const int32_t* targets, int64_t N, int V,
                           T dloss) {
  ESPLAG_CHECK(V > 0, "softmax_cross_entropy: vocabulary size must be positive, got ", V);
  // Validated up front: nothing may throw from inside a worker thread.
  for (int64_t n = 0; n < N; ++n)
    ESPLAG_CHECK(targets[n] >= 0 && targets[n] < V, "softmax_cross_entropy: target ", targets[n], " at row ", n,
                 " is outside the vocabulary [0, ", V, ")");
  parallel_for(
      N,
      [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; ++n) {
          const T* x = logits + n * V;
          // Shifting by the row maximum keeps every exp in (0, 1]: no overflow, and the
          // largest term is exactly 1, so the sum cannot underflow to 0.
          T m = x[0];
          for (int v = 1; v < V; ++v) m = std::max(m, x[v]);
          double sum = 0;
          if (dlogits) {
            T* d = dlogits + n * V;
            for (int v = 0; v < V; ++v) {
              const T e = std::exp(x[v] - m);
              d[v] = e;  // kept so the gradient pass needs no second exp
              sum += e;
            }
            const T scale = static_cast<T>(1.0 / sum) * dloss;
            for (int v = 0; v < V; ++v) d[v] *= scale;
            d[targets[n]] -= dloss;
          } else {
            for (int v = 0; v < V; ++v) sum += std::exp(x[v] - m);
          }
          // logsumexp - x[t] = log(sum) - (x[t] - m)
          losses[n] = static_cast<T>(std::log(sum) - double(x[targets[n]] - m));
        }
      },
      4);
}

template void softmax_cross_entropy<float>(float*, float*, const float*, const int32_t*, int64_t, int, float);
template void softmax_cross_entropy<double>(double*, double*, const double*, const int32_t*, int64_t, int,
                                            double);

}  // namespace esplag::cpu
