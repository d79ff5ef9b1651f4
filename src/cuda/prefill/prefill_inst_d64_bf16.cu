// Explicit instantiations of the prefill kernel: head_dim 64, bf16. Must match
// tile_compiled() in prefill_build_set.h.
#include "cuda/prefill/prefill_kernel.cuh"

namespace attnkit::cuda::prefill {
#if !defined(ATTNKIT_KERNEL_SUBSET)
ATTNKIT_PREFILL_INSTANTIATE_TILE(64, PrefillTile::kM128, DType::kBF16)
#endif
#if !defined(ATTNKIT_KERNEL_SUBSET)
ATTNKIT_PREFILL_INSTANTIATE_TILE(64, PrefillTile::kM64, DType::kBF16)
#endif
#if !defined(ATTNKIT_KERNEL_SUBSET)
ATTNKIT_PREFILL_INSTANTIATE_TILE(64, PrefillTile::kM128W4, DType::kBF16)
#endif
#if !defined(ATTNKIT_KERNEL_SUBSET)
// EXPERIMENT pre9: kernels with kSkipDeadWarps (ATTNKIT_EXP_PRE9_SKIP).
template void launch_prefill<64, PrefillTile::kM128W4, DType::kBF16, true, false, false,
                             swizzle_default(64), false, 7>(const PrefillParams&, cudaStream_t);
template void launch_prefill<64, PrefillTile::kM128W4, DType::kBF16, true, false, false,
                             swizzle_default(64), false, 8>(const PrefillParams&, cudaStream_t);
#endif
}  // namespace attnkit::cuda::prefill
