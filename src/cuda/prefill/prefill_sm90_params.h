// Runtime parameters of the Hopper (sm_90a) context FMHA: the portable kernel's PrefillParams plus
// the TMA tensor maps the host encodes per call (prefill_sm90_launch.cc) and how K/V reach shared
// memory. Host-includable (cuda.h declares CUtensorMap as a plain 128-byte struct).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "cuda/prefill/prefill_params.h"

namespace attnkit::cuda::prefill {

// How the producer warpgroup fills a K/V stage.
enum class Sm90KvMode : int32_t {
  // TMA boxes of a packed ([total, Hkv, D]) or dense ([B, S, Hkv, D]) tensor; map dims
  // (D, Hkv, tokens, batch).
  kTmaTensor = 0,
  // TMA boxes of a paged cache (block table, no cyclic window) or a contiguous cache (one block a
  // sequence); map dims (D, tokens_per_block, Hkv, num_blocks) with the cache layout's token and
  // head strides (HND or NHD, KvLayout), one box per page run.
  kTmaPaged = 1,
  // Loads and shared-memory stores by the 128 producer threads: 8-bit caches (widened to 16 bits
  // on the way), cyclic (sliding-window) caches. Every mode gathers the partial last tile's V this
  // way, so that V rows past the sequence are zeros (P = 0 must not meet a NaN of a stale slot).
  kGather = 2,
};

// The SAGE kernels' scales, as the quantize pass writes them (cuda/sage/sage_quant_params.h):
// token t of sequence b (first packed token s_b) of head h scales by
//   q_scale[h * q_scale_stride + (s_b >> q_block_shift) + b + (t >> q_block_shift)], likewise K;
// channel d of V by v_scale[(b * Hkv + kv_head) * head_dim + d]. Q and K codes are packed
// [tokens, H, D] (a dense call's sequence b at token b x seqlen), V^T is [Hkv][D][columns] with
// sequence b's tokens from column vt_seq_column(s_b, b) in the P column order.
struct Sm90SageParams {
  const float* q_scale = nullptr;
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  int64_t q_scale_stride = 0;
  int64_t k_scale_stride = 0;
  int32_t q_block_shift = 0;  // log2(q_block_size)
  int32_t k_block_shift = 0;
};

struct Sm90PrefillParams {
  CUtensorMap tma_q;  // (D, Hq, tokens, batch), box (64, G, kBlockM / G, 1), G = 2^q_pack_log2
  CUtensorMap tma_k;  // kTmaTensor: (D, Hkv, tokens, batch); kTmaPaged: (D, T, Hkv, blocks)
  // kTmaTensor / kTmaPaged: as tma_k. SAGE: V^T (columns, D, Hkv, 1), box (128, D, 1, 1).
  CUtensorMap tma_v;
  PrefillParams base;
  Sm90KvMode kv_mode = Sm90KvMode::kTmaTensor;
  int32_t page_box_rows = 0;  // kTmaPaged: rows of one box (divides tokens_per_block and kBlockN)
  bool kv_8bit = false;       // kGather: the cache holds fp8 e4m3 / int8 codes
  // Skip-softmax (the kSkip kernels): log2(lambda), and the device counters [tiles visited, tiles
  // skipped] the consumer warpgroups add their counts to (nullptr: not counted).
  float skip_log2_lambda = 0.f;
  unsigned long long* skip_counts = nullptr;
  Sm90SageParams sage;  // the SAGE kernels
};

}  // namespace attnkit::cuda::prefill
