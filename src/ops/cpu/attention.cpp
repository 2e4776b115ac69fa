// Causal grouped-query self-attention and rotary embeddings, CPU reference.
//
// Forward is split over rows (b, h, t): each row owns its slice of `out` and its row of
// `att`. Backward is split over (b, kv-head) groups instead, because every query head of
// a group accumulates into the same dK / dV head; one thread visits the group's query
// heads and time steps in a fixed order, so sums never depend on the thread count.
#include "ops/attention.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"

namespace esplag::cpu {

namespace {

void check_attention_shape(const char* op, int B, int Tlen, int NH, int NKV, int HD) {
  ESPLAG_CHECK(B >= 0 && Tlen >= 0, op, ": batch and sequence length must be non-negative, got B=", B,
               " T=", Tlen);
  ESPLAG_CHECK(NH > 0 && NKV > 0 && HD > 0, op, ": head counts and head size must be positive, got NH=", NH,
               " NKV=", NKV, " HD=", HD);
  ESPLAG_CHECK(NH % NKV == 0, op, ": query heads NH=", NH, " must be a multiple of key/value heads NKV=", NKV);
}

void check_rope_shape(const char* op, int B, int Tlen, int NH, int NKV, int HD, double theta) {
  check_attention_shape(op, B, Tlen, NH, NKV, HD);
  ESPLAG_CHECK(HD % 2 == 0, op, ": head size HD must be even to pair rotary dimensions, got HD=", HD);
  ESPLAG_CHECK(theta > 0 && std::isfinite(theta), op, ": rotary base theta must be positive and finite, got ",
               theta);
}

template <typename T>
T dot(const T* a, const T* b, int n) {
  T s = T(0);
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Rotates every q and k head of every token by its position (pos0 + its index in the
// sequence); `sign` = +1 applies the rotation, -1 its inverse (= transpose, which is what
// the backward needs).
template <typename T>
void rope_apply(T* x, int B, int Tlen, int NH, int NKV, int HD, double theta, int pos0, double sign) {
  const int half = HD / 2;
  const int64_t C = static_cast<int64_t>(NH + 2 * NKV) * HD;
  const int rotated_heads = NH + NKV;  // q heads then k heads are contiguous at the row start
  // Frequencies in double whatever T is: positions reach the thousands, where a float
  // angle would already be off in its last bits before the cosine is taken.
  std::vector<double> inv_freq(half);
  for (int i = 0; i < half; ++i) inv_freq[i] = std::pow(theta, -2.0 * i / HD);
  parallel_for(
      static_cast<int64_t>(B) * Tlen,
      [&](int64_t r0, int64_t r1) {
        std::vector<T> c(half), s(half);
        for (int64_t r = r0; r < r1; ++r) {
          const double t = static_cast<double>(pos0 + r % Tlen);
          for (int i = 0; i < half; ++i) {
            const double a = t * inv_freq[i];
            c[i] = static_cast<T>(std::cos(a));
            s[i] = static_cast<T>(sign * std::sin(a));
          }
          T* row = x + r * C;
          for (int h = 0; h < rotated_heads; ++h) {
            T* x1 = row + static_cast<int64_t>(h) * HD;
            T* x2 = x1 + half;
            for (int i = 0; i < half; ++i) {
              const T a = x1[i], b = x2[i];
              x1[i] = a * c[i] - b * s[i];
              x2[i] = b * c[i] + a * s[i];
            }
          }
        }
      },
      16);
}

}  // namespace

template <typename T>
void attention_forward(T* out, T* att, const T* qkv, int B, int Tlen, int NH, int NKV, int HD) {
  check_attention_shape("attention_forward", B, Tlen, NH, NKV, HD);
  const int group = NH / NKV;
  const int64_t C = static_cast<int64_t>(NH + 2 * NKV) * HD;
  const int64_t k_off = static_cast<int64_t>(NH) * HD, v_off = k_off + static_cast<int64_t>(NKV) * HD;
  const int64_t out_c = static_cast<int64_t>(NH) * HD;
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(HD)));

  // Rows grow with t, so a chunk of consecutive rows mixes short and long ones; a grain
  // of a few rows keeps tiny problems on one thread.
  parallel_for(
      static_cast<int64_t>(B) * NH * Tlen,
      [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const int t = static_cast<int>(r % Tlen);
          const int h = static_cast<int>((r / Tlen) % NH);
          const int64_t b = r / (static_cast<int64_t>(Tlen) * NH);
          const int kvh = h / group;
          const T* base = qkv + b * Tlen * C;
          const T* q = base + t * C + static_cast<int64_t>(h) * HD;
          T* a = att + r * Tlen;

          T maxv = -std::numeric_limits<T>::infinity();
          for (int j = 0; j <= t; ++j) {
            const T* k = base + j * C + k_off + static_cast<int64_t>(kvh) * HD;
            a[j] = dot(q, k, HD) * scale;
            if (a[j] > maxv) maxv = a[j];
          }
          T sum = T(0);
          for (int j = 0; j <= t; ++j) {
            a[j] = std::exp(a[j] - maxv);
            sum += a[j];
          }
          const T inv = T(1) / sum;
          for (int j = 0; j <= t; ++j) a[j] *= inv;
          for (int j = t + 1; j < Tlen; ++j) a[j] = T(0);

          T* o = out + (b * Tlen + t) * out_c + static_cast<int64_t>(h) * HD;
          for (int d = 0; d < HD; ++d) o[d] = T(0);
          for (int j = 0; j <= t; ++j) {
            const T* v = base + j * C + v_off + static_cast<int64_t>(kvh) * HD;
            const T p = a[j];
            for (int d = 0; d < HD; ++d) o[d] += p * v[d];
          }
        }
      },
      4);
}

template <typename T>
void attention_backward(T* dqkv, const T* dout, const T* qkv, const T* att, int B, int Tlen, int NH, int NKV,
                        int HD) {
  check_attention_shape("attention_backward", B, Tlen, NH, NKV, HD);
  const int group = NH / NKV;
  const int64_t C = static_cast<int64_t>(NH + 2 * NKV) * HD;
  const int64_t k_off = static_cast<int64_t>(NH) * HD, v_off = k_off + static_cast<int64_t>(NKV) * HD;
  const int64_t out_c = static_cast<int64_t>(NH) * HD;
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(HD)));

  parallel_for(
      static_cast<int64_t>(B) * NKV,
      [&](int64_t g0, int64_t g1) {
        std::vector<T> datt(Tlen);
        for (int64_t g = g0; g < g1; ++g) {
          const int kvh = static_cast<int>(g % NKV);
          const int64_t b = g / NKV;
          const T* base = qkv + b * Tlen * C;
          T* dbase = dqkv + b * Tlen * C;
          for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
            for (int t = 0; t < Tlen; ++t) {
              const T* a = att + ((b * NH + h) * Tlen + t) * Tlen;
              const T* go = dout + (b * Tlen + t) * out_c + static_cast<int64_t>(h) * HD;
              const T* q = base + t * C + static_cast<int64_t>(h) * HD;
              T* dq = dbase + t * C + static_cast<int64_t>(h) * HD;

              // out_t = Σ_j a_j v_j: da_j = go · v_j and dv_j += a_j go.
              T row = T(0);  // Σ_j a_j da_j, the softmax Jacobian's rank-one term
              for (int j = 0; j <= t; ++j) {
                const T* v = base + j * C + v_off + static_cast<int64_t>(kvh) * HD;
                T* dv = dbase + j * C + v_off + static_cast<int64_t>(kvh) * HD;
                datt[j] = dot(go, v, HD);
                row += a[j] * datt[j];
                for (int d = 0; d < HD; ++d) dv[d] += a[j] * go[d];
              }
              // Pre-softmax gradient a_j (da_j - row), then through s_j = scale q · k_j.
              for (int j = 0; j <= t; ++j) {
                const T ds = a[j] * (datt[j] - row) * scale;
                const T* k = base + j * C + k_off + static_cast<int64_t>(kvh) * HD;
                T* dk = dbase + j * C + k_off + static_cast<int64_t>(kvh) * HD;
                for (int d = 0; d < HD; ++d) {
                  dq[d] += ds * k[d];
                  dk[d] += ds * q[d];
                }
              }
            }
          }
        }
      },
      1);
}

template <typename T>
void rope_forward(T* qkv, int B, int Tlen, int NH, int NKV, int HD, double theta, int pos0) {
  check_rope_shape("rope_forward", B, Tlen, NH, NKV, HD, theta);
  ESPLAG_CHECK(pos0 >= 0, "rope_forward: start position pos0 must not be negative, got ", pos0);
  rope_apply(qkv, B, Tlen, NH, NKV, HD, theta, pos0, 1.0);
}

template <typename T>
void rope_backward(T* dqkv, int B, int Tlen, int NH, int NKV, int HD, double theta) {
  check_rope_shape("rope_backward", B, Tlen, NH, NKV, HD, theta);
  rope_apply(dqkv, B, Tlen, NH, NKV, HD, theta, 0, -1.0);
}

#define ESPLAG_INSTANTIATE(T)                                                                   \
  template void attention_forward<T>(T*, T*, const T*, int, int, int, int, int);                \
  template void attention_backward<T>(T*, const T*, const T*, const T*, int, int, int, int, int); \
  template void rope_forward<T>(T*, int, int, int, int, int, double, int);                      \
  template void rope_backward<T>(T*, int, int, int, int, int, double);
ESPLAG_INSTANTIATE(float)
ESPLAG_INSTANTIATE(double)
#undef ESPLAG_INSTANTIATE

}  // namespace esplag::cpu
