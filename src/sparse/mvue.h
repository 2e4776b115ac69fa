// MVUE 2:4 of a gradient (CPU reference): an unbiased stochastic 2:4 pruning, after
// Chmiel et al., "Minimum variance unbiased N:M sparsity for the neural gradients".
//
// A tensor is row-major [rows, cols]; groups are 4 consecutive columns of a row (as for
// every 2:4 pattern in sparse/). In a group a = (a0..a3) with more than two non-zeros,
// value i is kept with inclusion probability
//   p_i = 2·|a_i| / S          (S = Σ|a|), unless that exceeds 1 for the largest value j;
//   then p_j = 1 and p_i = |a_i| / (S − |a_j|) for the others,
// exactly two values are kept (systematic sampling: one uniform u in [0, 1) selects the
// values whose cumulative-probability interval contains u or u + 1), and a kept value is
// written as a_i / p_i, so E[out] = in. These are the inclusion probabilities of the
// minimum-variance unbiased 2:4 estimator.
//
// Probabilities are held in fixed point (multiples of 2^-24; every non-zero value gets at
// least 2^-24, the four sum to exactly 2, none exceeds 1), and the division uses the
// probability actually sampled with, so the estimator is exactly unbiased up to the final
// rounding of a_i / p_i (float, or bf16 for the bf16 variant), not merely up to the
// fixed-point resolution.
//
// Groups with at most two non-zeros are copied unchanged (they are already 2:4). A group
// holding a NaN or an infinity, or whose Σ|a| overflows float, keeps its two largest |a|
// (NaN ranked as +inf, ties by lower index, as sparse/magnitude.h) unscaled, so the
// non-finite value surfaces instead of being sampled away.
//
// The random number of group g (the linear index row·cols/4 + group) is a counter-based
// hash of (seed, g): results depend only on the seed and the shape, never on threads or
// launch geometry. The per-group function below is shared with the GPU kernel
// (sparse/cuda/sparsify.h), which therefore agrees with this reference bit for bit.
#pragma once
#include <cmath>
#include <cstdint>
#include <string>

#if defined(__CUDACC__)
#define ESPLAG_SPARSE_HD __host__ __device__ __forceinline__
#else
#define ESPLAG_SPARSE_HD inline
#endif
// Fully unrolled on the GPU (the group's arrays then live in registers).
#if defined(__CUDA_ARCH__)
#define ESPLAG_SPARSE_UNROLL _Pragma("unroll")
#else
#define ESPLAG_SPARSE_UNROLL
#endif

namespace esplag {
namespace sparse_detail {

// Probability 1 in the fixed-point scale of the inclusion probabilities.
constexpr uint32_t kMvueOne = 1u << 24;

// splitmix64's finaliser.
ESPLAG_SPARSE_HD uint64_t mvue_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The uniform of group `group` in [0, kMvueOne).
ESPLAG_SPARSE_HD uint32_t mvue_uniform24(uint64_t seed, uint64_t group) {
  return static_cast<uint32_t>(mvue_mix(seed ^ mvue_mix(group + 0x9e3779b97f4a7c15ull)) >> 40);
}

// Single IEEE float operations, never contracted into FMAs, so that the host and the
// device round identically.
ESPLAG_SPARSE_HD float mvue_add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
ESPLAG_SPARSE_HD float mvue_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
ESPLAG_SPARSE_HD float mvue_div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
ESPLAG_SPARSE_HD uint32_t mvue_round(float x) {  // x in [0, 2^25], nearest, ties to even
#if defined(__CUDA_ARCH__)
  return static_cast<uint32_t>(rintf(x));
#else
  return static_cast<uint32_t>(std::rint(x));
#endif
}

struct Mvue24Group {
  uint32_t keep = 0;     // bits 0..3: the kept positions (at most two)
  bool scaled = false;   // false: kept values are the inputs unchanged
  float out[4] = {0, 0, 0, 0};  // the output values, 0 where not kept
};

// The group's two largest |a| (NaN as +inf, ties: lower index), unscaled.
ESPLAG_SPARSE_HD Mvue24Group mvue_24_top2(const float (&a)[4]) {
  float k[4];
  ESPLAG_SPARSE_UNROLL
  for (int i = 0; i < 4; ++i) k[i] = a[i] != a[i] ? INFINITY : fabsf(a[i]);
  Mvue24Group g;
  ESPLAG_SPARSE_UNROLL
  for (int i = 0; i < 4; ++i) {
    int before = 0;
    ESPLAG_SPARSE_UNROLL
    for (int j = 0; j < 4; ++j) before += (k[j] > k[i]) || (k[j] == k[i] && j < i);
    if (before < 2) g.keep |= 1u << i, g.out[i] = a[i];
  }
  return g;
}

// Cumulative fixed-point boundaries of the non-zero values listed by `use` (bits) whose
// probabilities are m_i·total/sum: boundary after value i = round(prefix_i · total/sum),
// the last one forced to `total`. Prefix sums of non-negative values and the rounding are
// monotone, so every q_i >= 0 and they sum to exactly `total`.
ESPLAG_SPARSE_HD void mvue_quantize(const float (&m)[4], uint32_t use, float sum, uint32_t total,
                                           uint32_t (&q)[4]) {
  int last = -1;
  ESPLAG_SPARSE_UNROLL
  for (int i = 0; i < 4; ++i)
    if ((use >> i & 1u) && m[i] != 0.0f) last = i;
  const float inv = mvue_div(static_cast<float>(total), sum);
  float prefix = 0.0f;
  uint32_t prev = 0;
  ESPLAG_SPARSE_UNROLL
  for (int i = 0; i < 4; ++i) {
    if (!(use >> i & 1u)) continue;
    if (m[i] == 0.0f) {
      q[i] = 0;
      continue;
    }
    prefix = mvue_add(prefix, m[i]);
    uint32_t b = i == last ? total : mvue_round(mvue_mul(prefix, inv));
    if (b > total) b = total;
    q[i] = b - prev;
    prev = b;
  }
}

// One group of the MVUE 2:4 with uniform u in [0, kMvueOne).
ESPLAG_SPARSE_HD Mvue24Group mvue_24_group(const float (&a)[4], uint32_t u) {
  constexpr uint32_t kOne = kMvueOne;
  constexpr float kFloatMax = 3.40282347e38f;
  float m[4];
  bool finite = true;
  uint32_t nonzero = 0;
  int nonzeros = 0;
  ESPLAG_SPARSE_UNROLL
  for (int i = 0; i < 4; ++i) {
    m[i] = fabsf(a[i]);
    finite = finite && m[i] <= kFloatMax;  // false for NaN and inf
    if (m[i] != 0.0f) nonzero |= 1u << i, ++nonzeros;
  }
  if (!finite) return mvue_24_top2(a);
  Mvue24Group g;
  if (nonzeros <= 2) {
    g.keep = nonzero;
    ESPLAG_SPARSE_UNROLL
    for (int i = 0; i < 4; ++i) g.out[i] = (nonzero >> i & 1u) ? a[i] : 0.0f;
    return g;
  }
  const float sum = mvue_add(mvue_add(mvue_add(m[0], m[1]), m[2]), m[3]);
  if (!(sum <= kFloatMax)) return mvue_24_top2(a);

  // (Indices chosen at run time are used in comparisons only, never to index an array,
  // so that the GPU keeps the group in registers.)
  int big = 0;  // the largest |a|, ties: lower index
  float m_big = m[0];
  ESPLAG_SPARSE_UNROLL
  for (int i = 1; i < 4; ++i)
    if (m[i] > m_big) big = i, m_big = m[i];
  uint32_t q[4] = {0, 0, 0, 0};
  int capped = mvue_add(m_big, m_big) >= sum ? big : -1;
  if (capped < 0) {
    mvue_quantize(m, 0xFu, sum, 2 * kOne, q);
    // Rounding can push a value whose exact probability is just below 1 over it: that
    // value is then the capped one.
    ESPLAG_SPARSE_UNROLL
    for (int i = 0; i < 4; ++i)
      if (capped < 0 && q[i] > kOne) capped = i;
  }
  if (capped >= 0) {
    float rest = 0.0f;
    ESPLAG_SPARSE_UNROLL
    for (int i = 0; i < 4; ++i)
      if (i != capped) rest = mvue_add(rest, m[i]);
    mvue_quantize(m, 0xFu & ~(1u << capped), rest, kOne, q);
    ESPLAG_SPARSE_UNROLL
    for (int i = 0; i < 4; ++i)
      if (i == capped) q[i] = kOne;
  }
  // Every non-zero value gets a positive probability (else it could never be kept and
  // the estimator would be biased): a unit is taken from the largest (>= 2^24 / 2).
  ESPLAG_SPARSE_UNROLL
  for (int i = 0; i < 4; ++i)
    if (m[i] != 0.0f && q[i] == 0) {
      int k = 0;
      uint32_t q_k = q[0];
      ESPLAG_SPARSE_UNROLL
      for (int j = 1; j < 4; ++j)
        if (q[j] > q_k) k = j, q_k = q[j];
      ESPLAG_SPARSE_UNROLL
      for (int j = 0; j < 4; ++j)
        if (j == k) q[j] -= 1;
      q[i] = 1;
    }

  // Systematic sampling: the intervals [lo_i, lo_i + q_i) tile [0, 2·kOne) and none is
  // longer than kOne, so u and u + kOne fall in two different intervals.
  g.scaled = true;
  uint32_t lo = 0;
  const uint32_t u2 = u + kOne;
  ESPLAG_SPARSE_UNROLL
  for (int i = 0; i < 4; ++i) {
    const uint32_t hi = lo + q[i];
    if (q[i] != 0 && ((u >= lo && u < hi) || (u2 >= lo && u2 < hi))) {
      g.keep |= 1u << i;
      g.out[i] = mvue_div(a[i], mvue_mul(static_cast<float>(q[i]), 1.0f / kOne));
    }
    lo = hi;
  }
  return g;
}

}  // namespace sparse_detail

namespace cpu {

// out[rows, cols] (fully overwritten) = the MVUE 2:4 of in for `seed`; mask (one byte per
// value, 1 = kept, the layout of sparse/masks.h) may be null. Requires cols % 4 == 0;
// `name` names the tensor in errors. out may alias in.
void mvue_24(const float* in, float* out, uint8_t* mask, int64_t rows, int64_t cols, uint64_t seed,
             const std::string& name = "gradient");

// The same on bf16 raw bits (core/dtype.h): kept values that are scaled are rounded to
// bf16 once (nearest even) from the float a_i / p_i; unscaled kept values are copied bit
// for bit. What the GPU kernel computes.
void mvue_24_bf16(const uint16_t* in, uint16_t* out, uint8_t* mask, int64_t rows, int64_t cols, uint64_t seed,
                  const std::string& name = "gradient");

}  // namespace cpu
}  // namespace esplag
