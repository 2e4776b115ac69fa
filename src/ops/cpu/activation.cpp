#include "ops/activation.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>

#include "core/parallel.h"

namespace esplag::cpu {

namespace {

// Elements per thread below which splitting costs more than it saves.
constexpr int64_t kGrain = 1 << 14;

template <typename F>
void for_each_range(int64_t n, const F& f) {
  parallel_for(n, [&](int64_t i0, int64_t i1) { f(i0, i1); }, kGrain);
}

template <typename T>
T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));  // exp overflows to inf for very negative x: gives 0, as it should
}

}  // namespace

// Same expression order and constants as GPT-2's gelu and llm.c's gelu_forward (float
// results match); the backward differs from llm.c's only by rounding (see below).
template <typename T>
void gelu_forward(T* out, const T* inp, int64_t n) {
  const T s = static_cast<T>(std::sqrt(2.0 / std::numbers::pi));
  for_each_range(n, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const T x = inp[i];
      const T cube = T(0.044715) * x * x * x;
      out[i] = T(0.5) * x * (T(1) + std::tanh(s * (x + cube)));
    }
  });
}

template <typename T>
void gelu_backward(T* dinp, const T* inp, const T* dout, int64_t n) {
  const T s = static_cast<T>(std::sqrt(2.0 / std::numbers::pi));
  for_each_range(n, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const T x = inp[i];
      const T cube = T(0.044715) * x * x * x;
      const T tanh_arg = s * (x + cube);
      const T tanh_out = std::tanh(tanh_arg);
      // sech² = 1 - tanh²: one transcendental per element instead of llm.c's two (cosh),
      // the CPU step's costliest elementwise op; equal up to rounding.
      const T sech2 = T(1) - tanh_out * tanh_out;
      const T local_grad =
          T(0.5) * (T(1) + tanh_out) + x * T(0.5) * sech2 * s * (T(1) + T(3) * T(0.044715) * x * x);
      dinp[i] += local_grad * dout[i];
    }
  });
}

template <typename T>
void swiglu_forward(T* out, const T* inp, int64_t N, int H) {
  parallel_for(
      N,
      [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; ++n) {
          const T* g = inp + n * 2 * H;
          const T* u = g + H;
          T* o = out + n * H;
          for (int h = 0; h < H; ++h) o[h] = g[h] * sigmoid(g[h]) * u[h];
        }
      },
      std::max<int64_t>(1, kGrain / std::max(H, 1)));
}

template <typename T>
void swiglu_backward(T* dinp, const T* inp, const T* dout, int64_t N, int H) {
  parallel_for(
      N,
      [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; ++n) {
          const T* g = inp + n * 2 * H;
          const T* u = g + H;
          const T* d = dout + n * H;
          T* dg = dinp + n * 2 * H;
          T* du = dg + H;
          for (int h = 0; h < H; ++h) {
            const T sg = sigmoid(g[h]);
            const T silu = g[h] * sg;
            // d silu / dg = σ(g) (1 + g (1 - σ(g)))
            dg[h] += d[h] * u[h] * (sg * (T(1) + g[h] * (T(1) - sg)));
            du[h] += d[h] * silu;
          }
        }
      },
      std::max<int64_t>(1, kGrain / std::max(H, 1)));
}

template <typename T>
void relu2_forward(T* out, const T* inp, int64_t n) {
  for_each_range(n, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const T r = inp[i] > T(0) ? inp[i] : T(0);
      out[i] = r * r;
    }
  });
}

template <typename T>
void relu2_backward(T* dinp, const T* inp, const T* dout, int64_t n) {
  for_each_range(n, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const T r = inp[i] > T(0) ? inp[i] : T(0);
      dinp[i] += T(2) * r * dout[i];
    }
  });
}

template <typename T>
void residual_forward(T* out, const T* a, const T* b, int64_t n) {
  // No restrict: out may alias a or b, which is safe element by element.
  for_each_range(n, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) out[i] = a[i] + b[i];
  });
}

#define ESPLAG_INSTANTIATE(T)                                            \
  template void gelu_forward<T>(T*, const T*, int64_t);                  \
  template void gelu_backward<T>(T*, const T*, const T*, int64_t);       \
  template void swiglu_forward<T>(T*, const T*, int64_t, int);           \
  template void swiglu_backward<T>(T*, const T*, const T*, int64_t, int); \
  template void relu2_forward<T>(T*, const T*, int64_t);                 \
  template void relu2_backward<T>(T*, const T*, const T*, int64_t);      \
  template void residual_forward<T>(T*, const T*, const T*, int64_t);
ESPLAG_INSTANTIATE(float)
ESPLAG_INSTANTIATE(double)
#undef ESPLAG_INSTANTIATE

}  // namespace esplag::cpu
