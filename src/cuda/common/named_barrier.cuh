// Named CTA barriers (bar.sync / bar.arrive, any architecture): a subset of a CTA's warps meets
// on one of the ids 1-15 (0 is __syncthreads) without stopping the others.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace attnkit::cuda {

// Named barriers (ids 1-15; 0 is __syncthreads). kId is an immediate: a register id makes ptxas
// reserve all sixteen.
template <int kId>
__device__ __forceinline__ void named_barrier_sync(int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"n"(kId), "r"(threads) : "memory");
}
template <int kId>
__device__ __forceinline__ void named_barrier_arrive(int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"n"(kId), "r"(threads) : "memory");
}
// The same with a (warp-uniform) barrier id computed at run time.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// bar.red.and: whether `pred` holds in every one of the `threads` threads that meet at barrier
// `id` (a warpgroup's vote in one barrier, no shared memory).
__device__ __forceinline__ bool named_barrier_all(int id, bool pred, int threads) {
  uint32_t all;
  asm volatile(
      "{\n"
      ".reg .pred p, q;\n"
      "setp.ne.u32 p, %1, 0;\n"
      "bar.red.and.pred q, %2, %3, p;\n"
      "selp.u32 %0, 1, 0, q;\n"
      "}\n"
      : "=r"(all)
      : "r"(static_cast<uint32_t>(pred)), "r"(id), "r"(threads)
      : "memory");
  return all != 0;
}
// Both the id and the thread count as immediates (no register holds the count).
template <int kId, int kThreads>
__device__ __forceinline__ void named_barrier_sync() {
  asm volatile("bar.sync %0, %1;\n" ::"n"(kId), "n"(kThreads) : "memory");
}

}  // namespace attnkit::cuda
