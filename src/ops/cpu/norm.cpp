// LayerNorm and RMSNorm. Row statistics are accumulated in double whatever T is: they
// are a small part of the cost and keep long rows from drifting in float.
//
// Backward runs in two passes so that no element is summed by more than one thread:
// dinp per row (threads own rows), then dweight / dbias per channel (threads own
// channels, rows visited in order).
#include "ops/norm.h"

#include <cmath>
#include <cstdint>

#include "core/parallel.h"

namespace esplag::cpu {

namespace {
constexpr int64_t kRowGrain = 8;
constexpr int64_t kChannelGrain = 64;
}  // namespace

template <typename T>
void layernorm_forward(T* out, T* mean, T* rstd, const T* inp, const T* weight, const T* bias, int N, int C,
                       double eps) {
  parallel_for(
      N,
      [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; ++n) {
          const T* x = inp + n * C;
          double s = 0;
          for (int c = 0; c < C; ++c) s += x[c];
          const double m = s / C;
          double v = 0;
          for (int c = 0; c < C; ++c) {
            const double d = x[c] - m;
            v += d * d;
          }
          const T mt = static_cast<T>(m);
          const T rt = static_cast<T>(1.0 / std::sqrt(v / C + eps));
          T* o = out + n * C;
          for (int c = 0; c < C; ++c) o[c] = (x[c] - mt) * rt * weight[c] + (bias ? bias[c] : T(0));
          mean[n] = mt;
          rstd[n] = rt;
        }
      },
      kRowGrain);
}

template <typename T>
void layernorm_backward(T* dinp, T* dweight, T* dbias, const T* dout, const T* inp, const T* weight,
                        const T* mean, const T* rstd, int N, int C) {
  if (dinp) {
    parallel_for(
        N,
        [&](int64_t n0, int64_t n1) {
          for (int64_t n = n0; n < n1; ++n) {
            const T* x = inp + n * C;
            const T* d = dout + n * C;
            const T m = mean[n], r = rstd[n];
            // dx = rstd · (g - mean(g) - x̂ · mean(g · x̂)),  g = dout · weight.
            double sg = 0, sgx = 0;
            for (int c = 0; c < C; ++c) {
              const T g = d[c] * weight[c];
              sg += g;
              sgx += double(g) * ((x[c] - m) * r);
            }
            const T mg = static_cast<T>(sg / C), mgx = static_cast<T>(sgx / C);
            T* dx = dinp + n * C;
            for (int c = 0; c < C; ++c) {
              const T xhat = (x[c] - m) * r;
              dx[c] += r * (d[c] * weight[c] - mg - xhat * mgx);
            }
          }
        },
        kRowGrain);
  }
  if (dweight || dbias) {
    parallel_for(
        C,
        [&](int64_t c0, int64_t c1) {
          for (int64_t n = 0; n < N; ++n) {
            const T* x = inp + n * C;
            const T* d = dout + n * C;
            const T m = mean[n], r = rstd[n];
            if (dweight)
              for (int64_t c = c0; c < c1; ++c) dweight[c] += d[c] * ((x[c] - m) * r);
            if (dbias)
              for (int64_t c = c0; c < c1; ++c) dbias[c] += d[c];
          }
        },
        kChannelGrain);
  }
}

template <typename T>
void rmsnorm_forward(T* out, T* rstd, const T* inp, const T* weight, int N, int C, double eps) {
  parallel_for(
      N,
      [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; ++n) {
          const T* x = inp + n * C;
          double ss = 0;
          for (int c = 0; c < C; ++c) ss += double(x[c]) * x[c];
          const T rt = static_cast<T>(1.0 / std::sqrt(ss / C + eps));
          T* o = out + n * C;
          for (int c = 0; c < C; ++c) o[c] = x[c] * rt * weight[c];
          rstd[n] = rt;
        }
      },
      kRowGrain);
}

template <typename T>
void rmsnorm_backward(T* dinp, T* dweight, const T* dout, const T* inp, const T* weight, const T* rstd, int N,
                      int C) {
  if (dinp) {
    parallel_for(
        N,
        [&](int64_t n0, int64_t n1) {
          for (int64_t n = n0; n < n1; ++n) {
            const T* x = inp + n * C;
            const T* d = dout + n * C;
            const T r = rstd[n];
            // dx = rstd · g - rstd³ · x · mean(g · x),  g = dout · weight.
            double sgx = 0;
            for (int c = 0; c < C; ++c) sgx += double(d[c] * weight[c]) * x[c];
            const T k = static_cast<T>(double(r) * r * r * (sgx / C));
            T* dx = dinp + n * C;
            for (int c = 0; c < C; ++c) dx[c] += r * (d[c] * weight[c]) - k * x[c];
          }
        },
        kRowGrain);
  }
  if (dweight) {
    parallel_for(
        C,
        [&](int64_t c0, int64_t c1) {
          for (int64_t n = 0; n < N; ++n) {
            const T* x = inp + n * C;
            const T* d = dout + n * C;
            const T r = rstd[n];
            for (int64_t c = c0; c < c1; ++c) dweight[c] += d[c] * (x[c] * r);
          }
        },
        kChannelGrain);
  }
}

template void layernorm_forward<float>(float*, float*, float*, const float*, const float*, const float*, int, int,
                                       double);
template void layernorm_forward<double>(double*, double*, double*, const double*, const double*, const double*, int,
                                        int, double);
template void layernorm_backward<float>(float*, float*, float*, const float*, const float*, const float*,
                                        const float*, const float*, int, int);
template void layernorm_backward<double>(double*, double*, double*, const double*, const double*, const double*,
                                         const double*, const double*, int, int);
template void rmsnorm_forward<float>(float*, float*, const float*, const float*, int, int, double);
template void rmsnorm_forward<double>(double*, double*, const double*, const double*, int, int, double);
template void rmsnorm_backward<float>(float*, float*, const float*, const float*, const float*, const float*, int,
                                      int);
template void rmsnorm_backward<double>(double*, double*, const double*, const double*, const double*, const double*,
                                       int, int);

}  // namespace esplag::cpu
