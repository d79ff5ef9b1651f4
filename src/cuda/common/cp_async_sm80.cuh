// cp.async wrappers (sm80+): 16-byte global -> shared copies that bypass registers, committed in
// groups and waited on by count, for multi-stage load pipelines.
#pragma once

#include <cstdint>

namespace attnkit::cuda {

// Copies 16 bytes when `valid`, else writes 16 zero bytes (src-size 0: nothing is read, so
// `src` only has to be a valid-looking address).
__device__ __forceinline__ void cp_async_16(uint32_t smem_addr, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(src),
               "r"(src_bytes));
}

// The same with the ignore-src operand: one predicate where the src-size form makes ptxas adjust
// the address and compare (12 instructions a copy against ~20 in the wgmma decode kernel's copy
// loop). Zero bytes when !valid; `src` is not read then.
__device__ __forceinline__ void cp_async_16_or_zeros(uint32_t smem_addr, const void* src,
                                                     bool valid) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %2, 0;\n"
      "cp.async.cg.shared.global [%0], [%1], 16, p;\n"
      "}\n" ::"r"(smem_addr),
      "l"(src), "r"(static_cast<int>(!valid)));
}

// 16 bytes that are all valid (no zero fill), with an L2 cache policy (l2_policy_evict_first).
// Only this form takes a hint: for the hinted zero-fill form ptxas of CUDA 13.0 emitted LDGSTS
// naming a descriptor register that nothing writes, an illegal instruction at run time.
__device__ __forceinline__ void cp_async_16_l2_hint(uint32_t smem_addr, const void* src,
                                                    uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(smem_addr),
               "l"(src), "l"(policy));
}

// An L2 policy that marks the lines a hinted access brings in as the first to evict: for streams
// read once.
__device__ __forceinline__ uint64_t l2_policy_evict_first() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0;\n" : "=l"(policy));
  return policy;
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most `kPending` committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Waits for every cp.async of this thread, committed or not.
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

}  // namespace attnkit::cuda
