// Fused GQA decode: the support query, the split-KV heuristic and the launch.
// fused_decode_unsupported() and fused_decode() use the same head_dim / dtype tables, so what
// `attnkit info` and backend selection report is what fused_decode() runs.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/decode_workspace_check.h"
#include "core/kv_access.h"
#include "cuda/common/cuda_status.h"
#include "cuda/common/device_fault.h"
#include "cuda/cuda_backend.h"
#include "cuda/decode/decode_launch.h"

namespace attnkit::cuda {
namespace {

// head_dim values with compiled kernels. The CI subset (ATTNKIT_KERNEL_SUBSET) keeps 128 only.
bool head_dim_compiled(int32_t head_dim) {
#if defined(ATTNKIT_KERNEL_SUBSET)
  return head_dim == 128;
#else
  return head_dim == 64 || head_dim == 80 || head_dim == 96 || head_dim == 128 || head_dim == 256;
#endif
}

bool head_dim_known(int32_t head_dim) {
  return head_dim == 64 || head_dim == 80 || head_dim == 96 || head_dim == 128 || head_dim == 256;
}

DecodeKernelInfo kernel_info(int32_t head_dim, DType q, DType kv, DecodeKernelChoice choice) {
  switch (head_dim) {
#if !defined(ATTNKIT_KERNEL_SUBSET)
    case 64:
      return choice.nhd ? decode_kernel_info<64, true>(q, kv, choice)
                        : decode_kernel_info<64, false>(q, kv, choice);
#endif
#if !defined(ATTNKIT_KERNEL_SUBSET)
    case 80:
      return choice.nhd ? decode_kernel_info<80, true>(q, kv, choice)
                        : decode_kernel_info<80, false>(q, kv, choice);
#endif
#if !defined(ATTNKIT_KERNEL_SUBSET)
    case 96:
      return choice.nhd ? decode_kernel_info<96, true>(q, kv, choice)
                        : decode_kernel_info<96, false>(q, kv, choice);
#endif
    case 128:
      return choice.nhd ? decode_kernel_info<128, true>(q, kv, choice)
                        : decode_kernel_info<128, false>(q, kv, choice);
#if !defined(ATTNKIT_KERNEL_SUBSET)
    case 256:
      return choice.nhd ? decode_kernel_info<256, true>(q, kv, choice)
                        : decode_kernel_info<256, false>(q, kv, choice);
#endif
  }
  detail::fail("decode: head_dim ", head_dim, " has no fused kernel");
}

void launch_kernel(int32_t head_dim, const DecodeParams& params, DType q, DType kv,
                   bool transformed, DecodeKernelChoice choice, cudaStream_t stream) {
  switch (head_dim) {
#if !defined(ATTNKIT_KERNEL_SUBSET)
    case 64:
      return choice.nhd ? launch_decode<64, true>(params, q, kv, transformed, choice, stream)
                        : launch_decode<64, false>(params, q, kv, transformed, choice, stream);
#endif
#if !defined(ATTNKIT_KERNEL_SUBSET)
    case 80:
      return choice.nhd ? launch_decode<80, true>(params, q, kv, transformed, choice, stream)
                        : launch_decode<80, false>(params, q, kv, transformed, choice, stream);
#endif
#if !defined(ATTNKIT_KERNEL_SUBSET)
    case 96:
      return choice.nhd ? launch_decode<96, true>(params, q, kv, transformed, choice, stream)
                        : launch_decode<96, false>(params, q, kv, transformed, choice, stream);
#endif
    case 128:
      return choice.nhd ? launch_decode<128, true>(params, q, kv, transformed, choice, stream)
                        : launch_decode<128, false>(params, q, kv, transformed, choice, stream);
#if !defined(ATTNKIT_KERNEL_SUBSET)
    case 256:
      return choice.nhd ? launch_decode<256, true>(params, q, kv, transformed, choice, stream)
                        : launch_decode<256, false>(params, q, kv, transformed, choice, stream);
#endif
  }
  detail::fail("decode: head_dim ", head_dim, " has no fused kernel");
}

int device_attribute(cudaDeviceAttr attr, int device) {
  int value = 0;
  check_cuda(cudaDeviceGetAttribute(&value, attr, device), "decode: cudaDeviceGetAttribute");
  return value;
}

}  // namespace

// Groups of up to 8 heads take the keys-as-rows tile (half the MMAs) and groups of up to 16 the
// 16-row tile. Groups beyond 16 heads take two M blocks per CTA (K/V read once per 32 heads) for
// 16-bit caches on grids of at least SMs / 16 CTAs; otherwise, and for 8-bit caches, head blocks
// of 8 on the keys-as-rows kernel (the later head blocks' K/V reads mostly hit L2). Its tuned
// 8-bit path beats the two-M-block 8-bit kernel, and on small grids the 32-head CTAs need so
// many splits that their merge dominates (one 32-head CTA at 1 x 32k: 128 splits). MQA 32/1, head
// blocks of 8 against 32-head CTAs (H200, when the rule was chosen): bf16 1 x 32k 2.5x, fp8 64 x
// 4k +17%, but bf16 64 x 4k -7% and 8 x 32k -2% (head blocks of 16 lost to 8 everywhere). This
// rule against 32-head CTAs for every grid: bf16 1 / 2 / 4 x 32k 2.5x / 1.65x / 1.36x, fp8 1 x
// 32k 3x, int8 8 x 32k +23%, 64 x 4k even; bf16 8 x 32k (128 CTAs on 132 SMs) is its one loss
// (-3.7%: the crossover lies between 4 and 8 rows).
int decode_heads_per_cta(int32_t group_size, bool eight_bit_cache, int64_t rows_x_kv_heads,
                         int sm_count) {
  if (group_size <= 8) return 8;
  if (group_size <= 16) return 16;
  return !eight_bit_cache && rows_x_kv_heads * 16 >= sm_count ? 32 : 8;
}

int decode_batch_invariant_heads_per_cta(int32_t group_size, bool eight_bit_cache) {
  if (group_size <= 8) return 8;
  if (group_size <= 16) return 16;
  return eight_bit_cache ? 8 : 32;
}

bool decode_two_m_block_covers_sms(int64_t ctas, int sm_count, int64_t max_keys) {
  const int64_t percent = max_keys <= 4096 ? 78 : 95;
  return ctas * 100 >= static_cast<int64_t>(sm_count) * percent;
}

namespace {
// Splits are whole tiles: `splits` splits of `tiles` tiles, less those that would get none (the
// same work per split, fewer CTAs; e.g. 512 tiles over 33 splits is 16 tiles each, so 32 splits).
int32_t whole_tile_splits(int64_t tiles, int64_t splits) {
  const int64_t tiles_per_split = (tiles + splits - 1) / splits;
  return static_cast<int32_t>(
      std::max<int64_t>(1, (tiles + tiles_per_split - 1) / tiles_per_split));
}
}  // namespace

// Splits a (row, KV head, head block) CTA's keys when the CTAs alone leave SMs idle: the
// smallest split count whose waves fill >= 95% of the resident-CTA slots, with at least four
// tiles of keys per split (the prologue and the combine are not free). On the two-M-block kernel
// (one_wave), splits that short (at most kShortSplitKeys keys) take one CTA per SM instead: fewer,
// longer splits, fewer partials for the merge. The other kernels did so too until the split
// epilogue's changes and the prefetch before the programmatic wait (which takes calls of 32
// splits) made two CTAs an SM win there (H200, 32 splits against 16): bf16 1 x 8k +3.1%, 1 x 16k
// +3.5%, fp8 1 x 16k +6.8% (24 splits lost 13-14% against 16 everywhere).
int32_t decode_num_splits(int64_t ctas, int ctas_per_sm, int sm_count, int64_t max_keys, int tile_n,
                          bool one_wave) {
  constexpr int64_t kShortSplitKeys = 512;
  const int64_t slots = static_cast<int64_t>(ctas_per_sm) * sm_count;
  const int64_t max_splits = std::clamp<int64_t>(max_keys / (4 * tile_n), 1, kDecodeMaxSplits);
  int64_t best = 1;
  double best_fill = 0.0;
  for (int64_t s = 1; s <= max_splits; ++s) {
    const int64_t work = ctas * s;
    if (one_wave && s > 1 && work > slots) break;
    const int64_t waves = (work + slots - 1) / slots;
    const double fill = static_cast<double>(work) / static_cast<double>(waves * slots);
    if (fill >= 0.95) {
      best = s;
      break;
    }
    if (fill > best_fill + 1e-9) best = s, best_fill = fill;
  }
  const int64_t one_per_sm = sm_count / std::max<int64_t>(ctas, 1);
  if (one_wave && ctas_per_sm > 1 && one_per_sm >= 2 && one_per_sm < best &&
      (max_keys + best - 1) / best <= kShortSplitKeys) {
    best = one_per_sm;
  }
  return whole_tile_splits((max_keys + tile_n - 1) / tile_n, best);
}

int32_t decode_wgmma_num_splits(int64_t ctas, int ctas_per_sm, int sm_count, int64_t max_keys) {
  const int64_t slots = static_cast<int64_t>(ctas_per_sm) * sm_count;
  const int64_t tiles = std::max<int64_t>(1, (max_keys + 63) / 64);
  const int64_t most = std::clamp<int64_t>(std::min(slots / std::max<int64_t>(ctas, 1), tiles / 4),
                                           1, kDecodeMaxSplits);
  return whole_tile_splits(tiles, most);
}

// This kernel built for 2 / for 3 CTAs an SM against the mma.sync kernels, each with its split
// rule (H200): MQA 32/1 64 x 4k +9% / +5%, 96 x 4k -6% / +14%, 48 x 8k +6% / +12%, 16 x 8k +10% /
// -12%, 256 x 2k +5% / +7%, 32 x 32k +6% / +7%, 128 x 8k +3% / +5%; GQA 32/2 64 x 4k +2.5% / +4%,
// 8 x 8k +4% / -8%. The two-M-block kernel keeps the grids it covers without a split at <= 4096
// keys and up to 1.6 CTAs an SM (one CTA of it streams as fast as two, one of this kernel does
// not): there this kernel lost, MQA 128 x 2k -11% (-8% with 2 splits), 200 x 2k -6 to -8%, GQA
// 64/2 64 x 4k -3%. The 3-CTA build (4 units of 16 KB in flight a CTA against 6) pays where its
// one-wave split count leaves >= 1024 keys a split.
DecodeWgmmaPlan decode_wgmma_plan(int32_t group_size, int64_t ctas, int64_t pair_ctas, int sm_count,
                                  int64_t max_keys, int32_t forced_splits) {
  DecodeWgmmaPlan plan;
  if (group_size > 16 && decode_two_m_block_covers_sms(pair_ctas, sm_count, max_keys) &&
      pair_ctas * 10 <= static_cast<int64_t>(sm_count) * 16 && max_keys <= 4096) {
    return plan;
  }
  plan.use = true;
  const auto splits = [&](int ctas_per_sm) {
    return forced_splits > 0 ? forced_splits
                             : decode_wgmma_num_splits(ctas, ctas_per_sm, sm_count, max_keys);
  };
  const int32_t three = splits(3);
  const bool fills_two = forced_splits == 0 || ctas * three > 2 * static_cast<int64_t>(sm_count);
  if (max_keys / three >= 1024 && fills_two) {
    plan.ctas_per_sm = 3;
    plan.num_splits = three;
  } else {
    plan.ctas_per_sm = 2;
    plan.num_splits = splits(2);
  }
  return plan;
}

std::string fused_decode_unsupported(const AttentionSpec& spec, const detail::DecodeProblem& p) {
  if (p.device.is_cuda()) {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, p.device.index) !=
        cudaSuccess) {
      cudaGetLastError();
      return detail::concat("device ", p.device.str(), " cannot be queried");
    }
    if (major < 8) {
      return detail::concat("the fused decode kernels need compute capability >= 8.0, ",
                            p.device.str(), " has ", major, ".x");
    }
  }
  if (p.dtype != DType::kBF16 && p.dtype != DType::kF16) {
    return detail::concat("q dtype ", dtype_name(p.dtype),
                          " (the fused decode kernels take bf16 or f16)");
  }
  if (p.kv_dtype != p.dtype && p.kv_dtype != DType::kFp8E4M3 && p.kv_dtype != DType::kInt8) {
    return detail::concat("a ", dtype_name(p.kv_dtype), " cache with ", dtype_name(p.dtype),
                          " q (accepted caches: the dtype of q, fp8_e4m3 or int8)");
  }
  if (!head_dim_known(spec.head_dim)) {
    return detail::concat("head_dim ", spec.head_dim,
                          " (the fused decode kernels take 64, 80, 96, 128 or 256)");
  }
  if (!head_dim_compiled(spec.head_dim)) {
    return detail::concat("head_dim ", spec.head_dim,
                          " is not compiled in this build (ATTNKIT_KERNEL_SUBSET: head_dim 128 "
                          "only)");
  }
  if (p.num_rows > 65535) {
    return detail::concat("num_rows ", p.num_rows, " (the fused decode kernel takes <= 65535)");
  }
  if (spec.num_kv_heads > 65535) {
    return detail::concat("num_kv_heads ", spec.num_kv_heads, " (at most 65535)");
  }
  if (spec.alibi && spec.num_q_heads > kDecodeMaxAlibiHeads) {
    return detail::concat("ALiBi with ", spec.num_q_heads,
                          " query heads (the fused decode takes <= ", kDecodeMaxAlibiHeads, ")");
  }
  return "";
}

namespace {

// The accumulating merge's LSE range (set_decode_accumulate_range).
std::atomic<float> g_accumulate_min_lse2{kDecodeAccumulateMinLse2};
std::atomic<float> g_accumulate_max_lse2{kDecodeAccumulateMaxLse2};

// The launch of one call: parameters (the split workspace pointers left null), kernel choice.
struct DecodePlan {
  DecodeParams params;
  DecodeKernelChoice choice;
  bool transformed = false;
  int sm_count = 0;
  int compute_major = 0;
  DecodeWgmmaPlan wgmma;  // the Hopper warpgroup-MMA kernel (decode_wgmma.cu) when .use
  // Where a split call merges (decode_accumulate_merge, decode_separate_merge); the words of the
  // zeroed workspace region it needs (counters, and the accumulating merge's sums).
  bool separate_merge = false;
  bool accumulate = false;
  int64_t zeroed_words = 0;
  // Warps of the separate merge per (row, query head) (decode_merge_warps_per_item); batch-
  // invariant calls always take 1.
  int merge_warps = 1;
};

DecodePlan plan_decode(const AttentionSpec& spec, const DecodeArgs& args,
                       const detail::DecodeProblem& p) {
  const KvCacheView& cache = args.kv_cache;
  DecodePlan plan;
  DecodeParams& params = plan.params;
  params.q = args.q.data;
  params.q_row_stride = args.q.strides[0];
  params.q_head_stride = args.q.strides[1];
  params.out = args.out.data;
  params.out_row_stride = args.out.strides[0];
  params.out_head_stride = args.out.strides[1];
  if (args.lse.defined()) {
    params.lse = static_cast<float*>(args.lse.data);
    params.lse_row_stride = args.lse.strides[0];
    params.lse_head_stride = args.lse.strides[1];
  }
  params.kv = detail::make_kv_layout(cache);
  params.seq_lens = static_cast<const int32_t*>(cache.seq_lens.data);
  params.beam_width = args.beam_width;
  if (args.cache_indirection.defined()) {
    params.cache_indirection = static_cast<const int32_t*>(args.cache_indirection.data);
    params.indirection_seq_stride = args.cache_indirection.strides[0];
    params.indirection_beam_stride = args.cache_indirection.strides[1];
    params.indirection_pos_stride = args.cache_indirection.strides[2];
  }
  params.k_scale = static_cast<const float*>(cache.k_scale.data);
  params.v_scale = static_cast<const float*>(cache.v_scale.data);
  params.k_scale_per_head = cache.k_scale.defined() && cache.k_scale.numel() > 1;
  params.v_scale_per_head = cache.v_scale.defined() && cache.v_scale.numel() > 1;
  params.num_rows = static_cast<int32_t>(p.num_rows);
  params.num_q_heads = spec.num_q_heads;
  params.num_kv_heads = spec.num_kv_heads;
  params.group_size = spec.group_size();
  const int device = current_device("decode: cudaGetDevice");
  const int sm_count = device_attribute(cudaDevAttrMultiProcessorCount, device);
  plan.sm_count = sm_count;
  plan.compute_major = device_attribute(cudaDevAttrComputeCapabilityMajor, device);
  DecodeKernelChoice& choice = plan.choice;
  choice.nhd = cache.layout == KvCacheLayout::kNHD;
  // Batch-invariant calls (DecodeArgs::batch_invariant) take one kernel for the spec and the
  // dtypes whatever the batch: the tile of decode_batch_invariant_heads_per_cta, the mma.sync
  // kernels (not the wgmma one), the 4-CTA 8-bit kernel wherever it exists (wide_grid), splits
  // of kDecodeBatchInvariantSplitKeys keys and the separate merge of one warp an item.
  const bool invariant = args.batch_invariant;
  choice.heads_per_cta =
      invariant
          ? decode_batch_invariant_heads_per_cta(params.group_size, dtype_size(p.kv_dtype) == 1)
          : decode_heads_per_cta(params.group_size, dtype_size(p.kv_dtype) == 1,
                                 p.num_rows * spec.num_kv_heads, sm_count);
  // The Hopper warpgroup-MMA kernel for calls in its scope (decode_wgmma.cu) on the grids where it
  // beats the mma.sync kernels (decode_wgmma_plan).
  if (!invariant && plan.compute_major == 9 && decode_wgmma_compiled() && spec.head_dim == 128 &&
      p.kv_dtype == p.dtype && !spec.alibi && spec.logit_softcap <= 0.0 &&
      spec.mask.kind != MaskKind::kSlidingWindow && params.kv.window_slots == 0 &&
      !args.cache_indirection.defined() && params.group_size >= 16 &&
      p.num_rows * spec.num_kv_heads * 16 >= sm_count &&
      decode_separate_merge(2, params.group_size, spec.head_dim)) {
    const int64_t rows_x_kv = p.num_rows * spec.num_kv_heads;
    const auto blocks = [&](int heads) { return (params.group_size + heads - 1) / heads; };
    plan.wgmma = decode_wgmma_plan(params.group_size, rows_x_kv * blocks(kDecodeWgmmaHeads),
                                   rows_x_kv * blocks(32), sm_count, p.max_seq_len,
                                   std::min(args.num_splits, kDecodeMaxSplits));
    if (plan.wgmma.use) choice.heads_per_cta = kDecodeWgmmaHeads;
  }
  params.head_blocks = (params.group_size + choice.heads_per_cta - 1) / choice.heads_per_cta;
  params.head_dim = spec.head_dim;
  params.softmax_scale = static_cast<float>(spec.effective_scale());
  params.softcap = static_cast<float>(spec.logit_softcap);
  if (spec.mask.kind == MaskKind::kSlidingWindow) {
    params.window = spec.mask.window;
    params.sink_tokens = spec.mask.sink_tokens;
  }
  if (spec.alibi) {
    const std::vector<float> slopes =
        spec.alibi_slopes.empty() ? default_alibi_slopes(spec.num_q_heads) : spec.alibi_slopes;
    std::copy(slopes.begin(), slopes.end(), params.alibi_slopes);
  }
  plan.transformed = spec.alibi || spec.logit_softcap > 0.0;

  if (cache.paged) {
    while ((1 << params.page_shift) < cache.tokens_per_block) ++params.page_shift;
    params.table_cols = static_cast<int32_t>(cache.block_table.shape[1]);
  }
  const int64_t ctas = p.num_rows * spec.num_kv_heads * params.head_blocks;
  const DecodeKernelInfo info = plan.wgmma.use
                                    ? DecodeKernelInfo{plan.wgmma.ctas_per_sm, 64, 0}
                                    : kernel_info(spec.head_dim, p.dtype, p.kv_dtype, choice);
  // The call's kernel family has a 4-CTA-per-SM kernel (8-bit caches at head_dim 128, plain
  // logits: launch_traits), taken by grids that fill it (fills_four_ctas_per_sm).
  const bool has_four_cta_kernel = info.wide_ctas_per_sm > 0 && !plan.transformed;
  // Four CTAs per SM, at 95% of a wave: a grid that keeps the 4-CTA 8-bit kernel busy.
  const auto fills_four_ctas_per_sm = [&](int64_t grid_ctas) {
    return grid_ctas * 100 >= static_cast<int64_t>(sm_count) * 380;
  };
  if (invariant) {
    // Splits of a fixed length, as many as the longest row's keys need (at least two, so that
    // every row goes through the same merge; at most kDecodeMaxSplits, the last one reading to
    // the row's end). A row's splits, their order in the merge and the kernels are then the same
    // in every batch: the empty splits past a row's end add exact zeros.
    int64_t max_keys = p.max_seq_len;
    if (params.window > 0) {
      max_keys =
          std::min<int64_t>(max_keys, static_cast<int64_t>(params.window) + params.sink_tokens);
    }
    params.split_keys = kDecodeBatchInvariantSplitKeys;
    params.num_splits = static_cast<int32_t>(std::clamp<int64_t>(
        (max_keys + kDecodeBatchInvariantSplitKeys - 1) / kDecodeBatchInvariantSplitKeys, 2,
        kDecodeMaxSplits));
  } else if (plan.wgmma.use) {
    params.num_splits = plan.wgmma.num_splits;
  } else if (args.num_splits > 0) {
    params.num_splits = std::min(args.num_splits, kDecodeMaxSplits);
  } else {
    // The heuristic counts the resident CTAs of the 2-CTA-per-SM kernels (8-bit caches included:
    // their 4-CTA kernel is only taken by grids that fill it, below, and counted just after).
    int64_t max_keys = p.max_seq_len;
    if (params.window > 0) {
      max_keys =
          std::min<int64_t>(max_keys, static_cast<int64_t>(params.window) + params.sink_tokens);
    }
    params.num_splits =
        choice.heads_per_cta == 32 && decode_two_m_block_covers_sms(ctas, sm_count, max_keys)
            ? 1
            : decode_num_splits(ctas, info.ctas_per_sm, sm_count, max_keys, info.tile_n,
                                /*one_wave=*/choice.heads_per_cta == 32);
    // 8-bit caches at head_dim 128 (plain logits): when counting their 4-CTA kernel's slots fills
    // that kernel with splits of at least 32 tiles (4k keys), take that count: the 4-CTA kernel
    // beats the 2-CTA one by more than the merge costs. H200, fp8: 32 x 32k +2.8% (2 splits at 4
    // CTAs an SM against 1 at 2), 16 x 32k +2.6% (4 splits against 2); 1 x 32k keeps its 32 splits
    // (52 at 4 CTAs an SM did not fill it: -17%).
    if (has_four_cta_kernel) {
      const int32_t wide =
          decode_num_splits(ctas, info.wide_ctas_per_sm, sm_count, max_keys, info.tile_n);
      if (fills_four_ctas_per_sm(ctas * wide) &&
          max_keys / wide >= 32 * static_cast<int64_t>(info.tile_n)) {
        params.num_splits = wide;
      }
    }
  }
  choice.wide_grid = invariant || fills_four_ctas_per_sm(ctas * params.num_splits);
  // The kernel's split length (keys_per_split) for a row of max_seq_len keys.
  params.split_keys_guess = invariant ? params.split_keys
                                      : static_cast<int32_t>(decode_split_keys<int64_t>(
                                            p.max_seq_len, params.num_splits, info.tile_n));

  // Programmatic dependent launch on sm_90+ (decode_programmatic_launch): the next kernel's CTAs
  // become resident while this one's tail runs. Through a caller workspace (H200): bf16 1 x 32k
  // +1.0%, 2 x 32k +0.5%, 1 x 8k +3.5%, fp8 1 x 32k +1.5%; 64 x 4k +0.1%. The resident CTAs are
  // those of the kernel the call takes (launch_traits: the 4-CTA 8-bit kernel on wide grids with
  // plain logits).
  const bool four_ctas = choice.wide_grid && has_four_cta_kernel;
  const int64_t resident =
      static_cast<int64_t>(four_ctas ? info.wide_ctas_per_sm : info.ctas_per_sm) * sm_count;
  params.pdl = decode_programmatic_launch(plan.compute_major, params.num_splits,
                                          ctas * params.num_splits, resident)
                   ? 1
                   : 0;
  // Programmatic launches over a plain paged cache without a window (whose first tiles the early
  // ramp's guess locates) prefetch those tiles to L2 before griddepcontrol.wait where the rule
  // says it pays (decode_prefetch_keys).
  const bool plain_paged = cache.paged && !args.cache_indirection.defined() &&
                           params.kv.window_slots == 0 && params.window == 0;
  if (params.pdl && plain_paged && cache.num_blocks > 0) {
    params.prefetch_keys = decode_prefetch_keys(
        plan.wgmma.use, params.num_splits, ctas * params.num_splits, resident, params.group_size,
        spec.head_dim * static_cast<int32_t>(dtype_size(p.kv_dtype)));
    params.pool_blocks = cache.num_blocks;
  }
  if (params.num_splits > 1 && invariant) {
    // The separate merge of one warp an item: its order of the splits depends on head_dim only.
    plan.separate_merge = true;
    plan.merge_warps = 1;
  } else if (params.num_splits > 1) {
    plan.merge_warps = decode_merge_warps_per_item(p.num_rows * spec.num_q_heads, sm_count);
    plan.accumulate = decode_accumulate_merge(
        args.deterministic, plan.compute_major, params.num_splits, params.group_size, spec.head_dim,
        choice.heads_per_cta, plan.wgmma.use || four_ctas, ctas * params.num_splits, sm_count);
    plan.separate_merge =
        !plan.accumulate &&
        decode_separate_merge(params.num_splits, params.group_size, spec.head_dim);
    const int64_t counters = ctas;  // rows x KV heads x head blocks
    const int64_t row_heads = p.num_rows * spec.num_q_heads;
    if (plan.accumulate) {
      params.merge_accumulate = 1;
      params.accumulate_min_lse2 = g_accumulate_min_lse2.load(std::memory_order_relaxed);
      params.accumulate_max_lse2 = g_accumulate_max_lse2.load(std::memory_order_relaxed);
    }
    plan.zeroed_words =
        plan.separate_merge ? 0
        : plan.accumulate ? row_heads * (spec.head_dim + 1) + counters * (1 + kDecodeMaxSplits / 32)
                          : counters;
  }
  return plan;
}

int64_t counters_of(const DecodeParams& params) {
  return static_cast<int64_t>(params.num_rows) * params.num_kv_heads * params.head_blocks;
}
int64_t partial_words_of(const DecodeParams& params) {
  return static_cast<int64_t>(params.num_splits) * params.num_rows * params.num_q_heads *
         detail::decode_partial_words(params.head_dim);
}

// A split call through a caller's workspace must fit it (checked before anything is enqueued).
void check_workspace(const DecodeWorkspace& ws, const DecodePlan& plan, const char* what) {
  const DecodeParams& params = plan.params;
  ATTNKIT_CHECK(plan.zeroed_words <= ws.counter_capacity(), what,
                ": too small for this call: it has ", params.num_rows, " rows (", plan.zeroed_words,
                " zeroed words: counters for rows x KV heads x head blocks",
                plan.accumulate ? " and the accumulating merge's sums" : "",
                "), the workspace holds ", ws.counter_capacity(), " (max_rows x Hq x (D + 6))");
  ATTNKIT_CHECK(partial_words_of(params) <= ws.partial_capacity(), what,
                ": too small for this call: ", params.num_splits, " splits x ", params.num_rows,
                " rows x Hq ", params.num_q_heads, " x (D + 1) ",
                detail::decode_partial_words(params.head_dim), " = ", partial_words_of(params),
                " partial words, the workspace holds ", ws.partial_capacity(),
                " (max_rows x max_splits x Hq x (D + 1))");
}

}  // namespace

// PDL lets the next grid's CTAs become resident while this one's tail runs. That pays for a grid of
// more than one wave and for a call of many splits (its merge tail), not for a grid resident at
// once without splits or with two. This rule against PDL for every grid (H200): bf16 32 x 32k
// (256 CTAs in 264 slots) +1.7%, fp8 64 x 4k (512 in 528) +0.6%, fp8 32 x 32k (2 splits) +0.7%;
// against none: fp8 256 x 1k (4 waves) +0.4%, bf16 1 x 32k (32 splits) +0.9%.
namespace {
std::atomic<int> g_merge_mode{static_cast<int>(DecodeMergeMode::kAuto)};
}  // namespace

bool decode_separate_merge(int32_t num_splits, int group_size, int head_dim) {
  constexpr int64_t kInKernelMergeBytes = 64 * 1024;
  if (num_splits <= 1) return false;
  switch (static_cast<DecodeMergeMode>(g_merge_mode.load(std::memory_order_relaxed))) {
    case DecodeMergeMode::kInKernel:
    case DecodeMergeMode::kAccumulate:
      return false;
    case DecodeMergeMode::kSeparate:
      return true;
    case DecodeMergeMode::kAuto:
      break;
  }
  return group_size >= 16 ||
         static_cast<int64_t>(num_splits) * group_size * head_dim * 4 > kInKernelMergeBytes;
}

void set_decode_merge_mode(DecodeMergeMode mode) {
  g_merge_mode.store(static_cast<int>(mode), std::memory_order_relaxed);
}

bool decode_accumulate_merge(bool deterministic, int compute_major, int32_t num_splits,
                             int group_size, int head_dim, int heads_per_cta, bool other_kernel,
                             int64_t grid_ctas, int sm_count) {
  // The mma.sync kernels of up to 16 heads a CTA at two CTAs an SM accumulate (decode_kernel.cuh).
  if (num_splits <= 1 || other_kernel || heads_per_cta > 16) return false;
  switch (static_cast<DecodeMergeMode>(g_merge_mode.load(std::memory_order_relaxed))) {
    case DecodeMergeMode::kAccumulate:
      return true;
    case DecodeMergeMode::kInKernel:
    case DecodeMergeMode::kSeparate:
      return false;
    case DecodeMergeMode::kAuto:
      break;
  }
  return !deterministic && compute_major >= 9 && grid_ctas > sm_count &&
         !decode_separate_merge(num_splits, group_size, head_dim);
}

void set_decode_accumulate_range(float min_lse2, float max_lse2) {
  g_accumulate_min_lse2.store(min_lse2, std::memory_order_relaxed);
  g_accumulate_max_lse2.store(max_lse2, std::memory_order_relaxed);
}

namespace {
std::atomic<int64_t> g_prefetching_launches{0};
}  // namespace

int64_t decode_prefetching_launches() {
  return g_prefetching_launches.load(std::memory_order_relaxed);
}

int32_t decode_prefetch_keys(bool wgmma_kernel, int32_t num_splits, int64_t grid_ctas,
                             int64_t resident_ctas, int32_t group_size, int32_t token_bytes) {
  constexpr int32_t kPrefetchBytes = 32 * 1024;  // K and V of a CTA's first keys
  if (grid_ctas > resident_ctas || token_bytes <= 0) return 0;
  const bool pays = wgmma_kernel ? group_size >= 32 : num_splits >= 32 && group_size <= 8;
  return pays ? kPrefetchBytes / (2 * token_bytes) : 0;
}

bool decode_programmatic_launch(int compute_major, int32_t num_splits, int64_t grid_ctas,
                                int64_t resident_ctas) {
  if (compute_major < 9) return false;
  return grid_ctas > resident_ctas || num_splits > 2;
}

void fused_decode_check_workspace(const AttentionSpec& spec, const DecodeArgs& args,
                                  const detail::DecodeProblem& p, const char* what) {
  if (args.workspace == nullptr) return;
  const DecodePlan plan = plan_decode(spec, args, p);
  if (plan.params.num_splits > 1) check_workspace(*args.workspace, plan, what);
}

void fused_decode(const AttentionSpec& spec, const DecodeArgs& args, const detail::DecodeProblem& p,
                  Stream stream_handle, Op op) {
  const std::string reason = fused_decode_unsupported(spec, p);
  ATTNKIT_CHECK(reason.empty(), "decode: backend 'fused' cannot serve this call: ", reason);
  const cudaStream_t stream = as_cuda_stream(stream_handle);
  DecodePlan plan = plan_decode(spec, args, p);
  DecodeParams& params = plan.params;
  params.fault = fault_site(op);
  // Large groups and KV heads of many partials are merged by a kernel of their own after the
  // decode grid, which then needs no counters (decode_separate_merge).
  const bool separate_merge = plan.separate_merge;
  auto launch = [&] {
    if (params.prefetch_keys > 0) g_prefetching_launches.fetch_add(1, std::memory_order_relaxed);
    if (plan.wgmma.use) {
      launch_decode_wgmma(params, p.dtype, plan.wgmma.ctas_per_sm, plan.choice.nhd, stream);
    } else {
      launch_kernel(spec.head_dim, params, p.dtype, p.kv_dtype, plan.transformed, plan.choice,
                    stream);
    }
    if (separate_merge) {
      launch_decode_merge(params, p.dtype, plan.compute_major >= 9, plan.merge_warps, stream);
    }
  };
  if (params.num_splits == 1) {
    launch();
    return;
  }
  const size_t partial_values =
      static_cast<size_t>(params.num_splits) * static_cast<size_t>(p.num_rows) * spec.num_q_heads;
  const size_t output_words =
      static_cast<size_t>(detail::decode_partial_output_words(spec.head_dim));
  // The f32 partial outputs, then the f32 LSEs (detail::decode_partial_words), from `base`.
  auto place_partials = [&](float* base) {
    params.partial_out = base;
    params.partial_lse = base + partial_values * output_words;
  };
  const bool accumulate = plan.accumulate;
  const int64_t row_heads = static_cast<int64_t>(p.num_rows) * spec.num_q_heads;
  const size_t zeroed_words = static_cast<size_t>(plan.zeroed_words);
  // The zeroed region: the sums first (16-byte aligned for the kernel's vector reductions), the
  // denominators, the outlier words, then the counters.
  auto place_accumulators = [&](int32_t* zeroed) {
    params.split_counters = zeroed;
    if (!accumulate) return;
    params.merge_acc = reinterpret_cast<float*>(zeroed);
    params.merge_den = params.merge_acc + row_heads * spec.head_dim;
    params.merge_outliers = reinterpret_cast<uint32_t*>(params.merge_den + row_heads);
    params.split_counters = reinterpret_cast<int32_t*>(
        params.merge_outliers + counters_of(params) * (kDecodeMaxSplits / 32));
  };
  if (args.workspace != nullptr) {
    // The caller's workspace: counters are zero between calls (the merging CTA resets its own),
    // so the call is one kernel node (two with a separate merge, which uses no counters).
    check_workspace(*args.workspace, plan, "decode: workspace");
    place_partials(args.workspace->partials());
    if (!separate_merge) place_accumulators(args.workspace->counters());
    launch();
    return;
  }
  // Per-call stream-ordered workspace: no host synchronization, and capturable in a CUDA graph (a
  // memory node and a memset node). Layout: partial outputs (f32), partial LSEs, then (16-byte
  // aligned) the zeroed region of the last-CTA merge, zeroed by the memset.
  const size_t partial_words = (partial_values * (output_words + 1) + 3) / 4 * 4;
  void* workspace = nullptr;
  check_cuda(cudaMallocAsync(&workspace, (partial_words + zeroed_words) * sizeof(float), stream),
             "decode: cudaMallocAsync(split-KV workspace)");
  place_partials(static_cast<float*>(workspace));
  try {
    if (!separate_merge) {
      int32_t* zeroed = static_cast<int32_t*>(workspace) + partial_words;
      place_accumulators(zeroed);
      check_cuda(cudaMemsetAsync(zeroed, 0, zeroed_words * sizeof(int32_t), stream),
                 "decode: cudaMemsetAsync(split counters)");
    }
    launch();
  } catch (...) {
    cudaFreeAsync(workspace, stream);
    throw;
  }
  check_cuda(cudaFreeAsync(workspace, stream), "decode: cudaFreeAsync(split-KV workspace)");
}

}  // namespace attnkit::cuda
