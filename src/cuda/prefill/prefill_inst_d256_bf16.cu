// Explicit instantiations of the prefill kernel: head_dim 256, bf16. Must match
// tile_compiled() in prefill_build_set.h.
#include "cuda/prefill/prefill_kernel.cuh"

namespace attnkit::cuda::prefill {
#if !defined(ATTNKIT_KERNEL_SUBSET)
ATTNKIT_PREFILL_INSTANTIATE_TILE(256, PrefillTile::kM64, DType::kBF16)
#endif
#if !defined(ATTNKIT_KERNEL_SUBSET)
// EXPERIMENT pre9: packed K/V copies through L1 (ATTNKIT_EXP_PRE9_L1=1).
template void launch_prefill<256, PrefillTile::kM64, DType::kBF16, false, false, false, true, false,
                             false, true>(const PrefillParams&, cudaStream_t);
template void launch_prefill<256, PrefillTile::kM64, DType::kBF16, true, false, false, true, false,
                             false, true>(const PrefillParams&, cudaStream_t);
#endif
}  // namespace attnkit::cuda::prefill
