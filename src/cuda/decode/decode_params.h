// Runtime parameters of the fused GQA decode kernel (split-KV included). Host-side
// plain data (no CUDA types): decode_launch.cu fills it from validated DecodeArgs, the kernels
// receive it as `const __grid_constant__ DecodeParams`.
#pragma once

#include <cstdint>

#include "core/kv_access.h"
#include "cuda/common/device_fault.cuh"

namespace attnkit::cuda {

// ALiBi slopes travel in the parameter block; more query heads than this with ALiBi is
// reported unsupported by fused_decode_unsupported().
constexpr int kDecodeMaxAlibiHeads = 256;
// Query heads of one M block: the 16 rows of an m16n8k16 MMA. A CTA serves one or two M blocks
// of one KV-head group (DecodeTraits::kMBlocks).
constexpr int kDecodeHeadsPerCta = 16;
// Split-KV count limit (the merging CTA keeps one weight per split in shared memory); a larger
// DecodeArgs::num_splits is clamped to it.
constexpr int kDecodeMaxSplits = 128;
// The LSE range (log2 units) of a split whose output the accumulating merge adds in L2: 2^lse
// stays a normal f32 with room for 128 splits' sums.
constexpr float kDecodeAccumulateMinLse2 = -60.0f;
constexpr float kDecodeAccumulateMaxLse2 = 100.0f;

// The split length of batch-invariant calls (DecodeArgs::batch_invariant,
// DecodeParams::split_keys): split s of every row reads keys [s x 1024, (s + 1) x 1024), the last
// split of the call to the row's end. A multiple of every tile (64 and 128 keys); 128 splits cover
// 128k keys.
constexpr int32_t kDecodeBatchInvariantSplitKeys = 1024;

// The keys of each split of a row of num_keys keys, in whole tiles of tile_n: split s reads
// [s x that, (s + 1) x that) clipped to the row (an empty split runs no tile). The wgmma kernel's
// split ranges and the host's early-ramp guess (DecodeParams::split_keys_guess) come from here;
// decode_kernel.cuh writes the same expression inline (calling this there changed the register
// allocation of six of its kernels, sm_90a SASS compared, so that move waits for a GPU run).
template <typename Int>
ATTNKIT_HD Int decode_split_keys(Int num_keys, Int num_splits, Int tile_n) {
  return ((num_keys + num_splits - 1) / num_splits + tile_n - 1) / tile_n * tile_n;
}

struct DecodeParams {
  const void* q = nullptr;  // [num_rows, Hq, D] bf16/f16
  int64_t q_row_stride = 0;
  int64_t q_head_stride = 0;
  void* out = nullptr;  // [num_rows, Hq, D], dtype of q
  int64_t out_row_stride = 0;
  int64_t out_head_stride = 0;
  float* lse = nullptr;  // [num_rows, Hq] natural log, or nullptr
  int64_t lse_row_stride = 0;
  int64_t lse_head_stride = 0;

  // Split-KV workspace (num_splits > 1): each split's normalized output (already multiplied by
  // the V scale, kept in f32) and its LSE; the last CTA of each (row, KV head, head block) merges
  // them, or decode_merge.cu's kernel after the grid (decode_separate_merge).
  float* partial_out = nullptr;  // [num_splits, num_rows, Hq, D]
  float* partial_lse = nullptr;  // [num_splits, num_rows, Hq]
  // One arrival counter per (row, KV head, head block), zero at the launch (a caller's
  // DecodeWorkspace, or the per-call memset): the last split CTA to finish merges the splits and
  // sets the counter back to zero.
  int32_t* split_counters = nullptr;  // [num_rows, Hkv, head_blocks]
  // Accumulating merge (merge_accumulate != 0, in-kernel merges only): a split whose LSE (log2)
  // lies in [accumulate_min_lse2, accumulate_max_lse2] and whose scaled outputs stay
  // below 2^120 adds 2^lse x its output to merge_acc and 2^lse to merge_den with f32 reductions
  // in L2 instead of writing its partial; a split outside that range (an "outlier") writes its
  // partial and LSE as usual and sets its bit in merge_outliers. The last CTA reads the sums (and
  // the outliers' partials), writes the output and zeroes what it read. All three are zero at the
  // launch, like the counters (the same zeroed region).
  int32_t merge_accumulate = 0;
  float accumulate_min_lse2 = kDecodeAccumulateMinLse2;
  float accumulate_max_lse2 = kDecodeAccumulateMaxLse2;
  float* merge_acc = nullptr;          // [num_rows, Hq, D]
  float* merge_den = nullptr;          // [num_rows, Hq]
  uint32_t* merge_outliers = nullptr;  // [num_rows, Hkv, head_blocks, kDecodeMaxSplits / 32]
  // Launched with programmatic stream serialization (sm_90+): the kernel waits for the previous
  // grid (griddepcontrol.wait) before its first read and lets the next grid launch at once.
  int32_t pdl = 0;
  // With pdl on a plain paged cache without a window: the keys of its first tiles a CTA asks L2
  // to prefetch before griddepcontrol.wait (0: none), so that DRAM streams them while the previous
  // kernel's tail runs (decode_prefetch_before_wait). pool_blocks bounds the block ids it trusts.
  int32_t prefetch_keys = 0;
  int32_t pool_blocks = 0;

  // Where a failed guard records its fault (docs/safety.md): a block id outside
  // [0, kv.num_blocks), a seq_len outside [0, kv.row_capacity()] (cyclic caches: < 0), a
  // cache_indirection entry outside [0, beam_width).
  FaultSite fault;

  detail::KvLayout kv;                         // paged / contiguous / cyclic addressing
  int32_t page_shift = 0;                      // log2(tokens_per_block) of a paged cache
  int32_t table_cols = 0;                      // block_table columns (paged; validated >= 1)
  const int32_t* seq_lens = nullptr;           // [num_rows], counts the new token
  const int32_t* cache_indirection = nullptr;  // [num_rows / beam_width, beam_width, max_seq]
  int64_t indirection_seq_stride = 0;          // elements
  int64_t indirection_beam_stride = 0;         // elements
  int64_t indirection_pos_stride = 1;          // elements
  int32_t beam_width = 1;

  const float* k_scale = nullptr;  // [1] or [Hkv]; nullptr means 1
  const float* v_scale = nullptr;  // [1] or [Hkv]; nullptr means 1
  int32_t k_scale_per_head = 0;
  int32_t v_scale_per_head = 0;

  int32_t num_rows = 0;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t group_size = 0;   // Hq / Hkv
  int32_t head_blocks = 1;  // ceil(group_size / heads per CTA)
  int32_t num_splits = 1;
  // > 0 (batch-invariant calls): every split reads this many keys whatever the row's length and
  // the split count, split s from s x split_keys, the last split of the call to the row's end (a
  // multiple of the tile). 0: each row's keys are shared out over num_splits (decode_split_keys).
  int32_t split_keys = 0;
  // Keys per split for a row of max_seq_len keys: the kernel reads the block-table entries of its
  // first tiles before seq_len arrives, at split * split_keys_guess, and uses them only when the
  // row's own split start matches (entries of keys past the row's end are never used).
  int32_t split_keys_guess = 0;
  int32_t head_dim = 0;

  float softmax_scale = 0.0f;
  float softcap = 0.0f;     // > 0: logit = softcap * tanh(logit / softcap)
  int32_t window = 0;       // sliding window W (0: every key < seq_len)
  int32_t sink_tokens = 0;  // with a window: keys j < sink_tokens are attended as well
  float alibi_slopes[kDecodeMaxAlibiHeads] = {};  // [Hq]; all zero when ALiBi is off
};

}  // namespace attnkit::cuda
