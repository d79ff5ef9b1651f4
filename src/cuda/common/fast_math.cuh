// Single-instruction transcendental helpers shared by the attention kernels.
#pragma once

#include <cuda_runtime.h>

namespace attnkit::cuda {

// 2^x with one MUFU.EX2 (ex2.approx.ftz: results below 2^-126 flush to zero). exp2f without
// --use_fast_math wraps the same instruction in a denormal range fix (a compare, two multiplies
// and a select around it): its results differ only where this one flushes, which a softmax
// probability below 2^-126 of its row's maximum never notices.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace attnkit::cuda
