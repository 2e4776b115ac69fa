// Element types and the host-side conversions between them. Storage of bf16/fp16 is the
// raw 16-bit pattern; conversion rounds to nearest even, as the GPU does.
#pragma once
#include <cstdint>
#include <cstring>
#include <string>

namespace esplag {

enum class DType : uint8_t { f32, f64, bf16, f16, i32, i64, u16, u8 };

size_t dtype_size(DType t);
std::string dtype_name(DType t);        // "f32", "bf16", ...
std::string dtype_safetensors(DType t);  // "F32", "BF16", ... (the safetensors spelling)
DType dtype_from_name(const std::string& name);  // accepts both spellings; throws on unknown

inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_to_float(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t float_to_f16(float f);
float f16_to_float(uint16_t h);

}  // namespace esplag
