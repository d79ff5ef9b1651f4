// Element access by runtime dtype, host and device (the reference backend, the tests and the naive
// GPU kernels): every value goes through float with the bit-exact conversions of numerics.h.
#pragma once

#include <cstdint>

#include "attnkit/types.h"
#include "core/numerics.h"

namespace attnkit::detail {

// Reads element `index` (in elements from `data`) as float. Integer dtypes convert exactly
// (int8 as its integer value, not dequantized).
ATTNKIT_HD float load_as_float(const void* data, DType dtype, int64_t index) {
  switch (dtype) {
    case DType::kF32:
      return static_cast<const float*>(data)[index];
    case DType::kF16:
      return numerics::f16_bits_to_float(static_cast<const uint16_t*>(data)[index]);
    case DType::kBF16:
      return numerics::bf16_bits_to_float(static_cast<const uint16_t*>(data)[index]);
    case DType::kFp8E4M3:
      return numerics::fp8_e4m3_bits_to_float(static_cast<const uint8_t*>(data)[index]);
    case DType::kInt8:
      return static_cast<float>(static_cast<const int8_t*>(data)[index]);
    case DType::kInt32:
      return static_cast<float>(static_cast<const int32_t*>(data)[index]);
    case DType::kInt64:
      return static_cast<float>(static_cast<const int64_t*>(data)[index]);
  }
  return 0.0f;
}

// Writes `value` rounded to `dtype` (float dtypes round to nearest even; fp8 and int8 saturate).
ATTNKIT_HD void store_from_float(void* data, DType dtype, int64_t index, float value) {
  switch (dtype) {
    case DType::kF32:
      static_cast<float*>(data)[index] = value;
      return;
    case DType::kF16:
      static_cast<uint16_t*>(data)[index] = numerics::float_to_f16_bits(value);
      return;
    case DType::kBF16:
      static_cast<uint16_t*>(data)[index] = numerics::float_to_bf16_bits(value);
      return;
    case DType::kFp8E4M3:
      static_cast<uint8_t*>(data)[index] = numerics::float_to_fp8_e4m3_bits(value);
      return;
    case DType::kInt8:
      static_cast<int8_t*>(data)[index] = numerics::float_to_int8_sat(value);
      return;
    case DType::kInt32:
      static_cast<int32_t*>(data)[index] = static_cast<int32_t>(value);
      return;
    case DType::kInt64:
      static_cast<int64_t*>(data)[index] = static_cast<int64_t>(value);
      return;
  }
}

// Offset in elements of a multi-index into a strided view.
inline int64_t offset_of(const TensorView& t, std::initializer_list<int64_t> index) {
  int64_t offset = 0;
  int d = 0;
  for (int64_t i : index) offset += i * t.strides[d++];
  return offset;
}

}  // namespace attnkit::detail
