// Warpgroup-level controls of sm_90a: register reallocation between warpgroup roles and the
// wgmma fences and groups (the named barriers are named_barrier.cuh's). Only for the sm_90a
// device pass (__CUDA_ARCH_FEAT_SM90_ALL); the callers guard their kernels' bodies.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/named_barrier.cuh"

namespace attnkit::cuda::sm90 {

// setmaxnreg: the producer warpgroup gives registers back, the consumers take them. Effective
// only under a register cap at kernel entry (__launch_bounds__(threads, 1)).
template <int kRegs>
__device__ __forceinline__ void warpgroup_reg_dealloc() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void warpgroup_reg_alloc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// Named barriers: named_barrier.cuh (any architecture), under their sm90 names as well.
using ::attnkit::cuda::named_barrier_all;
using ::attnkit::cuda::named_barrier_arrive;
using ::attnkit::cuda::named_barrier_sync;

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most kPending committed groups of this warpgroup are still in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Pins the accumulator registers at this point of the program: reads after a wgmma_wait are not
// moved above it, writes before a wgmma issue not below it.
template <int kN>
__device__ __forceinline__ void fence_operands(float (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int kN>
__device__ __forceinline__ void fence_operands(uint32_t (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+r"(d[i])::"memory");
}
template <int kN>
__device__ __forceinline__ void fence_operands(int32_t (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

}  // namespace attnkit::cuda::sm90
