#include "core/fp8.h"

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"

namespace esplag {

namespace {

struct Layout {
  int exp_bits, mant_bits, bias;
  float max;
};

Layout layout(Fp8Format f) { return f == Fp8Format::e4m3 ? Layout{4, 3, 7, 448.0f} : Layout{5, 2, 15, 57344.0f}; }

constexpr int64_t kBlock = 1 << 14;  // values per task of the tensor-wide passes

}  // namespace

std::string to_string(Fp8Format f) { return f == Fp8Format::e4m3 ? "e4m3" : "e5m2"; }

Fp8Format fp8_format_from(const std::string& name, const std::string& what) {
  if (name == "e4m3") return Fp8Format::e4m3;
  if (name == "e5m2") return Fp8Format::e5m2;
  fail(what, " must be e4m3 or e5m2, got '", name, "'");
}

float fp8_max(Fp8Format f) { return layout(f).max; }

uint8_t fp8_encode(double x, Fp8Format f, bool* saturated) {
  const Layout L = layout(f);
  const int emin = 1 - L.bias;  // exponent of the smallest normal
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  if (saturated) *saturated = false;
  if (std::isnan(x)) return sign | 0x7F;
  const double a = std::fabs(x);
  double r = L.max;
  bool clipped = std::isinf(a);
  if (!clipped) {
    // The spacing of the codes around a (that of the subnormals below 2^emin); a / q is
    // exact, and nearbyint rounds it to nearest, ties to even.
    int e = 0;
    std::frexp(a, &e);
    const double q = std::ldexp(1.0, std::max(e - 1, emin) - L.mant_bits);
    r = std::nearbyint(a / q) * q;
    clipped = r > L.max;
    if (clipped) r = L.max;
  }
  if (saturated) *saturated = clipped;
  if (r == 0) return sign;
  int e = 0;
  std::frexp(r, &e);
  if (e - 1 < emin) return sign | uint8_t(r / std::ldexp(1.0, emin - L.mant_bits));  // subnormal
  const int field = e - 1 + L.bias;
  const int mant = int(r / std::ldexp(1.0, e - 1 - L.mant_bits)) - (1 << L.mant_bits);
  return sign | uint8_t(field << L.mant_bits) | uint8_t(mant);
}

float fp8_decode(uint8_t code, Fp8Format f) {
  const Layout L = layout(f);
  const float sign = (code & 0x80) ? -1.0f : 1.0f;
  const int field = (code >> L.mant_bits) & ((1 << L.exp_bits) - 1);
  const int mant = code & ((1 << L.mant_bits) - 1);
  if (f == Fp8Format::e4m3 && (code & 0x7F) == 0x7F) return std::nanf("");
  if (f == Fp8Format::e5m2 && field == 31) return mant == 0 ? sign * INFINITY : std::nanf("");
  if (field == 0) return sign * std::ldexp(float(mant), 1 - L.bias - L.mant_bits);
  return sign * std::ldexp(float((1 << L.mant_bits) + mant), field - L.bias - L.mant_bits);
}

float fp8_scale(float amax, Fp8Format f) {
  if (!(amax > 0.0f)) return 1.0f;
  const float s = fp8_max(f) / amax;
  return std::isfinite(s) ? s : FLT_MAX;
}

template <typename T>
T fp8_amax(const T* x, int64_t n) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<T> part(size_t(blocks), T(0));
  parallel_for(blocks, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      T m = T(0);
      for (int64_t i = b * kBlock, e = std::min(n, i + kBlock); i < e; ++i)
        if (std::isfinite(x[i])) m = std::max(m, T(std::fabs(x[i])));
      part[size_t(b)] = m;
    }
  });
  T m = T(0);
  for (T v : part) m = std::max(m, v);
  return m;
}

namespace {

// out[i] = decode(encode(x[i] · s)) / s for i in [0, n); returns the saturated count.
template <typename T>
int64_t scaled_round_trip(T* out, const T* x, int64_t n, float scale, Fp8Format f) {
  const T s = T(scale);
  int64_t saturated = 0;
  for (int64_t i = 0; i < n; ++i) {
    bool clipped = false;
    const uint8_t c = fp8_encode(double(x[i] * s), f, &clipped);
    saturated += clipped;
    out[i] = T(fp8_decode(c, f)) / s;
  }
  return saturated;
}

}  // namespace

template <typename T>
int64_t fp8_quantize_dequantize(T* out, const T* x, int64_t n, Fp8Format f) {
  return fp8_quantize_dequantize(out, x, n, f, float(fp8_amax(x, n)));
}

template <typename T>
int64_t fp8_quantize_dequantize(T* out, const T* x, int64_t n, Fp8Format f, float amax) {
  const float scale = fp8_scale(amax, f);
  std::atomic<int64_t> saturated{0};
  parallel_for((n + kBlock - 1) / kBlock, [&](int64_t b0, int64_t b1) {
    const int64_t i0 = b0 * kBlock, i1 = std::min(n, b1 * kBlock);
    saturated += scaled_round_trip(out + i0, x + i0, i1 - i0, scale, f);
  });
  return saturated;
}

template <typename T>
int64_t fp8_quantize_dequantize_rows(T* out, const T* x, int64_t rows, int64_t cols, Fp8Format f) {
  std::atomic<int64_t> saturated{0};
  parallel_for(rows, [&](int64_t r0, int64_t r1) {
    int64_t local = 0;
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = x + r * cols;
      local += scaled_round_trip(out + r * cols, row, cols, fp8_scale(float(fp8_amax(row, cols)), f), f);
    }
    saturated += local;
  });
  return saturated;
}

template float fp8_amax<float>(const float*, int64_t);
template double fp8_amax<double>(const double*, int64_t);
template int64_t fp8_quantize_dequantize<float>(float*, const float*, int64_t, Fp8Format);
template int64_t fp8_quantize_dequantize<double>(double*, const double*, int64_t, Fp8Format);
template int64_t fp8_quantize_dequantize<float>(float*, const float*, int64_t, Fp8Format, float);
template int64_t fp8_quantize_dequantize<double>(double*, const double*, int64_t, Fp8Format, float);
template int64_t fp8_quantize_dequantize_rows<float>(float*, const float*, int64_t, int64_t, Fp8Format);
template int64_t fp8_quantize_dequantize_rows<double>(double*, const double*, int64_t, int64_t, Fp8Format);

}  // namespace esplag
