// The per-head_dim entry points of the fused decode kernels, instantiated in decode_hd<D>.cu.
#pragma once

#include <cuda_runtime.h>

#include "attnkit/types.h"
#include "cuda/decode/decode_params.h"

namespace attnkit::cuda {

struct DecodeKernelInfo {
  int ctas_per_sm = 1;  // resident CTAs per SM (the split heuristic's unit of parallelism)
  int tile_n = 64;      // keys per pipeline tile (splits are whole tiles)
  // Resident CTAs per SM of the kernel that wide grids take with plain logits (4 for the 8-bit
  // caches at head_dim 128 with groups <= 8); 0: none.
  int wide_ctas_per_sm = 0;
};

// Which tile configuration serves a call: heads_per_cta = DecodeTraits::kM (8: keys as MMA rows,
// groups <= 8; 16; 32: two M blocks, groups > 16).
struct DecodeKernelChoice {
  int heads_per_cta = 16;
  // The grid (splits included) has CTAs for about four per SM: 8-bit caches may then take the
  // 4-CTA kernel (launch_traits).
  bool wide_grid = true;
  // The cache is NHD ([T, Hkv, D] blocks): the DecodeNhdTraits kernels (decode_hd<D>_nhd.cu).
  bool nhd = false;
};

// The keys of its first tiles (at the early ramp's guess) that each CTA of a programmatic launch
// prefetches to L2 before griddepcontrol.wait, while the previous kernel's tail runs: 32 KB of K
// and V (token_bytes: one key's K) for grids resident in one wave, of the mma.sync kernels with 32
// or more splits of groups of at most 8 heads (their merge tail leaves DRAM idle) or of the wgmma
// kernel (wgmma_kernel) with groups of 32 or more heads (the previous call's merge kernel runs
// meanwhile); else 0. Multi-wave grids, mma.sync calls of fewer splits or of groups of 16 and 32
// heads, and wgmma calls of groups of 16 lost or tied with it (docs/decode_design.md, "Prefetch
// before the programmatic wait").
int32_t decode_prefetch_keys(bool wgmma_kernel, int32_t num_splits, int64_t grid_ctas,
                             int64_t resident_ctas, int32_t group_size, int32_t token_bytes);

// Decode launches (since the process started) that prefetched before griddepcontrol.wait
// (decode_prefetch_keys > 0): tests check that a call took the path that reads the row's length
// and block table before the previous kernel has ended.
int64_t decode_prefetching_launches();

// Whether a decode grid is launched as a programmatic dependent of the previous kernel on the
// stream (decode_launch.cu): on sm_90+, for grids of more than one wave of resident CTAs and for
// calls of more than two splits; not for a grid resident at once with one or two splits.
bool decode_programmatic_launch(int compute_major, int32_t num_splits, int64_t grid_ctas,
                                int64_t resident_ctas);

// Launches the decode kernel of head_dim kHeadDim for the (q, cache) dtype pair and the cache's
// layout (kNhd == choice.nhd); the logits policy is kTransformed when soft-cap or ALiBi is on.
template <int kHeadDim, bool kNhd>
void launch_decode(const DecodeParams& p, DType q_dtype, DType kv_dtype, bool transformed_logits,
                   DecodeKernelChoice choice, cudaStream_t stream);
template <int kHeadDim, bool kNhd>
DecodeKernelInfo decode_kernel_info(DType q_dtype, DType kv_dtype, DecodeKernelChoice choice);

// Query heads a CTA serves (DecodeKernelChoice::heads_per_cta, decode_launch.cu) for a group of
// group_size heads, given the cache's element size, rows x KV heads and the SM count.
int decode_heads_per_cta(int32_t group_size, bool eight_bit_cache, int64_t rows_x_kv_heads,
                         int sm_count);

// The same for batch-invariant calls (DecodeArgs::batch_invariant): the tile decode_heads_per_cta
// gives large batches, fixed for the group and the cache's element size alone (8 heads for groups
// of up to 8, 16 up to 16, beyond that 32 for 16-bit caches and head blocks of 8 for 8-bit ones).
int decode_batch_invariant_heads_per_cta(int32_t group_size, bool eight_bit_cache);

// Whether a grid of `ctas` two-M-block CTAs (32 heads, decode_heads_per_cta) of at most max_keys
// keys each covers enough SMs with one CTA each to take no split: 95% of them, or 78% when the
// CTAs read at most 4096 keys. With its pairs of warps meeting on their own barriers that kernel
// streams as fast from one CTA an SM as from two, so a split only pays where the SMs it fills
// outweigh its cost (a merge, and a prologue a CTA), which weighs more the shorter the splits.
// No split against 2 (H200, MQA 32/1): 96 x 4k (73% of the SMs) -6%, 104 x 2k (79%) +10%, 120 x
// 4k (91%) +5%, 112 x 2k (85%) +16%, 128 x 2k +18%, but 112 x 8k -4% and 104 x 8k -10%; GQA 64/2
// 64 x 4k +7% (52 x 4k, 104 CTAs: -1.5%).
bool decode_two_m_block_covers_sms(int64_t ctas, int sm_count, int64_t max_keys);

// The split-KV heuristic (decode_launch.cu): splits per (row, KV head, head block) CTA given the
// CTA count, resident CTAs per SM, the SM count and the longest key range. one_wave: only counts
// whose CTAs are resident at once (the two-M-block kernel, whose extra waves of splits cost more
// than the slots they fill. Against the fill rule's count (H200, MQA 32/1): 96 x 4k 8 -> 2 splits
// +12%, 48 x 8k 11 -> 5 +7%).
int32_t decode_num_splits(int64_t ctas, int ctas_per_sm, int sm_count, int64_t max_keys, int tile_n,
                          bool one_wave = false);

// The split merge of a call: by the last CTA of each (row, KV head, head block) inside the decode
// kernel, or by decode_merge.cu's kernel after it (launch_decode_merge), taken by calls whose items
// hold many partials (decode_separate_merge).
// kAccumulate: in the kernel, the in-range splits adding their outputs in L2
// (DecodeParams::merge_accumulate).
enum class DecodeMergeMode { kAuto, kInKernel, kSeparate, kAccumulate };

// Whether a call of num_splits > 1 splits over KV heads of group_size query heads of head_dim
// merges in a kernel of its own: groups of 16 or more heads (one CTA merging a 32-head item was
// the tail of MQA 32/1 64 x 4k: ~6.7 of 51.5 us; MQA's head blocks of 8 gain too) or a KV head's
// splits of more than 64 KB of (f32) partials (up to 64 KB, the in-kernel merge stages them in
// one chunk). The group, not the CTA's head block, decides: with head blocks of 8 merged apart,
// MQA 32/1 2 x 32k +8.5%, 4 x 16k +4.6%, 8 x 32k +2.8% (H200; the other rows within 0.2%).
bool decode_separate_merge(int32_t num_splits, int group_size, int head_dim);

// Tests: forces the merge path of the split calls that follow (process-wide; kAuto: the rule).
void set_decode_merge_mode(DecodeMergeMode mode);

// Whether a split call merges in the kernel over sums its splits add in L2
// (DecodeParams::merge_accumulate) rather than over their partials: f32 reductions in an order
// that varies from run to run, so only for calls that allow it (DecodeArgs::deterministic =
// false), on sm_90+ (vector reductions, where it was measured; sm_80 builds add scalars, taken
// only when a test forces the merge), on the mma.sync kernels of up to 16 heads a CTA at two CTAs
// an SM (other_kernel: the wgmma or 4-CTA 8-bit kernel), where the rule keeps the merge in the
// kernel, and on grids of more CTAs than SMs: where one CTA an SM runs splits of equal length they
// end together and their reductions queue at L2. Against the last CTA's merge (H200): bf16 1 x
// 32k +1.9%, fp8 1 x 32k +2.6%, int8 +1.8%, page 16 +2.1%, fp8 1 x 64k +2.2%, 2 x 32k +0.4%,
// head_dim 64 +1.3%; one CTA an SM: 1 x 8k -0.8%, fp8 1 x 16k -1.9%.
bool decode_accumulate_merge(bool deterministic, int compute_major, int32_t num_splits,
                             int group_size, int head_dim, int heads_per_cta, bool other_kernel,
                             int64_t grid_ctas, int sm_count);

// Tests: the LSE range (log2 units) of the splits the accumulating merge adds in L2; the others
// go through their partials (process-wide; defaults kDecodeAccumulateMinLse2 / MaxLse2).
void set_decode_accumulate_range(float min_lse2, float max_lse2);

// Warps of the separate merge per (row, query head) for `items` of them: one, or a CTA of four
// for fewer items than SMs (batch 1 of MQA or GQA-16: 32 items, 64-128 partials each). Four warps
// against one (H200): MQA 32/1 1 x 32k +5.8%, GQA 32/2 1 x 32k +6.7%, but MQA 16 x 8k (512 items)
// -25%, GQA 32/2 8 x 8k (256) -2.2%.
int decode_merge_warps_per_item(int64_t items, int sm_count);

// Launches the separate split merge (decode_merge.cu) of the partials `p` describes, into p.out and
// p.lse, with warps_per_item (1 or 4) warps per (row, query head); `programmatic` (sm_90+): as a
// programmatic dependent of the decode grid before it.
void launch_decode_merge(const DecodeParams& p, DType q_dtype, bool programmatic,
                         int warps_per_item, cudaStream_t stream);

// The Hopper warpgroup-MMA kernel for groups of 16 or more query heads (decode_wgmma.cu): query
// heads per CTA (the MMA's M; heads past the group are zero rows).
constexpr int kDecodeWgmmaHeads = 64;
// Whether this build holds the kernel's sm_90a code (ATTNKIT_CUDA_ARCHS names 90a).
bool decode_wgmma_compiled();

// Which grids take it, and how (decode_launch.cu). A grid of `ctas` (rows x KV heads x head blocks
// of 64) CTAs of at most max_keys keys, for a group of group_size heads whose mma.sync kernel
// would run pair_ctas two-M-block CTAs (rows x KV heads x head blocks of 32).
struct DecodeWgmmaPlan {
  bool use = false;
  int ctas_per_sm = 2;  // the build taken: 2 CTAs an SM (6 units of 16 KB) or 3 (4 units)
  int32_t num_splits = 1;
};
DecodeWgmmaPlan decode_wgmma_plan(int32_t group_size, int64_t ctas, int64_t pair_ctas, int sm_count,
                                  int64_t max_keys, int32_t forced_splits);
// The most splits that keep ctas x splits within one wave of ctas_per_sm CTAs an SM, at least 4
// tiles (256 keys) each, in whole tiles.
int32_t decode_wgmma_num_splits(int64_t ctas, int ctas_per_sm, int sm_count, int64_t max_keys);

// Launches it for `p` (head_dim 128, a cache of q's dtype, plain logits, no window / beams; split
// calls write partials for launch_decode_merge) on grid (splits x head blocks, KV heads, rows).
void launch_decode_wgmma(const DecodeParams& p, DType q_dtype, int ctas_per_sm, bool nhd,
                         cudaStream_t stream);
// Launches of its 2- or 3-CTA build in this process (tests: which calls it served).
int64_t decode_wgmma_launches(int ctas_per_sm);

#define ATTNKIT_DECLARE_DECODE(kHeadDim, kNhd)                                                \
  extern template void launch_decode<kHeadDim, kNhd>(const DecodeParams&, DType, DType, bool, \
                                                     DecodeKernelChoice, cudaStream_t);       \
  extern template DecodeKernelInfo decode_kernel_info<kHeadDim, kNhd>(DType, DType,           \
                                                                      DecodeKernelChoice);
#define ATTNKIT_DECLARE_DECODE_LAYOUTS(kHeadDim) \
  ATTNKIT_DECLARE_DECODE(kHeadDim, false)        \
  ATTNKIT_DECLARE_DECODE(kHeadDim, true)
ATTNKIT_DECLARE_DECODE_LAYOUTS(64)
ATTNKIT_DECLARE_DECODE_LAYOUTS(80)
ATTNKIT_DECLARE_DECODE_LAYOUTS(96)
ATTNKIT_DECLARE_DECODE_LAYOUTS(128)
ATTNKIT_DECLARE_DECODE_LAYOUTS(256)
#undef ATTNKIT_DECLARE_DECODE_LAYOUTS
#undef ATTNKIT_DECLARE_DECODE

}  // namespace attnkit::cuda
