// SAGE quantization scalars (docs/semantics.md, docs/diffusion.md): block scales and codes of
// Q and K (int8 or fp8 e4m3), V (fp8 e4m3 per channel) and P (fp8 e4m3 with the fixed scale
// 1/448). Shared by the reference backend (host) and the CUDA quantize kernels (device) so that
// both produce the same codes. Kernels must divide with IEEE division (no fast-math reciprocal):
// x / scale is what decides a code, bit for bit.
#pragma once

#include <cstdint>

#include "core/numerics.h"

namespace attnkit::sage {

// Symmetric int8: codes in [-127, 127], so -128 is never produced and q * k products stay in
// [-16129, 16129] (an int32 dot product over 512 channels cannot overflow).
constexpr float kInt8CodeMax = 127.0f;
constexpr float kFp8CodeMax = numerics::kFp8E4M3Max;  // 448
// P in [0, 1] is stored as fp8(p * kPScale); the 1/kPScale folds into the final normalization.
constexpr float kPScale = numerics::kFp8E4M3Max;

// Scale of a block whose largest |x| is amax. An all-zero block gets scale 1 (its codes are all
// zero either way; amax / 127 would make x / scale a 0/0 NaN).
ATTNKIT_HD float int8_block_scale(float amax) { return amax > 0.0f ? amax / kInt8CodeMax : 1.0f; }
ATTNKIT_HD float fp8_block_scale(float amax) { return amax > 0.0f ? amax / kFp8CodeMax : 1.0f; }

// Round to nearest even, saturate to [-127, 127].
ATTNKIT_HD int8_t quantize_int8(float x, float scale) {
  const int8_t code = numerics::float_to_int8_sat(x / scale);
  return code < -127 ? static_cast<int8_t>(-127) : code;
}
// Round to nearest even, saturate to +-448.
ATTNKIT_HD uint8_t quantize_fp8(float x, float scale) {
  return numerics::float_to_fp8_e4m3_bits(x / scale);
}
ATTNKIT_HD float fp8_value(uint8_t code) { return numerics::fp8_e4m3_bits_to_float(code); }

ATTNKIT_HD float dequantize_int8(int8_t code, float scale) {
  return static_cast<float>(code) * scale;
}
ATTNKIT_HD float dequantize_fp8(uint8_t code, float scale) { return fp8_value(code) * scale; }

// P (an exp(s - running_max) in [0, 1]) for the P*V product: the fp8 code of p * 448. P*V
// multiplies fp8_value(code) and the result is divided by kPScale once, at the end.
ATTNKIT_HD uint8_t quantize_p(float p) { return numerics::float_to_fp8_e4m3_bits(p * kPScale); }

}  // namespace attnkit::sage
