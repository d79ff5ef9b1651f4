// Global-memory accesses with explicit ordering or cache effects, and the programmatic-launch
// controls: the device side of the split merges' counters and sums, and of a kernel launched as a
// programmatic dependent (launch.cuh's launch_maybe_programmatic). The griddepcontrol, vector
// reduction and bulk-prefetch forms are sm_90 instructions: the callers guard them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace attnkit::cuda {

// A relaxed load at gpu scope: coherent with other SMs' writes (not an L1 line), no ordering.
__device__ __forceinline__ int32_t ld_relaxed_gpu(const int32_t* src) {
  int32_t value;
  asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];\n" : "=r"(value) : "l"(src));
  return value;
}

// *counter += 1 with acquire / release semantics at gpu scope; returns the old value.
__device__ __forceinline__ int32_t atom_add_one_acq_rel_gpu(int32_t* counter) {
  int32_t old;
  asm volatile("atom.add.acq_rel.gpu.s32 %0, [%1], 1;\n" : "=r"(old) : "l"(counter) : "memory");
  return old;
}

// dst[0..3] += (x, y, z, w) in L2, relaxed (one vector reduction, sm_90).
__device__ __forceinline__ void red_add_v4_f32(float4* dst, float x, float y, float z, float w) {
  asm volatile("red.relaxed.gpu.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "f"(x),
               "f"(y), "f"(z), "f"(w)
               : "memory");
}

// A hint that `bytes` (a multiple of 16) from src be brought into L2 (sm_90).
__device__ __forceinline__ void prefetch_l2_bulk(const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" : : "l"(src), "r"(bytes) : "memory");
}

// In a programmatic dependent launch (sm_90): waits until the previous kernel on the stream has
// completed and its writes are visible.
__device__ __forceinline__ void griddep_wait() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}
// Lets the next programmatic dependent kernel launch (its CTAs become resident as this one's
// retire).
__device__ __forceinline__ void griddep_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

}  // namespace attnkit::cuda
