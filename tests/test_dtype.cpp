#include <gtest/gtest.h>

#include <cmath>
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
