// The skip_stats buffer of a fused prefill() call (PrefillArgs::skip_stats, the SkipStats layout
// int64 {tiles_total, tiles_skipped, block_m, block_n}), written in stream order without a host
// synchronization. Host-only header.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/prefill/prefill_params.h"

namespace attnkit::cuda::prefill {

// Enqueues one small kernel that writes {tiles, 0, block_m, block_n} to `stats`. count_tiles:
// tiles = the (query tile, key tile) pairs of block_m query tokens x block_n keys that the call's
// sequences visit (per query head; `masked`: causal, bottom-right), read from the device lengths
// of prm with the kernels' guards (a faulting sequence counts no tiles); else tiles = 0, for a
// skipping kernel to add its counts to. Mask none or causal (validation rejects skip_stats under
// a sliding window).
void write_skip_stats(const PrefillParams& prm, bool masked, bool count_tiles, int block_m,
                      int block_n, int64_t* stats, cudaStream_t stream);

}  // namespace attnkit::cuda::prefill
