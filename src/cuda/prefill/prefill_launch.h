// Declarations of the explicitly instantiated prefill launchers (host-includable). One
// instantiation per (head_dim, tile, dtype, kMasked, kQuantKv, kPaged); the list is
// ATTNKIT_PREFILL_INSTANTIATE_TILE (prefill_kernel.cuh), which the prefill_inst_d*.cu files
// compile per head_dim and dtype.
#pragma once

#include <cuda_runtime.h>

#include "attnkit/types.h"
#include "cuda/prefill/prefill_params.h"
#include "cuda/prefill/prefill_traits.h"

namespace attnkit::cuda::prefill {

// kMasked: causal (bottom-right) with optional sliding window and sinks; else no mask.
// kQuantKv: paged cache of fp8_e4m3 / int8, widened on load; else 16-bit K/V of the q dtype.
// kPaged: K/V from the paged cache (row-run copies); else packed / dense tensors. kQuantKv
// implies kPaged. A compile-time property: the paged kernels copy row runs in every tile
// configuration, the packed kernels hold only the packed copy.
// kSwizzle: XOR-swizzled smem rows (PrefillTraits); else 16-byte row padding.
// kSkipDeadBlocks (packed causal kM128W4 only): a warp's two row blocks interleaved across the
// warps, and a block whose rows all lie before a tile's first key skips the tile
// (prefill_kernel.cuh). kRunsOnly (kPaged only): a paged cache with a block table and no cyclic
// window; the kernel holds only the row-run copy. Else a paged kernel also holds the per-chunk slot
// copy (contiguous and cyclic caches) and picks one at run time. kSplitWarps (packed unmasked
// head_dim 256 kM64 only): warp pairs share 32 query rows, S split by key halves and O by dim
// halves (prefill_tile_split.inc). kSkipSoftmax (packed 16-bit K/V, plain layout): the
// skip-softmax policy (prefill_tile_skip.inc), with PrefillParams::skip_log2_lambda.
template <int kHeadDim, PrefillTile kTile, DType kDType, bool kMasked, bool kQuantKv, bool kPaged,
          bool kSwizzle = swizzle_default(kHeadDim), bool kRunsOnly = false,
          bool kSkipDeadBlocks = false, bool kSplitWarps = false, bool kSkipSoftmax = false>
void launch_prefill(const PrefillParams& params, cudaStream_t stream);

// Dynamic shared memory of one CTA, for the support check against the device limit.
int prefill_smem_bytes(int head_dim, PrefillTile tile, bool quant_kv);
// Query rows per CTA (the sm90 kernel's depend on head_dim).
int prefill_block_m(PrefillTile tile, int head_dim);
// Keys per tile (the sm90 kernel's depend on head_dim and the mask).
int prefill_block_n(PrefillTile tile, int head_dim, bool masked);
// Threads per CTA.
int prefill_threads(PrefillTile tile);

}  // namespace attnkit::cuda::prefill
