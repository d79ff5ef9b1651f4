// The consumer warpgroups of the Hopper context FMHA (prefill_sm90_kernel.cuh): each owns 64 query
// rows of the CTA's 128-row block and runs, per key tile,
//   S = Q K^T   (wgmma, Q and K from shared memory),
//   the mask and logit modifiers of the variant, the online softmax in registers,
//   O += P V    (wgmma, P from registers: the S accumulator's layout is the A operand's).
//
// Two overlaps keep the tensor cores busy (FlashAttention-3's schedule):
// - Within a warpgroup, tile j's S = Q K^T is issued together with tile j-1's O += P V, so the
//   softmax of tile j runs while P V of tile j-1 is still in the tensor cores. P(j) is written into
//   the P registers only after that P V has completed (wgmma reads its register operands
//   asynchronously).
// - Between the two warpgroups (ping-pong): each issues its MMAs only in its turn (named barriers
//   2 and 3), so one warpgroup's MMAs run while the other computes its softmax.
//
// Accumulator layout of an m64nN wgmma (per warp w of the warpgroup, g = lane / 4, t = lane % 4):
// element 4 i + 2 r + e is row 16 w + g + 8 r, column 8 i + 2 t + e.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "cuda/common/fast_math.cuh"
#include "cuda/common/mbarrier_sm90.cuh"
#include "cuda/common/warpgroup_sm90.cuh"
#include "cuda/common/wgmma_sm90.cuh"
#include "cuda/prefill/prefill_scheduler.cuh"
#include "cuda/prefill/prefill_sm90_params.h"
#include "cuda/prefill/prefill_sm90_producer.cuh"
#include "cuda/prefill/prefill_sm90_traits.h"
#include "cuda/prefill/prefill_variant.cuh"

namespace attnkit::cuda::prefill::sm90_detail {

// The running statistics of a thread's two rows, in log2 units of the scaled logits.
struct RowStats {
  float max[2];  // -inf until the row has seen a key
  float sum[2];  // this thread's partial sums (a quad holds a row)
};

// kSkip: the skip-softmax policy (docs/diffusion.md). A warpgroup's 64 query rows x kBlockN keys
// are the skip tile: after S = Q K^T, the warpgroup votes (one bar.red.and) whether every valid
// row's tile maximum is below its running maximum by more than ln(lambda); a skipped tile takes no
// exponentials, no rescale and no P V, and its V stage is released unused.
//
// kFp8 (T::kFp8, kDType fp8 e4m3): S = Q K^T and O += P V run on fp8 wgmma (k32 steps); P is
// rounded to e4m3 as 256 x exp2(logit - max) (the factor 2^8 moves P's range [0, 1] away from
// e4m3's subnormals and cancels in O / l), V comes transposed (Sm90Producer::transpose_v).
//
// kSage (T::kSage, kDType int8 or fp8 e4m3: the Q K^T codes of the quantize pass): S is
// dequantized in registers, each column by its K block's scale (loaded while Q K^T runs) and each
// row by its Q block's scale (folded into the exponent's factor); P is rounded as fp8(448 p), the
// scale docs/diffusion.md fixes; O is multiplied by V's per-channel scales in the epilogue. An int8
// Q K^T accumulates exactly in int32 and is converted to float once.
template <class T, DType kDType, bool kMods, bool kSkip = false>
struct Sm90Consumer {
  using Tag = typename TagOf<kDType>::Type;
  using QkTag = Tag;
  using PvTag = std::conditional_t<T::kFp8, Fp8Tag, Tag>;
  // The S = Q K^T accumulator: int32 for int8 codes.
  using QkAcc = std::conditional_t<T::kInt8Qk, int32_t, float>;
  static constexpr int kMmaK = sm90::kMmaK<QkTag>;
  static constexpr int kSRegs = T::kBlockN / 2;
  static constexpr int kORegs = T::kHeadDim / 2;
  static constexpr int kPSteps = T::kBlockN / sm90::kMmaK<PvTag>;  // k steps of P V
  // log2 of P's scale before its rounding to fp8 (kFp8), 0 for 16-bit P: 2^8 for the FP8
  // kernels, 448 (log2 448 = 8.807...) for SAGE.
  static constexpr float kPLog2Scale = T::kSage ? 8.807354922057604f : T::kFp8 ? 8.f : 0.f;
  // SAGE: the K scales a thread multiplies its S columns by (column 8 i + 2 t + e: ks[2 i + e]).
  static constexpr int kKScales = T::kBlockN / 4;

  const Sm90PrefillParams& sp;
  Sm90Smem<T> smem;
  int wg;    // consumer warpgroup 0 or 1
  int wtid;  // thread in the warpgroup, 0..127

  __device__ static float descale(const Descale& d, int32_t batch, int32_t kv_head) {
    return d.ptr ? d.ptr[batch * d.batch_stride + kv_head * d.head_stride] : 1.f;
  }

  // ---- MMAs -----------------------------------------------------------------------------------
  __device__ void issue_qk(QkAcc (&s)[kSRegs], int stage) const {
    const uint32_t q = smem.q() + wg * 64 * 128;
    const uint32_t k = smem.k(stage);
    fence_operands(s);
    wgmma_fence();
    // A k step spans 32 bytes (16 bf16 / f16 or 32 fp8 head dims): 4 a 128-byte column block.
#pragma unroll
    for (int kk = 0; kk < T::kHeadDim / kMmaK; ++kk) {
      const uint32_t in_block = (kk % 4) * 32;
      const uint64_t da = smem_desc_sw128(q + (kk / 4) * T::kQColBlockBytes + in_block, 16, 1024);
      const uint64_t db = smem_desc_sw128(k + (kk / 4) * T::kKvColBlockBytes + in_block, 16, 1024);
      wgmma_ss<T::kBlockN, QkTag>(s, da, db, kk > 0 ? 1 : 0);
    }
    wgmma_commit();
    fence_operands(s);
  }

  __device__ void issue_pv(float (&o)[kORegs], const uint32_t (&pa)[kPSteps][4], int stage) const {
    const uint32_t v = smem.v(stage);
    fence_operands(o);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kPSteps; ++kk) {
      // 16-bit V: MN-major, 16 keys (2048 bytes) a step. fp8 V^T: K-major, 32 keys (32 bytes of
      // its 128-byte rows) a step.
      const uint64_t db = T::kFp8 ? smem_desc_sw128(v + kk * 32, 16, 1024)
                                  : smem_desc_sw128(v + kk * 16 * 128, T::kKvColBlockBytes, 1024);
      wgmma_rs<T::kHeadDim, PvTag>(o, pa[kk], db, 1);
    }
    wgmma_commit();
    fence_operands(o);
  }

  // Announces a buffer free once this warp's share of the MMAs that read it has completed: one
  // arrival a consumer warp (the "empty" barriers count kConsumerWarps).
  __device__ void release(uint32_t empty_bar) const {
    if (wtid % 32 == 0) mbarrier_arrive(empty_bar);
  }

  // Zeros rows [valid, kBlockN) of the V tile in `stage`, which TMA filled with whatever lies past
  // the sequence (the next sequence's rows, a page's unwritten slots, or nothing at all for boxes
  // past the sequence): P is 0 there, and 0 x NaN would be NaN. Only the partial last key tile
  // (the first one visited) has such rows. Both consumer warpgroups zero the rows before their own
  // P V (the same zeros; neither reads the other's), then fence them for the async proxy. Doing
  // this in the producer instead, as a gather of the whole tile, cost 5 us a work item.
  __device__ void zero_v_tail(int stage, int32_t valid) const {
    const uint32_t v = smem.v(stage);
    constexpr int kChunksPerRow = 8 * T::kColBlocks;
    const int rows = T::kBlockN - valid;
    for (int c = wtid; c < rows * kChunksPerRow; c += 128) {
      const int r = valid + c / kChunksPerRow;
      st_shared_v4(v + swizzled_offset(r, c % kChunksPerRow, T::kKvColBlockBytes),
                   make_uint4(0, 0, 0, 0));
    }
    fence_proxy_async_smem();
    named_barrier_sync(kConsumerBarrier0 + wg, 128);
  }

  // The array S = Q K^T accumulates into: the int32 one for int8 codes, else S itself.
  template <class IntAcc>
  __device__ static auto& qk_accumulator(IntAcc& s_int, float (&s)[kSRegs]) {
    if constexpr (T::kInt8Qk) {
      return s_int;
    } else {
      return s;
    }
  }

  // ---- SAGE scales -----------------------------------------------------------------------------
  // The first scale slot of sequence b in a scale row (sage_quant_params.h scale_slot, minus the
  // token's own block): (s_b >> shift) + b.
  __device__ static int64_t first_slot(int64_t seq_start, int32_t batch, int32_t shift) {
    return (seq_start >> shift) + batch;
  }

  // The K scales of this thread's columns of the tile at key0 (keys past the sequence read the
  // zeroed tail of the scale row, sage_quant_params.h: their logits are masked).
  __device__ void load_k_scales(float (&ks)[kKScales], const float* row, int32_t key0) const {
    const int32_t shift = sp.sage.k_block_shift;
    const int32_t col0 = key0 + 2 * (wtid % 4);
    if (shift == 0) {
#pragma unroll
      for (int i = 0; i < kKScales / 2; ++i) {
        ks[2 * i] = __ldg(row + col0 + 8 * i);
        ks[2 * i + 1] = __ldg(row + col0 + 8 * i + 1);
      }
    } else if (shift == 2) {
      // Columns 2 t and 2 t + 1 share a block of 4 keys.
#pragma unroll
      for (int i = 0; i < kKScales / 2; ++i) {
        ks[2 * i] = ks[2 * i + 1] = __ldg(row + ((col0 + 8 * i) >> shift));
      }
    } else {
      // 16-key blocks: n8 blocks 2 j and 2 j + 1 share one too.
#pragma unroll
      for (int i = 0; i < kKScales / 4; ++i) {
        const float scale = __ldg(row + ((col0 + 16 * i) >> shift));
        ks[4 * i] = ks[4 * i + 1] = ks[4 * i + 2] = ks[4 * i + 3] = scale;
      }
    }
  }

  // S in float from the Q K^T accumulator: times the K scale of each column (SAGE), and with
  // logit modifiers also times the Q scale of each row (qs), whose logits they take dequantized.
  __device__ static void dequantize_s(const QkAcc (&acc)[kSRegs], float (&s)[kSRegs],
                                      const float (&ks)[kKScales], const float (&qs)[2]) {
#pragma unroll
    for (int i = 0; i < T::kBlockN / 8; ++i) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = 4 * i + 2 * r + e;
          const float scale = kMods ? ks[2 * i + e] * qs[r] : ks[2 * i + e];
          s[j] = static_cast<float>(acc[j]) * scale;
        }
      }
    }
  }

  // ---- softmax --------------------------------------------------------------------------------
  // Mask and modifiers on the raw S of the tile at key0, then the online softmax: s becomes
  // exp2(logit - max) (fp32), stats absorb the tile, corr[r] is the factor O must be multiplied
  // by before this tile's P V is added. With kSkip, returns true (with st as it was, corr = 1 and
  // s not exponentiated) when the warpgroup skips the tile; row_valid[r] says whether row r votes.
  // exp_scale[r]: the factor of row r's logits in the exponent (log2 e, times the softmax scale on
  // the plain path, times the Q block's scale on the SAGE path).
  template <bool kMaskTile>
  __device__ bool softmax(float (&s)[kSRegs], RowStats& st, float (&corr)[2], int32_t key0,
                          const int32_t (&pos)[2], const bool (&row_valid)[2], int32_t kv_len,
                          const LogitMods& mods, const float (&exp_scale)[2]) const {
    const int t4 = wtid % 4;
    const PrefillParams& p = sp.base;
#pragma unroll
    for (int i = 0; i < T::kBlockN / 8; ++i) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[4 * i + 2 * r + e];
          const int32_t key = key0 + 8 * i + 2 * t4 + e;
          if constexpr (kMods) x = mods.apply(x, pos[r], key);
          if constexpr (kMaskTile) {
            if (!attends<T::kMasked>(p, pos[r], key, kv_len)) x = -INFINITY;
          }
        }
      }
    }
    float tile_max[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int i = 0; i < T::kBlockN / 8; ++i)
        mx = fmaxf(mx, fmaxf(s[4 * i + 2 * r], s[4 * i + 2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      tile_max[r] = mx * exp_scale[r];
    }
    if constexpr (kSkip) {
      const bool mine = (!row_valid[0] || skips_row(tile_max[0], st.max[0], sp.skip_log2_lambda)) &&
                        (!row_valid[1] || skips_row(tile_max[1], st.max[1], sp.skip_log2_lambda));
      const bool all = named_barrier_all(kConsumerBarrier0 + wg, mine, 128);
      // The same in every thread; the warp vote tells ptxas so (a uniform predicate), without
      // which it serializes the wgmma of the branches that depend on it (C7518).
      if (__all_sync(0xffffffffu, all)) {
        corr[0] = corr[1] = 1.f;
        return true;
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m_new = fmaxf(st.max[r], tile_max[r]);
      // A row without a key so far keeps max -inf; 0 stands in so that exp2 gives 0, not NaN.
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      corr[r] = fast_exp2(st.max[r] - m_use);
      st.max[r] = m_new;
      float sum = 0.f;
      // (0.f - m is not -m for m = 0: spelled apart so that the 16-bit kernels keep -m_use.)
      const float offset = T::kFp8 ? kPLog2Scale - m_use : -m_use;
#pragma unroll
      for (int i = 0; i < T::kBlockN / 8; ++i) {
        s[4 * i + 2 * r] = fast_exp2(fmaf(s[4 * i + 2 * r], exp_scale[r], offset));
        s[4 * i + 2 * r + 1] = fast_exp2(fmaf(s[4 * i + 2 * r + 1], exp_scale[r], offset));
        sum += s[4 * i + 2 * r] + s[4 * i + 2 * r + 1];
      }
      st.sum[r] = st.sum[r] * corr[r] + sum;
    }
    return false;
  }

  __device__ static void rescale(float (&o)[kORegs], const float (&corr)[2]) {
#pragma unroll
    for (int i = 0; i < T::kHeadDim / 8; ++i) {
      o[4 * i] *= corr[0];
      o[4 * i + 1] *= corr[0];
      o[4 * i + 2] *= corr[1];
      o[4 * i + 3] *= corr[1];
    }
  }

  // P in the A-operand layout of the k steps of P V, rounded to the q dtype. fp8: a k32 step's
  // register holds the accumulator's values of 2 n8 blocks of one row as they lie
  // (fp8_layout::p_source; the V^T columns are permuted to match, fp8_layout::vt_key).
  __device__ static void to_p(const float (&s)[kSRegs], uint32_t (&pa)[kPSteps][4]) {
#pragma unroll
    for (int kk = 0; kk < kPSteps; ++kk) {
      if constexpr (T::kFp8) {
        using fp8_layout::p_source;
        const float* x = s + 16 * kk;
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          pa[kk][r] = pack_fp8x4(x[p_source(r, 0)], x[p_source(r, 1)], x[p_source(r, 2)],
                                 x[p_source(r, 3)]);
        }
      } else {
        pa[kk][0] = pack_pair<Tag>(s[8 * kk], s[8 * kk + 1]);
        pa[kk][1] = pack_pair<Tag>(s[8 * kk + 2], s[8 * kk + 3]);
        pa[kk][2] = pack_pair<Tag>(s[8 * kk + 4], s[8 * kk + 5]);
        pa[kk][3] = pack_pair<Tag>(s[8 * kk + 6], s[8 * kk + 7]);
      }
    }
  }

  // The warpgroups take turns in a ring: w waits at its barrier, which w - 1 arrives at when its
  // turn ends (256 threads: the waiting warpgroup and the arriving one).
  __device__ void turn_begin() const { named_barrier_sync(kPingPongBarrier0 + wg, 256); }
  __device__ void turn_end() const {
    const int next = wg + 1 == T::kConsumerWarpgroups ? 0 : wg + 1;
    named_barrier_arrive(kPingPongBarrier0 + next, 256);
  }

  // ---- epilogue -------------------------------------------------------------------------------
  // O / l (times the cache's V scale) to out, the LSE (natural log) to lse; rows past the sequence
  // are not written. A row without any key writes zeros and -inf. Row r of the block is query
  // token r >> q_pack_log2 of head q_head0 + (r & (group - 1)) (PrefillParams::q_pack_log2).
  // OutTag: the output's element (the q dtype; bf16 or f16 for the FP8 and SAGE kernels). SAGE:
  // channel c is multiplied by V's scale of (sequence, KV head, c).
  template <class OutTag>
  __device__ void store(const float (&o)[kORegs], const RowStats& st, const SequenceInfo& seq,
                        int32_t m0, int32_t q_head0, float v_scale, int32_t batch) const {
    using Elem = uint16_t;
    const PrefillParams& p = sp.base;
    const int warp = wtid / 32, lane = wtid % 32;
    const int g = lane / 4, t4 = lane % 4;
    const float* channel_scale = nullptr;
    if constexpr (T::kSage) {
      channel_scale =
          sp.sage.v_scale +
          (static_cast<int64_t>(batch) * p.num_kv_heads + q_head0 / p.group_size) * T::kHeadDim +
          2 * t4;
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float sum = st.sum[r];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const int32_t row = m0 + wg * 64 + warp * 16 + g + 8 * r;
      const int32_t token = row >> p.q_pack_log2;
      const int32_t head = q_head0 + (row & ((1 << p.q_pack_log2) - 1));
      if (token >= seq.q_len) continue;
      const float inv = sum > 0.f ? v_scale / sum : 0.f;
      Elem* out = static_cast<Elem*>(p.out) + seq.o_offset + token * p.o_tok_stride +
                  static_cast<int64_t>(head) * p.o_head_stride;
#pragma unroll
      for (int i = 0; i < T::kHeadDim / 8; ++i) {
        float scale0 = inv, scale1 = inv;
        if constexpr (T::kSage) {
          const float2 c = __ldg(reinterpret_cast<const float2*>(channel_scale + 8 * i));
          scale0 *= c.x;
          scale1 *= c.y;
        }
        *reinterpret_cast<uint32_t*>(out + 8 * i + 2 * t4) =
            pack_pair<OutTag>(o[4 * i + 2 * r] * scale0, o[4 * i + 2 * r + 1] * scale1);
      }
      if (p.lse != nullptr && t4 == 0) {
        p.lse[seq.lse_offset + token * p.lse_tok_stride +
              static_cast<int64_t>(head) * p.lse_head_stride] =
            sum > 0.f ? (st.max[r] + __log2f(sum) - kPLog2Scale) * kLn2 : -INFINITY;
      }
    }
  }

  __device__ void store(const float (&o)[kORegs], const RowStats& st, const SequenceInfo& seq,
                        int32_t m0, int32_t q_head0, float v_scale, int32_t batch) const {
    if constexpr (T::kFp8) {
      if (sp.base.out_f16) {
        store<F16Tag>(o, st, seq, m0, q_head0, v_scale, batch);
      } else {
        store<Bf16Tag>(o, st, seq, m0, q_head0, v_scale, batch);
      }
    } else {
      store<Tag>(o, st, seq, m0, q_head0, v_scale, batch);
    }
  }

  // ---- the work loop --------------------------------------------------------------------------
  __device__ void run() const {
    const PrefillParams& p = sp.base;
    const int warp = wtid / 32, lane = wtid % 32;
    const PersistentScheduler sched = PersistentScheduler::make(p);
    PipelineState<T::kStages> k_read, v_read;
    uint32_t q_iter = 0;
    // Skip-softmax statistics of this warpgroup: key tiles visited and skipped.
    unsigned long long tiles_visited = 0, tiles_skipped = 0;
    // Warpgroup 0 takes the first turn.
    if (wg == T::kConsumerWarpgroups - 1) named_barrier_arrive(kPingPongBarrier0, 256);

    for (int64_t w = sched.first(); sched.valid(w); w = sched.next(w)) {
      const PrefillWorkTile work = sched.tile(p, w);
      // A faulting sequence comes back without rows or without keys (the producer records it).
      const SequenceInfo seq = sequence_info(p, work.batch, p.paged);
      // m0: the block's first row; t0 its first query token (GQA packing: a row is a (token,
      // head) pair, PrefillParams::q_pack_log2).
      const int pack = p.q_pack_log2;
      const int32_t m0 = work.m_block * T::kBlockM;
      const int32_t t0 = m0 >> pack;
      if (t0 >= seq.q_len) continue;
      const int32_t tokens_valid = min(T::kBlockM >> pack, seq.q_len - t0);
      const int32_t q_pos0 = seq.kv_len - seq.q_len;  // bottom-right aligned
      const int32_t p_lo = q_pos0 + t0;
      const int32_t p_hi = p_lo + tokens_valid - 1;
      const KeyBlockRange range =
          key_block_range<T::kBlockN, T::kMasked>(p, seq.kv_len, p_lo, p_hi);
      const int32_t num_tiles = range.count();
      const int32_t q_head0 = work.head << pack;  // the item's first query head
      const int32_t kv_head = q_head0 / p.group_size;
      float k_scale, v_scale;
      if constexpr (T::kSage) {
        k_scale = v_scale = 1.f;  // per block and channel (sp.sage)
      } else if constexpr (T::kFp8) {
        k_scale =
            descale(p.q_descale, work.batch, kv_head) * descale(p.k_descale, work.batch, kv_head);
        v_scale = descale(p.v_descale, work.batch, kv_head);
      } else {
        k_scale = p.k_scale ? p.k_scale[p.k_scale_per_head ? kv_head : 0] : 1.f;
        v_scale = p.v_scale ? p.v_scale[p.v_scale_per_head ? kv_head : 0] : 1.f;
      }
      // A packed call has no ALiBi (one slope a head; run_prefill packs only without it).
      const LogitMods mods = LogitMods::make(p, p.softmax_scale * k_scale, q_head0);
      // The plain path folds the scale into the exponent's FFMA; modified logits are in natural
      // units already.
      const float exp_scale = kMods ? kLog2e : mods.logit_scale * kLog2e;
      const int32_t row0 = m0 + wg * 64 + warp * 16 + lane / 4;
      const int32_t tok[2] = {row0 >> pack, (row0 + 8) >> pack};
      const int32_t pos[2] = {q_pos0 + tok[0], q_pos0 + tok[1]};
      const bool row_valid[2] = {tok[0] < seq.q_len, tok[1] < seq.q_len};
      // SAGE: the Q scales of the thread's rows (rows past the sequence read the scale row's
      // zeroed tail) and the start of the K scales of the sequence's KV head.
      float qs[2] = {1.f, 1.f};
      const float* k_scale_row = nullptr;
      if constexpr (T::kSage) {
        const Sm90SageParams& sg = sp.sage;
        const int64_t q_first =
            first_slot(p.cu_seqlens_q ? seq.q_start : int64_t{work.batch} * p.seqlen_q, work.batch,
                       sg.q_block_shift);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int32_t head = q_head0 + ((row0 + 8 * r) & ((1 << pack) - 1));
          qs[r] =
              __ldg(sg.q_scale + head * sg.q_scale_stride + q_first + (tok[r] >> sg.q_block_shift));
        }
        k_scale_row = sg.k_scale + kv_head * sg.k_scale_stride +
                      first_slot(p.cu_seqlens_kv ? seq.k_start : int64_t{work.batch} * p.seqlen_kv,
                                 work.batch, sg.k_block_shift);
      }
      // The exponent's factor of each row: the Q scale folds in unless the modifiers take the
      // logits dequantized (dequantize_s).
      const float row_exp_scale[2] = {kMods || !T::kSage ? exp_scale : exp_scale * qs[0],
                                      kMods || !T::kSage ? exp_scale : exp_scale * qs[1]};
      // A warpgroup whose rows all lie past the sequence still runs the loop (its turns pair with
      // the other's) but counts no tiles.
      const bool counts_tiles = ((m0 + wg * 64) >> pack) < seq.q_len;
      if (kSkip && counts_tiles) tiles_visited += num_tiles;

      float o[kORegs];
#pragma unroll
      for (int i = 0; i < kORegs; ++i) o[i] = 0.f;
      RowStats st;
      st.max[0] = st.max[1] = -INFINITY;
      st.sum[0] = st.sum[1] = 0.f;
      if (num_tiles == 0) {
        store(o, st, seq, m0, q_head0, v_scale, work.batch);
        continue;
      }

      float s[kSRegs];
      // The Q K^T accumulator: s itself, except for int8 codes (an int32 accumulator).
      int32_t s_int[T::kInt8Qk ? kSRegs : 1];
      auto& acc = qk_accumulator(s_int, s);
      float ks[kKScales];  // SAGE: the K scales of the tile's columns
      uint32_t pa[kPSteps][4];
      float corr[2];
      // Nonzero once a K tile of this work item was marked faulted by the producer (a block-table
      // entry outside the pool): the work item's rows are then written as zeros, LSE -inf. Read
      // after the tile's k_full wait, before its k_empty release (the next fill rewrites it).
      uint32_t faulted = 0;
      mbarrier_wait(smem.q_full(), q_iter & 1u);
      // The first key tile is the sequence's last: its V rows past the sequence are zeroed before
      // its P V (gathered tiles come zero-filled).
      const int32_t first_valid = min(T::kBlockN, seq.kv_len - range.block(0) * T::kBlockN);
      // (The FP8 kernels' transpose writes those rows as zeros.)
      const bool zero_first =
          !T::kFp8 && first_valid < T::kBlockN && sp.kv_mode != Sm90KvMode::kGather;

      // Tile 0: S alone. Its rows have seen no key yet, so skip-softmax never skips it.
      {
        const int32_t key0 = range.block(0) * T::kBlockN;
        mbarrier_wait(smem.k_full(k_read.index), k_read.phase);
        faulted |= ld_shared_u32(smem.kv_fault(k_read.index));
        turn_begin();
        issue_qk(acc, k_read.index);
        turn_end();
        if constexpr (T::kSage) load_k_scales(ks, k_scale_row, key0);
        wgmma_wait<0>();
        fence_operands(acc);
        release(smem.k_empty(k_read.index));
        k_read.advance();
        if (num_tiles == 1) release(smem.q_empty());
        if constexpr (T::kSage) dequantize_s(acc, s, ks, qs);
        if (tile_needs_mask<T::kMasked>(p, key0, T::kBlockN, seq.kv_len, p_lo, p_hi)) {
          softmax<true>(s, st, corr, key0, pos, row_valid, seq.kv_len, mods, row_exp_scale);
        } else {
          softmax<false>(s, st, corr, key0, pos, row_valid, seq.kv_len, mods, row_exp_scale);
        }
        to_p(s, pa);
      }
      // Tiles 1..n-1: S(j) and P(j-1) V(j-1) in flight together, the softmax of S(j) under P V.
      // After a skipped tile there is no P V to issue: S(j) runs alone. The two versions of a
      // tile's step are straight-line code, each ending with nothing in flight, and the choice
      // between them is made where nothing is in flight; a wgmma issued or awaited on one path
      // of a branch inside the step would make ptxas serialize every wgmma (C7518).
      // Returns whether the warpgroup skipped tile `it`.
      const auto key_tile = [&](auto with_pv, int32_t it) -> bool {
        constexpr bool kWithPv = decltype(with_pv)::value;
        const int32_t key0 = range.block(it) * T::kBlockN;
        if (it == 1 && zero_first) {
          mbarrier_wait(smem.v_full(v_read.index), v_read.phase);
          zero_v_tail(v_read.index, first_valid);
        }
        mbarrier_wait(smem.k_full(k_read.index), k_read.phase);
        faulted |= ld_shared_u32(smem.kv_fault(k_read.index));
        turn_begin();
        issue_qk(acc, k_read.index);
        // The previous tile's V stage: consumed by its P V, or (skipped tile) released unused,
        // but only once full (its TMA must have landed before the stage is refilled).
        mbarrier_wait(smem.v_full(v_read.index), v_read.phase);
        if constexpr (kWithPv) issue_pv(o, pa, v_read.index);
        turn_end();
        if constexpr (T::kSage) load_k_scales(ks, k_scale_row, key0);
        wgmma_wait<kWithPv ? 1 : 0>();  // S(j) done; P V may still be in flight
        fence_operands(acc);
        release(smem.k_empty(k_read.index));
        k_read.advance();
        if (it == num_tiles - 1) release(smem.q_empty());
        if constexpr (T::kSage) dequantize_s(acc, s, ks, qs);
        float corr_next[2];
        bool skip;
        if (tile_needs_mask<T::kMasked>(p, key0, T::kBlockN, seq.kv_len, p_lo, p_hi)) {
          skip = softmax<true>(s, st, corr_next, key0, pos, row_valid, seq.kv_len, mods,
                               row_exp_scale);
        } else {
          skip = softmax<false>(s, st, corr_next, key0, pos, row_valid, seq.kv_len, mods,
                                row_exp_scale);
        }
        if constexpr (kWithPv) {
          wgmma_wait<0>();  // P(j-1) V(j-1) done: O and the P registers are free
          fence_operands(o);
        }
        release(smem.v_empty(v_read.index));
        v_read.advance();
        // Also after a skipped tile (corr_next = 1; its P is never used): registers that a later
        // wgmma reads are written on every path. The 8-bit kernels skip the multiply when no row
        // of the warp has a new maximum (corr = 1 exactly), the common case after a row's first
        // tiles; their softmax, not their MMAs, bounds them.
        if constexpr (T::kFp8) {
          if (__any_sync(0xffffffffu, corr_next[0] != 1.f || corr_next[1] != 1.f)) {
            rescale(o, corr_next);
          }
        } else {
          rescale(o, corr_next);
        }
        to_p(s, pa);
        return skip;
      };
      // pending: the previous tile's P waits for its P V (always, without kSkip).
      bool pending = true;
      for (int32_t it = 1; it < num_tiles; ++it) {
        if constexpr (kSkip) {
          const bool skip =
              pending ? key_tile(std::true_type{}, it) : key_tile(std::false_type{}, it);
          pending = !skip;
          tiles_skipped += skip && counts_tiles;
        } else {
          key_tile(std::true_type{}, it);
        }
      }
      // The last P V (none when the last tile was skipped). The turn is taken either way: both
      // warpgroups take the same number of turns.
      mbarrier_wait(smem.v_full(v_read.index), v_read.phase);
      if (num_tiles == 1 && zero_first) zero_v_tail(v_read.index, first_valid);
      if (pending) {
        turn_begin();
        issue_pv(o, pa, v_read.index);
        turn_end();
        wgmma_wait<0>();
        fence_operands(o);
      } else {
        turn_begin();
        turn_end();
      }
      release(smem.v_empty(v_read.index));
      v_read.advance();
      ++q_iter;
      if (faulted != 0) {
#pragma unroll
        for (int i = 0; i < kORegs; ++i) o[i] = 0.f;
        st.sum[0] = st.sum[1] = 0.f;
      }
      store(o, st, seq, m0, q_head0, v_scale, work.batch);
    }
    if (kSkip && wtid == 0 && sp.skip_counts != nullptr) {
      atomicAdd(sp.skip_counts, tiles_visited);
      atomicAdd(sp.skip_counts + 1, tiles_skipped);
    }
    // The last warpgroup's last turn_end left an arrival at warpgroup 0's barrier: take it, so
    // that no named barrier is pending when the CTA exits.
    if (wg == 0) named_barrier_sync(kPingPongBarrier0, 256);
  }
};

}  // namespace attnkit::cuda::prefill::sm90_detail
