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

// Whether head_dim also has the kRunsOnly paged kernels (every compiled tile, both dtypes, 16-bit
// and 8-bit caches, both masks), which serve a block table without a cyclic window; the general
// paged kernels, which also hold the per-chunk slot copy of contiguous and cyclic caches, serve
// the rest. Measured on H200 (bf16, one process per row, twice each, alternated, same run,
// TFLOP/s, general -> runs-only; packed): head_dim 128 (round 4, 19:54 UTC) causal 2k pages
// 16 / 32 / 64 294.0 / 294.0 / 294.5 -> 311.7 / 312.1 / 312.0 (320.4), causal 8k 350.2 -> 373.4
// (384.9), non-causal 2k page 16 350.3 -> 365.8 (374.2), fp8 page 16 causal 2k 221.1 -> 232.7;
// session 6 round 1 (21:06 UTC), causal 2k page 16: head_dim 80 167.7 / 167.8 -> 171.6 / 171.8
// (165.7), 96 178.3 / 178.4 -> 180.5 / 180.5 (174.9). Not at head_dim 64 and 256, where the
// runs-only kernels lost: 64 causal page 16 1k 195.9 / 195.7 -> 194.2 / 194.2 (208.4), 8k 297.7 /
// 297.5 -> 293.6 / 293.8 (315.5); 256 causal 2k page 8 283.9 / 283.8 -> 281.2 / 281.3 (303.7).
// f16 is not measured (the same code with the f16 MMA).
constexpr bool runs_compiled(int head_dim) {
  return head_dim == 80 || head_dim == 96 || head_dim == 128;
}

}  // namespace attnkit::cuda::prefill
