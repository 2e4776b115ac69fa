#include "ops/embedding.h"

#include <cstdint>

#include "core/error.h"
#include "core/parallel.h"

namespace esplag::cpu {

template <typename T>
void embedding_forward(T* out, const int32_t* tokens, const T* wte, const T* wpe, int B, int Tlen, int C) {
  const int64_t N = int64_t(B) * Tlen;
  // The vocabulary size is not known here (callers check the upper bound); a negative id
  // would read before the table, so it is rejected before any thread starts.
  for (int64_t i = 0; i < N; ++i)
    ESPLAG_CHECK(tokens[i] >= 0, "embedding_forward: token id ", tokens[i], " at position ", i, " is negative");
  parallel_for(
      N,
      [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
          const T* e = wte + int64_t(tokens[i]) * C;
          T* o = out + i * C;
          if (wpe) {
            const T* p = wpe + (i % Tlen) * C;
            for (int c = 0; c < C; ++c) o[c] = e[c] + p[c];
          } else {
            for (int c = 0; c < C; ++c) o[c] = e[c];
          }
        }
      },
      16);
}

template <typename T>
void embedding_backward(T* dwte, T* dwpe, const T* dout, const int32_t* tokens, int B, int Tlen, int C) {
  const int64_t N = int64_t(B) * Tlen;
  for (int64_t i = 0; i < N; ++i)
    ESPLAG_CHECK(tokens[i] >= 0, "embedding_backward: token id ", tokens[i], " at position ", i, " is negative");
  // Several positions can hold the same token, so rows of dwte are not owned by positions.
  // Threads own ranges of channels instead and visit positions in order: no races, and the
  // summation order of every element is fixed.
  parallel_for(
      C,
      [&](int64_t c0, int64_t c1) {
        if (dwte) {
          for (int64_t i = 0; i < N; ++i) {
            T* g = dwte + int64_t(tokens[i]) * C;
            const T* d = dout + i * C;
            for (int64_t c = c0; c < c1; ++c) g[c] += d[c];
          }
        }
        if (dwpe) {
          for (int b = 0; b < B; ++b)
            for (int t = 0; t < Tlen; ++t) {
              T* g = dwpe + int64_t(t) * C;
              const T* d = dout + (int64_t(b) * Tlen + t) * C;
              for (int64_t c = c0; c < c1; ++c) g[c] += d[c];
            }
        }
      },
      64);
}

template void embedding_forward<float>(float*, const int32_t*, const float*, const float*, int, int, int);
template void embedding_forward<double>(double*, const int32_t*, const double*, const double*, int, int, int);
template void embedding_backward<float>(float*, float*, const float*, const int32_t*, int, int, int);
template void embedding_backward<double>(double*, double*, const double*, const int32_t*, int, int, int);

}  // namespace esplag::cpu
