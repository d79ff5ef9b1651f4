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

// Whether (head_dim, dtype) also has the kRunsOnly paged kernels (every compiled tile, 16-bit
// and 8-bit caches, both masks), which serve a block table without a cyclic window; the general
// paged kernels, which also hold the per-chunk slot copy of contiguous and cyclic caches, serve
// the rest. The general kernels' dead copy costs registers and loop code (head_dim 128 m128w4
// masked: 3280 loop instructions and 64 / 104 spill bytes vs 2442 and 40 / 52; packed 2436).
// Measured on H200 (round 4, same run, twice each, TFLOP/s, general -> runs-only, packed):
// causal 2k pages 16 / 32 / 64 294.0 / 294.0 / 294.5 -> 311.7 / 312.1 / 312.0 (packed 320.4),
// causal 8k 350.2 / 350.0 / 350.5 -> 373.4 / 373.3 / 373.3 (384.9), non-causal 2k page 16 350.3
// -> 365.8 (374.2), fp8 page 16 causal 2k 221.1 -> 232.7. Other head dims (already at 93-94% of
// packed with the general kernels) are not measured with it: 4 more kernels per tile each.
constexpr bool runs_compiled(int head_dim, DType dtype) {
  return head_dim == 128 && dtype == DType::kBF16;
}

}  // namespace attnkit::cuda::prefill
