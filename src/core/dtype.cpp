#include "attnrt/core/dtype.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "attnrt/core/error.h"

namespace attnrt {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: case DType::i32: return 4;
    case DType::f16: case DType::bf16: return 2;
    case DType::e4m3: case DType::e5m2: case DType::u8: return 1;
    case DType::i64: return 8;
  }
  return 0;
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "fp32";
    case DType::f16: return "fp16";
    case DType::bf16: return "bf16";
    case DType::e4m3: return "fp8_e4m3";
    case DType::e5m2: return "fp8_e5m2";
    case DType::i32: return "int32";
    case DType::i64: return "int64";
    case DType::u8: return "uint8";
  }
  return "?";
}

bool is_fp8(DType t) { return t == DType::e4m3 || t == DType::e5m2; }
bool is_float(DType t) {
  return t == DType::f32 || t == DType::f16 || t == DType::bf16 || is_fp8(t);
}

DType parse_dtype(std::string_view name) {
  struct Alias { std::string_view name; DType type; };
  static constexpr Alias kAliases[] = {
      {"fp32", DType::f32},      {"float32", DType::f32},     {"float", DType::f32},
      {"fp16", DType::f16},      {"float16", DType::f16},     {"half", DType::f16},
      {"bf16", DType::bf16},     {"bfloat16", DType::bf16},
      {"fp8_e4m3", DType::e4m3}, {"fp8_e4m3fn", DType::e4m3}, {"e4m3", DType::e4m3},
      {"fp8_e5m2", DType::e5m2}, {"e5m2", DType::e5m2},
  };
  for (const auto& a : kAliases) {
    if (a.name == name) return a.type;
  }
  fail("unknown dtype '{}': use one of fp32, fp16, bf16, fp8_e4m3, fp8_e5m2 "
       "(aliases: float32, float16, half, bfloat16, fp8_e4m3fn, e4m3, e5m2)", name);
}

namespace {

// The narrow formats by their bit fields: M mantissa bits, exponent bias B. A float's bits, sign
// cleared and finite, rounded to the format (round to nearest, ties to even), before any
// saturation: the mantissa is the float's, shifted; below the smallest normal 2^(1-B) the value
// is a multiple of the quantum 2^(1-B-M), found by scaling (exact: a power of two) and rounding
// to an integer. A code that rounds up into the next binade carries into the exponent field.
template <int M, int B>
uint32_t round_to_code(uint32_t x) {
  constexpr uint32_t kMinNormal = static_cast<uint32_t>(127 + 1 - B) << 23;
  if (x < kMinNormal) {
    constexpr float kToQuanta = std::bit_cast<float>(static_cast<uint32_t>(127 + B + M - 1) << 23);
    return static_cast<uint32_t>(std::nearbyint(std::bit_cast<float>(x) * kToQuanta));
  }
  constexpr int kDrop = 23 - M;
  x += ((1u << (kDrop - 1)) - 1) + ((x >> kDrop) & 1u);
  return (x >> kDrop) - (static_cast<uint32_t>(127 - B) << M);
}

// An fp8 code of |x| (bits with the sign cleared): NaN stays NaN (0x7f), anything at or above the
// largest finite value `max_bits` (infinity too) saturates to `max_code`, as does a value that
// rounds past it.
template <int M, int B>
uint8_t fp8_code(float x, uint32_t max_bits, uint32_t max_code) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const auto sign = static_cast<uint8_t>((u >> 24) & 0x80);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7f;
  if (a >= max_bits) return static_cast<uint8_t>(sign | max_code);
  return static_cast<uint8_t>(sign | std::min(round_to_code<M, B>(a), max_code));
}

// The 256 values of an fp8 format, decoded at compile time: M mantissa bits, bias B, whether the
// top exponent holds infinities and NaNs (e5m2) or only NaN at 0x7f (e4m3fn).
template <int M, int B, bool kIeee>
constexpr std::array<float, 256> fp8_table() {
  std::array<float, 256> t{};
  for (uint32_t c = 0; c < 256; ++c) {
    const uint32_t sign = (c & 0x80) << 24, exp = (c & 0x7f) >> M, mant = c & ((1u << M) - 1);
    uint32_t bits;
    if (kIeee && exp == (0x7fu >> M)) {
      bits = 0x7f800000u | (mant ? 0x400000u : 0u);
    } else if (!kIeee && (c & 0x7f) == 0x7f) {
      bits = 0x7fc00000u;
    } else if (exp == 0) {  // mant * 2^(1-B-M), exact
      constexpr float kQuantum = std::bit_cast<float>(static_cast<uint32_t>(127 + 1 - B - M) << 23);
      bits = std::bit_cast<uint32_t>(static_cast<float>(mant) * kQuantum);
    } else {
      bits = ((exp + 127 - B) << 23) | (mant << (23 - M));
    }
    t[c] = std::bit_cast<float>(sign | bits);
  }
  return t;
}

constexpr std::array<float, 256> kE4m3Values = fp8_table<3, 7, false>();
constexpr std::array<float, 256> kE5m2Values = fp8_table<2, 15, true>();

}  // namespace

float fp16_to_float(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000) << 16;
  const uint32_t exp = (bits >> 10) & 0x1f, mant = bits & 0x3ff;
  if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mant ? 0x400000u : 0u));
  if (exp == 0) {  // zero or subnormal: mant * 2^-24, exact
    const float v = static_cast<float>(mant) * 0x1p-24f;
    return sign ? -v : v;
  }
  return std::bit_cast<float>(sign | ((exp + 127 - 15) << 23) | (mant << 13));
}

uint16_t float_to_fp16(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const auto sign = static_cast<uint16_t>((u >> 16) & 0x8000);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00;   // NaN
  if (a >= 0x477ff000u) return sign | 0x7c00;  // 65520 and above round to infinity (IEEE)
  return static_cast<uint16_t>(sign | round_to_code<10, 15>(a));
}

float e4m3_to_float(uint8_t bits) { return kE4m3Values[bits]; }
uint8_t float_to_e4m3(float x) { return fp8_code<3, 7>(x, 0x43e00000u /* 448 */, 0x7e); }
float e5m2_to_float(uint8_t bits) { return kE5m2Values[bits]; }
uint8_t float_to_e5m2(float x) { return fp8_code<2, 15>(x, 0x47600000u /* 57344 */, 0x7b); }

float load_as_float(const void* base, DType t, size_t i) {
  switch (t) {
    case DType::f32: return static_cast<const float*>(base)[i];
    case DType::f16: return fp16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::bf16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::e4m3: return e4m3_to_float(static_cast<const uint8_t*>(base)[i]);
    case DType::e5m2: return e5m2_to_float(static_cast<const uint8_t*>(base)[i]);
    default: fail("load_as_float: {} is not a float dtype", dtype_name(t));
  }
}

void store_from_float(void* base, DType t, size_t i, float value) {
  switch (t) {
    case DType::f32: static_cast<float*>(base)[i] = value; return;
    case DType::f16: static_cast<uint16_t*>(base)[i] = float_to_fp16(value); return;
    case DType::bf16: static_cast<uint16_t*>(base)[i] = float_to_bf16(value); return;
    case DType::e4m3: static_cast<uint8_t*>(base)[i] = float_to_e4m3(value); return;
    case DType::e5m2: static_cast<uint8_t*>(base)[i] = float_to_e5m2(value); return;
    default: fail("store_from_float: {} is not a float dtype", dtype_name(t));
  }
}

}  // namespace attnrt
