// Bit-exact conversions against known bit patterns (the values CUDA's own conversions give).
#include "core/numerics.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace attnkit::numerics {
namespace {

TEST(Numerics, Bf16KnownPatterns) {
  EXPECT_EQ(float_to_bf16_bits(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16_bits(-2.0f), 0xc000);
  EXPECT_EQ(float_to_bf16_bits(bits_float(0x3f808000u)), 0x3f80);  // tie, even stays
  EXPECT_EQ(float_to_bf16_bits(bits_float(0x3f818000u)), 0x3f82);  // tie, odd rounds up
  EXPECT_EQ(float_to_bf16_bits(bits_float(0x3f808001u)), 0x3f81);  // above the tie
  EXPECT_EQ(float_to_bf16_bits(std::numeric_limits<float>::quiet_NaN()), 0x7fff);
  EXPECT_EQ(float_to_bf16_bits(INFINITY), 0x7f80);
  EXPECT_EQ(float_to_bf16_bits(bits_float(0x7f7fffffu)), 0x7f80);  // max float rounds to inf
  EXPECT_EQ(bf16_bits_to_float(0x4049), 3.140625f);
}

TEST(Numerics, F16KnownPatterns) {
  EXPECT_EQ(float_to_f16_bits(1.0f), 0x3c00);
  EXPECT_EQ(float_to_f16_bits(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_f16_bits(65519.0f), 0x7bff);
  EXPECT_EQ(float_to_f16_bits(65520.0f), 0x7c00);  // tie to even goes to infinity
  EXPECT_EQ(float_to_f16_bits(-INFINITY), 0xfc00);
  EXPECT_EQ(float_to_f16_bits(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(float_to_f16_bits(std::ldexp(1.0f, -25)), 0x0000);  // tie to even: zero
  EXPECT_EQ(float_to_f16_bits(std::ldexp(1.5f, -25)), 0x0001);
  EXPECT_EQ(float_to_f16_bits(std::ldexp(3.0f, -25)), 0x0002);  // 1.5 units: tie to even (2)
  EXPECT_EQ(float_to_f16_bits(std::ldexp(1.0f, -14)), 0x0400);  // smallest normal
  EXPECT_EQ(float_to_f16_bits(0.1f), 0x2e66);
  EXPECT_EQ(float_to_f16_bits(-0.0f), 0x8000);
  EXPECT_EQ(float_to_f16_bits(std::numeric_limits<float>::quiet_NaN()), 0x7fff);
  EXPECT_EQ(f16_bits_to_float(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(f16_bits_to_float(0xc000), -2.0f);
}

TEST(Numerics, Fp8E4M3KnownPatterns) {
  EXPECT_EQ(float_to_fp8_e4m3_bits(1.0f), 0x38);
  EXPECT_EQ(float_to_fp8_e4m3_bits(448.0f), 0x7e);
  EXPECT_EQ(float_to_fp8_e4m3_bits(1000.0f), 0x7e);  // saturates
  EXPECT_EQ(float_to_fp8_e4m3_bits(-1e9f), 0xfe);
  EXPECT_EQ(float_to_fp8_e4m3_bits(INFINITY), 0x7e);  // satfinite
  EXPECT_EQ(float_to_fp8_e4m3_bits(std::numeric_limits<float>::quiet_NaN()), 0x7f);
  EXPECT_EQ(float_to_fp8_e4m3_bits(std::ldexp(1.0f, -9)), 0x01);   // smallest subnormal
  EXPECT_EQ(float_to_fp8_e4m3_bits(std::ldexp(1.0f, -10)), 0x00);  // tie to even: zero
  EXPECT_EQ(float_to_fp8_e4m3_bits(std::ldexp(3.0f, -10)), 0x02);  // 1.5 units -> 2
  EXPECT_EQ(float_to_fp8_e4m3_bits(std::ldexp(1.0f, -6)), 0x08);   // smallest normal
  EXPECT_EQ(float_to_fp8_e4m3_bits(1.0625f), 0x38);  // tie between 1.0 and 1.125: even
  EXPECT_EQ(float_to_fp8_e4m3_bits(1.1875f), 0x3a);  // tie between 1.125 and 1.25: even (1.25)
  EXPECT_EQ(float_to_fp8_e4m3_bits(-3.5f), 0xc6);
  EXPECT_EQ(fp8_e4m3_bits_to_float(0x7e), 448.0f);
  EXPECT_TRUE(std::isnan(fp8_e4m3_bits_to_float(0xff)));
  EXPECT_EQ(fp8_e4m3_bits_to_float(0x01), std::ldexp(1.0f, -9));
}

TEST(Numerics, Fp8RoundTripOfEveryCode) {
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7f) == 0x7f) continue;  // NaN
    const float x = fp8_e4m3_bits_to_float(static_cast<uint8_t>(code));
    EXPECT_EQ(float_to_fp8_e4m3_bits(x), code == 0x80 ? 0x80 : code) << code;
  }
}

TEST(Numerics, Int8SaturatesAndRoundsEven) {
  EXPECT_EQ(float_to_int8_sat(2.5f), 2);
  EXPECT_EQ(float_to_int8_sat(3.5f), 4);
  EXPECT_EQ(float_to_int8_sat(-2.5f), -2);
  EXPECT_EQ(float_to_int8_sat(200.0f), 127);
  EXPECT_EQ(float_to_int8_sat(-200.0f), -128);
  EXPECT_EQ(float_to_int8_sat(std::numeric_limits<float>::quiet_NaN()), 0);
  EXPECT_EQ(quantize_int8(1.0f, 0.5f), 2);
  EXPECT_EQ(quantize_fp8_e4m3(2.0f, 2.0f), 0x38);
}

}  // namespace
}  // namespace attnkit::numerics
