// Bit-exact scalar conversions shared by the reference backend (host) and the CUDA kernels
// (device). They match CUDA's own conversions bit for bit: round to nearest even; bf16 and f16
// turn NaN into the canonical 0x7FFF; fp8 e4m3 saturates to +-448 (NaN stays NaN, 0x7F);
// int8 rounds to nearest even and saturates to [-128, 127] with NaN -> 0 (cvt.rni.sat.s8.f32).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define ATTNKIT_HD __host__ __device__ __forceinline__
#else
#define ATTNKIT_HD inline
#endif

namespace attnkit::numerics {

ATTNKIT_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

ATTNKIT_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
#endif
}

// Rounds the non-negative integer `value` right by `shift` bits, to nearest even.
ATTNKIT_HD uint32_t shift_round_even(uint32_t value, int shift) {
  if (shift <= 0) return value << (-shift);
  if (shift >= 32) return 0;
  const uint32_t q = value >> shift;
  const uint32_t rem = value & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  return (rem > half || (rem == half && (q & 1u))) ? q + 1u : q;
}

// ---- bf16 -------------------------------------------------------------------------------------
ATTNKIT_HD uint16_t float_to_bf16_bits(float x) {
  const uint32_t u = float_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
ATTNKIT_HD float bf16_bits_to_float(uint16_t b) {
  return bits_float(static_cast<uint32_t>(b) << 16);
}

// ---- f16 --------------------------------------------------------------------------------------
ATTNKIT_HD uint16_t float_to_f16_bits(float x) {
  const uint32_t u = float_bits(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return 0x7fff;           // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: infinity
  const int exp = static_cast<int>(abs >> 23) - 127;
  if (exp < -25) return sign;  // below half the smallest subnormal (2^-25): zero
  const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
  if (exp < -14) {
    // Subnormal: units of 2^-24; value = mant * 2^(exp - 23).
    return sign | static_cast<uint16_t>(shift_round_even(mant, -exp - 1));
  }
  // Normal: 10 mantissa bits; a carry out of the mantissa bumps the exponent correctly.
  const uint32_t q = shift_round_even(mant, 13);  // in [1024, 2048]
  return sign | static_cast<uint16_t>(((exp + 15) << 10) + (q - 1024u));
}
ATTNKIT_HD float f16_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    const float magnitude = static_cast<float>(mant) * 5.9604644775390625e-8f;  // 2^-24
    return sign ? -magnitude : magnitude;
  }
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

// ---- fp8 e4m3 (saturating) --------------------------------------------------------------------
constexpr float kFp8E4M3Max = 448.0f;

ATTNKIT_HD uint8_t float_to_fp8_e4m3_bits(float x) {
  const uint32_t u = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return 0x7f;           // NaN (CUDA gives 0x7F for any NaN input)
  if (abs >= 0x43e00000u) return sign | 0x7eu;  // >= 448 (and infinity): saturate
  if (abs < 0x00800000u) return sign;           // zero and float subnormals round to zero
  const int exp = static_cast<int>(abs >> 23) - 127;
  const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
  uint32_t bits;
  if (exp < -6) {
    // Subnormal: units of 2^-9; value = mant * 2^(exp - 23). 8 units is the smallest normal.
    bits = shift_round_even(mant, 14 - exp);
  } else {
    const uint32_t q = shift_round_even(mant, 20);  // in [8, 16]
    bits = static_cast<uint32_t>((exp + 7) << 3) + (q - 8u);
  }
  if (bits > 0x7eu) bits = 0x7eu;  // rounding up past 448 saturates as well
  return sign | static_cast<uint8_t>(bits);
}
ATTNKIT_HD float fp8_e4m3_bits_to_float(uint8_t b) {
  const uint32_t exp = (b >> 3) & 0xfu;
  const uint32_t mant = b & 0x7u;
  float magnitude;
  if (exp == 0xf && mant == 0x7) {
    magnitude = bits_float(0x7fc00000u);
  } else if (exp == 0) {
    magnitude = static_cast<float>(mant) * 0.001953125f;  // 2^-9
  } else {
    magnitude = bits_float(((exp + 120u) << 23) | (mant << 20));
  }
  return (b & 0x80u) ? -magnitude : magnitude;
}

// ---- int8 -------------------------------------------------------------------------------------
ATTNKIT_HD int8_t float_to_int8_sat(float x) {
  if (x != x) return 0;
  const float r = rintf(x);  // round half to even in the default rounding mode
  if (r <= -128.0f) return -128;
  if (r >= 127.0f) return 127;
  return static_cast<int8_t>(r);
}

// ---- KV-cache quantization: stored = round(x / scale), x = stored * scale (float32) -----------
ATTNKIT_HD uint8_t quantize_fp8_e4m3(float x, float scale) {
  return float_to_fp8_e4m3_bits(x / scale);
}
ATTNKIT_HD int8_t quantize_int8(float x, float scale) { return float_to_int8_sat(x / scale); }

}  // namespace attnkit::numerics
