// Scalar element access by runtime dtype on the device, for the naive (vanilla) kernels and the
// metadata kernels: every value goes through float with the bit-exact conversions of
// core/numerics.h, so the GPU vanilla backend rounds exactly like the CPU reference.
#pragma once

#include <cstdint>

#include "attnkit/types.h"
#include "core/element.h"

namespace attnkit::cuda {

// The shared host/device conversions (core/element.h) under the names the kernels use.
__device__ __forceinline__ float load_element(const void* data, DType dtype, int64_t index) {
  return detail::load_as_float(data, dtype, index);
}
__device__ __forceinline__ void store_element(void* data, DType dtype, int64_t index, float value) {
  detail::store_from_float(data, dtype, index, value);
}

// The float32 scale of KV head `head`: per tensor ([1]), per head ([Hkv]) or none (1).
__device__ __forceinline__ float kv_scale_of(const float* scale, bool per_head, int32_t head) {
  return scale == nullptr ? 1.0f : scale[per_head ? head : 0];
}

}  // namespace attnkit::cuda
