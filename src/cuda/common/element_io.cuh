// Scalar element access by runtime dtype on the device, for the naive (vanilla) kernels and the
// metadata kernels: every value goes through float with the bit-exact conversions of
// core/numerics.h, so the GPU vanilla backend rounds exactly like the CPU reference.
#pragma once

#include <cstdint>

#include "attnkit/types.h"
#include "core/numerics.h"

namespace attnkit::cuda {

__device__ __forceinline__ float load_element(const void* data, DType dtype, int64_t index) {
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
    default:
      return 0.0f;
  }
}

// Rounds to nearest even (f16, bf16) or saturates (fp8 e4m3, int8) like numerics.h.
__device__ __forceinline__ void store_element(void* data, DType dtype, int64_t index, float value) {
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
    default:
      return;
  }
}

// The float32 scale of KV head `head`: per tensor ([1]), per head ([Hkv]) or none (1).
__device__ __forceinline__ float kv_scale_of(const float* scale, bool per_head, int32_t head) {
  return scale == nullptr ? 1.0f : scale[per_head ? head : 0];
}

}  // namespace attnkit::cuda
