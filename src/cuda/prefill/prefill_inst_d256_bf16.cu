// Explicit instantiations of the prefill kernel: head_dim 256, bf16. Must match
// tile_compiled() in prefill_build_set.h.
#include "cuda/prefill/prefill_kernel.cuh"

namespace attnkit::cuda::prefill {
#if !defined(ATTNKIT_KERNEL_SUBSET)
ATTNKIT_PREFILL_INSTANTIATE_TILE(256, PrefillTile::kM64, DType::kBF16)
ATTNKIT_PREFILL_INSTANTIATE_SPLIT(DType::kBF16)
#endif
}  // namespace attnkit::cuda::prefill
