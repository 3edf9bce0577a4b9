#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <random>
#include <cstdlib>
#include <string>

#include "attnrt/core/dtype.h"
#include "attnrt/core/env.h"
#include "attnrt/core/error.h"

using namespace attnrt;

TEST(DType, E4M3RoundTripsEveryCode) {
  for (int c = 0; c < 256; ++c) {
    float f = e4m3_to_float(static_cast<uint8_t>(c));
    if ((c & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(f)) << c;
      continue;
    }
    EXPECT_EQ(float_to_e4m3(f), c) << "code " << c << " value " << f;
  }
  EXPECT_EQ(e4m3_to_float(0x7e), 448.f);
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.f, -9));
}

TEST(DType, E5M2RoundTripsEveryCode) {
  for (int c = 0; c < 256; ++c) {
    float f = e5m2_to_float(static_cast<uint8_t>(c));
    if ((c & 0x7f) > 0x7c) {
      EXPECT_TRUE(std::isnan(f)) << c;
      continue;
    }
    if ((c & 0x7f) == 0x7c) {
      EXPECT_TRUE(std::isinf(f)) << c;
      continue;
    }
    EXPECT_EQ(float_to_e5m2(f), c) << "code " << c << " value " << f;
  }
  EXPECT_EQ(e5m2_to_float(0x7b), 57344.f);
}

// Midpoints between neighbouring codes round to the code with an even mantissa.
template <typename Dec, typename Enc>
void check_midpoints(Dec dec, Enc enc, int max_code) {
  for (int c = 0; c < max_code; ++c) {
    float lo = dec(static_cast<uint8_t>(c)), hi = dec(static_cast<uint8_t>(c + 1));
    double mid = (static_cast<double>(lo) + hi) / 2;
    int even = (c % 2 == 0) ? c : c + 1;
    EXPECT_EQ(enc(static_cast<float>(mid)), even) << "between codes " << c << " and " << c + 1;
    EXPECT_EQ(enc(std::nextafter(static_cast<float>(mid), 0.f)), c);
    EXPECT_EQ(enc(std::nextafter(static_cast<float>(mid), 1e9f)), c + 1);
    EXPECT_EQ(enc(static_cast<float>(-mid)), even | 0x80);
  }
}

TEST(DType, E4M3RoundsMidpointsToEven) { check_midpoints(e4m3_to_float, float_to_e4m3, 0x7e); }
TEST(DType, E5M2RoundsMidpointsToEven) { check_midpoints(e5m2_to_float, float_to_e5m2, 0x7b); }

TEST(DType, Fp8Saturates) {
  EXPECT_EQ(float_to_e4m3(1e6f), 0x7e);
  EXPECT_EQ(float_to_e4m3(-1e6f), 0xfe);
  EXPECT_EQ(float_to_e4m3(INFINITY), 0x7e);
  EXPECT_EQ(float_to_e5m2(1e9f), 0x7b);
  EXPECT_EQ(float_to_e5m2(-INFINITY), 0xfb);
  EXPECT_TRUE(std::isnan(e4m3_to_float(float_to_e4m3(NAN))));
  EXPECT_TRUE(std::isnan(e5m2_to_float(float_to_e5m2(NAN))));
}

TEST(DType, Bf16AndFp16RoundToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  // 1 + 2^-8 is the midpoint between bf16 1.0 and 1.0078125: ties to even (1.0).
  EXPECT_EQ(float_to_bf16(1.0f + std::ldexp(1.f, -8)), 0x3f80);
  EXPECT_EQ(float_to_bf16(1.0f + 3 * std::ldexp(1.f, -8)), 0x3f82);
  for (uint32_t c = 0; c < 0x7c00; ++c) {
    float f = fp16_to_float(static_cast<uint16_t>(c));
    ASSERT_EQ(float_to_fp16(f), c) << c;
    ASSERT_EQ(float_to_fp16(-f), c | 0x8000) << c;
  }
  EXPECT_EQ(float_to_fp16(65520.f), 0x7c00);  // overflow to infinity (IEEE)
  EXPECT_EQ(float_to_fp16(65519.f), 0x7bff);
}

// The conversions' arithmetic definition, the oracle of the bit-level ones in dtype.cpp: the
// value rounded in double to the format's quantum at its binade (ties to even), then saturated or
// overflowed, then encoded field by field.
struct SmallFloat {
  int mbits, bias;
  double max_finite;
  bool saturate;      // fp8: clamp to max_finite; fp16: overflow to infinity
  uint32_t nan_code;  // without sign
  uint32_t inf_code;  // without sign (only used when !saturate)
  int total_bits;
  bool has_inf;
};
constexpr SmallFloat kE4M3{3, 7, 448.0, true, 0x7f, 0, 8, false};
constexpr SmallFloat kE5M2{2, 15, 57344.0, true, 0x7f, 0x7c, 8, true};
constexpr SmallFloat kF16{10, 15, 65504.0, false, 0x7e00, 0x7c00, 16, true};

uint32_t encode_by_definition(float xf, const SmallFloat& f) {
  const uint32_t sign = std::signbit(xf) ? (1u << (f.total_bits - 1)) : 0u;
  if (std::isnan(xf)) return sign | f.nan_code;
  double a = std::fabs(static_cast<double>(xf));
  const int min_exp = 1 - f.bias;
  if (!std::isinf(a) && a != 0.0) {
    int e;
    std::frexp(a, &e);
    const double quantum = std::ldexp(1.0, std::max(e - 1, min_exp) - f.mbits);
    a = std::nearbyint(a / quantum) * quantum;
  }
  if (a > f.max_finite) {
    if (!f.saturate) return sign | f.inf_code;
    a = f.max_finite;
  }
  if (a == 0.0) return sign;
  int e;
  std::frexp(a, &e);
  if (e - 1 < min_exp) return sign | static_cast<uint32_t>(std::ldexp(a, f.mbits - min_exp));
  const auto mant = static_cast<uint32_t>(std::ldexp(a, f.mbits - (e - 1))) - (1u << f.mbits);
  return sign | (static_cast<uint32_t>(e - 1 + f.bias) << f.mbits) | mant;
}

double decode_by_definition(uint32_t bits, const SmallFloat& f) {
  const int ebits = f.total_bits - 1 - f.mbits;
  const bool neg = (bits >> (f.total_bits - 1)) & 1u;
  const uint32_t exp = (bits >> f.mbits) & ((1u << ebits) - 1), mant = bits & ((1u << f.mbits) - 1);
  double v;
  if (f.has_inf && exp == (1u << ebits) - 1) {
    v = mant ? NAN : INFINITY;
  } else if (!f.has_inf && (bits & ((1u << (f.total_bits - 1)) - 1)) == f.nan_code) {
    v = NAN;
  } else if (exp == 0) {
    v = std::ldexp(static_cast<double>(mant), 1 - f.bias - f.mbits);
  } else {
    v = std::ldexp(static_cast<double>(mant + (1u << f.mbits)), static_cast<int>(exp) - f.bias - f.mbits);
  }
  return neg ? -v : v;
}

void expect_decodes_by_definition(float got, uint32_t code, const SmallFloat& f) {
  const double want = decode_by_definition(code, f);
  if (std::isnan(want)) {
    ASSERT_TRUE(std::isnan(got)) << "code " << code;
    ASSERT_EQ(std::signbit(got), std::signbit(want)) << "code " << code;
  } else {
    ASSERT_EQ(std::bit_cast<uint32_t>(got), std::bit_cast<uint32_t>(static_cast<float>(want)))
        << "code " << code;
  }
}

TEST(DType, DecodersMatchTheArithmeticDefinitionOnEveryCode) {
  for (uint32_t c = 0; c < 0x10000; ++c)
    expect_decodes_by_definition(fp16_to_float(static_cast<uint16_t>(c)), c, kF16);
  for (uint32_t c = 0; c < 0x100; ++c) {
    expect_decodes_by_definition(e4m3_to_float(static_cast<uint8_t>(c)), c, kE4M3);
    expect_decodes_by_definition(e5m2_to_float(static_cast<uint8_t>(c)), c, kE5M2);
  }
}

// The float bit patterns where rounding decides: for each exponent and leading mantissa bits of a
// float, the low bits just below, at and above half a code's step (fp16 drops 13 bits, fp8 20 and
// 21), plus uniformly random bits and random values inside each format's range, both signs.
void expect_encoders_match(uint32_t u) {
  const float x = std::bit_cast<float>(u);
  ASSERT_EQ(float_to_fp16(x), encode_by_definition(x, kF16)) << std::hexfloat << x;
  ASSERT_EQ(float_to_e4m3(x), encode_by_definition(x, kE4M3)) << std::hexfloat << x;
  ASSERT_EQ(float_to_e5m2(x), encode_by_definition(x, kE5M2)) << std::hexfloat << x;
}

TEST(DType, EncodersMatchTheArithmeticDefinition) {
  for (int drop : {13, 20, 21}) {
    const uint32_t half = 1u << (drop - 1), step = 1u << drop;
    for (uint32_t hi = 0; hi < (1u << (32 - drop)); ++hi) {
      for (uint32_t lo : {0u, 1u, half - 1, half, half + 1, step - 1}) {
        expect_encoders_match((hi << drop) | lo);
        if (testing::Test::HasFatalFailure()) return;
      }
    }
  }
  std::mt19937_64 rng(std::random_device{}());
  std::uniform_real_distribution<float> in_range(-70000.f, 70000.f), small(-1e-3f, 1e-3f);
  for (int i = 0; i < 1000000; ++i) {
    expect_encoders_match(static_cast<uint32_t>(rng()));
    expect_encoders_match(std::bit_cast<uint32_t>(in_range(rng)));
    expect_encoders_match(std::bit_cast<uint32_t>(small(rng)));
    if (testing::Test::HasFatalFailure()) return;
  }
}

// Every float, when asked for (ATTNRT_DTYPE_EXHAUSTIVE=1; about a quarter of an hour of one core).
TEST(DType, EncodersMatchTheArithmeticDefinitionOnEveryFloat) {
  const char* on = std::getenv("ATTNRT_DTYPE_EXHAUSTIVE");
  if (on == nullptr || std::string(on) != "1") GTEST_SKIP() << "set ATTNRT_DTYPE_EXHAUSTIVE=1";
  uint32_t u = 0;
  do {
    expect_encoders_match(u);
    if (testing::Test::HasFatalFailure()) return;
  } while (++u != 0);
}

TEST(DType, ParseNamesAndRejectUnknown) {
  EXPECT_EQ(parse_dtype("bfloat16"), DType::bf16);
  EXPECT_EQ(parse_dtype("fp8_e4m3"), DType::e4m3);
  try {
    parse_dtype("fp7");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fp7"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("fp8_e5m2"), std::string::npos);
  }
}

TEST(EnvChoice, UnsetEmptyChosenAndRejected) {
  const char* name = "ATTNRT_TEST_ENV_CHOICE";
  unsetenv(name);
  EXPECT_FALSE(env_choice(name, {"a", "bb"}, "test").has_value());
  setenv(name, "", 1);
  EXPECT_FALSE(env_choice(name, {"a", "bb"}, "test").has_value());
  setenv(name, "bb", 1);
  EXPECT_EQ(env_choice(name, {"a", "bb"}, "test"), "bb");
  setenv(name, "b", 1);
  try {
    env_choice(name, {"a", "bb"}, "test");
    ADD_FAILURE() << "b was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "test: ATTNRT_TEST_ENV_CHOICE=b is invalid; use one of a, bb (or leave it unset)");
  }
  unsetenv(name);
}

TEST(EnvInteger, UnsetEmptyInRangeAndRejected) {
  const char* name = "ATTNRT_TEST_ENV_INTEGER";
  unsetenv(name);
  EXPECT_FALSE(env_integer(name, 0, 10, "test", "0 to 10").has_value());
  setenv(name, "", 1);
  EXPECT_FALSE(env_integer(name, 0, 10, "test", "0 to 10").has_value());
  setenv(name, "7", 1);
  EXPECT_EQ(env_integer(name, 0, 10, "test", "0 to 10"), 7);
  for (const char* bad : {"11", "-1", "3x", "x"}) {
    setenv(name, bad, 1);
    try {
      env_integer(name, 0, 10, "test", "0 to 10");
      ADD_FAILURE() << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()),
                std::string("test: ATTNRT_TEST_ENV_INTEGER=") + bad + " is invalid; use 0 to 10");
    }
  }
  unsetenv(name);
}
