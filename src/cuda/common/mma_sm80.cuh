// Warp-level tensor-core MMA wrappers (mma.sync, sm80+): m16n8k16 with bf16 or f16 inputs and
// float32 accumulators. Fragment layouts (g = lane / 4, t = lane % 4):
//   A 16x16 (row-major): a[0] = (g, 2t..2t+1), a[1] = (g+8, 2t..), a[2] = (g, 2t+8..),
//                        a[3] = (g+8, 2t+8..)
//   B 16x8 (k x n):      b[0] = (k 2t..2t+1, n g), b[1] = (k 2t+8.., n g)
//   C 16x8 float:        c[0..1] = (g, 2t..2t+1), c[2..3] = (g+8, 2t..2t+1)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace attnkit::cuda {

// Tag types for the 16-bit MMA input element.
struct Bf16Tag {
  using Storage = __nv_bfloat16;
  using Pair = __nv_bfloat162;
};
struct F16Tag {
  using Storage = __half;
  using Pair = __half2;
};
// The 8-bit one: fp8 e4m3 codes (the sm90 FP8 kernels' wgmma, wgmma_sm90.cuh).
struct Fp8Tag {
  using Storage = uint8_t;
};
// int8 codes (the SAGE kernels' Q K^T: s8 x s8 -> s32 wgmma).
struct Int8Tag {
  using Storage = int8_t;
};

template <typename Tag>
__device__ __forceinline__ void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]);

template <>
__device__ __forceinline__ void mma_m16n8k16<Bf16Tag>(float (&c)[4], const uint32_t (&a)[4],
                                                      const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <>
__device__ __forceinline__ void mma_m16n8k16<F16Tag>(float (&c)[4], const uint32_t (&a)[4],
                                                     const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Two floats rounded (nearest even) into one register of two 16-bit elements, lo first.
template <typename Tag>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t pack_pair<Bf16Tag>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack_pair<F16Tag>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

}  // namespace attnkit::cuda
