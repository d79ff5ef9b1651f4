// Tensor memory accelerator (TMA, sm_90) copies: a tiled box of a global tensor, described by a
// CUtensorMap the host encoded (prefill_sm90_launch.cc), lands in shared memory and counts its
// bytes down on an mbarrier. Out-of-bounds box elements are zero-filled, so a box never reads
// outside the tensor the map describes.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace attnkit::cuda::sm90 {

// Brings the map into the constant / descriptor cache before its first use.
__device__ __forceinline__ void tma_prefetch_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// 4-d tiled load of the box at coordinates (c0, c1, c2, c3) (innermost first, in elements).
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                            int32_t c0, int32_t c1, int32_t c2, int32_t c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// Orders this thread's generic-proxy shared-memory writes (st.shared) before later async-proxy
// reads of the same bytes (wgmma operands, TMA stores).
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

}  // namespace attnkit::cuda::sm90
