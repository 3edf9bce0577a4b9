#include "attnrt/core/dtype.h"

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

// A small IEEE-style binary format: `mbits` mantissa bits, exponent bias `bias`.
struct SmallFloat {
  int mbits;
  int bias;
  double max_finite;
  bool saturate;      // fp8: clamp to max_finite; fp16: overflow to infinity
  uint32_t nan_code;  // without sign
  uint32_t inf_code;  // without sign (only used when !saturate)
  int total_bits;
};

constexpr SmallFloat kE4M3{3, 7, 448.0, true, 0x7f, 0, 8};
constexpr SmallFloat kE5M2{2, 15, 57344.0, true, 0x7f, 0x7c, 8};
constexpr SmallFloat kF16{10, 15, 65504.0, false, 0x7e00, 0x7c00, 16};

uint32_t encode(float xf, const SmallFloat& f) {
  const uint32_t sign = std::signbit(xf) ? (1u << (f.total_bits - 1)) : 0u;
  if (std::isnan(xf)) return sign | f.nan_code;
  double a = std::fabs(static_cast<double>(xf));
  const int min_exp = 1 - f.bias;  // exponent of the smallest normal
  if (!std::isinf(a) && a != 0.0) {
    int e;
    std::frexp(a, &e);
    int exp = std::max(e - 1, min_exp);
    double quantum = std::ldexp(1.0, exp - f.mbits);
    a = std::nearbyint(a / quantum) * quantum;  // default FP environment: ties to even
  }
  if (a > f.max_finite) {
    if (f.saturate) a = f.max_finite;
    else return sign | f.inf_code;
  }
  if (a == 0.0) return sign;
  int e;
  std::frexp(a, &e);
  int exp = e - 1;
  if (exp < min_exp) {  // subnormal
    auto mant = static_cast<uint32_t>(std::ldexp(a, f.mbits - min_exp));
    return sign | mant;
  }
  auto mant = static_cast<uint32_t>(std::ldexp(a, f.mbits - exp)) - (1u << f.mbits);
  return sign | (static_cast<uint32_t>(exp + f.bias) << f.mbits) | mant;
}

float decode(uint32_t bits, const SmallFloat& f, bool has_inf) {
  const int ebits = f.total_bits - 1 - f.mbits;
  const bool neg = (bits >> (f.total_bits - 1)) & 1u;
  const uint32_t exp = (bits >> f.mbits) & ((1u << ebits) - 1);
  const uint32_t mant = bits & ((1u << f.mbits) - 1);
  double v;
  if (has_inf && exp == (1u << ebits) - 1) {
    v = mant ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  } else if (!has_inf && (bits & ((1u << (f.total_bits - 1)) - 1)) == f.nan_code) {
    v = std::numeric_limits<double>::quiet_NaN();
  } else if (exp == 0) {
    v = std::ldexp(static_cast<double>(mant), 1 - f.bias - f.mbits);
  } else {
    v = std::ldexp(static_cast<double>(mant + (1u << f.mbits)),
                   static_cast<int>(exp) - f.bias - f.mbits);
  }
  return static_cast<float>(neg ? -v : v);
}

}  // namespace

float fp16_to_float(uint16_t bits) { return decode(bits, kF16, true); }
uint16_t float_to_fp16(float x) { return static_cast<uint16_t>(encode(x, kF16)); }
float e4m3_to_float(uint8_t bits) { return decode(bits, kE4M3, false); }
uint8_t float_to_e4m3(float x) { return static_cast<uint8_t>(encode(x, kE4M3)); }
float e5m2_to_float(uint8_t bits) { return decode(bits, kE5M2, true); }
uint8_t float_to_e5m2(float x) { return static_cast<uint8_t>(encode(x, kE5M2)); }

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
