// The fused GQA decode kernel (XQA style): one CTA serves up to 8, 16 or 32 query heads of one
// KV head, so every K/V byte is read once per group. Grid: x = split * head_blocks + head_block,
// y = KV head, z = row. A tile of 64 keys (128 for 8-bit caches at head_dim 128 with groups of up
// to 8 heads) is loaded into shared memory by a multi-stage cp.async pipeline; each group of four
// warps splits the tile 16 (32) keys a warp and keeps its own online-softmax state (m, l, O); the
// warps are merged at the end, and with split-KV the last CTA of a (row, KV head) merges the
// splits. QK^T and PV run on mma.sync m16n8k16 with float
// accumulation: for groups of up to 8 heads the keys are the MMA rows (S^T = K Q^T, O^T = V^T P^T,
// half the MMAs of a 16-row tile), otherwise the heads. 8-bit caches run their MMAs in f16
// whatever the query type (one cvt widens a pair of stored bytes; a bf16 q is rounded to f16
// once, saturating at +-65504); their scales multiply the logits (K) and the output (V).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cuda/common/cp_async_sm80.cuh"
#include "cuda/common/fast_math.cuh"
#include "cuda/common/kv_widen.cuh"
#include "cuda/common/ldmatrix_sm80.cuh"
#include "cuda/common/memory_sm90.cuh"
#include "cuda/common/mma_sm80.cuh"
#include "cuda/common/named_barrier.cuh"
#include "cuda/decode/decode_epilogue.cuh"
#include "cuda/decode/decode_params.h"
#include "cuda/decode/split_weights.cuh"

namespace attnkit::cuda {

// KV-cache element types: the cache's storage, and how two stored bytes of a 32-bit word (byte
// kLo, byte kHi) widen to a pair of MMA inputs (lo first).
struct KvNative {  // the cache holds the query's own type: no conversion
  static constexpr int kBytes = 2;
};
struct KvFp8E4M3 {
  static constexpr int kBytes = 1;
  template <typename Tag, int kLo, int kHi>
  __device__ __forceinline__ static uint32_t widen(uint32_t word) {
    const uint32_t two = kLo == 0 && kHi == 1   ? word & 0xffffu
                         : kLo == 2 && kHi == 3 ? word >> 16
                                                : __byte_perm(word, 0, kLo | (kHi << 4));
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<uint16_t>(two), __NV_E4M3);
    if constexpr (std::is_same_v<Tag, F16Tag>) {
      return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
    } else {
      // e4m3 values are exact in bf16 as well.
      const float2 f = __half22float2(__half2(h));
      return pack_pair<Tag>(f.x, f.y);
    }
  }
  // Both pairs of a word, bytes (0, 1) and (2, 3): the cvt reads the high half in place, where
  // widen<Tag, 2, 3> needs a shift first (both widenings by words: fp8 64 x 4k +0.7%, H200).
  template <typename Tag>
  __device__ __forceinline__ static void widen_word(uint32_t word, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    // The e4m3x2 cvt is an sm_89+ instruction; older targets widen through the intrinsic below.
    if constexpr (std::is_same_v<Tag, F16Tag>) {
      widen_fp8x4_f16(word, lo, hi);
      return;
    }
#endif
    lo = widen<Tag, 0, 1>(word);
    hi = widen<Tag, 2, 3>(word);
  }
  // Bytes (0, 2) and (1, 3) of a word: one byte permute for both pairs (widen<Tag, 0, 2> and
  // widen<Tag, 1, 3> take one each).
  template <typename Tag>
  __device__ __forceinline__ static void widen_word_interleaved(uint32_t word, uint32_t& even,
                                                                uint32_t& odd) {
    widen_word<Tag>(__byte_perm(word, 0, 0x3120), even, odd);
  }
};
struct KvInt8 {
  static constexpr int kBytes = 1;
  template <typename Tag, int kLo, int kHi>
  __device__ __forceinline__ static uint32_t widen(uint32_t word) {
    if constexpr (std::is_same_v<Tag, F16Tag>) {
      // f16 0x64XX is 1024 + XX: bias the bytes to unsigned (the xor is shared by the word's two
      // pairs), place them under 0x64 with one byte permute and subtract 1152 (0x6480) in one
      // f16x2 op; exact for every int8.
      const uint32_t biased =
          __byte_perm(word ^ 0x80808080u, 0x64646464u, kLo | (4 << 4) | (kHi << 8) | (4 << 12));
      const __half2 h = __hsub2(*reinterpret_cast<const __half2*>(&biased),
                                __halves2half2(__ushort_as_half(0x6480), __ushort_as_half(0x6480)));
      return *reinterpret_cast<const uint32_t*>(&h);
    } else {
      // |x| <= 128 is exact in bf16.
      const float lo = static_cast<float>(static_cast<int8_t>((word >> (8 * kLo)) & 0xff));
      const float hi = static_cast<float>(static_cast<int8_t>((word >> (8 * kHi)) & 0xff));
      return pack_pair<Tag>(lo, hi);
    }
  }
  // The pairs of a word as KvFp8E4M3's (the byte permutes and the f16x2 subtracts are per pair
  // already).
  template <typename Tag>
  __device__ __forceinline__ static void widen_word(uint32_t word, uint32_t& lo, uint32_t& hi) {
    lo = widen<Tag, 0, 1>(word);
    hi = widen<Tag, 2, 3>(word);
  }
  template <typename Tag>
  __device__ __forceinline__ static void widen_word_interleaved(uint32_t word, uint32_t& even,
                                                                uint32_t& odd) {
    even = widen<Tag, 0, 2>(word);
    odd = widen<Tag, 1, 3>(word);
  }
};

// Shared memory of sm_90 (H100/H200): 228 KB per SM, 1 KB reserved per CTA. The tile
// configuration sizes its pipeline for two (or three) CTAs per SM from it.
constexpr int kDecodeSmemPerSm = 228 * 1024;

// How the K/V pipeline is organised. With one M block (groups <= 16) every warp copies exactly
// the keys it reads and waits for them with a warp barrier; with two M blocks the two warps that
// read a key slice copy it together and meet on a named barrier of their own (next_unit).
// kStages: a stage holds K and V of a tile.
// kSwizzledHalves: K and V of a tile are separate units of the ring, so K(t)'s buffer is refilled
//   while V(t) is still read; rows are unpadded, their 16-byte chunks XOR-swizzled by the row
//   (conflict-free ldmatrix), and Q is staged in the ring's last buffer, so that at head_dim 128
//   seven halves of 16 KB fit next to a second CTA: 6 in flight (3 tiles) against the 2 tiles of
//   three padded stages.
enum class DecodePipe { kStages, kSwizzledHalves };

// The pipeline of a tile configuration: swizzled halves for keys as rows with 8 or more chunks a
// row, for 16-bit caches and for the 8-bit kernels at head_dim 128. Against kStages with CTA
// barriers (H200): bf16 64 x 4k +7%, 32 x 32k +8%, 1 x 32k +6%; fp8 1 x 32k +1.5%. Padded halves
// (6) and warp barriers alone were within 0.5%. The 8-bit kernels at head_dim 128 take 128-key
// tiles (decode_default_keys_per_warp), whose halves are 16 KB as well.
constexpr DecodePipe decode_default_pipe(int head_dim, int kv_bytes, int heads_per_cta) {
  if (heads_per_cta != 8 || (head_dim * kv_bytes / 16) % 8 != 0) return DecodePipe::kStages;
  if (kv_bytes == 2 || head_dim == 128) return DecodePipe::kSwizzledHalves;
  return DecodePipe::kStages;
}

// Keys a warp takes from each tile (the tile is 4 warps of them): 32 (128-key tiles, two 16-key
// MMA blocks a warp) for 8-bit caches at head_dim 128 with groups of up to 8 heads, so that one
// swizzled half holds 16 KB as with 16-bit caches and the per-tile work (softmax update, waits,
// block-table reads, copy setup) is spread over twice the bytes. Against 64-key tiles (H200):
// fp8 64 x 4k / 128 x 2k / 256 x 1k +7% / +7% / +8%, 1 x 32k +8%, 32 x 32k -0.5%; int8 64 x 4k
// +8%; fp8 64 x 4k at pages 16 / 64 +5% / +8%.
constexpr int decode_default_keys_per_warp(int head_dim, int kv_bytes, int heads_per_cta) {
  return kv_bytes == 1 && head_dim == 128 && heads_per_cta == 8 ? 32 : 16;
}

// Compile-time configuration. kHeadsPerCta: query heads of one KV-head group that a CTA serves.
// 8: the keys are the MMA rows and the heads its n8 columns (S^T = K Q^T, O^T = V^T P^T), half
// the MMAs of a 16-row tile for groups of up to 8 heads. 16: the heads are the 16 MMA rows. 32:
// two 16-row M blocks (MQA 32/1 reads K/V once); the warps form two groups of four that share
// every tile.
template <int kHeadDim_, typename QTag_, typename Kv_, int kHeadsPerCta_ = 16, int kCtasPerSm_ = 2,
          DecodePipe kPipe_ = decode_default_pipe(kHeadDim_, Kv_::kBytes, kHeadsPerCta_),
          int kKeysPerWarp_ = decode_default_keys_per_warp(kHeadDim_, Kv_::kBytes, kHeadsPerCta_)>
struct DecodeTraits {
  static constexpr int kHeadDim = kHeadDim_;
  using QTag = QTag_;
  using Kv = Kv_;
  static constexpr int kM = kHeadsPerCta_;  // query heads (rows) per CTA
  static_assert(kM == 8 || kM == 16 || kM == 32);
  static constexpr bool kKeysAsRows = kM == 8;
  static constexpr int kMBlocks = kM == 32 ? 2 : 1;
  // Accumulator tiles of O per warp: n8 tiles of d (heads as rows) or m16 tiles of d.
  static constexpr int kAccTiles = kKeysAsRows ? kHeadDim_ / 16 : kHeadDim_ / 8;
  // CTAs per SM that the pipeline is sized for. Measured on the H200: two (3 bf16 stages) beat one
  // (6 stages, too few warps to hide their latency) and three (2 stages, fewer bytes in flight).
  // 8-bit caches at head_dim 128 with groups <= 8 run four (launch_traits).
  static constexpr int kTargetCtasPerSm = kCtasPerSm_;
  static constexpr int kKeyWarps = 4;
  static constexpr int kWarps = kKeyWarps * kMBlocks;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kKeysPerWarp = kKeysPerWarp_;
  static_assert(kKeysPerWarp == 16 || (kKeysPerWarp == 32 && kKeysAsRows && Kv::kBytes == 1));
  static constexpr int kTileN = kKeyWarps * kKeysPerWarp;
  // Keys whose 16-byte copies one warp issues (every warp shares the loads).
  static constexpr int kCopyKeysPerWarp = kTileN / kWarps;
  static constexpr bool k8Bit = Kv::kBytes == 1;
  // The cache's block layout: HND ([Hkv, T, D], these traits) or NHD ([T, Hkv, D],
  // DecodeNhdTraits).
  static constexpr bool kNhd = false;
  // The MMA input type: the query's own, or f16 for 8-bit caches (e4m3 and int8 widen to f16 in
  // one or two ops per pair; to bf16 they would need four).
  using MmaTag = std::conditional_t<k8Bit, F16Tag, QTag>;
  // 8-bit caches feed the MMAs from the stored bytes: ldmatrix on byte rows, widened to the
  // query type in registers (no widening pass through shared memory).
  static constexpr bool kDirect = k8Bit;
  // Byte rows of an 8-bit stage: padded so that their pitch is an odd number of 16-byte units
  // (conflict-free ldmatrix; D = 80 also gets room for the unused half of its last x4 load).
  static constexpr int kRawRowBytes = kHeadDim + ((kHeadDim / 16) % 2 == 0 ? 16 : 32);
  // Rows of 16-bit elements padded by 16 bytes: ldmatrix's 8 row addresses then fall into
  // distinct bank groups (the row pitch is an odd number of 16-byte units).
  static constexpr int kRowStride = kHeadDim + 8;
  static constexpr int kRowBytes = kRowStride * 2;
  static constexpr int kChunksPerToken = kHeadDim * Kv::kBytes / 16;  // 16-byte copies per row
  static constexpr int kQBytes = kM * kRowBytes;
  static constexpr bool kSwizzle = kPipe_ == DecodePipe::kSwizzledHalves && kKeysAsRows &&
                                   kMBlocks == 1 && kChunksPerToken % 8 == 0;
  // K/V rows in shared memory: padded (kRowBytes, 8-bit kRawRowBytes), or unpadded with their
  // 16-byte chunks XOR-swizzled by the row.
  static constexpr int kKvRowBytes =
      kSwizzle ? kChunksPerToken * 16 : (Kv::kBytes == 1 ? kRawRowBytes : kRowBytes);
  static constexpr int kKvRowStride = kKvRowBytes / 2;  // in 16-bit elements
  // Q in the pipeline's last buffer (the prologue leaves it empty; the loop first refills it
  // after a CTA barrier that follows the Q fragment loads).
  static constexpr int kQOutside = kSwizzle ? 0 : kQBytes;
  // One pipeline stage: K and V of kTileN keys, stored (8-bit: unpadded) or ready for ldmatrix.
  static constexpr int kStageHalfBytes = kTileN * kKvRowBytes;  // K (or V) of one stage
  static constexpr int kStageBytes = 2 * kStageHalfBytes;
  // As many stages as fit next to the other CTAs of the SM.
  static constexpr int kCtaBudget = kDecodeSmemPerSm / kTargetCtasPerSm - 1024;
  static constexpr int kStagesFit = (kCtaBudget - kQBytes) / kStageBytes;
  static constexpr int kMaxStages = 6;
  static constexpr int kStages =
      kStagesFit < 2 ? 2 : (kStagesFit > kMaxStages ? kMaxStages : kStagesFit);
  // Warp-local pipeline: every warp copies exactly the keys it reads (one M block).
  static constexpr bool kWarpLocal = kMBlocks == 1;
  static constexpr bool kHalves = kPipe_ == DecodePipe::kSwizzledHalves && kMBlocks == 1;
  // Pipeline units: a tile's K and V (full stages) or its K, then its V (halves).
  static constexpr int kUnitsPerTile = kHalves ? 2 : 1;
  static constexpr int kUnitBytes = kHalves ? kStageHalfBytes : kStageBytes;
  static constexpr int kHalvesFit = (kCtaBudget - kQOutside) / kStageHalfBytes;
  // At four CTAs per SM three halves (two in flight) are the most that fit: the 4-CTA 8-bit
  // kernel at head_dim 128 (3 x 16 KB).
  static constexpr int kMinHalves = kTargetCtasPerSm >= 4 ? 3 : 4;
  static constexpr int kUnits =
      kHalves
          ? (kHalvesFit < kMinHalves ? kMinHalves
                                     : (kHalvesFit > 2 * kMaxStages ? 2 * kMaxStages : kHalvesFit))
          : kStages;
  // The warp merge reuses the pipeline memory: O (rows of kMergeStride floats), m and l of every
  // warp, the key warps' weights and the (m, l) of every head; the split combine then keeps a
  // weight per (head, split) there. O's rows are padded by 4 floats: the accumulator layouts store
  // lanes (g, t) at rows 2t (keys as rows) or g (heads as rows) and the same column, which an
  // unpadded 128- or 256-float row puts in one bank (4- and 8-way conflicts; 4 floats make them 1-
  // and 2-way). H200: bf16 1 x 32k +1.0%, fp8 1 x 32k +1.4%, fp8 64 x 4k +0.5%, MQA 32/1 64 x 4k
  // +2.3%; no row slower.
  static constexpr int kMergeStride = kHeadDim + 4;
  static constexpr int kMergeBytes =
      (kWarps * kDecodeHeadsPerCta * (kMergeStride + 2) + kM * (kKeyWarps + 2)) *
      static_cast<int>(sizeof(float));
  static constexpr int kCombineBytes = kM * kDecodeMaxSplits * static_cast<int>(sizeof(float));
  static constexpr int kPipelineBytes = std::max({kUnits * kUnitBytes, kMergeBytes, kCombineBytes});
  static constexpr int kSmemBytes = kQOutside + kPipelineBytes;
  static_assert(!kSwizzle || kQBytes <= kUnitBytes);
  static constexpr int kMinCtasPerSm =
      std::max(1, std::min(std::max(kTargetCtasPerSm, 3), kDecodeSmemPerSm / (kSmemBytes + 1024)));
  static_assert(kHeadDim % 16 == 0 && (kHeadDim * Kv::kBytes) % 16 == 0);
  static_assert(kTileN % kWarps == 0 && 32 % kCopyKeysPerWarp == 0);
};

// The kernel of `Base`'s tile configuration over an NHD cache ([T, Hkv, D] blocks): a key's rows
// of one KV head are Hkv x D elements apart instead of D (KvLayout::token_stride_bytes), which only
// the K/V copies' source addresses see; shared memory, the math and the HND kernels (their types,
// names and code) are unchanged.
template <typename Base>
struct DecodeNhdTraits : Base {
  static constexpr bool kNhd = true;
};

// Logit transforms as a compile-time policy: kPlain is q.k * scale; kTransformed applies the
// soft-cap (when softcap > 0) and the ALiBi bias (slope 0 when off), in the order of
// docs/semantics.md.
enum class DecodeLogits { kPlain, kTransformed };

// The softmax's lazy rescale (decode_update_max): a row's reference max rises only when a tile's
// max passes it by more than this many log2 units, so that once a row has settled its tiles skip
// the O and l rescale. 8 bounds the probabilities by 2^8, which f16 and bf16 P operands hold with
// their full relative precision. Against the exact max (H200): MQA 32/1 128 x 2k +2.6%, 16 x 8k
// +2.3%, GQA 64/2 64 x 4k +2.3%; GQA 32/8 rows (one-M-block kernel) within 0.2%.
constexpr float kDecodeRescaleSlack = 8.0f;

// One row's softmax reference after a tile whose max is m_tile (log2 units), with the slack above;
// alpha = 1 when it did not rise (the caller skips the O multiplies when the whole warp has alpha
// 1). l and O accumulate against the same reference, so (m_run, l_run) stay a consistent pair for
// the merges and the LSE. A row without keys so far (m_run = -inf) takes any finite m_tile; a fully
// masked row keeps m_use = 0 (probabilities exp2(-inf) = 0).
__device__ __forceinline__ void decode_update_max(float m_tile, float& m_run, float& l_run,
                                                  float& alpha, float& m_use) {
  const bool rise = m_tile > m_run + kDecodeRescaleSlack;
  const float m_new = rise ? m_tile : m_run;
  m_use = m_new == -INFINITY ? 0.0f : m_new;
  alpha = rise ? fast_exp2(m_run - m_use) : 1.0f;
  m_run = m_new;
  l_run *= alpha;
}

__device__ __forceinline__ float warp_max_quad(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float warp_sum_quad(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The keys a decode query attends, as a dense index range [0, num_keys): the sink keys
// [0, sink_count) followed by the window [window_begin, seq_len).
struct DecodeKeyRange {
  int32_t sink_count = 0;
  int32_t window_begin = 0;
  int32_t num_keys = 0;

  __device__ __forceinline__ DecodeKeyRange(int32_t seq_len, int32_t window, int32_t sinks) {
    if (seq_len <= 0) return;
    if (window > 0) {
      window_begin = max(0, seq_len - window);
      sink_count = min(sinks, window_begin);
    }
    num_keys = sink_count + (seq_len - window_begin);
  }
  __device__ __forceinline__ int32_t position(int32_t key) const {
    return key < sink_count ? key : window_begin + (key - sink_count);
  }
};

// The L2 eviction policy of the K / V stream: evict_first. Each K / V byte is read once a call,
// and at batch 1 x 32k the call streams 67-134 MB through the 50 MB L2: with the default policy
// that stream pushes out what the call reads again at its end (the epilogue's and merge's code,
// whose fetches ncu's sampling put first among the last CTA's stalls; the block table; the
// partials) and the next call's prefetched first tiles. Against the default policy (H200): bf16
// 1 x 32k +4.7%, fp8 1 x 32k +5.6%, int8 +3.3%, page 16 +3.1%, 1 x 8k +3.5%, 1 x 128k +0.8%, fp8
// 256 x 1k +2.2%; 64 x 4k and MQA even. Only the linear copies take it (copy_tile): the
// zero-fill form with a cache hint met the ptxas fault described at copy_tile.
__device__ __forceinline__ uint64_t decode_kv_policy() { return l2_policy_evict_first(); }

// The natural-log LSE of a softmax whose max is m2 (log2 units) and whose sum of exponentials
// (relative to it) is l: -inf where no key counted (l = 0).
__device__ __forceinline__ float decode_natural_lse(float m2, float l) {
  return l == 0.0f ? -INFINITY : (m2 + log2f(l)) * 0.6931471805599453f;
}

// Counts this split CTA's arrival for its (row, KV head, head block); true (in every thread) in the
// last CTA to arrive, which merges. The splits' writes are made visible by the release / acquire
// count (the CUDA threadFenceReduction pattern) and read through L2 (__ldcg), never a stale L1
// line.
__device__ __forceinline__ bool decode_split_arrival_is_last(const DecodeParams& p, int row,
                                                             int kv_head, int head_block) {
  __shared__ int is_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t* counter = p.split_counters +
                       (static_cast<int64_t>(row) * p.num_kv_heads + kv_head) * p.head_blocks +
                       head_block;
    // One thread counts with release / acquire semantics: release publishes the CTA's partial
    // writes (ordered before this thread by the barrier above), acquire makes the other splits'
    // writes visible to the merge (ordered after it by the barrier below). Against a
    // __threadfence() in every thread before the count and after it (H200): bf16 1 x 32k +0.6%,
    // 2 x 32k +0.4%, 1 x 8k +1%, fp8 1 x 32k +1.1% (thread 0 alone fencing around a relaxed
    // atomicAdd: +0.3%).
    const int32_t arrived = atom_add_one_acq_rel_gpu(counter);
    is_last = arrived == p.num_splits - 1;
    // Every split of this (row, KV head, head block) has counted: the counter is free again, so
    // the next call through the same workspace finds it at zero without a memset.
    if (is_last) *counter = 0;
  }
  __syncthreads();
  return is_last != 0;
}

// The accumulating merge's last CTA (DecodeParams::merge_accumulate): out = acc / den and lse =
// log(den) from the sums the in-range splits added in L2, combined with the outliers' partials
// (LSE weights, as in decode_combine_in_last_cta) when there are any. Every sum and outlier word
// it reads it sets back to zero for the next call.
template <typename Traits>
__device__ __forceinline__ void decode_combine_accumulated(const DecodeParams& p, int row,
                                                           int kv_head, int head_block,
                                                           int first_head, int heads_here,
                                                           float* scratch) {
  using QT = typename Traits::QTag::Storage;
  constexpr int kD = Traits::kHeadDim;
  constexpr int kMaskWords = kDecodeMaxSplits / 32;
  if (!decode_split_arrival_is_last(p, row, kv_head, head_block)) return;
  const int out_items = heads_here * kD;
  const int64_t first_item = static_cast<int64_t>(row) * p.num_q_heads + first_head;
  float* acc_src = p.merge_acc + first_item * kD;
  float* den_src = p.merge_den + first_item;
  uint32_t* mask_src =
      p.merge_outliers +
      ((static_cast<int64_t>(row) * p.num_kv_heads + kv_head) * p.head_blocks + head_block) *
          kMaskWords;
  // One L2 round trip: every load first, each zeroed by the thread that loaded it, the sums,
  // denominators and outlier words shared through shared memory.
  float* acc = scratch;                                            // [kM * kD]
  float* den = acc + Traits::kM * kD;                              // [kM]
  uint32_t* mask = reinterpret_cast<uint32_t*>(den + Traits::kM);  // [kMaskWords]
  for (int i = threadIdx.x; i < out_items; i += Traits::kThreads) {
    acc[i] = __ldcg(acc_src + i);
    __stcg(acc_src + i, 0.0f);
  }
  if (threadIdx.x < heads_here) {
    den[threadIdx.x] = __ldcg(den_src + threadIdx.x);
    __stcg(den_src + threadIdx.x, 0.0f);
  }
  const int mask_thread = static_cast<int>(threadIdx.x) - (Traits::kThreads - kMaskWords);
  if (mask_thread >= 0) {
    mask[mask_thread] = __ldcg(mask_src + mask_thread);
    __stcg(mask_src + mask_thread, 0u);
  }
  __syncthreads();
  bool any_outlier = false;
#pragma unroll
  for (int w = 0; w < kMaskWords; ++w) any_outlier = any_outlier || mask[w] != 0u;
  if (p.lse != nullptr && !any_outlier && threadIdx.x < heads_here) {
    const float d = den[threadIdx.x];
    p.lse[row * p.lse_row_stride + (first_head + threadIdx.x) * p.lse_head_stride] =
        d > 0.0f ? logf(d) : -INFINITY;
  }
  const int64_t split_stride = static_cast<int64_t>(p.num_rows) * p.num_q_heads;
  constexpr float kLog2e = 1.4426950408889634f;
#pragma unroll 1
  for (int i = threadIdx.x; i < out_items; i += Traits::kThreads) {
    const int r = i / kD;
    const float d = den[r];
    QT* out =
        static_cast<QT*>(p.out) + row * p.out_row_stride + (first_head + r) * p.out_head_stride;
    if (!any_outlier) {
      // The common case: no split out of range.
      out[i % kD] = QT(d > 0.0f ? acc[i] / d : 0.0f);
      continue;
    }
    // Outliers: the sums are one more partial with lse2 = log2(den) and output acc / den, merged
    // with the outliers' partials by their LSEs. Rare (scores far from 0 in log2 units, or huge
    // values), so plain loads a (split, item).
    float m = d > 0.0f ? log2f(d) : -INFINITY;
    bool faulted = false;  // an outlier split a guard stopped (decode_faulted_lse)
    for (int w = 0; w < kMaskWords; ++w) {
      for (uint32_t bits = mask[w]; bits != 0u; bits &= bits - 1u) {
        const int s = 32 * w + __ffs(bits) - 1;
        const float lse = __ldcg(p.partial_lse + s * split_stride + first_item + r);
        faulted = faulted || decode_lse_faulted(lse);
        m = fmaxf(m, lse * kLog2e);
      }
    }
    if (faulted) {
      out[i % kD] = QT(0.0f);
      if (p.lse != nullptr && i % kD == 0) {
        p.lse[row * p.lse_row_stride + (first_head + r) * p.lse_head_stride] = -INFINITY;
      }
      continue;
    }
    // Every contribution empty (no keys anywhere): zeros, LSE -inf.
    const float m_ref = m == -INFINITY ? 0.0f : m;
    // The sums' weight 2^(log2(den) - m) times their output acc / den.
    float sum = d > 0.0f ? exp2f(log2f(d) - m_ref) : 0.0f;
    float o = d > 0.0f ? acc[i] * exp2f(-m_ref) : 0.0f;
    for (int w = 0; w < kMaskWords; ++w) {
      for (uint32_t bits = mask[w]; bits != 0u; bits &= bits - 1u) {
        const int s = 32 * w + __ffs(bits) - 1;
        const float lse = __ldcg(p.partial_lse + s * split_stride + first_item + r);
        if (lse == -INFINITY) continue;  // a head without keys in an outlier split
        const float weight = exp2f(lse * kLog2e - m_ref);
        sum += weight;
        o += weight * __ldcg(p.partial_out + (s * split_stride + first_item) * kD + i);
      }
    }
    out[i % kD] = QT(sum > 0.0f ? o / sum : 0.0f);
    if (p.lse != nullptr && i % kD == 0) {
      p.lse[row * p.lse_row_stride + (first_head + r) * p.lse_head_stride] =
          decode_natural_lse(m_ref, sum);
    }
  }
}

// The last split CTA of a (row, KV head, head block) to arrive merges every split's normalized
// output and LSE (both f32): out = sum_s w_s out_s with w_s = exp(lse_s - m) / sum_s'
// exp(lse_s' - m), lse = m + log(sum).
template <typename Traits>
__device__ __forceinline__ void decode_combine_in_last_cta(const DecodeParams& p, int row,
                                                           int kv_head, int head_block,
                                                           int first_head, int heads_here,
                                                           float* scratch) {
  using QT = typename Traits::QTag::Storage;
  constexpr int kD = Traits::kHeadDim;
  if (!decode_split_arrival_is_last(p, row, kv_head, head_block)) return;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int num_splits = p.num_splits;
  const int64_t split_stride = static_cast<int64_t>(p.num_rows) * p.num_q_heads;
  const int64_t first_item = static_cast<int64_t>(row) * p.num_q_heads + first_head;
  // The first head of each warp has its LSEs loaded first, before any arithmetic and before the
  // partials are staged, so that the LSE pass does not queue behind them (the last CTA's LSE pass
  // 2.34 -> 1.57 us at bf16 1 x 32k: +0.4% on the call).
  constexpr int kLsePerLane = kDecodeMaxSplits / 32;
  float first_lse[kLsePerLane];
  if (warp < heads_here) {
#pragma unroll
    for (int i = 0; i < kLsePerLane; ++i) {
      const int s = lane + 32 * i;
      first_lse[i] =
          s < num_splits ? __ldcg(p.partial_lse + s * split_stride + first_item + warp) : -INFINITY;
    }
  }
  // The partial outputs are f32 values: 4 to a 16-byte vector.
  constexpr int kPerVec = 4;
  constexpr int kVecs = kD / kPerVec;
  const int split_vecs = heads_here * kVecs;  // 16-byte vectors of one split's partial outputs
  const int64_t split_stride_vecs = split_stride * kVecs;
  const float4* partial = reinterpret_cast<const float4*>(p.partial_out) + first_item * kVecs;
  // The partial outputs are staged in shared memory by cp.async (.cg: through L2, never a stale L1
  // line), two buffers of splits after the weights, the first two issued before the LSE pass: the
  // merge waits for about one L2 round trip per chunk, and the first ones overlap the LSE pass
  // (bf16 1 x 32k +3.6% against loading 16 float4s per thread into registers at a time).
  constexpr int kWeightFloats = Traits::kM * kDecodeMaxSplits;
  constexpr int kBufferVecs = (Traits::kPipelineBytes - kWeightFloats * 4) / 16 / 2;
  static_assert(kBufferVecs >= Traits::kM * kVecs,
                "the merge stages at least one split per buffer");
  // Chunks are sized by the heads this CTA has (groups of 4 heads in the kM = 8 kernel: twice the
  // splits per buffer), and all splits go in one chunk over both buffers when they fit (head_dim
  // 128, kM = 8, f32 partials: up to 54 splits of 4 heads, 27 of 8), instead of chunks sized
  // for kM heads (13 splits: 3 chunks, three round trips, for the 32 splits of batch 1). H200:
  // bf16 1 x 32k +1.9%, 1 x 16k +3.2%, 1 x 8k +4.8%, 2 x 32k +0.4%, 4 x 32k even (one chunk
  // before as well); fp8 1 x 32k +3.2%.
  int chunk_splits = num_splits, num_chunks = 1;
  if (num_splits * split_vecs > 2 * kBufferVecs) {
    chunk_splits = kBufferVecs / split_vecs;
    num_chunks = (num_splits + chunk_splits - 1) / chunk_splits;
  }
  float4* staging = reinterpret_cast<float4*>(scratch + kWeightFloats);
  // A thread's vectors v = threadIdx.x + k kThreads of a chunk are (split, vector) pairs that
  // advance by a fixed step, found once by subtraction (at most kThreads / kVecs steps: one or
  // two for groups of 4 heads), so that the issue loop has no integer division: one warp a
  // scheduler runs it, and with a division a vector it took ~120 instructions per four copies, the
  // last copy of batch 1 x 32k's 32 KB issued ~1000 cycles after the count (division-free: bf16 1
  // x 32k +1.8%, H200; docs/decode_design.md, "Split-KV and the merge").
  int first_s = 0, first_i = threadIdx.x;
  while (first_i >= split_vecs) first_i -= split_vecs, ++first_s;
  int step_s = 0, step_i = Traits::kThreads;
  while (step_i >= split_vecs) step_i -= split_vecs, ++step_s;
  const int64_t step_src = step_s * split_stride_vecs + step_i;
  const int64_t wrap_src = split_stride_vecs - split_vecs;
  auto stage_chunk = [&](int chunk) {
    const int s0 = chunk * chunk_splits;
    const int n_vecs = min(chunk_splits, num_splits - s0) * split_vecs;
    float4* dst = staging + (chunk % 2) * kBufferVecs;
    const float4* src = partial + (s0 + first_s) * split_stride_vecs + first_i;
    int i = first_i;
#pragma unroll 4
    for (int v = threadIdx.x; v < n_vecs; v += Traits::kThreads) {
      cp_async_16(smem_u32(dst + v), src, true);
      src += step_src;
      i += step_i;
      if (i >= split_vecs) {
        i -= split_vecs;
        src += wrap_src;
      }
    }
    cp_async_commit();
  };
  stage_chunk(0);
  if (num_chunks > 1) stage_chunk(1);
  float* weight = scratch;  // [kM][num_splits]
  bool item_faulted = false;
  for (int r = warp; r < heads_here; r += Traits::kWarps) {
    float lse[kLsePerLane];
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < kLsePerLane; ++i) {
      const int s = lane + 32 * i;
      if (r == warp) {
        lse[i] = first_lse[i];
      } else {
        lse[i] =
            s < num_splits ? __ldcg(p.partial_lse + s * split_stride + first_item + r) : -INFINITY;
      }
      m = fmaxf(m, lse[i]);
    }
    // Empty splits have LSE -inf (and wrote zeros): weight 0. A split a guard stopped marks
    // every head of the item: weights 0, LSE -inf, and the outputs are written as zeros below.
    bool faulted;
    const float sum = split_weights(lse, m, num_splits, lane, weight + r * num_splits, faulted);
    item_faulted = item_faulted || faulted;
    if (lane == 0 && p.lse != nullptr) {
      p.lse[row * p.lse_row_stride + (first_head + r) * p.lse_head_stride] =
          sum > 0.0f ? m + logf(sum) : -INFINITY;
    }
  }
  item_faulted = __syncthreads_or(item_faulted) != 0;
  // Each output vector (a head's kPerVec d's) is summed over the splits by `parts` consecutive
  // threads, the splits strided among them and their sums shuffled together, so that a CTA with
  // fewer vectors than threads (4 heads x 16 vectors at head_dim 128: 64 of 128 threads) keeps
  // every thread busy; each thread owns up to kItems vectors. The merging CTA runs alone at the
  // end of the call: its serial chain of shared loads and adds is the call's tail. Deriving the
  // weights per thread from the LSEs instead of the pass above was slower (bf16 1 x 32k -2.8%: an
  // exponential in every split's chain).
  constexpr int kItems = (Traits::kM * kVecs + Traits::kThreads - 1) / Traits::kThreads;
  // Splits in flight a thread: two where a thread owns several vectors (the two-M-block kernel,
  // held to 128 registers a thread), four otherwise.
  constexpr int kSplitUnroll = kItems > 1 ? 2 : 4;
  int parts = 1;
  while (parts < 8 && split_vecs * parts * 2 <= Traits::kThreads) parts *= 2;
  const int part = threadIdx.x % parts;
  const int base = threadIdx.x / parts;
  float acc[kItems][kPerVec];
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
#pragma unroll
    for (int k = 0; k < kPerVec; ++k) acc[j][k] = 0.0f;
  }
  for (int chunk = 0; chunk < num_chunks; ++chunk) {
    if (chunk + 1 < num_chunks) {
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const float4* src = staging + (chunk % 2) * kBufferVecs;
    const int s0 = chunk * chunk_splits;
    const int n = min(chunk_splits, num_splits - s0);
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int i = base + j * Traits::kThreads;
      if (i < split_vecs) {
        const float* w = weight + (i / kVecs) * num_splits + s0;
#pragma unroll kSplitUnroll
        for (int s = part; s < n; s += parts) {
          const float4 v = src[s * split_vecs + i];
          const float ws = w[s];
          acc[j][0] += ws * v.x;
          acc[j][1] += ws * v.y;
          acc[j][2] += ws * v.z;
          acc[j][3] += ws * v.w;
        }
      }
    }
    __syncthreads();
    if (chunk + 2 < num_chunks) stage_chunk(chunk + 2);
  }
  for (int offset = 1; offset < parts; offset *= 2) {
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
#pragma unroll
      for (int k = 0; k < kPerVec; ++k)
        acc[j][k] += __shfl_xor_sync(0xffffffffu, acc[j][k], offset);
    }
  }
  if (part != 0) return;
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int i = base + j * Traits::kThreads;
    if (i < split_vecs) {
      const int r = i / kVecs, c = i % kVecs;
      QT* out = static_cast<QT*>(p.out) + row * p.out_row_stride +
                (first_head + r) * p.out_head_stride + kPerVec * c;
#pragma unroll
      for (int k = 0; k < kPerVec; ++k) out[k] = QT(item_faulted ? 0.0f : acc[j][k]);
    }
  }
}

// The capacity a row's length is checked against: the row's slots for a linear cache; a cyclic
// cache's length is unbounded (its slots wrap).
__device__ __forceinline__ int64_t decode_len_capacity(const DecodeParams& p) {
  return p.kv.window_slots == 0 ? p.kv.row_capacity() : INT64_MAX;
}

// Records the faults a decode CTA met (decode_kernel and the wgmma kernel keep only a flag and a
// key in their loops and call this once, at their end, where nothing is live across the call: a
// call site earlier made ptxas keep more registers, and spill in the wgmma kernel's 3-CTA build).
// bad_len: the row's length is outside [0, decode_len_capacity] (read again); pos >= 0: the key
// position of a failed guard, whose cache_indirection entry (when it names no beam) or else
// block-table entry of the key's page is read again and recorded.
__device__ __noinline__ inline void record_decode_faults(const DecodeParams& p, int row,
                                                         bool bad_len, int32_t pos) {
  if (bad_len) {
    record_fault(p.fault, FaultKind::kSeqLen, FaultArg::kSeqLens, row, 0, p.seq_lens[row],
                 decode_len_capacity(p));
  }
  if (pos < 0) return;
  int64_t src_row = row;
  if (p.cache_indirection != nullptr) {
    const int beam_seq = row / p.beam_width, beam = row % p.beam_width;
    const int32_t src_beam =
        p.cache_indirection[beam_seq * p.indirection_seq_stride + beam * p.indirection_beam_stride +
                            pos * p.indirection_pos_stride];
    if (static_cast<uint32_t>(src_beam) >= static_cast<uint32_t>(p.beam_width)) {
      record_fault(p.fault, FaultKind::kIndirection, FaultArg::kCacheIndirection, row, pos,
                   src_beam, p.beam_width);
      return;
    }
    src_row = static_cast<int64_t>(beam_seq) * p.beam_width + src_beam;
  }
  if (p.kv.block_table == nullptr) return;
  const int64_t column = p.kv.slot_of(pos) >> p.page_shift;
  const int32_t block = p.kv.block_table[src_row * p.kv.block_table_row_stride + column];
  record_fault(p.fault, FaultKind::kBlockId, FaultArg::kBlockTable, src_row, column, block,
               p.kv.num_blocks);
}

// Byte offset of KV head `head` at logical slot `slot` of block-table row `row` (a contiguous
// cache: block `row`), without 64-bit division: a paged cache's tokens_per_block is
// 1 << page_shift, a contiguous row holds slot < tokens_per_block. HND: ((head x T + token) x D) x
// element size, the arithmetic the HND kernels are tuned with (compile-time layouts keep the
// stride multiplies out of their code); NHD: the layout's strides.
template <bool kNhd>
__device__ __forceinline__ int64_t decode_byte_offset(const detail::KvLayout& kv, int64_t row,
                                                      int64_t slot, int32_t head,
                                                      int32_t page_shift) {
  int64_t block = row, token = slot;
  if (kv.block_table) {
    block = kv.block_table[row * kv.block_table_row_stride + (slot >> page_shift)];
    token = slot & ((int64_t{1} << page_shift) - 1);
  }
  if constexpr (kNhd) {
    return kv.row_offset(block, token, head);
  } else {
    return block * kv.block_stride_bytes +
           ((static_cast<int64_t>(head) * kv.tokens_per_block + token) * kv.head_dim + 0) *
               kv.element_bytes;
  }
}

// Before griddepcontrol.wait (a programmatic launch), the previous kernel may still be writing
// anything this one reads (seq_lens, the block table, the cache), so nothing read here is used
// after the wait: the row's length and its first block-table entries (relaxed loads) only aim
// bulk L2 prefetches (cp.async.bulk.prefetch.L2, a hint: L2 is the coherence point, so a line the
// previous kernel writes afterwards is not stale) of the K and V the CTA's first tiles read at
// its early-ramp guess (split * split_keys_guess). DRAM then streams them while the previous
// kernel's tail (its last CTAs, a split merge) runs, and the CTA's first copies after the wait
// hit L2. Block ids outside the pool (stale or unwritten entries) are skipped, and a run never
// leaves its page (its length is clipped to the page and the row's length), so no prefetch
// leaves the pool; nothing read here is a fault (it may be stale): the guards run on the values
// read after the wait. One thread a (page, K or V) run of tokens. An NHD page holds the run's
// tokens of every KV head as one range (Hkv x run rows): the CTA of KV head h prefetches its h-th
// Hkv-th of it, so that the Hkv CTAs of a (row, split) cover the range once.
template <int kTokenBytes, bool kNhd = false>
__device__ __forceinline__ void decode_prefetch_before_wait(const DecodeParams& p, int row,
                                                            int kv_head, int split) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const int32_t begin = split * p.split_keys_guess;
  const int32_t want_end = begin + min(p.prefetch_keys, p.split_keys_guess);
  const int32_t first_page = begin >> p.page_shift;
  const int32_t page = first_page + static_cast<int32_t>(threadIdx.x / 2);
  if (page > (want_end - 1) >> p.page_shift) return;
  const int32_t* table_row = p.kv.block_table + row * p.kv.block_table_row_stride;
  const int32_t seq_len = ld_relaxed_gpu(p.seq_lens + row);
  const int32_t block = ld_relaxed_gpu(table_row + min(page, p.table_cols - 1));
  const int32_t lo = max(begin, page << p.page_shift);
  const int32_t hi = min(min(want_end, seq_len), (page + 1) << p.page_shift);
  if (lo >= hi || block < 0 || block >= p.pool_blocks) return;
  const uint8_t* base = (threadIdx.x & 1) ? p.kv.v_base : p.kv.k_base;
  if constexpr (kNhd) {
    const uint8_t* src = base + static_cast<int64_t>(block) * p.kv.block_stride_bytes +
                         (lo & ((1 << p.page_shift) - 1)) * p.kv.token_stride_bytes +
                         static_cast<int64_t>(kv_head) * (hi - lo) * kTokenBytes;
    prefetch_l2_bulk(src, (hi - lo) * kTokenBytes);
    return;
  }
  const uint8_t* src =
      base + static_cast<int64_t>(block) * p.kv.block_stride_bytes +
      (static_cast<int64_t>(kv_head) * p.kv.tokens_per_block + (lo & ((1 << p.page_shift) - 1))) *
          kTokenBytes;
  prefetch_l2_bulk(src, (hi - lo) * kTokenBytes);
#endif
}

template <typename Traits, DecodeLogits kLogits>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinCtasPerSm)
    decode_kernel(const __grid_constant__ DecodeParams p) {
  using QTag = typename Traits::QTag;
  using QT = typename QTag::Storage;
  using MmaTag = typename Traits::MmaTag;
  using MT = typename MmaTag::Storage;
  using Kv = typename Traits::Kv;
  constexpr int kD = Traits::kHeadDim;
  constexpr int kTileN = Traits::kTileN;
  constexpr int kRowStride = Traits::kRowStride;
  constexpr int kM = Traits::kM;
  constexpr int kMB = kDecodeHeadsPerCta;  // rows of one M block
  constexpr int kCopyKeys = Traits::kCopyKeysPerWarp;
  constexpr float kLog2e = 1.4426950408889634f;

  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* pipe_smem = smem + Traits::kQOutside;
  MT* q_smem = reinterpret_cast<MT*>(
      Traits::kSwizzle ? pipe_smem + (Traits::kUnits - 1) * Traits::kUnitBytes : smem);
  constexpr int kKvRowStride = Traits::kKvRowStride;
  // Byte offset of (row, 16-byte chunk) in a K/V buffer, and the same in 16-bit elements.
  auto kv_byte = [](int r, int chunk) -> int {
    if constexpr (Traits::kSwizzle) {
      return r * Traits::kKvRowBytes + ((chunk ^ (r & 7)) * 16);
    } else {
      return r * Traits::kKvRowBytes + chunk * 16;
    }
  };
  auto kv_at = [&](int r, int chunk) -> int { return kv_byte(r, chunk) / 2; };

  const int head_block = blockIdx.x % p.head_blocks;
  const int split = blockIdx.x / p.head_blocks;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (p.pdl) {
    // Launched as a programmatic dependent of the previous kernel on the stream: wait for it to
    // complete (and its writes to be visible) before the first read, then let the next kernel
    // launch, so that its CTAs become resident while this one's tail runs.
    if (p.prefetch_keys > 0) {
      decode_prefetch_before_wait<Traits::kChunksPerToken * 16, Traits::kNhd>(p, blockIdx.z,
                                                                              blockIdx.y, split);
    }
    griddep_wait();
    griddep_launch_dependents();
  }
#endif
  const int kv_head = blockIdx.y;
  const int row = blockIdx.z;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  // Warp w takes keys kKeysPerWarp * (w % 4) .. + kKeysPerWarp - 1 of every tile for the M block
  // w / 4.
  const int key_warp = warp % Traits::kKeyWarps;
  const int m_block = warp / Traits::kKeyWarps;
  // The kCopyKeys keys of a tile this warp copies: its own slot, or with two M blocks the half of
  // its key warp's keys, so that the keys a pair of warps (one per M block) reads are the keys the
  // pair copies and the pair alone meets at each unit (next_unit's named barrier).
  const int copy_slot = Traits::kMBlocks == 2 ? key_warp * Traits::kMBlocks + m_block : warp;
  const int first_head = kv_head * p.group_size + head_block * kM;
  const int heads_here = min(kM, p.group_size - head_block * kM);

  // The row's length, guarded: a linear row holds at most its capacity (table columns x
  // tokens_per_block), a cyclic one any length >= 0. A bad length is taken as 0 (the row reads
  // nothing and is written as zeros with LSE -inf) and recorded once, by the row's first CTA, at
  // the end (record_decode_faults).
  int32_t seq_len = p.seq_lens[row];
  const bool bad_len = seq_len < 0 || seq_len > decode_len_capacity(p);
  if (bad_len) seq_len = 0;
  // Early ramp: the block-table entries of the first tiles and Q do not wait for seq_len. With a
  // plain paged cache and no window, split s starts at s * split_keys_guess when the row has
  // max_seq_len keys; the entries read there (columns clamped to the table) are used only when the
  // row's own start matches, and only for keys below its end (entries past it may hold anything).
  constexpr int kUnits = Traits::kUnits;
  constexpr int kUnitsPerTile = Traits::kUnitsPerTile;
  constexpr int kIssueTile = (kUnits - 1) / kUnitsPerTile;
  constexpr int kOffsetTiles = kIssueTile + (Traits::kHalves ? 2 : 1);
  const bool plain_paged =
      p.kv.block_table != nullptr && p.cache_indirection == nullptr && p.kv.window_slots == 0;
  const int32_t* table_row =
      plain_paged ? p.kv.block_table + row * p.kv.block_table_row_stride : nullptr;
  const bool early_table = plain_paged && p.window == 0;
  const int32_t guess_begin = split * p.split_keys_guess;
  int32_t early_block[kOffsetTiles];
#pragma unroll
  for (int s = 0; s < kOffsetTiles; ++s) {
    early_block[s] = 0;
    if (early_table && lane < kCopyKeys) {
      const int64_t key =
          static_cast<int64_t>(guess_begin) + s * kTileN + copy_slot * kCopyKeys + lane;
      early_block[s] = table_row[min(key >> p.page_shift, static_cast<int64_t>(p.table_cols - 1))];
    }
  }
  // Query rows of this head block (rows past the group are zero). All loads are issued before
  // the shared stores (the compiler cannot reorder global loads across shared stores itself).
  constexpr int kQIters = (kM * kD + Traits::kThreads - 1) / Traits::kThreads;
  QT q_vals[kQIters];
  auto load_q = [&] {
    const QT* q = static_cast<const QT*>(p.q) + row * p.q_row_stride;
#pragma unroll
    for (int j = 0; j < kQIters; ++j) {
      const int i = threadIdx.x + j * Traits::kThreads;
      const int r = i / kD, d = i % kD;
      int src = d;
      if constexpr (Traits::kDirect) {
        // Direct 8-bit K fragments hold 4 consecutive stored bytes (d 4t..4t+3 of a 16-d step)
        // where the MMA expects k = 2t, 2t+1, 2t+8, 2t+9: permute Q's d the same way.
        const int x = d % 16;
        src = d - x + 4 * ((x % 8) / 2) + (x % 2) + 2 * (x / 8);
      }
      q_vals[j] =
          i < kM * kD && r < heads_here ? q[(first_head + r) * p.q_head_stride + src] : QT(0.0f);
    }
  };
  load_q();
  const int32_t q_pos = seq_len - 1;
  const DecodeKeyRange keys(seq_len, p.window, p.sink_tokens);
  // Batch-invariant calls (split_keys > 0) fix the split length, the last split reading to the
  // row's end; otherwise the row's keys are shared out over the splits.
  const int32_t keys_per_split =
      p.split_keys > 0
          ? p.split_keys
          : ((keys.num_keys + p.num_splits - 1) / p.num_splits + kTileN - 1) / kTileN * kTileN;
  const int32_t key_begin = split * keys_per_split;
  // An empty split (key_begin >= key_end) runs no tile and writes zeros with LSE -inf.
  const int32_t key_end = p.split_keys > 0 && split == p.num_splits - 1
                              ? keys.num_keys
                              : min(keys.num_keys, key_begin + keys_per_split);

  const int beam_seq = row / p.beam_width;
  const int beam = row % p.beam_width;
  // Device guards (docs/safety.md): every block id is compared with the pool where a key's address
  // is formed (one compare per key lane and tile, beside its block-table load), every
  // cache_indirection entry with the beams. A failed guard gives the key offset -1 (the copy
  // zero-fills it, nothing is read) and keeps the key's position in fault_pos; after the loop
  // the CTA's result is discarded for zeros (decode_faulted_lse for a split, which the merge turns
  // into zeros for the row), and the fault is recorded at the kernel's end (record_decode_faults).
  int32_t fault_pos = -1;
  // Stage loader, in two steps. key_offset(): lane t < kCopyKeys of warp w computes the byte
  // offset of key kCopyKeys * w + t of a tile (block table, cyclic slot, beam indirection: all
  // through KvLayout), or -1 past the split. copy_tile(): the copy lanes fetch the offsets by
  // shuffle so that consecutive lanes copy consecutive 16 bytes. The main loop computes the
  // offsets one tile ahead, so that the block-table latency overlaps the math.
  // The common paged cache (no beams, not cyclic) takes a short path: one table read and one
  // multiply per key, with the per-CTA terms hoisted. head_bytes: the KV head's first row in a
  // block; in_page(t): slot t's row from there (HND rows kTokenBytes apart, NHD Hkv heads' rows).
  const int64_t head_bytes =
      Traits::kNhd
          ? static_cast<int64_t>(kv_head) * (Traits::kChunksPerToken * 16)
          : static_cast<int64_t>(kv_head) * p.kv.tokens_per_block * (Traits::kChunksPerToken * 16);
  const int32_t page_mask = (1 << p.page_shift) - 1;
  // (HND: the product in the type of t, as the offsets were computed before NHD existed.)
  auto in_page = [&](auto t) -> int64_t {
    if constexpr (Traits::kNhd) {
      return static_cast<int64_t>(t) * p.kv.token_stride_bytes;
    } else {
      return t * (Traits::kChunksPerToken * 16);
    }
  };
  auto key_offset = [&](int tile) -> int64_t {
    const int32_t key = key_begin + tile * kTileN + copy_slot * kCopyKeys + lane;
    if (lane >= kCopyKeys || key >= key_end) return -1;
    const int32_t pos = keys.position(key);
    if (plain_paged) {
      const int32_t block = table_row[pos >> p.page_shift];
      if (static_cast<uint32_t>(block) >= static_cast<uint32_t>(p.kv.num_blocks)) {
        fault_pos = pos;
        return -1;
      }
      return static_cast<int64_t>(block) * p.kv.block_stride_bytes + head_bytes +
             in_page(pos & page_mask);
    }
    int64_t src_row = row;
    if (p.cache_indirection != nullptr) {
      const int32_t src_beam =
          p.cache_indirection[beam_seq * p.indirection_seq_stride +
                              beam * p.indirection_beam_stride + pos * p.indirection_pos_stride];
      if (static_cast<uint32_t>(src_beam) >= static_cast<uint32_t>(p.beam_width)) {
        fault_pos = pos;
        return -1;
      }
      src_row = static_cast<int64_t>(beam_seq) * p.beam_width + src_beam;
    }
    const int64_t slot = p.kv.slot_of(pos);
    if (p.kv.block_table == nullptr) {
      return decode_byte_offset<Traits::kNhd>(p.kv, src_row, slot, kv_head, p.page_shift);
    }
    const int64_t column = slot >> p.page_shift;
    const int32_t block = p.kv.block_table[src_row * p.kv.block_table_row_stride + column];
    if (static_cast<uint32_t>(block) >= static_cast<uint32_t>(p.kv.num_blocks)) {
      fault_pos = pos;
      return -1;
    }
    return static_cast<int64_t>(block) * p.kv.block_stride_bytes + head_bytes +
           in_page(slot & page_mask);
  };
  const uint64_t kv_policy = decode_kv_policy();
  // Copies K (copy_k) and / or V (copy_v) of a tile's keys into k_dst / v_dst.
  auto copy_tile = [&](int64_t my_offset, uint8_t* k_dst, uint8_t* v_dst, bool copy_k,
                       bool copy_v) {
    constexpr int kDstRowBytes = Traits::kKvRowBytes;
    constexpr int kChunks = kCopyKeys * Traits::kChunksPerToken;
    constexpr int kTokenBytes = Traits::kChunksPerToken * 16;
    // Fast path (warp-uniform): the warp's keys are consecutive tokens of one page run (the usual
    // case), so its copy is one linear run of kChunks 16-byte pieces from the first key (HND), or
    // kCopyKeys rows `pitch` apart (NHD: a token's row of this KV head, then the next token's).
    const int64_t first = __shfl_sync(0xffffffffu, my_offset, 0);
    [[maybe_unused]] const int64_t pitch = Traits::kNhd ? p.kv.token_stride_bytes : kTokenBytes;
    // With 32 keys a warp (8-bit caches at head_dim 128), keys 16-31 may start a run of their
    // own: pages of 16 keys are copied linearly as well, not through the per-token shuffles.
    // fp8 64 x 4k at page 16 +2.4% (H200), within 1% of page 32.
    constexpr bool kTwoRuns = kCopyKeys == 32;
    int64_t second = first + 16 * kTokenBytes;
    bool linear;
    if constexpr (Traits::kNhd) {
      if constexpr (kTwoRuns) {
        second = __shfl_sync(0xffffffffu, my_offset, 16);
        const int64_t run_first = lane >= 16 ? second : first;
        linear =
            __all_sync(0xffffffffu, my_offset >= 0 && my_offset == run_first + (lane % 16) * pitch);
      } else {
        linear = __all_sync(0xffffffffu, lane >= kCopyKeys ||
                                             (my_offset >= 0 && my_offset == first + lane * pitch));
      }
    } else if constexpr (kTwoRuns) {
      second = __shfl_sync(0xffffffffu, my_offset, 16);
      const int64_t run_first = lane >= 16 ? second : first;
      linear = __all_sync(0xffffffffu,
                          my_offset >= 0 && my_offset == run_first + (lane % 16) * kTokenBytes);
    } else {
      linear =
          __all_sync(0xffffffffu, lane >= kCopyKeys ||
                                      (my_offset >= 0 && my_offset == first + lane * kTokenBytes));
    }
    if (linear) {
      constexpr int kCpt = Traits::kChunksPerToken;
      const uint8_t* k_src = p.kv.k_base + first + lane * 16;
      const uint8_t* v_src = p.kv.v_base + first + lane * 16;
      // The second run's sources, for the chunks of keys 16-31 (base >= kChunks / 2).
      const uint8_t* k_src2 = p.kv.k_base + second - (kChunks / 2) * 16 + lane * 16;
      const uint8_t* v_src2 = p.kv.v_base + second - (kChunks / 2) * 16 + lane * 16;
      // This lane's destination for base = 0; the per-iteration part is a constant when the
      // pieces of a token divide (or are a multiple of) the 32 lanes.
      const uint32_t lane_dst =
          copy_slot * kCopyKeys * kDstRowBytes +
          (32 % kCpt == 0 ? (lane / kCpt) * kDstRowBytes + (lane % kCpt) * 16 : lane * 16);
      // Identity shuffles keep the two addresses per-lane registers. Without them ptxas (CUDA
      // 13.0) moved the warp-uniform buffer base of some kernels (16- and 32-head 16-bit ones at
      // head_dim 128, those of head_dim 256) into a uniform register, and its [R + UR + imm] form
      // of the hinted LDGSTS names a descriptor register nothing writes: an illegal instruction
      // at run time (scripts/check_sass_descriptors.py checks every kernel).
      const uint32_t k_lane = __shfl_sync(0xffffffffu, smem_u32(k_dst) + lane_dst, lane);
      const uint32_t v_lane = __shfl_sync(0xffffffffu, smem_u32(v_dst) + lane_dst, lane);
      // NHD: chunk c is part c % kCpt of the warp's key c / kCpt, from that key's row. When the
      // pieces of a token divide the 32 lanes the lane's part and key offset are fixed
      // (nhd_lane) and an iteration adds whole rows. (The second run: keys 16-31, from `second`.)
      static_assert(!kTwoRuns || 32 % kCpt == 0, "two runs: the 8-bit head_dim 128 kernels");
      [[maybe_unused]] const int64_t nhd_lane =
          32 % kCpt == 0 ? (lane / kCpt) * pitch + (lane % kCpt) * 16 : 0;
#pragma unroll
      for (int base = 0; base < kChunks; base += 32) {
        const int c = base + lane;
        if (c < kChunks) {
          int dst;
          if constexpr (Traits::kSwizzle) {
            // The row's chunks are XOR-swizzled by the row (the warp's first row is a multiple
            // of 8, so the row within the warp decides).
            const int r = base / kCpt + lane / kCpt;
            dst = (base / kCpt) * kDstRowBytes + (((lane % kCpt) ^ (r & 7)) - (lane % kCpt)) * 16;
          } else if constexpr (32 % kCpt == 0) {
            dst = (base / kCpt) * kDstRowBytes;
          } else if constexpr (kCpt % 32 == 0) {
            dst = (base / kCpt) * kDstRowBytes + (base % kCpt) * 16;
          } else {
            dst = (c / kCpt) * kDstRowBytes + (c % kCpt) * 16 - lane * 16;
          }
          const bool run2 = kTwoRuns && base >= kChunks / 2;
          if constexpr (Traits::kNhd) {
            int64_t src;
            if constexpr (32 % kCpt == 0) {
              const int key = base / kCpt;  // of the lane's first key of the iteration
              src = (run2 ? second + (key - 16) * pitch : first + key * pitch) + nhd_lane;
            } else {
              src = first + (c / kCpt) * pitch + (c % kCpt) * 16;
            }
            if (copy_k) cp_async_16_l2_hint(k_lane + dst, p.kv.k_base + src, kv_policy);
            if (copy_v) cp_async_16_l2_hint(v_lane + dst, p.kv.v_base + src, kv_policy);
          } else {
            if (copy_k) {
              cp_async_16_l2_hint(k_lane + dst, (run2 ? k_src2 : k_src) + base * 16, kv_policy);
            }
            if (copy_v) {
              cp_async_16_l2_hint(v_lane + dst, (run2 ? v_src2 : v_src) + base * 16, kv_policy);
            }
          }
        }
      }
      return;
    }
    // Every lane runs every iteration: the shuffles need the whole warp.
#pragma unroll
    for (int base = 0; base < kChunks; base += 32) {
      const int c = base + lane;
      const int token = min(c / Traits::kChunksPerToken, kCopyKeys - 1);
      const int part = c % Traits::kChunksPerToken;
      const int64_t key_offset = __shfl_sync(0xffffffffu, my_offset, token);
      const bool valid = key_offset >= 0;
      const int64_t offset = key_offset + part * 16;
      if (c < kChunks) {
        const int dst = (copy_slot * kCopyKeys + token) * kDstRowBytes +
                        (Traits::kSwizzle ? part ^ (token & 7) : part) * 16;
        if (copy_k) {
          cp_async_16(smem_u32(k_dst + dst), valid ? p.kv.k_base + offset : p.kv.k_base, valid);
        }
        if (copy_v) {
          cp_async_16(smem_u32(v_dst + dst), valid ? p.kv.v_base + offset : p.kv.v_base, valid);
        }
      }
    }
  };

  const float k_scale = p.k_scale ? p.k_scale[p.k_scale_per_head ? kv_head : 0] : 1.0f;
  const float v_scale = p.v_scale ? p.v_scale[p.v_scale_per_head ? kv_head : 0] : 1.0f;
  const float qk_scale = p.softmax_scale * k_scale;
  const int g = lane / 4, t = lane % 4;
  // This thread's two heads (as CTA rows): g and g + 8 of its M block, or 2t and 2t + 1 when the
  // keys are the MMA rows.
  const int head0 = Traits::kKeysAsRows ? 2 * t : m_block * kMB + g;
  const int head1 = Traits::kKeysAsRows ? 2 * t + 1 : head0 + 8;
  float slope[2] = {0.0f, 0.0f};
  if constexpr (kLogits == DecodeLogits::kTransformed) {
    slope[0] = head0 < heads_here ? p.alibi_slopes[first_head + head0] : 0.0f;
    slope[1] = head1 < heads_here ? p.alibi_slopes[first_head + head1] : 0.0f;
  }
  float o[Traits::kAccTiles][4];
#pragma unroll
  for (int n = 0; n < Traits::kAccTiles; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY};  // log2 domain, heads head0 / head1
  float l_run[2] = {0.0f, 0.0f};            // this thread's share of the row sums

  const int num_tiles = key_end > key_begin ? (key_end - key_begin + kTileN - 1) / kTileN : 0;
  // The pipeline is a ring of kUnits buffers; unit u is tile u / kUnitsPerTile (with halves: its
  // K for even u, its V for odd u) and lives in buffer u % kUnits. Consuming a unit first refills
  // the buffer of the unit consumed before it with unit u + kUnits - 1.
  // Offsets (per copy lane) of the tile of the next unit to issue and, with halves, of the tile
  // after it (a half's math is too short to hide a block-table read).
  int64_t issue_offset = -1, ahead_offset = -1;
  {
    // The prologue's block-table reads are issued together, then its copies.
    int64_t offsets[kOffsetTiles];
    if (early_table && key_begin == guess_begin) {
#pragma unroll
      for (int s = 0; s < kOffsetTiles; ++s) {
        const int32_t key = key_begin + s * kTileN + copy_slot * kCopyKeys + lane;
        offsets[s] = -1;
        if (lane < kCopyKeys && key < key_end) {
          if (static_cast<uint32_t>(early_block[s]) < static_cast<uint32_t>(p.kv.num_blocks)) {
            offsets[s] = static_cast<int64_t>(early_block[s]) * p.kv.block_stride_bytes +
                         head_bytes + in_page(key & page_mask);
          } else {
            fault_pos = key;  // no window here: the key is its position
          }
        }
      }
    } else {
#pragma unroll
      for (int s = 0; s < kOffsetTiles; ++s) offsets[s] = s < num_tiles ? key_offset(s) : -1;
    }
#pragma unroll
    for (int u = 0; u < kUnits - 1; ++u) {
      const int tile = u / kUnitsPerTile;
      uint8_t* dst = pipe_smem + u * Traits::kUnitBytes;
      if (tile < num_tiles) {
        if constexpr (Traits::kHalves) {
          copy_tile(offsets[tile], dst, dst, u % 2 == 0, u % 2 == 1);
        } else {
          copy_tile(offsets[tile], dst, dst + Traits::kStageHalfBytes, true, true);
        }
      }
      cp_async_commit();
    }
    issue_offset = offsets[kIssueTile];
    if constexpr (Traits::kHalves) ahead_offset = offsets[kOffsetTiles - 1];
  }
  int read_buffer = 0, write_buffer = kUnits - 1;
  // Waits for the next unit (its buffer is read_buffer), refills write_buffer with the unit
  // kUnits - 1 ahead (a tile's K for part 0, its V for part 1; both for full stages), and returns
  // the shared memory of the unit to consume.
  auto next_unit = [&](int issue_tile, int part) -> uint8_t* {
    cp_async_wait<kUnits - 2>();
    if constexpr (Traits::kWarpLocal) {
      __syncwarp();
    } else {
      // The two warps of a key warp (one per M block) copy and read the same keys: a named
      // barrier of those 64 threads (ids 1-4), not the CTA's.
      // Immediate ids (a register id makes ptxas reserve all 16 barriers).
      switch (key_warp) {
        case 0:
          named_barrier_sync<1, 64>();
          break;
        case 1:
          named_barrier_sync<2, 64>();
          break;
        case 2:
          named_barrier_sync<3, 64>();
          break;
        default:
          named_barrier_sync<4, 64>();
          break;
      }
    }
    uint8_t* dst = pipe_smem + write_buffer * Traits::kUnitBytes;
    if (issue_tile < num_tiles) {
      if constexpr (Traits::kHalves) {
        copy_tile(issue_offset, dst, dst, part == 0, part == 1);
      } else {
        copy_tile(issue_offset, dst, dst + Traits::kStageHalfBytes, true, true);
      }
    }
    cp_async_commit();
    // The next block-table read overlaps this tile's math.
    if constexpr (Traits::kHalves) {
      if (part == 1) {
        issue_offset = ahead_offset;
        ahead_offset = key_offset(issue_tile + 2);
      }
    } else {
      issue_offset = key_offset(issue_tile + 1);
    }
    uint8_t* unit = pipe_smem + read_buffer * Traits::kUnitBytes;
    read_buffer = read_buffer + 1 == kUnits ? 0 : read_buffer + 1;
    write_buffer = write_buffer + 1 == kUnits ? 0 : write_buffer + 1;
    return unit;
  };
  {
#pragma unroll
    for (int j = 0; j < kQIters; ++j) {
      const int i = threadIdx.x + j * Traits::kThreads;
      if (i < kM * kD) {
        float v = static_cast<float>(q_vals[j]);
        if constexpr (!std::is_same_v<MmaTag, QTag>) {
          // bf16 q for f16 MMAs: exact within f16's range, saturated beyond it (NaN stays NaN).
          if (fabsf(v) > 65504.0f) v = copysignf(65504.0f, v);
        }
        q_smem[(i / kD) * kRowStride + i % kD] = MT(v);
      }
    }
  }

  // Keys as rows: Q is the B operand of every tile; its fragments stay in registers.
  uint32_t q_frag[Traits::kKeysAsRows ? kD / 16 : 1][2];
  if constexpr (Traits::kKeysAsRows) {
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kD / 16; kk += 2) {
      // Matrices: heads 0-7 x d 16kk..+7, +8..15, 16(kk+1).., +8.. (for D = 80 the last pair
      // reads padding that is not used).
      uint32_t r[4];
      ldmatrix_x4(r, smem_u32(q_smem + (lane % 8) * kRowStride + (kk + lane / 16) * 16 +
                              ((lane / 8) % 2) * 8));
      q_frag[kk][0] = r[0];
      q_frag[kk][1] = r[1];
      if (kk + 1 < kD / 16) {
        q_frag[kk + 1][0] = r[2];
        q_frag[kk + 1][1] = r[3];
      }
    }
  }

  // The warp-local pipeline has no CTA barrier in the loop: Q's stores need one here (and Q in
  // the last pipeline buffer must be read by every warp before the loop refills that buffer).
  if constexpr (!Traits::kKeysAsRows || Traits::kSwizzle) __syncthreads();

  for (int tile = 0; tile < num_tiles; ++tile) {
    // K (and with full stages V) of this tile; the unit issued is kUnits - 1 ahead.
    const uint8_t* k_smem = next_unit(tile + (kUnits - 1) / kUnitsPerTile, (kUnits - 1) % 2);
    // V of this tile: with halves, waited for after the scores so that K's buffer is refilled
    // while V is still in flight.
    auto v_unit = [&]() -> const uint8_t* {
      if constexpr (Traits::kHalves) {
        return next_unit(tile + kUnits / 2, kUnits % 2);
      } else {
        return k_smem + Traits::kStageHalfBytes;
      }
    };
    if constexpr (Traits::kKeysAsRows) {
      // S^T = K Q^T: lane (g, t) holds keys g, g + 8 of each 16-key block x heads 2t, 2t + 1. Two
      // accumulators halve the MMA dependency chain.
      constexpr int kSub = Traits::kKeysPerWarp / 16;  // 16-key blocks of a warp
      float s[kSub][4] = {}, s_odd[kSub][4] = {};
      if constexpr (Traits::kDirect) {
        const uint8_t* k_rows = k_smem + key_warp * Traits::kKeysPerWarp * Traits::kKvRowBytes;
#pragma unroll
        for (int b = 0; b < kSub; ++b) {
#pragma unroll
          for (int kk = 0; kk < kD / 16; kk += 2) {
            uint32_t x[4];
            ldmatrix_x4(x, smem_u32(k_rows + kv_byte(16 * b + ((lane / 8) % 2) * 8 + lane % 8,
                                                     kk + lane / 16)));
#pragma unroll
            for (int step = 0; step < 2; ++step) {
              if (kk + step < kD / 16) {
                const uint32_t lo = x[2 * step], hi = x[2 * step + 1];  // keys g, g + 8
                uint32_t a[4];
                Kv::template widen_word<MmaTag>(lo, a[0], a[2]);
                Kv::template widen_word<MmaTag>(hi, a[1], a[3]);
                if (step == 0) {
                  mma_m16n8k16<MmaTag>(s[b], a, q_frag[kk + step]);
                } else {
                  mma_m16n8k16<MmaTag>(s_odd[b], a, q_frag[kk + step]);
                }
              }
            }
          }
        }
      } else {
        static_assert(kSub == 1, "16-bit caches take 16 keys a warp");
        const QT* k_rows =
            reinterpret_cast<const QT*>(k_smem) + key_warp * Traits::kKeysPerWarp * kKvRowStride;
#pragma unroll
        for (int kk = 0; kk < kD / 16; ++kk) {
          uint32_t a[4];
          ldmatrix_x4(a, smem_u32(k_rows + kv_at(lane % 16, 2 * kk + lane / 16)));
          if (kk % 2 == 0) {
            mma_m16n8k16<MmaTag>(s[0], a, q_frag[kk]);
          } else {
            mma_m16n8k16<MmaTag>(s_odd[0], a, q_frag[kk]);
          }
        }
      }
      const int32_t warp_key0 = key_begin + tile * kTileN + key_warp * Traits::kKeysPerWarp;
      float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int b = 0; b < kSub; ++b) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int32_t key = warp_key0 + 16 * b + g + 8 * (e / 2);
          float x = s[b][e] + s_odd[b][e];
          if constexpr (kLogits == DecodeLogits::kPlain) {
            x *= qk_scale * kLog2e;
          } else {
            x *= qk_scale;
            if (p.softcap > 0.0f) x = p.softcap * tanhf(x / p.softcap);
            x += slope[e & 1] * static_cast<float>(keys.position(key) - q_pos);
            x *= kLog2e;
          }
          s[b][e] = key < key_end ? x : -INFINITY;
          tile_max[e & 1] = fmaxf(tile_max[e & 1], s[b][e]);
        }
      }
      float alpha[2], m_use[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float m_tile = tile_max[h];
#pragma unroll
        for (int offset = 4; offset < 32; offset *= 2)
          m_tile = fmaxf(m_tile, __shfl_xor_sync(0xffffffffu, m_tile, offset));
        decode_update_max(m_tile, m_run[h], l_run[h], alpha[h], m_use[h]);
      }
      // P^T as the B operand (k = key, n = head): transpose the two 8x8 key blocks of each
      // 16-key block.
      uint32_t pb[kSub][2];
#pragma unroll
      for (int b = 0; b < kSub; ++b) {
        float pr[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) pr[e] = fast_exp2(s[b][e] - m_use[e & 1]);
        l_run[0] += pr[0] + pr[2];
        l_run[1] += pr[1] + pr[3];
        pb[b][0] = movmatrix_trans(pack_pair<MmaTag>(pr[0], pr[1]));
        pb[b][1] = movmatrix_trans(pack_pair<MmaTag>(pr[2], pr[3]));
      }
      if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
        for (int c = 0; c < Traits::kAccTiles; ++c) {
          o[c][0] *= alpha[0];
          o[c][1] *= alpha[1];
          o[c][2] *= alpha[0];
          o[c][3] *= alpha[1];
        }
      }
      const uint8_t* v_smem = v_unit();
      // O^T += V^T P^T: 16 d's per MMA (A from ldmatrix.trans of the V rows).
      if constexpr (Traits::kDirect) {
        // Byte rows through .trans: lane (g, t) gets V[2t][2g], V[2t][2g+1], V[2t+1][2g],
        // V[2t+1][2g+1] of a 16-d chunk; MMA row g is d = 2g, row g + 8 is d = 2g + 1.
        const uint8_t* v_rows = v_smem + key_warp * Traits::kKeysPerWarp * Traits::kKvRowBytes;
#pragma unroll
        for (int b = 0; b < kSub; ++b) {
#pragma unroll
          for (int cc = 0; cc < kD / 16; cc += 2) {
            uint32_t x[4];
            ldmatrix_x4_trans(x, smem_u32(v_rows + kv_byte(16 * b + ((lane / 8) % 2) * 8 + lane % 8,
                                                           cc + lane / 16)));
#pragma unroll
            for (int step = 0; step < 2; ++step) {
              if (cc + step < kD / 16) {
                const uint32_t lo = x[2 * step], hi = x[2 * step + 1];  // keys 0-7, keys 8-15
                uint32_t a[4];
                Kv::template widen_word_interleaved<MmaTag>(lo, a[0], a[1]);
                Kv::template widen_word_interleaved<MmaTag>(hi, a[2], a[3]);
                mma_m16n8k16<MmaTag>(o[cc + step], a, pb[b]);
              }
            }
          }
        }
      } else {
        const QT* v_rows =
            reinterpret_cast<const QT*>(v_smem) + key_warp * Traits::kKeysPerWarp * kKvRowStride;
#pragma unroll
        for (int c = 0; c < kD / 16; ++c) {
          uint32_t a[4];
          ldmatrix_x4_trans(
              a, smem_u32(v_rows + kv_at((lane / 16) * 8 + lane % 8, 2 * c + (lane / 8) % 2)));
          mma_m16n8k16<MmaTag>(o[c], a, pb[0]);
        }
      }
    } else {
      // S = Q K^T for this warp's 16 keys: two n8 tiles.
      float s[2][4] = {};
      if constexpr (Traits::kDirect) {
        const uint8_t* k_rows = k_smem + key_warp * Traits::kKeysPerWarp * Traits::kKvRowBytes;
#pragma unroll
        for (int kk = 0; kk < kD / 16; kk += 2) {
          // Matrices: keys 0-7 / 8-15 of steps kk and kk + 1 (for D = 80 the last step's second
          // half reads row padding and is not used).
          uint32_t b[4];
          ldmatrix_x4(b,
                      smem_u32(k_rows + kv_byte(((lane / 8) % 2) * 8 + lane % 8, kk + lane / 16)));
#pragma unroll
          for (int step = 0; step < 2; ++step) {
            if (kk + step < kD / 16) {
              uint32_t a[4];
              ldmatrix_x4(a, smem_u32(q_smem + (m_block * kMB + lane % 16) * kRowStride +
                                      (kk + step) * 16 + (lane / 16) * 8));
#pragma unroll
              for (int n = 0; n < 2; ++n) {
                const uint32_t word = b[2 * step + n];
                uint32_t bn[2];
                Kv::template widen_word<MmaTag>(word, bn[0], bn[1]);
                mma_m16n8k16<MmaTag>(s[n], a, bn);
              }
            }
          }
        }
      } else {
        const QT* k_rows =
            reinterpret_cast<const QT*>(k_smem) + key_warp * Traits::kKeysPerWarp * kKvRowStride;
#pragma unroll
        for (int kk = 0; kk < kD / 16; ++kk) {
          uint32_t a[4], b[4];
          ldmatrix_x4(a, smem_u32(q_smem + (m_block * kMB + lane % 16) * kRowStride + kk * 16 +
                                  (lane / 16) * 8));
          ldmatrix_x4(b, smem_u32(k_rows + ((lane / 16) * 8 + lane % 8) * kKvRowStride + kk * 16 +
                                  ((lane / 8) % 2) * 8));
          const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
          mma_m16n8k16<MmaTag>(s[0], a, b0);
          mma_m16n8k16<MmaTag>(s[1], a, b1);
        }
      }

      const int32_t warp_key0 = key_begin + tile * kTileN + key_warp * Traits::kKeysPerWarp;
      float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int32_t key = warp_key0 + n * 8 + 2 * t + (e & 1);
          float x;
          if constexpr (kLogits == DecodeLogits::kPlain) {
            x = s[n][e] * (qk_scale * kLog2e);
          } else {
            x = s[n][e] * qk_scale;
            if (p.softcap > 0.0f) x = p.softcap * tanhf(x / p.softcap);
            x += slope[e / 2] * static_cast<float>(keys.position(key) - q_pos);
            x *= kLog2e;
          }
          s[n][e] = key < key_end ? x : -INFINITY;
          tile_max[e / 2] = fmaxf(tile_max[e / 2], s[n][e]);
        }
      }
      float alpha[2], m_use[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        decode_update_max(warp_max_quad(tile_max[r]), m_run[r], l_run[r], alpha[r], m_use[r]);
      }
      uint32_t pa[4];
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const float p0 = fast_exp2(s[n][0] - m_use[0]), p1 = fast_exp2(s[n][1] - m_use[0]);
        const float p2 = fast_exp2(s[n][2] - m_use[1]), p3 = fast_exp2(s[n][3] - m_use[1]);
        l_run[0] += p0 + p1;
        l_run[1] += p2 + p3;
        pa[2 * n] = pack_pair<MmaTag>(p0, p1);
        pa[2 * n + 1] = pack_pair<MmaTag>(p2, p3);
      }
      // Once the running maxima settle, alpha is 1 for every row of the warp: skip the kD / 2
      // multiplies per thread (a warp-uniform branch; the result is bit-identical).
      if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
        for (int n = 0; n < kD / 8; ++n) {
          o[n][0] *= alpha[0];
          o[n][1] *= alpha[0];
          o[n][2] *= alpha[1];
          o[n][3] *= alpha[1];
        }
      }
      const uint8_t* v_smem = v_unit();
      // O += P V: V rows are k-major, so the B fragments come from ldmatrix.trans.
      if constexpr (Traits::kDirect) {
        // On byte rows, .trans gives lane (g, t) the stored bytes V[2t][2g], V[2t][2g+1],
        // V[2t+1][2g], V[2t+1][2g+1] of a 16-d chunk: bytes 0,2 feed the n8 tile of the even d's,
        // bytes 1,3 the tile of the odd d's (the epilogue undoes this column order).
        const uint8_t* v_rows = v_smem + key_warp * Traits::kKeysPerWarp * Traits::kKvRowBytes;
#pragma unroll
        for (int cc = 0; cc < kD / 16; cc += 2) {
          uint32_t b[4];
          ldmatrix_x4_trans(
              b, smem_u32(v_rows + kv_byte(((lane / 8) % 2) * 8 + lane % 8, cc + lane / 16)));
#pragma unroll
          for (int step = 0; step < 2; ++step) {
            if (cc + step < kD / 16) {
              const uint32_t lo = b[2 * step], hi = b[2 * step + 1];  // keys 0-7, keys 8-15
              uint32_t even[2], odd[2];
              Kv::template widen_word_interleaved<MmaTag>(lo, even[0], odd[0]);
              Kv::template widen_word_interleaved<MmaTag>(hi, even[1], odd[1]);
              mma_m16n8k16<MmaTag>(o[2 * (cc + step)], pa, even);
              mma_m16n8k16<MmaTag>(o[2 * (cc + step) + 1], pa, odd);
            }
          }
        }
      } else {
        const QT* v_rows =
            reinterpret_cast<const QT*>(v_smem) + key_warp * Traits::kKeysPerWarp * kKvRowStride;
#pragma unroll
        for (int dd = 0; dd < kD / 16; ++dd) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, smem_u32(v_rows + (((lane / 8) % 2) * 8 + lane % 8) * kKvRowStride +
                                        dd * 16 + (lane / 16) * 8));
          const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
          mma_m16n8k16<MmaTag>(o[2 * dd], pa, b0);
          mma_m16n8k16<MmaTag>(o[2 * dd + 1], pa, b1);
        }
      }
    }
  }

  // Merge the warps' states through shared memory (the pipeline is drained first). A CTA whose
  // guards failed anywhere keeps nothing of what it read: its state is that of a row without keys
  // (zeros, LSE -inf), and a split marks its LSE as faulted for the merge.
  cp_async_wait<0>();
  const bool row_fault = __syncthreads_or(fault_pos >= 0) != 0;
  if (row_fault) {
#pragma unroll
    for (int n = 0; n < Traits::kAccTiles; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    m_run[0] = m_run[1] = -INFINITY;
    l_run[0] = l_run[1] = 0.0f;
  }
  constexpr int kMergeStride = Traits::kMergeStride;
  float* merge_o = reinterpret_cast<float*>(pipe_smem);            // [warp][kMB][kMergeStride]
  float* merge_m = merge_o + Traits::kWarps * kMB * kMergeStride;  // [warp][kMB]
  float* merge_l = merge_m + Traits::kWarps * kMB;                 // [warp][kMB]
  // Per head, the weight of each key warp's O: exp2(m_w - m) / l * v_scale.
  float4* merge_w = reinterpret_cast<float4*>(merge_l + Traits::kWarps * kMB);  // [kM]
  float2* merge_ml = reinterpret_cast<float2*>(merge_w + kM);  // [kM]: the head's m, l
  static_assert(Traits::kKeyWarps == 4, "one float4 of warp weights a head");
  if constexpr (Traits::kKeysAsRows) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = l_run[h];
#pragma unroll
      for (int offset = 4; offset < 32; offset *= 2) l += __shfl_xor_sync(0xffffffffu, l, offset);
      if (g == 0) {
        merge_m[warp * kMB + 2 * t + h] = m_run[h];
        merge_l[warp * kMB + 2 * t + h] = l;
      }
    }
#pragma unroll
    for (int c = 0; c < Traits::kAccTiles; ++c) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        // Row g of tile c is d = 16c + g (8-bit caches: 16c + 2g), row g + 8 the next 8 (+ 1).
        const int d = Traits::kDirect ? 16 * c + 2 * g + e / 2 : 16 * c + g + 8 * (e / 2);
        merge_o[(warp * kMB + 2 * t + (e & 1)) * kMergeStride + d] = o[c][e];
      }
    }
  } else {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float l = warp_sum_quad(l_run[r]);
      if (t == 0) {
        merge_m[warp * kMB + g + 8 * r] = m_run[r];
        merge_l[warp * kMB + g + 8 * r] = l;
      }
    }
#pragma unroll
    for (int n = 0; n < kD / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = 2 * t + (e & 1);
        // Direct 8-bit PV: tile 2c holds the even d's of chunk c, tile 2c + 1 the odd ones.
        const int d = Traits::kDirect ? (n / 2) * 16 + 2 * col + n % 2 : n * 8 + col;
        merge_o[(warp * kMB + g + 8 * (e / 2)) * kMergeStride + d] = o[n][e];
      }
    }
  }
  __syncthreads();

  // The warps' states combine in two steps: one thread a head computes the weight of each key
  // warp's O and the head's LSE, then every thread sums its (head, d) outputs from them. One warp
  // a scheduler runs this, so it is a chain of latencies: one (head, d) at a time, each with its
  // own max and exponentials, took ~2000 cycles from the first output to the written partials
  // (batch 1 x 32k's per-CTA timeline), on the call's tail. Against that form (H200): bf16 1 x
  // 32k +0.6%, 1 x 8k +2.2%, fp8 1 x 32k +2.1%, MQA 32/1 64 x 4k +6.2%, 64 x 4k +0.2%.
  if (threadIdx.x < kM) {
    const int r = threadIdx.x;
    // Row r belongs to M block r / 16, whose key warps are w0 .. w0 + 3.
    const int w0 = (r / kMB) * Traits::kKeyWarps, rr = r % kMB;
    float m_w[4], m_all = -INFINITY;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      m_w[k] = merge_m[(w0 + k) * kMB + rr];
      m_all = fmaxf(m_all, m_w[k]);
    }
    // A row without keys (m_all = -inf) gets weights exp2(-inf) = 0, so l_all = 0 below.
    const float m_ref = m_all == -INFINITY ? 0.0f : m_all;
    float l_all = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      m_w[k] = exp2f(m_w[k] - m_ref);
      l_all += m_w[k] * merge_l[(w0 + k) * kMB + rr];
    }
    const bool empty = l_all == 0.0f;
    const float scale = empty ? 0.0f : v_scale / l_all;
    merge_w[r] = make_float4(m_w[0] * scale, m_w[1] * scale, m_w[2] * scale, m_w[3] * scale);
    merge_ml[r] = make_float2(m_all, l_all);
  }
  __syncthreads();
  // The 4-CTA and the two-M-block kernels (<= 128 registers) merge without accumulation: its code
  // spilled there.
  const bool accumulate = Traits::kTargetCtasPerSm == 2 && Traits::kM <= 16 && p.num_splits > 1 &&
                          p.merge_accumulate != 0;
  // The heads' LSEs (a log polynomial and a global store each) are written by the last warp after
  // the barrier, beside its items, not by warp 0 on its way to the barrier after the weights.
  if (const int r = static_cast<int>(threadIdx.x) - (Traits::kThreads - 32);
      r >= 0 && r < heads_here) {
    const float2 ml = merge_ml[r];
    const float lse = decode_natural_lse(ml.x, ml.y);
    const int head = first_head + r;
    if (p.num_splits == 1) {
      if (p.lse != nullptr) p.lse[row * p.lse_row_stride + head * p.lse_head_stride] = lse;
    } else if (!accumulate) {
      p.partial_lse[(static_cast<int64_t>(split) * p.num_rows + row) * p.num_q_heads + head] =
          row_fault ? decode_faulted_lse() : lse;
    }
  }
  // A thread's output items are unrolled (decode_store_output). The count is a quarter, half or
  // all of the kernel's most (kM heads), the least that covers the heads this CTA has, so that
  // small groups (MHA: one head of kM = 8) do not compute 8 items for 1.
  const int out_items = heads_here * kD;
  constexpr int kOutItems = (kM * kD + Traits::kThreads - 1) / Traits::kThreads;
  constexpr int kHalfItems = kOutItems / 2 > 0 ? kOutItems / 2 : 1;
  constexpr int kQuarterItems = kOutItems / 4 > 0 ? kOutItems / 4 : 1;
  // The accumulating merge (DecodeParams::merge_accumulate): 2^lse x the normalized output = 2^m x
  // the unnormalized one (x v_scale) goes to the sums in L2 by vector reductions of four
  // consecutive d's (a quarter of the scalar reductions, which queued at L2 when 16 splits of a
  // KV head arrived together). A head without keys adds nothing. Any head whose LSE or any product
  // out of range (or NaN) makes the whole split an outlier that writes its partial instead:
  // products past 2^120 could overflow 128 splits' sums, nonzero ones below 2^-100 lose bits to the
  // reductions' flush of subnormals.
  bool outlier = false;
  if (accumulate) {
    constexpr int kVecs = kM * kD / 4;
    constexpr int kVecItems = (kVecs + Traits::kThreads - 1) / Traits::kThreads;
    const int out_vecs = out_items / 4;
    float4 vec[kVecItems];
    bool in_range = true;
#pragma unroll
    for (int j = 0; j < kVecItems; ++j) {
      const int i = 4 * min(static_cast<int>(threadIdx.x) + j * Traits::kThreads, kVecs - 1);
      const int r = i / kD, d = i % kD;
      const int w0 = (r / kMB) * Traits::kKeyWarps, rr = r % kMB;
      const float4 w = merge_w[r];
      const float* o_w = merge_o + (w0 * kMB + rr) * kMergeStride + d;
      float x[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        x[k] = w.x * o_w[k] + w.y * o_w[kMB * kMergeStride + k] +
               w.z * o_w[2 * kMB * kMergeStride + k] + w.w * o_w[3 * kMB * kMergeStride + k];
      }
      vec[j] = make_float4(x[0], x[1], x[2], x[3]);
      const float2 ml = merge_ml[r];
      const float lse2 = ml.x + __log2f(ml.y);
      const float scale = ml.y == 0.0f ? 0.0f : exp2f(ml.x) * ml.y;
      bool ok = ml.y == 0.0f || (lse2 >= p.accumulate_min_lse2 && lse2 <= p.accumulate_max_lse2);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float magnitude = fabsf(x[k] * scale);
        ok = ok && magnitude <= 0x1p120f && (magnitude >= 0x1p-100f || x[k] == 0.0f);
      }
      if (static_cast<int>(threadIdx.x) + j * Traits::kThreads < out_vecs) in_range &= ok;
    }
    // A faulted split goes through its partial, whose LSE carries the mark.
    outlier = __syncthreads_or(!in_range || row_fault);
    const int64_t first_item = static_cast<int64_t>(row) * p.num_q_heads + first_head;
    float4* dst = reinterpret_cast<float4*>(
        outlier ? p.partial_out +
                      (static_cast<int64_t>(split) * p.num_rows * p.num_q_heads + first_item) * kD
                : p.merge_acc + first_item * kD);
#pragma unroll
    for (int j = 0; j < kVecItems; ++j) {
      const int v = threadIdx.x + j * Traits::kThreads;
      if (v >= out_vecs) continue;
      if (outlier) {
        dst[v] = vec[j];
        continue;
      }
      const float2 ml = merge_ml[(4 * v) / kD];
      if (ml.y == 0.0f) continue;
      const float scale = exp2f(ml.x) * ml.y;
#if __CUDA_ARCH__ >= 900
      red_add_v4_f32(dst + v, vec[j].x * scale, vec[j].y * scale, vec[j].z * scale,
                     vec[j].w * scale);
#else
      // Vector reductions need sm_90; the rule takes this merge there only (tests force it).
      float* sum = reinterpret_cast<float*>(dst + v);
      atomicAdd(sum, vec[j].x * scale);
      atomicAdd(sum + 1, vec[j].y * scale);
      atomicAdd(sum + 2, vec[j].z * scale);
      atomicAdd(sum + 3, vec[j].w * scale);
#endif
    }
  } else if (out_items <= kQuarterItems * Traits::kThreads) {
    decode_store_output<Traits, QT, kQuarterItems>(p, merge_w, merge_o, row, split, first_head,
                                                   out_items);
  } else if (out_items <= kHalfItems * Traits::kThreads) {
    decode_store_output<Traits, QT, kHalfItems>(p, merge_w, merge_o, row, split, first_head,
                                                out_items);
  } else {
    decode_store_output<Traits, QT, kOutItems>(p, merge_w, merge_o, row, split, first_head,
                                               out_items);
  }
  if (accumulate) {
    // Each head's 2^lse joins the denominators, or an outlier's LSEs go where the merge reads them
    // and its bit marks it.
    if (const int r = static_cast<int>(threadIdx.x) - (Traits::kThreads - 32);
        r >= 0 && r < heads_here) {
      const float2 ml = merge_ml[r];
      const int head = first_head + r;
      if (outlier) {
        p.partial_lse[(static_cast<int64_t>(split) * p.num_rows + row) * p.num_q_heads + head] =
            row_fault ? decode_faulted_lse() : decode_natural_lse(ml.x, ml.y);
      } else if (ml.y != 0.0f) {
        atomicAdd(p.merge_den + static_cast<int64_t>(row) * p.num_q_heads + head,
                  exp2f(ml.x) * ml.y);
      }
    }
    if (outlier && threadIdx.x == 0) {
      const int64_t item =
          (static_cast<int64_t>(row) * p.num_kv_heads + kv_head) * p.head_blocks + head_block;
      atomicOr(p.merge_outliers + item * (kDecodeMaxSplits / 32) + split / 32, 1u << (split % 32));
    }
  }
  if (p.num_splits > 1 && p.split_counters != nullptr) {
    // The merge buffers are dead after this barrier: the combine reuses them.
    __syncthreads();
    if (accumulate) {
      decode_combine_accumulated<Traits>(p, row, kv_head, head_block, first_head, heads_here,
                                         reinterpret_cast<float*>(pipe_smem));
    } else {
      decode_combine_in_last_cta<Traits>(p, row, kv_head, head_block, first_head, heads_here,
                                         reinterpret_cast<float*>(pipe_smem));
    }
  }
  // Faults are recorded last by the CTAs of KV head 0 and head block 0 (every item of the row
  // meets the same entries): a bad length by the row's first CTA, a failed key guard by each lane
  // that met one, for the last key it met.
  if (blockIdx.y == 0 && head_block == 0 &&
      (fault_pos >= 0 || (bad_len && threadIdx.x == 0 && split == 0))) {
    record_decode_faults(p, row, bad_len, fault_pos);
  }
}

}  // namespace attnkit::cuda
