// Element types and host conversions. All float->narrow conversions round to nearest, ties to even.
// fp8 conversions saturate to the largest finite value (the "satfinite" behaviour KV caches use);
// NaN stays NaN.
#pragma once

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace attnrt {

enum class DType : uint8_t { f32, f16, bf16, e4m3, e5m2, i32, i64, u8 };

size_t dtype_size(DType t);
std::string_view dtype_name(DType t);  // "fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "int32", ...
bool is_fp8(DType t);
bool is_float(DType t);
// Parses the names above and the aliases users type: float32, float16, half, bfloat16,
// fp8_e4m3fn, e4m3, fp8_e5m2, e5m2. Throws attnrt::Error listing the accepted names.
DType parse_dtype(std::string_view name);

// Raw-bit conversions. The bf16 pair is inline: data generation and tooling call it per element.
inline float bf16_to_float(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}
inline uint16_t float_to_bf16(float x) {
  uint32_t u = std::bit_cast<uint32_t>(x);
  if (std::isnan(x)) return static_cast<uint16_t>((u >> 16) | 0x40);  // keep sign, quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<uint16_t>(u >> 16);
}
float fp16_to_float(uint16_t bits);
uint16_t float_to_fp16(float x);
float e4m3_to_float(uint8_t bits);  // e4m3fn: no infinities, 0x7f/0xff are NaN, max 448
uint8_t float_to_e4m3(float x);
float e5m2_to_float(uint8_t bits);  // IEEE-like: max finite 57344
uint8_t float_to_e5m2(float x);

// Generic element access on raw memory of a float dtype (slow path: tests, reference, tooling).
float load_as_float(const void* base, DType t, size_t index);
void store_from_float(void* base, DType t, size_t index, float value);

}  // namespace attnrt
