// FP8 numbers (docs/fp8.md): the two OCP formats, exact conversions to and from them, and the
// per-tensor and per-row scaling that fp8 training multiplies its operands with. This is
// the reference the GPU's fp8 casts are tested against.
//
//   e4m3 (OCP E4M3FN): bias 7, 3 mantissa bits, max 448, no infinities, NaN 0x7F / 0xFF.
//   e5m2: bias 15, 2 mantissa bits, max 57344, IEEE-like (±inf 0x7C / 0xFC, NaN above).
//
// A cast rounds to nearest, ties to even, with subnormals exact, and saturates: a finite
// value that would round past the largest finite code, or an infinity, becomes ±max (what
// cvt...satfinite and cuBLASLt's fp8 outputs do). NaN stays NaN.
//
// Scaling: a tensor (or a row) is multiplied by scale = max / amax before the cast, amax
// being the largest finite |x| of the tensor (row); so its largest value lands on max. An
// amax of 0 (all zeros) gives scale 1; a scale that would overflow float (amax below
// max / FLT_MAX) is FLT_MAX. Dequantising divides by the same scale.
#pragma once
#include <cstdint>
#include <string>

namespace esplag {

enum class Fp8Format { e4m3, e5m2 };

// "e4m3" / "e5m2".
std::string to_string(Fp8Format f);
// The format named "e4m3" or "e5m2"; throws Error naming `what` (a config key) otherwise.
Fp8Format fp8_format_from(const std::string& name, const std::string& what);

// The largest finite value: 448 (e4m3), 57344 (e5m2).
float fp8_max(Fp8Format f);

// x rounded to the nearest code (ties to even), saturating to ±max. When `saturated` is
// given, it is set to whether the cast clipped x (an infinity, or a finite x that would
// have rounded past max); NaN is not counted.
uint8_t fp8_encode(double x, Fp8Format f, bool* saturated = nullptr);
// The value of a code (every code is exact in float).
float fp8_decode(uint8_t code, Fp8Format f);

// max / amax with the rules above.
float fp8_scale(float amax, Fp8Format f);

// The largest finite |x[i]| of n values (0 when there is none).
template <typename T>
T fp8_amax(const T* x, int64_t n);

// out = decode(encode(x · s)) / s with s = fp8_scale(amax(x)) over the whole tensor of n
// values: what an fp8 product multiplies, back in T. out may alias x. Returns the number
// of values the cast saturated.
template <typename T>
int64_t fp8_quantize_dequantize(T* out, const T* x, int64_t n, Fp8Format f);
// The same with s = fp8_scale(amax) for a given amax (delayed scaling: one from earlier
// steps, so that values above it saturate).
template <typename T>
int64_t fp8_quantize_dequantize(T* out, const T* x, int64_t n, Fp8Format f, float amax);
// The same with one scale per row of the row-major [rows, cols] matrix x.
template <typename T>
int64_t fp8_quantize_dequantize_rows(T* out, const T* x, int64_t rows, int64_t cols, Fp8Format f);

}  // namespace esplag
