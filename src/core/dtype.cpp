#include "core/dtype.h"

#include <cmath>

#include "core/error.h"

namespace esplag {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f64: case DType::i64: return 8;
    case DType::f32: case DType::i32: return 4;
    case DType::bf16: case DType::f16: case DType::u16: return 2;
    case DType::u8: return 1;
  }
  fail("unknown dtype");
}

std::string dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::u16: return "u16";
    case DType::u8: return "u8";
  }
  fail("unknown dtype");
}

std::string dtype_safetensors(DType t) {
  switch (t) {
    case DType::f32: return "F32";
    case DType::f64: return "F64";
    case DType::bf16: return "BF16";
    case DType::f16: return "F16";
    case DType::i32: return "I32";
    case DType::i64: return "I64";
    case DType::u16: return "U16";
    case DType::u8: return "U8";
  }
  fail("unknown dtype");
}

DType dtype_from_name(const std::string& n) {
  if (n == "f32" || n == "F32" || n == "fp32" || n == "float32") return DType::f32;
  if (n == "f64" || n == "F64" || n == "fp64" || n == "float64") return DType::f64;
  if (n == "bf16" || n == "BF16" || n == "bfloat16") return DType::bf16;
  if (n == "f16" || n == "F16" || n == "fp16" || n == "float16") return DType::f16;
  if (n == "i32" || n == "I32" || n == "int32") return DType::i32;
  if (n == "i64" || n == "I64" || n == "int64") return DType::i64;
  if (n == "u16" || n == "U16" || n == "uint16") return DType::u16;
  if (n == "u8" || n == "U8" || n == "uint8") return DType::u8;
  fail("unknown dtype '", n, "' (expected one of f32, f64, bf16, f16, i32, i64, u16, u8)");
}

uint16_t float_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0));
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (abs < 0x38800000u) {  // subnormal or zero in half precision
    float af;
    std::memcpy(&af, &abs, 4);
    const uint32_t m = static_cast<uint32_t>(std::nearbyint(af * 16777216.0f));  // 2^24
    return static_cast<uint16_t>(sign | m);
  }
  uint32_t m = abs + 0xc8000fffu + ((abs >> 13) & 1u);  // rebias exponent, round to nearest even
  return static_cast<uint16_t>(sign | (m >> 13));
}

float f16_to_float(uint16_t h) {
  const uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  float out;
  if (exp == 0) {
    out = std::ldexp(static_cast<float>(man), -24);
    if (sign) out = -out;
    return out;
  }
  uint32_t bits = exp == 31 ? (sign | 0x7f800000u | (man << 13)) : (sign | ((exp + 112) << 23) | (man << 13));
  std::memcpy(&out, &bits, 4);
  return out;
}

}  // namespace esplag
