// The fp8 conversions and scaling of core/fp8.h: every code of both formats, the rounding
// between every pair of neighbouring codes, saturation, subnormals, NaN and the scale rule.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/fp8.h"

using namespace esplag;

namespace {

const Fp8Format kFormats[] = {Fp8Format::e4m3, Fp8Format::e5m2};

bool is_nan_code(uint8_t c, Fp8Format f) { return std::isnan(fp8_decode(c, f)); }
bool is_inf_code(uint8_t c, Fp8Format f) { return std::isinf(fp8_decode(c, f)); }

}  // namespace

TEST(Fp8, KnownCodes) {
  EXPECT_EQ(fp8_max(Fp8Format::e4m3), 448.0f);
  EXPECT_EQ(fp8_max(Fp8Format::e5m2), 57344.0f);
  EXPECT_EQ(fp8_decode(0x7E, Fp8Format::e4m3), 448.0f);
  EXPECT_EQ(fp8_decode(0x38, Fp8Format::e4m3), 1.0f);
  EXPECT_EQ(fp8_decode(0x08, Fp8Format::e4m3), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(fp8_decode(0x01, Fp8Format::e4m3), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(fp8_decode(0xFE, Fp8Format::e4m3), -448.0f);
  EXPECT_EQ(fp8_decode(0x7B, Fp8Format::e5m2), 57344.0f);
  EXPECT_EQ(fp8_decode(0x3C, Fp8Format::e5m2), 1.0f);
  EXPECT_EQ(fp8_decode(0x04, Fp8Format::e5m2), std::ldexp(1.0f, -14));
  EXPECT_EQ(fp8_decode(0x01, Fp8Format::e5m2), std::ldexp(1.0f, -16));
  EXPECT_EQ(fp8_decode(0x7C, Fp8Format::e5m2), INFINITY);
  EXPECT_EQ(fp8_decode(0xFC, Fp8Format::e5m2), -INFINITY);
  // NaN: e4m3 only S.1111.111, e5m2 every S.11111.mm with mm != 0.
  for (int c = 0; c < 256; ++c) {
    EXPECT_EQ(is_nan_code(uint8_t(c), Fp8Format::e4m3), (c & 0x7F) == 0x7F) << c;
    EXPECT_EQ(is_nan_code(uint8_t(c), Fp8Format::e5m2), (c & 0x7C) == 0x7C && (c & 3) != 0) << c;
    EXPECT_FALSE(is_inf_code(uint8_t(c), Fp8Format::e4m3)) << c;
  }
}

TEST(Fp8, DecodeEncodeIsTheIdentityOnEveryFiniteCode) {
  for (Fp8Format f : kFormats)
    for (int c = 0; c < 256; ++c) {
      const uint8_t code = uint8_t(c);
      if (is_nan_code(code, f) || is_inf_code(code, f)) continue;
      bool saturated = true;
      EXPECT_EQ(fp8_encode(fp8_decode(code, f), f, &saturated), code) << to_string(f) << " code " << c;
      EXPECT_FALSE(saturated);
    }
}

// Between every two neighbouring positive codes (every binade boundary, subnormals and the
// subnormal-to-normal step included): below the midpoint rounds down, above it up, the
// midpoint itself to the code with the even mantissa; the same mirrored for negatives.
TEST(Fp8, RoundsToNearestTiesToEvenBetweenEveryNeighbour) {
  for (Fp8Format f : kFormats)
    for (int c = 0; c + 1 <= 0x7F; ++c) {
      const uint8_t lo = uint8_t(c), hi = uint8_t(c + 1);
      if (is_nan_code(hi, f) || is_inf_code(hi, f)) break;
      const double a = fp8_decode(lo, f), b = fp8_decode(hi, f), mid = (a + b) / 2;
      ASSERT_LT(a, b);
      const uint8_t even = (lo & 1) == 0 ? lo : hi;
      EXPECT_EQ(fp8_encode(mid, f), even) << to_string(f) << " between codes " << c << " and " << c + 1;
      EXPECT_EQ(fp8_encode(std::nextafter(mid, a), f), lo);
      EXPECT_EQ(fp8_encode(std::nextafter(mid, b), f), hi);
      // float inputs: the nearest floats to the midpoint.
      EXPECT_EQ(fp8_encode(std::nextafter(float(mid), float(a)), f), lo);
      EXPECT_EQ(fp8_encode(std::nextafter(float(mid), float(b)), f), hi);
      EXPECT_EQ(fp8_encode(-mid, f), uint8_t(0x80 | even));
      EXPECT_EQ(fp8_encode(-std::nextafter(mid, b), f), uint8_t(0x80 | hi));
    }
}

TEST(Fp8, SubnormalsAreExactAndTheSmallestHalfTiesToZero) {
  EXPECT_EQ(fp8_encode(std::ldexp(1.0, -10), Fp8Format::e4m3), 0x00);  // half the smallest subnormal
  EXPECT_EQ(fp8_encode(std::ldexp(3.0, -10), Fp8Format::e4m3), 0x02);  // tie between 1 and 2 -> 2
  EXPECT_EQ(fp8_encode(std::ldexp(5.0, -10), Fp8Format::e4m3), 0x02);  // tie between 2 and 3 -> 2
  EXPECT_EQ(fp8_encode(std::ldexp(7.0, -9), Fp8Format::e4m3), 0x07);   // largest subnormal
  EXPECT_EQ(fp8_encode(std::ldexp(1.0, -17), Fp8Format::e5m2), 0x00);
  EXPECT_EQ(fp8_encode(std::ldexp(3.0, -16), Fp8Format::e5m2), 0x03);
  EXPECT_EQ(fp8_encode(-std::ldexp(1.0, -40), Fp8Format::e5m2), 0x80);  // -0
  EXPECT_EQ(fp8_encode(1e-30f, Fp8Format::e4m3), 0x00);
}

TEST(Fp8, SaturatesToMaxInsteadOfOverflowing) {
  bool sat = false;
  // e4m3: 464 is the midpoint of 448 (mantissa 110, even) and the would-be 480: rounds to
  // 448 without saturating; anything above would have overflowed.
  EXPECT_EQ(fp8_encode(464.0, Fp8Format::e4m3, &sat), 0x7E);
  EXPECT_FALSE(sat);
  EXPECT_EQ(fp8_encode(std::nextafter(464.0f, 1e9f), Fp8Format::e4m3, &sat), 0x7E);
  EXPECT_TRUE(sat);
  EXPECT_EQ(fp8_encode(-1e30, Fp8Format::e4m3, &sat), 0xFE);
  EXPECT_TRUE(sat);
  EXPECT_EQ(fp8_encode(INFINITY, Fp8Format::e4m3, &sat), 0x7E);
  EXPECT_TRUE(sat);
  // e5m2: 61440, midpoint of 57344 (mantissa 11, odd) and 65536, would round up to inf.
  EXPECT_EQ(fp8_encode(std::nextafter(61440.0, 0.0), Fp8Format::e5m2, &sat), 0x7B);
  EXPECT_FALSE(sat);
  EXPECT_EQ(fp8_encode(61440.0, Fp8Format::e5m2, &sat), 0x7B);
  EXPECT_TRUE(sat);
  EXPECT_EQ(fp8_encode(-INFINITY, Fp8Format::e5m2, &sat), 0xFB);
  EXPECT_TRUE(sat);
}

TEST(Fp8, NanStaysNanAndIsNotCountedAsSaturated) {
  for (Fp8Format f : kFormats) {
    bool sat = true;
    const uint8_t c = fp8_encode(std::nan(""), f, &sat);
    EXPECT_TRUE(is_nan_code(c, f));
    EXPECT_FALSE(sat);
  }
  EXPECT_EQ(fp8_encode(std::nan(""), Fp8Format::e4m3), 0x7F);
}

TEST(Fp8, ScaleRule) {
  EXPECT_EQ(fp8_scale(0.0f, Fp8Format::e4m3), 1.0f);  // all zeros
  EXPECT_EQ(fp8_scale(448.0f, Fp8Format::e4m3), 1.0f);
  EXPECT_EQ(fp8_scale(2.0f, Fp8Format::e4m3), 224.0f);
  EXPECT_EQ(fp8_scale(57344.0f, Fp8Format::e5m2), 1.0f);
  EXPECT_EQ(fp8_scale(1e-45f, Fp8Format::e4m3), FLT_MAX);  // max / amax overflows float
  EXPECT_EQ(fp8_format_from("e4m3", "k"), Fp8Format::e4m3);
  EXPECT_THROW(fp8_format_from("fp16", "train.fp8_grad"), Error);
}

TEST(Fp8, QuantizeDequantizeScalesTheLargestValueOntoMax) {
  // amax = 448·2^-6: the scale is 2^6 exactly, and values on the e4m3 grid times 2^-6 come back unchanged.
  std::vector<float> x = {7.0f, -448.0f, 0.0f, 1.125f, -0.015625f, 3.5f};
  for (float& v : x) v = std::ldexp(v, -6);
  std::vector<float> out(x.size());
  EXPECT_EQ(fp8_quantize_dequantize(out.data(), x.data(), int64_t(x.size()), Fp8Format::e4m3), 0);
  EXPECT_EQ(out, x);
  // Off the grid: within half a unit in the last place (2^-4 relative for e4m3 normals).
  std::vector<float> y = {1.0f, 0.3f, -0.77f, 0.0123f};
  std::vector<float> q(y.size());
  fp8_quantize_dequantize(q.data(), y.data(), int64_t(y.size()), Fp8Format::e4m3);
  for (size_t i = 1; i < y.size(); ++i) {
    EXPECT_NEAR(q[i], y[i], std::fabs(y[i]) / 16 + 1e-7) << i;
    EXPECT_NE(q[i], y[i]) << i;
  }
  EXPECT_FLOAT_EQ(q[0], 1.0f);  // amax lands on max and comes back
}

TEST(Fp8, QuantizeDequantizeCountsSaturationAndKeepsZeros) {
  std::vector<float> x = {1.0f, INFINITY, -2.0f, 0.0f};
  std::vector<float> out(x.size());
  // amax is the largest finite value (2); the infinity saturates to max / scale = 2.
  EXPECT_EQ(fp8_quantize_dequantize(out.data(), x.data(), 4, Fp8Format::e4m3), 1);
  EXPECT_EQ(out[1], 2.0f);
  EXPECT_EQ(out[2], -2.0f);
  std::vector<double> zeros(5, 0.0), z(5, 1.0);
  EXPECT_EQ(fp8_quantize_dequantize(z.data(), zeros.data(), 5, Fp8Format::e5m2), 0);
  EXPECT_EQ(z, zeros);
  std::vector<float> in_place = {0.3f, 0.6f};
  fp8_quantize_dequantize(in_place.data(), in_place.data(), 2, Fp8Format::e4m3);
  EXPECT_FLOAT_EQ(in_place[1], 0.6f);
}

TEST(Fp8, PerRowScalesKeepSmallRowsThatOneTensorScaleFlushes) {
  // Row 0 is 2^-20 of row 1: with one scale its values fall below e4m3's smallest subnormal.
  const std::vector<float> x = {std::ldexp(1.75f, -20), std::ldexp(-1.0f, -20), 1.75f, -1.0f, 0.0f, 0.0f};
  std::vector<float> rows(x.size()), tensor(x.size());
  fp8_quantize_dequantize_rows(rows.data(), x.data(), 3, 2, Fp8Format::e4m3);
  fp8_quantize_dequantize(tensor.data(), x.data(), 6, Fp8Format::e4m3);
  EXPECT_EQ(rows, x);  // each row's scale (a power of two) puts its amax on 448
  EXPECT_EQ(tensor[0], 0.0f);
  EXPECT_EQ(tensor[2], 1.75f);
}
