// The producer warpgroup of the Hopper context FMHA (prefill_sm90_kernel.cuh): fills the Q buffer
// and the K / V rings for every work item of its CTA, in the order the consumers read them.
//
// TMA tiles (kTmaTensor, kTmaPaged) are issued by warp 0: lane 0 announces the tile's bytes on
// the stage's "full" barrier, then each lane issues the boxes of its page run (one box per column
// block of 64 head dims). Gathered tiles (kGather, and every partial last V tile) are loaded and
// stored by all 128 threads, which then fence their stores for the async proxy and meet at a named
// barrier before thread 0 arrives on the "full" barrier.
//
// Block-table entries are compared with the pool ([0, num_blocks)) where they are read, before any
// address or TMA coordinate is formed from them (docs/safety.md, prefill). A bad entry's rows are
// not loaded: a TMA box of it is not issued (the stage's "full" barrier expects only the bytes of
// the boxes issued, so the pipeline's protocol is unchanged), a gathered row of it is zeros. The
// producer then marks the K stage faulted (Sm90Smem::kv_fault, written before the arrival on
// k_full that publishes it); the consumers OR the marks of the tiles of a work item and write its
// rows as zeros with LSE -inf. Producer thread 0 records the first bad entry of a work item once
// its tiles are issued (head 0 only, record_work_faults); the V tile reads the same entries and
// skips the same rows. (The paged tensor maps span exactly the pool's blocks, so a box at a block
// coordinate outside it would read zeros, not memory past the pool: PTX ISA, tensor "Out of
// Boundary Access", zero fill mode; the guard does not rely on it.)
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/kv_widen.cuh"
#include "cuda/common/mbarrier_sm90.cuh"
#include "cuda/common/tma_sm90.cuh"
#include "cuda/common/warpgroup_sm90.cuh"
#include "cuda/prefill/prefill_scheduler.cuh"
#include "cuda/prefill/prefill_sm90_fp8_layout.h"
#include "cuda/prefill/prefill_sm90_params.h"
#include "cuda/prefill/prefill_sm90_traits.h"
#include "cuda/prefill/prefill_variant.cuh"
#include "cuda/sage/sage_quant_params.h"

namespace attnkit::cuda::prefill::sm90_detail {

using namespace attnkit::cuda::sm90;

// Named barriers of the kernel (0 is __syncthreads).
constexpr int kProducerBarrier = 1;   // the producer warpgroup, after a gathered tile
constexpr int kPingPongBarrier0 = 2;  // consumer warpgroup w's turn to issue MMAs: 2 + w
constexpr int kConsumerBarrier0 = 5;  // consumer warpgroup w alone: 5 + w (at most 3 consumers)

// Shared-memory addresses of one CTA.
template <class T>
struct Sm90Smem {
  uint32_t base;  // 1024-byte aligned
  __device__ uint32_t q() const { return base + T::kQOffset; }
  __device__ uint32_t k(int stage) const { return base + T::kKOffset + stage * T::kKvTileBytes; }
  __device__ uint32_t v(int stage) const { return base + T::kVOffset + stage * T::kKvTileBytes; }
  __device__ uint32_t bar(int i) const { return base + T::kBarrierOffset + 8 * i; }
  __device__ uint32_t q_full() const { return bar(0); }
  __device__ uint32_t q_empty() const { return bar(1); }
  __device__ uint32_t k_full(int s) const { return bar(2 + s); }
  __device__ uint32_t k_empty(int s) const { return bar(2 + T::kStages + s); }
  __device__ uint32_t v_full(int s) const { return bar(2 + 2 * T::kStages + s); }
  __device__ uint32_t v_empty(int s) const { return bar(2 + 3 * T::kStages + s); }
  __device__ uint32_t kv_fault(int s) const { return base + T::kFaultOffset + 4 * s; }
  // kFp8: the V staging ring (TMA destination) and its barriers; v() holds the transposed tiles.
  __device__ uint32_t v_stage(int s) const { return base + T::kVStageOffset + s * T::kKvTileBytes; }
  __device__ uint32_t vs_full(int s) const { return bar(2 + 4 * T::kStages + s); }
  __device__ uint32_t vs_empty(int s) const { return bar(2 + 5 * T::kStages + s); }
};

// Byte offset of 16-byte chunk `chunk` (of 16-bit elements) of row `row` in a swizzled tile whose
// column blocks are `col_block_bytes` apart.
__device__ __forceinline__ uint32_t swizzled_offset(int row, int chunk, int col_block_bytes) {
  return (chunk >> 3) * col_block_bytes + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
}

__device__ __forceinline__ void st_shared_v4(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t ld_shared_u32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

// The FP8 kernels' V transpose. fp8 wgmma reads B K-major only, so P V needs V^T: [head_dim rows
// x kBlockN keys] in 128-byte swizzled rows, from the staged [kBlockN keys x head_dim] tile, with
// the keys of each 32-key step permuted so that P needs no shuffle (fp8_layout::vt_key: the
// V-column permutation of FlashAttention-3). Keys at or past `valid` are written as zeros (P is 0
// there, but 0 x NaN = NaN).
//
// All 128 producer threads take part. Step (n, m) of lane 4a + b of warp w (n = w, w + 4, ...)
// moves 4 x 4 bytes: head dims fp8_layout::transpose_d0 of the 4 keys of V^T column quad
// fp8_layout::transpose_quad; the 32 lanes of a step read and write 32 different banks (the quad's
// chunk moves with a, against the swizzle's XOR with the row;
// tests/cpu/prefill_fp8_layout_test.cc).
template <class T>
__device__ __forceinline__ void transpose_v_tile(uint32_t src, uint32_t dst, int32_t valid,
                                                 int ptid) {
  static_assert(T::kBlockN == fp8_layout::kVtKeys, "V^T rows are 128 keys");
  const int warp = ptid / 32, lane = ptid % 32;
#pragma unroll
  for (int n = warp; n < T::kHeadDim / 32; n += 4) {
    const int d0 = fp8_layout::transpose_d0(lane, n);
#pragma unroll 2
    for (int m = 0; m < 8; ++m) {
      const int q = fp8_layout::transpose_quad(lane, m);
      uint32_t w[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int key = fp8_layout::quad_key(q, j);
        w[j] = key < valid
                   ? ld_shared_u32(src + fp8_layout::staged_offset(key, d0, T::kKvColBlockBytes))
                   : 0u;
      }
      // 4 x 4 byte transpose, out[i] = byte i of w[0..3] (__byte_perm: nibble k of the selector
      // picks result byte k from {b, a}, a = bytes 0-3).
      const uint32_t t0 = __byte_perm(w[0], w[1], 0x5140), t1 = __byte_perm(w[2], w[3], 0x5140);
      const uint32_t t2 = __byte_perm(w[0], w[1], 0x7362), t3 = __byte_perm(w[2], w[3], 0x7362);
      const uint32_t out[4] = {__byte_perm(t0, t1, 0x5410), __byte_perm(t0, t1, 0x7632),
                               __byte_perm(t2, t3, 0x5410), __byte_perm(t2, t3, 0x7632)};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        st_shared_u32(dst + fp8_layout::vt_offset(d0 + i, 4 * q), out[i]);
      }
    }
  }
}

// bar.sync of named barrier kId that also returns whether `pred` held in any of its threads.
template <int kId>
__device__ __forceinline__ bool named_barrier_sync_or(int threads, bool pred) {
  uint32_t any;
  asm volatile(
      "{\n.reg .pred p, q;\n"
      "setp.ne.u32 p, %1, 0;\n"
      "bar.red.or.pred q, %2, %3, p;\n"
      "selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(any)
      : "r"(static_cast<uint32_t>(pred)), "n"(kId), "r"(threads)
      : "memory");
  return any != 0;
}

// The start of the K (or V) row of key `key` of this work item, or null where no row exists (a
// table entry outside the pool). Row strides and layouts as PrefillParams / KvLayout say.
struct KvRows {
  const uint8_t* k_tensor;  // packed / dense: K of (sequence, kv head), key 0; paged: the KV
  const uint8_t* v_tensor;  // head's row at slot 0 of block 0 (k_base + kv_head x head stride)
  int64_t k_tok_bytes, v_tok_bytes;  // paged: the cache's token stride (KvLayout)
  int32_t batch;

  __device__ const uint8_t* row(const Sm90PrefillParams& sp, bool is_v, int32_t key) const {
    const PrefillParams& p = sp.base;
    if (!p.paged) {
      return is_v ? v_tensor + key * v_tok_bytes : k_tensor + key * k_tok_bytes;
    }
    const int64_t slot = p.kv.slot_of(key);
    int64_t block = batch, token = slot;
    if (p.kv.block_table != nullptr) {
      block = p.kv.block_table[batch * p.kv.block_table_row_stride + (slot >> p.kv_page_shift)];
      token = slot & ((int64_t{1} << p.kv_page_shift) - 1);
      if (static_cast<uint64_t>(block) >= static_cast<uint64_t>(p.kv.num_blocks)) return nullptr;
    }
    return (is_v ? v_tensor : k_tensor) + block * p.kv.block_stride_bytes + token * k_tok_bytes;
  }
};

// Loads rows [0, valid) of the K (or V) tile at key0 into the swizzled stage at `dst`, zeros in
// rows [valid, kBlockN) and in the rows of bad table entries; 16-bit rows, or 8-bit rows widened to
// the q dtype. All 128 producer threads take part (ptid = 0..127). Returns whether this thread met
// a bad entry.
template <class T, DType kDType>
__device__ __forceinline__ bool gather_tile(const Sm90PrefillParams& sp, const KvRows& rows,
                                            bool is_v, int32_t key0, int32_t valid, uint32_t dst,
                                            int ptid) {
  bool bad = false;
  // Source chunks of 16 bytes a row: 16-bit rows hold 8 elements a chunk, 8-bit rows 16.
  if (!sp.kv_8bit) {
    constexpr int kChunks = T::kHeadDim / 8;
    constexpr int kRowsPerPass = 128 / kChunks;
    const int chunk = ptid % kChunks;
#pragma unroll 4
    for (int r = ptid / kChunks; r < T::kBlockN; r += kRowsPerPass) {
      uint4 v = make_uint4(0, 0, 0, 0);
      const uint8_t* src = r < valid ? rows.row(sp, is_v, key0 + r) : nullptr;
      bad = bad || (r < valid && src == nullptr);
      if (src != nullptr) v = __ldg(reinterpret_cast<const uint4*>(src) + chunk);
      st_shared_v4(dst + swizzled_offset(r, chunk, T::kKvColBlockBytes), v);
    }
  } else {
    constexpr int kChunks = T::kHeadDim / 16;
    constexpr int kRowsPerPass = 128 / kChunks;
    const int chunk = ptid % kChunks;
    const bool is_int8 = sp.base.kv_is_int8;
#pragma unroll 2
    for (int r = ptid / kChunks; r < T::kBlockN; r += kRowsPerPass) {
      uint4 raw = make_uint4(0, 0, 0, 0);
      const uint8_t* src = r < valid ? rows.row(sp, is_v, key0 + r) : nullptr;
      bad = bad || (r < valid && src == nullptr);
      if (src != nullptr) raw = __ldg(reinterpret_cast<const uint4*>(src) + chunk);
      uint4 lo, hi;
      if (is_int8) {
        const uint2 a = widen_int8x4<kDType>(raw.x), b = widen_int8x4<kDType>(raw.y);
        const uint2 c = widen_int8x4<kDType>(raw.z), d = widen_int8x4<kDType>(raw.w);
        lo = make_uint4(a.x, a.y, b.x, b.y);
        hi = make_uint4(c.x, c.y, d.x, d.y);
      } else {
        lo = make_uint4(widen_fp8x2<kDType>(raw.x & 0xffffu), widen_fp8x2<kDType>(raw.x >> 16),
                        widen_fp8x2<kDType>(raw.y & 0xffffu), widen_fp8x2<kDType>(raw.y >> 16));
        hi = make_uint4(widen_fp8x2<kDType>(raw.z & 0xffffu), widen_fp8x2<kDType>(raw.z >> 16),
                        widen_fp8x2<kDType>(raw.w & 0xffffu), widen_fp8x2<kDType>(raw.w >> 16));
      }
      st_shared_v4(dst + swizzled_offset(r, 2 * chunk, T::kKvColBlockBytes), lo);
      st_shared_v4(dst + swizzled_offset(r, 2 * chunk + 1, T::kKvColBlockBytes), hi);
    }
  }
  return bad;
}

template <class T, DType kDType>
struct Sm90Producer {
  const Sm90PrefillParams& sp;
  Sm90Smem<T> smem;
  int ptid;  // 0..127

  // Issues the K (or V) tile at key0 into `dst`, completing on `full`. The caller (warp 0) has
  // waited for the stage to be empty. fault_word: the K stage's fault mark, written by lane 0
  // before its arrival on `full` (the K tile only). Returns (warp-uniform) whether a box of the
  // tile had a bad table entry.
  __device__ bool tma_tile(const CUtensorMap* map, bool is_v, const SequenceInfo& seq,
                           const PrefillWorkTile& work, int32_t kv_head, int32_t key0, uint32_t dst,
                           uint32_t full, uint32_t fault_word) const {
    const PrefillParams& p = sp.base;
    const int lane = ptid & 31;
    if (sp.kv_mode == Sm90KvMode::kTmaTensor) {
      if (lane == 0) {
        mbarrier_arrive_expect_tx(full, T::kKvTileBytes);
        const int32_t tok = seq.k_start + key0;
        const int32_t batch = p.cu_seqlens_kv ? 0 : work.batch;
#pragma unroll
        for (int c = 0; c < T::kColBlocks; ++c) {
          tma_load_4d(dst + c * T::kKvColBlockBytes, map, full, c * T::kColElems, kv_head, tok,
                      batch);
        }
      }
      return false;
    }
    // kTmaPaged: boxes of page_box_rows rows, one a lane (run_sm90: at most 32 a tile); a box that
    // starts past the sequence is not loaded (its rows are masked in S; the consumers zero the
    // partial tile's V rows). Each lane reads and checks its box's table entry first, then lane 0
    // announces the bytes of the good boxes only.
    const int32_t box_rows = sp.page_box_rows;
    const int32_t boxes = T::kBlockN / box_rows;
    const int32_t live = min(boxes, (seq.kv_len - key0 + box_rows - 1) / box_rows);
    const int32_t key = key0 + lane * box_rows;
    int32_t block = work.batch, token = key;
    bool good = lane < live;
    if (good && p.kv.block_table != nullptr) {
      block = p.kv.block_table[work.batch * p.kv.block_table_row_stride + (key >> p.kv_page_shift)];
      token = key & ((1 << p.kv_page_shift) - 1);
      good = static_cast<uint32_t>(block) < static_cast<uint32_t>(p.kv.num_blocks);
    }
    const uint32_t good_boxes = __ballot_sync(0xffffffffu, good);
    const bool any_bad = __popc(good_boxes) != live;
    if (lane == 0) {
      if (!is_v) st_shared_u32(fault_word, any_bad);
      mbarrier_arrive_expect_tx(
          full, static_cast<uint32_t>(__popc(good_boxes) * box_rows * 128 * T::kColBlocks));
    }
    __syncwarp();
    if (good) {
#pragma unroll
      for (int c = 0; c < T::kColBlocks; ++c) {
        tma_load_4d(dst + c * T::kKvColBlockBytes + lane * box_rows * 128, map, full,
                    c * T::kColElems, token, kv_head, block);
      }
    }
    return any_bad;
  }

  // kFp8: transposes key tile `it` of the work item from the staging ring into the V ring (all
  // 128 threads; each arrives on v_full and vs_empty, which count 128).
  __device__ void transpose_v(const KeyBlockRange& range, const SequenceInfo& seq, int32_t it,
                              PipelineState<T::kStages>& t) const {
    const int32_t key0 = range.block(it) * T::kBlockN;
    const int32_t valid = min(T::kBlockN, seq.kv_len - key0);
    mbarrier_wait(smem.vs_full(t.index), t.phase);
    mbarrier_wait(smem.v_empty(t.index), t.phase ^ 1u);
    transpose_v_tile<T>(smem.v_stage(t.index), smem.v(t.index), valid, ptid);
    fence_proxy_async_smem();
    mbarrier_arrive(smem.v_full(t.index));
    mbarrier_arrive(smem.vs_empty(t.index));
    t.advance();
  }

  __device__ void run() const {
    const PrefillParams& p = sp.base;
    const bool lead = ptid == 0;
    const bool tma_warp = ptid < 32;
    if (lead) {
      tma_prefetch_map(&sp.tma_q);
      if (sp.kv_mode != Sm90KvMode::kGather) {
        tma_prefetch_map(&sp.tma_k);
        tma_prefetch_map(&sp.tma_v);
      }
    }
    const PersistentScheduler sched = PersistentScheduler::make(p);
    PipelineState<T::kStages> stage;
    PipelineState<T::kStages> transposed;  // kFp8: the V tiles transposed, one behind `stage`
    uint32_t q_iter = 0;
    for (int64_t w = sched.first(); sched.valid(w); w = sched.next(w)) {
      const PrefillWorkTile work = sched.tile(p, w);
      // A sequence whose metadata faults comes back without rows or without keys; producer thread
      // 0 records it in its head-0 query block 0 (the consumers compute the same geometry).
      const SequenceInfo seq = sequence_info(p, work.batch, p.paged);
      if (seq.fault && lead && work.head == 0 && work.m_block == 0) {
        record_work_faults<T::kBlockM, T::kBlockN, T::kMasked>(p, work.batch, work.m_block, p.paged,
                                                               true, false);
      }
      // The block's first query token and its tokens (GQA packing: kBlockM >> q_pack_log2 tokens
      // x the group's heads, PrefillParams::q_pack_log2).
      const int32_t t0 = (work.m_block * T::kBlockM) >> p.q_pack_log2;
      if (t0 >= seq.q_len) continue;
      const int32_t tokens_valid = min(T::kBlockM >> p.q_pack_log2, seq.q_len - t0);
      const int32_t p_lo = seq.kv_len - seq.q_len + t0;
      const KeyBlockRange range =
          key_block_range<T::kBlockN, T::kMasked>(p, seq.kv_len, p_lo, p_lo + tokens_valid - 1);
      const int32_t num_tiles = range.count();
      if (num_tiles == 0) continue;                        // the consumers write zeros without Q
      const int32_t q_head0 = work.head << p.q_pack_log2;  // the item's first query head
      const int32_t kv_head = q_head0 / p.group_size;
      KvRows rows;
      rows.batch = work.batch;
      if (p.paged) {
        rows.k_tok_bytes = rows.v_tok_bytes = p.kv.token_stride_bytes;
        rows.k_tensor = p.kv.k_base + kv_head * p.kv.head_stride_bytes;
        rows.v_tensor = p.kv.v_base + kv_head * p.kv.head_stride_bytes;
      } else {
        rows.k_tok_bytes = p.k_tok_stride * T::kElemBytes;
        rows.v_tok_bytes = p.v_tok_stride * T::kElemBytes;
        rows.k_tensor =
            static_cast<const uint8_t*>(p.k) +
            (seq.k_offset + static_cast<int64_t>(kv_head) * p.k_head_stride) * T::kElemBytes;
        rows.v_tensor =
            static_cast<const uint8_t*>(p.v) +
            (seq.v_offset + static_cast<int64_t>(kv_head) * p.v_head_stride) * T::kElemBytes;
      }

      // kVtGlobal: the V^T column of the sequence's key 0 (Sm90SageParams).
      int32_t vt_col0 = 0;
      if constexpr (T::kVtGlobal) {
        const int64_t kv_start = p.cu_seqlens_kv ? seq.k_start : int64_t{work.batch} * p.seqlen_kv;
        vt_col0 = static_cast<int32_t>(sage::vt_seq_column(kv_start, work.batch));
      }
      bool item_fault = false;  // a K tile of this work item had a bad table entry
      for (int32_t it = 0; it < num_tiles; ++it) {
        const int32_t key0 = range.block(it) * T::kBlockN;
        const int32_t valid = min(T::kBlockN, seq.kv_len - key0);
        const bool gather_k = !T::kFp8 && sp.kv_mode == Sm90KvMode::kGather;
        const bool gather_v = gather_k;
        // K (the FP8 kernels take TMA tiles only: run_sm90 gathers no fp8 call)
        if (gather_k) {
          // Warps 1-3 skip the TMA tiles without waiting: meet warp 0 first, so that the empty
          // barrier is at most one phase behind the parity waited for.
          named_barrier_sync<kProducerBarrier>(128);
          mbarrier_wait(smem.k_empty(stage.index), stage.phase ^ 1u);
          bool bad = false;
          if constexpr (!T::kFp8) {
            bad = gather_tile<T, kDType>(sp, rows, false, key0, valid, smem.k(stage.index), ptid);
          }
          fence_proxy_async_smem();
          const bool any_bad = named_barrier_sync_or<kProducerBarrier>(128, bad);
          item_fault = item_fault || any_bad;
          if (lead) {
            st_shared_u32(smem.kv_fault(stage.index), any_bad);
            mbarrier_arrive(smem.k_full(stage.index));
          }
        } else if (tma_warp) {
          if (lead) mbarrier_wait(smem.k_empty(stage.index), stage.phase ^ 1u);
          __syncwarp();
          const bool any_bad =
              tma_tile(&sp.tma_k, false, seq, work, kv_head, key0, smem.k(stage.index),
                       smem.k_full(stage.index), smem.kv_fault(stage.index));
          item_fault = item_fault || any_bad;
        }
        // Q, after the first K tile so that a wait for the consumers to release Q does not hold
        // the K ring back.
        if (it == 0 && lead) {
          mbarrier_wait(smem.q_empty(), (q_iter & 1u) ^ 1u);
          mbarrier_arrive_expect_tx(smem.q_full(), T::kQBytes);
          // One box of kBlockM rows: (64 dims, 1 head, kBlockM tokens), or packed (64 dims, the
          // group's heads, its tokens), whose rows land token-major as the packing orders them.
          const int32_t tok = seq.q_start + t0;
          const int32_t batch = p.cu_seqlens_q ? 0 : work.batch;
#pragma unroll
          for (int c = 0; c < T::kColBlocks; ++c) {
            tma_load_4d(smem.q() + c * T::kQColBlockBytes, &sp.tma_q, smem.q_full(),
                        c * T::kColElems, q_head0, tok, batch);
          }
        }
        // V
        if constexpr (T::kVtGlobal) {
          // One box of V^T: head_dim rows of the tile's 128 columns (sage_quant_params.h), which
          // past the sequence hold the next sequence's codes or zeros (P is 0 there).
          if (lead) {
            mbarrier_wait(smem.v_empty(stage.index), stage.phase ^ 1u);
            mbarrier_arrive_expect_tx(smem.v_full(stage.index), T::kKvTileBytes);
            tma_load_4d(smem.v(stage.index), &sp.tma_v, smem.v_full(stage.index), vt_col0 + key0, 0,
                        kv_head, 0);
          }
        } else if constexpr (T::kFp8) {
          // Into the staging ring; the tile before it is transposed meanwhile, so that the wait
          // for a tile to land does not hold back the next tile's loads.
          if (tma_warp) {
            if (lead) mbarrier_wait(smem.vs_empty(stage.index), stage.phase ^ 1u);
            __syncwarp();
            tma_tile(&sp.tma_v, true, seq, work, kv_head, key0, smem.v_stage(stage.index),
                     smem.vs_full(stage.index), 0u);
          }
          if (it > 0) transpose_v(range, seq, it - 1, transposed);
        } else if (gather_v) {
          named_barrier_sync<kProducerBarrier>(128);
          mbarrier_wait(smem.v_empty(stage.index), stage.phase ^ 1u);
          if constexpr (!T::kFp8) {
            gather_tile<T, kDType>(sp, rows, true, key0, valid, smem.v(stage.index), ptid);
          }
          fence_proxy_async_smem();
          named_barrier_sync<kProducerBarrier>(128);
          if (lead) mbarrier_arrive(smem.v_full(stage.index));
        } else if (tma_warp) {
          if (lead) mbarrier_wait(smem.v_empty(stage.index), stage.phase ^ 1u);
          __syncwarp();
          tma_tile(&sp.tma_v, true, seq, work, kv_head, key0, smem.v(stage.index),
                   smem.v_full(stage.index), 0u);
        }
        stage.advance();
      }
      if constexpr (T::kTransposesV) transpose_v(range, seq, num_tiles - 1, transposed);
      if (item_fault && lead && work.head == 0) {
        record_work_faults<T::kBlockM, T::kBlockN, T::kMasked>(p, work.batch, work.m_block, p.paged,
                                                               false, true);
      }
      ++q_iter;
    }
  }
};

}  // namespace attnkit::cuda::prefill::sm90_detail
