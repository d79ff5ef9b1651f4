// ldmatrix wrappers (sm75+): four 8x8 matrices of 16-bit elements from shared memory into the
// MMA fragment layout. Lane l gives the address of row (l % 8) of matrix (l / 8); the result
// register i holds matrix i. The .trans form transposes each matrix (B operands stored k-major).
// movmatrix transposes a matrix already in registers.
#pragma once

#include <cstdint>

namespace attnkit::cuda {

__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t smem_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr));
}

// Transposes an 8x8 matrix of 16-bit elements held in the MMA accumulator layout (lane (g, t):
// row g, columns 2t, 2t + 1), giving lane (g, t) row g of the transpose (movmatrix, sm75+).
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

}  // namespace attnkit::cuda
