// The Hopper (sm_90a) context FMHA, in the manner of FlashAttention-3: a persistent, warp-
// specialized kernel of three warpgroups. Warpgroup 0 is the producer (prefill_sm90_producer.cuh:
// TMA or gathered loads of Q and of K / V rings guarded by mbarriers), warpgroups 1 and 2 are the
// consumers (prefill_sm90_consumer.cuh: wgmma mainloop with the online softmax, ping-pong and
// intra-warpgroup overlap, epilogue). setmaxnreg moves registers from the producer (40 a thread)
// to the consumers (232). The tile scheduler is PersistentScheduler (prefill_scheduler.cuh), the
// mask and logit modifiers the variant functions of prefill_variant.cuh.
//
// Included only by the generated instantiation files (prefill_sm90_inst_*.cu, see
// cmake/prefill_manifest.cmake); prefill_sm90_launch.cc builds the parameters.
#pragma once

#include <cuda_runtime.h>

#include "cuda/common/cuda_status.h"
#include "cuda/common/launch.cuh"
#include "cuda/common/ldmatrix_sm80.cuh"
#include "cuda/common/mbarrier_sm90.cuh"
#include "cuda/common/warpgroup_sm90.cuh"
#include "cuda/prefill/prefill_sm90_consumer.cuh"
#include "cuda/prefill/prefill_sm90_launch.h"
#include "cuda/prefill/prefill_sm90_producer.cuh"
#include "cuda/prefill/prefill_sm90_traits.h"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ATTNKIT_PREFILL_SM90_DEVICE 1
#endif

namespace attnkit::cuda::prefill {

// The traits of a (head_dim, q dtype, mask, skip, SAGE) kernel: fp8 e4m3 q takes the FP8 kernel;
// kSage the SAGE kernels, whose q dtype (int8 or fp8 e4m3) is that of the Q K^T codes.
template <int kHeadDim, DType kDType, bool kMasked, bool kSkip, bool kSage = false>
using Sm90TraitsOf = Sm90PrefillTraits<kHeadDim, kMasked, kSkip, kDType == DType::kFp8E4M3, kSage,
                                       kDType == DType::kInt8>;

template <int kHeadDim, DType kDType, bool kMasked, bool kMods, bool kSkip, bool kSage>
__global__ void __launch_bounds__(Sm90TraitsOf<kHeadDim, kDType, kMasked, kSkip, kSage>::kThreads,
                                  1)
    prefill_sm90_kernel(const __grid_constant__ Sm90PrefillParams sp) {
#if defined(ATTNKIT_PREFILL_SM90_DEVICE)
  using T = Sm90TraitsOf<kHeadDim, kDType, kMasked, kSkip, kSage>;
  using namespace sm90_detail;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const Sm90Smem<T> smem{(smem_u32(smem_raw) + 1023u) & ~1023u};
  constexpr uint32_t kConsumerWarps = 4 * T::kConsumerWarpgroups;
  if (threadIdx.x == 0) {
    sm90::mbarrier_init(smem.q_full(), 1);
    sm90::mbarrier_init(smem.q_empty(), kConsumerWarps);
#pragma unroll
    for (int s = 0; s < T::kStages; ++s) {
      sm90::mbarrier_init(smem.k_full(s), 1);
      sm90::mbarrier_init(smem.k_empty(s), kConsumerWarps);
      // The FP8 kernels' V tiles are transposed by the 128 producer threads, which arrive each.
      sm90::mbarrier_init(smem.v_full(s), T::kTransposesV ? 128 : 1);
      sm90::mbarrier_init(smem.v_empty(s), kConsumerWarps);
      if constexpr (T::kTransposesV) {
        sm90::mbarrier_init(smem.vs_full(s), 1);
        sm90::mbarrier_init(smem.vs_empty(s), 128);
      }
      st_shared_u32(smem.kv_fault(s), 0u);  // only paged tiles mark faults
    }
    sm90::mbarrier_init_fence();
  }
  __syncthreads();
  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    sm90::warpgroup_reg_dealloc<T::kProducerRegs>();
    const Sm90Producer<T, kDType> producer{sp, smem, static_cast<int>(threadIdx.x)};
    producer.run();
  } else {
    sm90::warpgroup_reg_alloc<T::kConsumerRegs>();
    const Sm90Consumer<T, kDType, kMods, kSkip> consumer{sp, smem, wg - 1,
                                                         static_cast<int>(threadIdx.x % 128)};
    consumer.run();
  }
#endif
}

template <int kHeadDim, DType kDType, bool kMasked, bool kMods, bool kSkip, bool kSage>
void launch_prefill_sm90(const Sm90PrefillParams& sp, int grid, cudaStream_t stream) {
  using T = Sm90TraitsOf<kHeadDim, kDType, kMasked, kSkip, kSage>;
  constexpr auto kernel = prefill_sm90_kernel<kHeadDim, kDType, kMasked, kMods, kSkip, kSage>;
  opt_in_dynamic_smem_once<kernel>(
      T::kSmemBytes, "prefill (sm90): cudaFuncSetAttribute(max dynamic shared memory)");
  kernel<<<grid, T::kThreads, T::kSmemBytes, stream>>>(sp);
  check_launch("prefill (sm90): kernel launch");
}

}  // namespace attnkit::cuda::prefill

// The six kernels of one head_dim and dtype: mask x logit modifiers, and the skip-softmax
// kernels of the unmasked (dense) calls.
#define ATTNKIT_PREFILL_SM90_LAUNCHER_OF(D, DT, MASKED, MODS, SKIP, SAGE)                      \
  template void launch_prefill_sm90<D, DT, MASKED, MODS, SKIP, SAGE>(const Sm90PrefillParams&, \
                                                                     int, cudaStream_t);
#define ATTNKIT_PREFILL_SM90_LAUNCHER(D, DT, MASKED, MODS, SKIP) \
  ATTNKIT_PREFILL_SM90_LAUNCHER_OF(D, DT, MASKED, MODS, SKIP, false)
#define ATTNKIT_PREFILL_SM90_INSTANTIATE(D, DT)             \
  ATTNKIT_PREFILL_SM90_LAUNCHER(D, DT, false, false, false) \
  ATTNKIT_PREFILL_SM90_LAUNCHER(D, DT, false, true, false)  \
  ATTNKIT_PREFILL_SM90_LAUNCHER(D, DT, true, false, false)  \
  ATTNKIT_PREFILL_SM90_LAUNCHER(D, DT, true, true, false)
// The FP8 kernels (fp8 e4m3 Q / K / V, head_dim 128 and 256): masks and modifiers, no skip.
#define ATTNKIT_PREFILL_SM90_INSTANTIATE_FP8(D) ATTNKIT_PREFILL_SM90_INSTANTIATE(D, DType::kFp8E4M3)
#define ATTNKIT_PREFILL_SM90_INSTANTIATE_SKIP(D, DT)       \
  ATTNKIT_PREFILL_SM90_LAUNCHER(D, DT, false, false, true) \
  ATTNKIT_PREFILL_SM90_LAUNCHER(D, DT, false, true, true)
// The SAGE kernels of one head_dim and Q K^T dtype (int8 or fp8 e4m3): unmasked (dense() and
// prefill()) and causal (prefill()), with and without logit modifiers.
#define ATTNKIT_PREFILL_SM90_INSTANTIATE_SAGE(D, QK)                 \
  ATTNKIT_PREFILL_SM90_LAUNCHER_OF(D, QK, false, false, false, true) \
  ATTNKIT_PREFILL_SM90_LAUNCHER_OF(D, QK, false, true, false, true)  \
  ATTNKIT_PREFILL_SM90_LAUNCHER_OF(D, QK, true, false, false, true)  \
  ATTNKIT_PREFILL_SM90_LAUNCHER_OF(D, QK, true, true, false, true)
