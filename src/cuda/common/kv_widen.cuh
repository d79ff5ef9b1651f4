// Exact widening of 8-bit KV-cache elements (fp8 e4m3, int8) to the 16-bit MMA input types, for
// kernels that read an 8-bit cache with 16-bit MMAs. Scales are applied elsewhere (folded into the
// logit scale and the epilogue), so the widened values are the stored codes themselves.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "attnkit/types.h"

namespace attnkit::cuda {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
constexpr bool kHasFp8Cvt = false;
#else
constexpr bool kHasFp8Cvt = true;
#endif

// Two fp8 e4m3 values (low byte first) -> two 16-bit values of kDType (exact: e4m3 -> f16 in one
// cvt on sm89+, and f16 -> f32 -> bf16 is exact for every e4m3 value).
template <DType kDType>
__device__ __forceinline__ uint32_t widen_fp8x2(uint32_t two) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t h2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(static_cast<uint16_t>(two)));
  if constexpr (kDType == DType::kF16) {
    return h2;
  } else {
    float lo, hi;
    asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}"
        : "=f"(lo), "=f"(hi)
        : "r"(h2));
    uint32_t b2;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(b2) : "f"(hi), "f"(lo));
    return b2;
  }
#else
  return two;  // not reached: kHasFp8Cvt is false
#endif
}

// Four fp8 e4m3 values of a word -> two f16 pairs: bytes (0, 1) into lo, (2, 3) into hi. The cvt
// reads each half of the word in place (no shift for the high pair). sm89+ only; the callers
// guard it.
__device__ __forceinline__ void widen_fp8x4_f16(uint32_t word, uint32_t& lo, uint32_t& hi) {
  asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\n"
      "cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(word));
}

// Four int8 values (low byte first) -> four 16-bit values of kDType, exact: b + 128 sits in the
// mantissa of 1024.0 (f16) or 2^23 (f32), and subtracting 1152 or 2^23 + 128 leaves b.
template <DType kDType>
__device__ __forceinline__ uint2 widen_int8x4(uint32_t four) {
  const uint32_t u = four ^ 0x80808080u;
  uint2 out;
  if constexpr (kDType == DType::kF16) {
    const uint32_t lo = __byte_perm(u, 0x64646464u, 0x4140);
    const uint32_t hi = __byte_perm(u, 0x64646464u, 0x4342);
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(out.x) : "r"(lo), "r"(0x64806480u));
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(out.y) : "r"(hi), "r"(0x64806480u));
  } else {
    float f[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      f[k] = __uint_as_float(__byte_perm(u, 0x4b000000u, 0x7440 + k)) - 8388736.f;
    }
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(out.x) : "f"(f[1]), "f"(f[0]));
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(out.y) : "f"(f[3]), "f"(f[2]));
  }
  return out;
}

}  // namespace attnkit::cuda
