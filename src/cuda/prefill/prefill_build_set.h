// Which prefill kernels this build compiles: the support table generated from
// cmake/prefill_manifest.cmake (generated/prefill/prefill_manifest.inc). The full build compiles
// every entry; ATTNKIT_KERNEL_SUBSET (CI on two cores) keeps head_dim 128 bf16 (sm80 tile m128 and
// the sm90 kernel), and every other call reports "not compiled in this build".
#pragma once

#include "attnkit/types.h"
#include "cuda/prefill/prefill_traits.h"

namespace attnkit::cuda::prefill {

struct PrefillManifestEntry {
  bool sm90;
  int head_dim;
  DType dtype;
  PrefillTile tile;
};

inline constexpr PrefillManifestEntry kPrefillManifest[] = {
#define ATTNKIT_PREFILL_KERNEL(SM90, D, DT, TILE) {SM90, D, DT, TILE},
#include "prefill/prefill_manifest.inc"
#undef ATTNKIT_PREFILL_KERNEL
};

constexpr bool manifest_has(int head_dim, PrefillTile tile, DType dtype) {
  for (const PrefillManifestEntry& e : kPrefillManifest) {
    if (e.head_dim == head_dim && e.tile == tile && e.dtype == dtype) return true;
  }
  return false;
}

// Whether the sm80 kernels of (head_dim, tile, dtype) are compiled.
constexpr bool tile_compiled(int head_dim, PrefillTile tile, DType dtype) {
  return tile != PrefillTile::kSm90 && tile_exists(head_dim, tile) &&
         manifest_has(head_dim, tile, dtype);
}

// Whether the sm90 kernels of (head_dim, dtype) are compiled.
constexpr bool sm90_compiled(int head_dim, DType dtype) {
  return manifest_has(head_dim, PrefillTile::kSm90, dtype);
}

// Whether the SAGE kernels of head_dim are compiled (the manifest's "sage" entries, listed with
// dtype int8).
constexpr bool sage_compiled(int head_dim) {
  return manifest_has(head_dim, PrefillTile::kSm90, DType::kInt8);
}

// Whether head_dim also has the row-run paged kernels (kRunsOnly: a block table without a cyclic
// window, no per-chunk slot copy compiled in). They won 2-6% at head_dim 80, 96 and 128 (causal
// and non-causal, 16-bit and fp8 caches) and lost 1-2% at 64 and 256, which keep the general
// paged kernels only (docs/prefill_design.md).
constexpr bool runs_compiled(int head_dim) {
  return head_dim == 80 || head_dim == 96 || head_dim == 128;
}

}  // namespace attnkit::cuda::prefill
