// fp8 codes on the device with core/fp8.h's scaling rule, bit for bit: shared by the casts
// (ops/cuda/fp8_cast.cu) and the writer of cuSPARSELt's compressed e4m3 layout
// (sparse/cuda/cusparselt_layout_e4m3.cu), which casts while it compresses.
//
// The code of a value comes from cvt.rn.satfinite (via cuda_fp8.h, which emulates it below
// compute capability 8.9): round to nearest even from fp32, subnormals exact, anything past
// the largest finite code (infinities included) to ±max, which is core's fp8_encode of the
// same fp32 value. NaN is then given x's sign explicitly (neither the device's product nor
// the instruction keeps it).
#pragma once

#include <cuda_fp8.h>

#include <cfloat>
#include <cstdint>

namespace esplag::gpu::detail {

template <bool E5M2>
struct Fp8Format {
  static constexpr float max = E5M2 ? 57344.0f : 448.0f;
  static constexpr __nv_fp8_interpretation_t kind = E5M2 ? __NV_E5M2 : __NV_E4M3;
  // Whether |x · s| = a saturates: it would round past max (464 is a tie that goes to the
  // even 448 in e4m3; 61440 one that goes to the even 65536 in e5m2).
  __device__ static bool clips(float a) { return E5M2 ? a >= 61440.0f : a > 464.0f; }
};

// core's fp8_scale on the device (IEEE division, as on the host).
template <bool E5M2>
__device__ __forceinline__ float fp8_scale_of(float amax) {
  if (!(amax > 0.0f)) return 1.0f;
  const float s = __fdiv_rn(Fp8Format<E5M2>::max, amax);
  return isfinite(s) ? s : FLT_MAX;
}

// The codes of x0 · s and x1 · s, x0's in the low byte, for x0 and x1 not NaN: fp8_encode2
// without its NaN sign fix (which looks at x only; fp8_encode4 chooses).
template <bool E5M2>
__device__ __forceinline__ uint32_t fp8_encode2_no_nan(float x0, float x1, float s) {
  return __nv_cvt_float2_to_fp8x2(make_float2(x0 * s, x1 * s), __NV_SATFINITE, Fp8Format<E5M2>::kind);
}

// The codes of x0 · s and x1 · s, x0's in the low byte. A NaN takes the sign of x (the
// device's product of a NaN is the canonical, positive NaN; the host's keeps x's sign).
template <bool E5M2>
__device__ __forceinline__ uint32_t fp8_encode2(float x0, float x1, float s) {
  uint32_t c = fp8_encode2_no_nan<E5M2>(x0, x1, s);
  if (isnan(x0)) c = (c & 0xFF00u) | (signbit(x0) ? 0xFFu : 0x7Fu);
  if (isnan(x1)) c = (c & 0x00FFu) | (signbit(x1) ? 0xFF00u : 0x7F00u);
  return c;
}

// The codes of four values at scale s, x0's in the lowest byte: fp8_encode2's, its NaN fix
// taken only where one of the four is NaN (rare), since it costs more than the cast itself.
template <bool E5M2>
__device__ __forceinline__ uint32_t fp8_encode4(float x0, float x1, float x2, float x3, float s) {
  if (isnan(x0) | isnan(x1) | isnan(x2) | isnan(x3))
    return fp8_encode2<E5M2>(x0, x1, s) | fp8_encode2<E5M2>(x2, x3, s) << 16;
  return fp8_encode2_no_nan<E5M2>(x0, x1, s) | fp8_encode2_no_nan<E5M2>(x2, x3, s) << 16;
}

// Four words of four codes transposed as a 4 × 4 byte matrix: byte j of word i becomes
// byte i of word j.
__device__ __forceinline__ void transpose4x4(uint32_t (&w)[4]) {
  const uint32_t ab_lo = __byte_perm(w[0], w[1], 0x5140u), ab_hi = __byte_perm(w[0], w[1], 0x7362u);
  const uint32_t cd_lo = __byte_perm(w[2], w[3], 0x5140u), cd_hi = __byte_perm(w[2], w[3], 0x7362u);
  w[0] = __byte_perm(ab_lo, cd_lo, 0x5410u);
  w[1] = __byte_perm(ab_lo, cd_lo, 0x7632u);
  w[2] = __byte_perm(ab_hi, cd_hi, 0x5410u);
  w[3] = __byte_perm(ab_hi, cd_hi, 0x7632u);
}

}  // namespace esplag::gpu::detail
