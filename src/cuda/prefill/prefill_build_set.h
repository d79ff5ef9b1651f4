// Which prefill instantiations this build compiles. The full build: every head_dim of
// tile_exists() in bf16 and f16. ATTNKIT_KERNEL_SUBSET (CI on two cores): head_dim 128, bf16,
// tile kM128 only; everything else reports "not compiled in this build (ATTNKIT_KERNEL_SUBSET)".
#pragma once

#include "attnkit/types.h"
#include "cuda/prefill/prefill_traits.h"

namespace attnkit::cuda::prefill {

#if defined(ATTNKIT_KERNEL_SUBSET)
constexpr bool kPrefillSubset = true;
#else
constexpr bool kPrefillSubset = false;
#endif

constexpr bool tile_compiled(int head_dim, PrefillTile tile, DType dtype) {
  if (!tile_exists(head_dim, tile)) return false;
  if (dtype != DType::kBF16 && dtype != DType::kF16) return false;
  if (kPrefillSubset) {
    return head_dim == 128 && dtype == DType::kBF16 && tile == PrefillTile::kM128;
  }
  return true;
}

}  // namespace attnkit::cuda::prefill
