// Explicit instantiations of the prefill kernel: head_dim 128, bf16. Must match
// tile_compiled() and runs_compiled() in prefill_build_set.h.
#include "cuda/prefill/prefill_kernel.cuh"

namespace attnkit::cuda::prefill {
ATTNKIT_PREFILL_INSTANTIATE_TILE(128, PrefillTile::kM128, DType::kBF16)
ATTNKIT_PREFILL_INSTANTIATE_RUNS(128, PrefillTile::kM128, DType::kBF16)
#if !defined(ATTNKIT_KERNEL_SUBSET)
ATTNKIT_PREFILL_INSTANTIATE_TILE(128, PrefillTile::kM64, DType::kBF16)
ATTNKIT_PREFILL_INSTANTIATE_RUNS(128, PrefillTile::kM64, DType::kBF16)
#endif
#if !defined(ATTNKIT_KERNEL_SUBSET)
ATTNKIT_PREFILL_INSTANTIATE_TILE(128, PrefillTile::kM128W4, DType::kBF16)
ATTNKIT_PREFILL_INSTANTIATE_SKIP(128, DType::kBF16)
ATTNKIT_PREFILL_INSTANTIATE_RUNS(128, PrefillTile::kM128W4, DType::kBF16)
#endif
}  // namespace attnkit::cuda::prefill
