// Runtime parameters and tile configurations of the context FMHA (prefill) kernel family.
// Host-only header (no CUDA types): the host dispatch fills PrefillParams, the kernels receive it
// as `const __grid_constant__`. An sm90 wgmma mainloop takes the same Params and the same tile
// scheduler; only the Traits and the mainloop differ.
#pragma once

#include <cstdint>

#include "core/kv_access.h"
#include "cuda/common/device_fault.cuh"

namespace attnkit::cuda::prefill {

// Largest head count for which ALiBi slopes travel in the Params (1 KB).
constexpr int kMaxAlibiHeads = 256;

// Tile configurations. Each head_dim compiles the ones listed by tiles_for_head_dim().
enum class PrefillTile : int32_t {
  kM128 = 0,  // 128 query rows, 8 warps: the most reuse of each K/V tile (long sequences)
  kM64 = 1,   // 64 query rows, 4 warps: twice the CTAs (short sequences, head_dim 256)
  // 128 query rows, 4 warps of 32 rows: each K/V fragment read from smem feeds two MMA row
  // blocks (half the smem traffic per MMA), Q re-read from smem; head_dim 64 and 128.
  kM128W4 = 2,
  // kM128W4 with 128 keys per tile (head_dim 64): half the per-key cost of the barrier, the
  // row-max shuffles and the O rescale, for a twice wider S tile in registers.
  kM128W4N128 = 3,
  // The Hopper (sm_90a) warp-specialized kernel (prefill_sm90_kernel.cuh): 128 query rows, two
  // consumer warpgroups, its key tile from sm90_block_n(); head_dim 64, 128 and 256.
  kSm90 = 4,
};
constexpr int kNumPrefillTiles = 5;
constexpr PrefillTile kAllPrefillTiles[] = {PrefillTile::kM128, PrefillTile::kM64,
                                            PrefillTile::kM128W4, PrefillTile::kM128W4N128,
                                            PrefillTile::kSm90};
// "m128", "m64", "m128w4", "m128w4n128", "sm90"
const char* prefill_tile_name(PrefillTile tile);

// A dequantization scale of the FP8 kernels (e4m3 Q / K / V codes): ptr[batch * batch_stride +
// kv_head * head_stride], 1 where ptr is null. Per tensor: both strides 0; per (sequence, KV head):
// [B, Hkv]; per KV head (a cache's scales): batch_stride 0.
struct Descale {
  const float* ptr = nullptr;
  int32_t batch_stride = 0;
  int32_t head_stride = 0;
};

// One packed-varlen, paged or dense ([B, S, H, D]) attention launch. Element strides; "tok" is
// the token dimension. Sequence b's queries start at cu_seqlens_q[b] tokens (or b * q_batch_stride
// elements when cu_seqlens_q is null: dense mode with seqlen_q queries per sequence).
struct PrefillParams {
  const void* q = nullptr;  // [total_q, Hq, D] or [B, Sq, Hq, D]
  void* out = nullptr;      // like q
  float* lse = nullptr;     // optional [total_q, Hq] or [B, Sq, Hq]; natural log
  int64_t q_tok_stride = 0, q_head_stride = 0, q_batch_stride = 0;
  int64_t o_tok_stride = 0, o_head_stride = 0, o_batch_stride = 0;
  int64_t lse_tok_stride = 0, lse_head_stride = 0, lse_batch_stride = 0;

  const int32_t* cu_seqlens_q = nullptr;   // [B + 1] or null (dense: seqlen_q each)
  const int32_t* cu_seqlens_kv = nullptr;  // [B + 1] packed mode, or null
  // The packed extents the cu_seqlens entries must lie in (q / out / lse rows, k / v rows).
  int32_t total_q = 0;
  int32_t total_kv = 0;
  // Where the kernels record a bad cu_seqlens, seq_lens or block-table value (docs/safety.md).
  FaultSite fault;
  int32_t seqlen_q = 0;   // dense mode only
  int32_t seqlen_kv = 0;  // dense mode only

  // Packed / dense K and V (paged == false).
  const void* k = nullptr;  // [total_kv, Hkv, D] or [B, Skv, Hkv, D]
  const void* v = nullptr;
  int64_t k_tok_stride = 0, k_head_stride = 0, k_batch_stride = 0;
  int64_t v_tok_stride = 0, v_head_stride = 0, v_batch_stride = 0;

  // Paged cache (paged == true): K/V of sequence b from block-table row b, kv_len = seq_lens[b].
  bool paged = false;
  detail::KvLayout kv;
  const int32_t* kv_seq_lens = nullptr;  // [B]
  int32_t kv_page_shift = 0;             // paged: tokens_per_block == 1 << kv_page_shift
  bool kv_is_int8 = false;               // quantized cache: int8 (else fp8 e4m3)
  const float* k_scale = nullptr;        // [1] or [Hkv]; null = 1
  const float* v_scale = nullptr;
  bool k_scale_per_head = false;
  bool v_scale_per_head = false;

  int32_t batch = 0;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t group_size = 1;    // num_q_heads / num_kv_heads
  int32_t num_m_blocks = 0;  // ceil(max_seqlen_q x 2^q_pack_log2 / kBlockM)
  // GQA packing (the sm90 kernel; 0 in the portable kernels): a work item's kBlockM rows are
  // kBlockM >> q_pack_log2 query tokens x the 2^q_pack_log2 = group_size query heads of one KV
  // head (row r: token r >> q_pack_log2, head r & (group_size - 1)), so that a call of short
  // sequences fills its blocks and reads each K/V tile once for the whole group. The scheduler's
  // heads are then the KV heads.
  int32_t q_pack_log2 = 0;
  // CTA order (both schedulers): the (head, sequence) pairs are walked in sections of
  // section_pairs pairs; inside a section the query blocks run from the last to the first, pairs
  // fastest. A section of about one resident wave keeps its K/V in L2 while every query block
  // of its pairs reads them; >= batch * num_q_heads gives one section (heaviest blocks first).
  int32_t section_pairs = 1;

  float softmax_scale = 0.f;
  // Mask (kMasked kernels): causal bottom-right; window > 0 adds p - window < j, sinks j < sink.
  int32_t window = 0;
  int32_t sink_tokens = 0;
  // Logit modifiers, applied in this order after the scale: soft-cap, then ALiBi.
  float softcap = 0.f;  // 0: off
  bool alibi = false;
  float alibi_slopes[kMaxAlibiHeads] = {};

  // Skip-softmax (the portable kernels' kSkipSoftmax instantiations; the sm90 kernel reads its
  // own copy in Sm90PrefillParams): log2(lambda) in log2 units of the scaled logits, and the
  // device counters {tiles visited, tiles skipped} that every CTA adds its counts to (nullptr: not
  // counted).
  float skip_log2_lambda = 0.f;
  // prefill() with target_sparsity: lambda = a exp(b s) / kv_len of each sequence;
  // skip_log2_lambda then holds log2(a exp(b s)) and the kernel subtracts log2(kv_len).
  bool skip_per_kv_len = false;
  unsigned long long* skip_counts = nullptr;
  // FP8 kernels (q, k and v fp8 e4m3): the logits are (q . k) x q_descale x k_descale x
  // softmax_scale, the output P V x v_descale (out in bf16 / f16). A paged call takes k / v
  // descales from the cache's scales. (Last, so that the 16-bit kernels' parameter offsets do not
  // move.)
  Descale q_descale, k_descale, v_descale;
  bool out_f16 = false;  // FP8 kernels: out is f16 (else bf16)
};

// Whether a call takes the modifier path: soft-cap or ALiBi, or a softmax scale that is not
// positive (it would not commute with the row maximum, which the plain path takes before scaling).
// The cache's K scale, which multiplies the logit scale on the device, must be positive.
inline bool needs_logit_mods(const PrefillParams& p) {
  return p.softcap > 0.f || p.alibi || !(p.softmax_scale > 0.f);
}

}  // namespace attnkit::cuda::prefill
