// Shared-memory transaction barriers (mbarrier, sm_90): the producer / consumer handshake of the
// warp-specialized kernels. A barrier completes a phase when its pending arrivals reach zero and
// every byte announced with expect_tx has landed (TMA copies count their bytes down on it).
// Waiters name the parity of the phase they wait for; a fresh barrier is in phase 0, so waiting
// for parity 1 returns at once (the producer's first wait on an "empty" barrier).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace attnkit::cuda::sm90 {

__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
}

// Makes the initialized barriers visible to the async proxy (TMA) and the other threads; follow
// it with a CTA barrier.
__device__ __forceinline__ void mbarrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// One arrival that also announces `bytes` of TMA transactions for the current phase.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ bool mbarrier_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}

// Blocks until the phase of parity `parity` has completed (try_wait suspends the thread for a
// while in hardware before it returns false, so the loop does not spin hot).
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  while (!mbarrier_try_wait(bar, parity)) {
  }
}

// A stage index and the parity of its current phase, advanced once per use of a ring of kStages.
template <int kStages>
struct PipelineState {
  int index = 0;
  uint32_t phase = 0;
  __device__ void advance() {
    if (++index == kStages) {
      index = 0;
      phase ^= 1u;
    }
  }
};

}  // namespace attnkit::cuda::sm90
