// Explicit instantiations of the prefill kernel: head_dim 64, bf16, the 128-key tile. Must match
// tile_compiled() in prefill_build_set.h.
#include "cuda/prefill/prefill_kernel.cuh"

namespace attnkit::cuda::prefill {
#if !defined(ATTNKIT_KERNEL_SUBSET)
ATTNKIT_PREFILL_INSTANTIATE_TILE(64, PrefillTile::kM128W4N128, DType::kBF16)
#endif
}  // namespace attnkit::cuda::prefill
