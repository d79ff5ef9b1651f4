// The portable context FMHA kernel (FlashAttention-2 style, mma.sync m16n8k16, sm80+).
//
// One CTA computes kBlockM query rows of one (sequence, query head); every warp owns kMAtoms x 16
// rows and keeps its S tile, its O accumulator and (where they fit) its Q fragments in registers.
// K/V tiles of kBlockN keys stream through cp.async: a kStages ring of K+V (head_dim <= 128), one
// K and one V buffer overlapped FA2-style (head_dim 256), or one raw 8-bit stage widened through a
// LUT (fp8/int8 caches). The online softmax runs in the log2 domain with the scale folded into
// the exponent's FFMA. Included only by the prefill_inst_*.cu files, which instantiate
// launch_prefill.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "core/numerics.h"
#include "cuda/common/cp_async_sm80.cuh"
#include "cuda/common/cuda_status.h"
#include "cuda/common/fast_math.cuh"
#include "cuda/common/kv_widen.cuh"
#include "cuda/common/ldmatrix_sm80.cuh"
#include "cuda/common/mma_sm80.cuh"
#include "cuda/prefill/prefill_launch.h"
#include "cuda/prefill/prefill_scheduler.cuh"
#include "cuda/prefill/prefill_traits.h"
#include "cuda/prefill/prefill_variant.cuh"

namespace attnkit::cuda::prefill {

// Where the K/V rows of one key block come from: the packed / dense tensors (packed kernels) or
// the paged cache (kPaged kernels), whose block-table entries are read one tile ahead
// (lookup_runs) so that the dependent global load never stalls the cp.async issue.
template <class T>
struct KvSource {
  const uint8_t* k_packed;  // packed: K of (sequence, kv head), token 0
  const uint8_t* v_packed;
  int64_t k_tok_bytes, v_tok_bytes;
  int32_t kv_len, batch, kv_head;
  // Paged: a block table and no cyclic window (row runs); else every chunk resolves its slot.
  bool fast_pages;
  int32_t page_shift;

  __device__ int64_t work_row_offset(const PrefillParams& p) const {
    return static_cast<int64_t>(batch) * p.kv.block_table_row_stride;
  }
};

// The smem offset of an ldmatrix lane's row at (even) chunk step `cs`, from its offset at chunk
// step 0: under the swizzle the step flips chunk bits (one LOP3 on a loop-invariant offset).
template <class T>
__device__ __forceinline__ uint32_t chunk_step(uint32_t lane_off, int cs) {
  if constexpr (T::kSwizzle) {
    uint32_t off;
    asm volatile("xor.b32 %0, %1, %2;" : "=r"(off) : "r"(lane_off), "r"((cs & 7) * 16));
    return off + (cs & ~7) * 16;
  } else {
    return lane_off + cs * 16;
  }
}

// Warps 0 and 1 (64 threads) meet at named barrier 1, warps 2 and 3 at barrier 2 (split warps of a
// 4-warp CTA). Immediate barrier ids: a register id makes ptxas reserve all 16.
__device__ __forceinline__ void pair_barrier(int warp) {
  if (warp < 2) {
    asm volatile("bar.sync 1, 64;" ::: "memory");
  } else {
    asm volatile("bar.sync 2, 64;" ::: "memory");
  }
}

// Issues the cp.async copies of the kBlockN 16-bit rows of key block `n_block` from the packed
// tensor `packed0` (and `packed1` when kTwo; tok_bytes apart) into T::offset() rows. Rows past
// kv_len are zero-filled. The paged kernels copy with load_rows_paged below.
template <class T, bool kTwo>
__device__ __forceinline__ void load_rows(int32_t kv_len, int32_t n_block, const uint8_t* packed0,
                                          int64_t tok_bytes0, uint8_t* dst0, const uint8_t* packed1,
                                          int64_t tok_bytes1, uint8_t* dst1) {
  constexpr int kChunksPerRow = T::kChunksPerRow;
  constexpr int kChunks = T::kBlockN * kChunksPerRow;
  constexpr int kIters = (kChunks + T::kThreads - 1) / T::kThreads;
  const int32_t key0 = n_block * T::kBlockN;
  const int tid = threadIdx.x;
  if constexpr (T::kThreads % kChunksPerRow == 0) {
    // A thread copies the same chunk of rows r0, r0 + kRowStep, ...: one 64-bit multiply per
    // tile, then pointer increments.
    constexpr int kRowStep = T::kThreads / kChunksPerRow;
    const int r0 = tid / kChunksPerRow;
    const int ch = tid % kChunksPerRow;
    const uint8_t* src0 = packed0 + static_cast<int64_t>(key0 + r0) * tok_bytes0 + ch * 16;
    const uint8_t* src1 =
        kTwo ? packed1 + static_cast<int64_t>(key0 + r0) * tok_bytes1 + ch * 16 : nullptr;
    const int64_t step0 = kRowStep * tok_bytes0;
    const int64_t step1 = kRowStep * tok_bytes1;
    // kRowStep is a power of two and r0 < kRowStep: the swizzle phase of row r0 + i * kRowStep is
    // (r0 & 7) ^ (i * kRowStep & 7), so every row's smem address is one register XOR a constant
    // plus an immediate (as in load_rows_paged).
    static_assert((kRowStep & (kRowStep - 1)) == 0, "rows r0 + i * kRowStep share r0's phase bits");
    const uint32_t s0 = smem_u32(dst0) + r0 * T::kRowBytes;
    const uint32_t s1 = kTwo ? smem_u32(dst1) + r0 * T::kRowBytes : 0u;
    const uint32_t ch_phase = (T::kSwizzle ? ch ^ (r0 & 7) : ch) * 16;
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int r = r0 + i * kRowStep;
      if (kChunks % T::kThreads == 0 || r < T::kBlockN) {
        const bool valid = key0 + r < kv_len;
        const uint32_t d = i * kRowStep * T::kRowBytes +
                           (T::kSwizzle ? ch_phase ^ ((i * kRowStep & 7) * 16) : ch_phase);
        // Rows past kv_len copy 0 bytes (zero fill): their address is never read.
        cp_async_16(s0 + d, src0, valid);
        if constexpr (kTwo) cp_async_16(s1 + d, src1, valid);
      }
      src0 += step0;
      if constexpr (kTwo) src1 += step1;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int c = tid + i * T::kThreads;
      if (kChunks % T::kThreads == 0 || c < kChunks) {
        const int r = c / kChunksPerRow;
        const int ch = c % kChunksPerRow;
        const int32_t key = key0 + r;
        const bool valid = key < kv_len;
        const int64_t tok = valid ? key : 0;
        cp_async_16(smem_u32(dst0 + T::offset(r, ch)), packed0 + tok * tok_bytes0 + ch * 16, valid);
        if constexpr (kTwo) {
          cp_async_16(smem_u32(dst1 + T::offset(r, ch)), packed1 + tok * tok_bytes1 + ch * 16,
                      valid);
        }
      }
    }
  }
}

// The paged kernels' copy (kPaged): every thread copies one 16-byte column of kRun consecutive
// rows (a "run") that lie inside one page, for every tile configuration. kRun is the thread's
// share of the tile's chunks rounded up to a power of two and capped at 8 (the smallest page), so
// a run never crosses a page; a thread holding more than 8 chunks (head_dim 256) copies
// kRunsPerThread runs, each with its own block id.
template <class T, int kElemBytes>
struct PagedCopy {
  static constexpr int kChunksPerRow = T::kHeadDim * kElemBytes / 16;
  static constexpr int kChunks = T::kBlockN * kChunksPerRow;
  static constexpr int kShare = (kChunks + T::kThreads - 1) / T::kThreads;
  static constexpr int kRun = kShare <= 1 ? 1 : kShare <= 2 ? 2 : kShare <= 4 ? 4 : 8;
  static constexpr int kRuns = T::kBlockN / kRun * kChunksPerRow;
  static constexpr int kRunsPerThread = (kRuns + T::kThreads - 1) / T::kThreads;
  static_assert(T::kBlockN % kRun == 0, "runs tile the key block");
  // The first row (in the tile) and the chunk of run u.
  __device__ static constexpr int run_row(int u) { return u / kChunksPerRow * kRun; }
  __device__ static constexpr int run_chunk(int u) { return u % kChunksPerRow; }
};

// Block ids of a thread's runs of one tile (-1: the run starts past the sequence, or its page's
// table entry is not a block of the pool).
template <int N>
struct RunPages {
  int32_t id[N];
};

// Reads the block ids of a thread's runs of key block `n_block`. Each id is compared with the pool
// ([0, num_blocks)) where it is read: a bad one becomes -1 (the run copies zeros, no address is
// formed from it) and sets `fault`, which makes the CTA write its query rows as zeros and record
// the entry (record_work_faults, where the CTA leaves). The page lies inside the row:
// kv_len <= table_cols x tokens_per_block (sequence_info).
template <class T, int kElemBytes>
__device__ __forceinline__ RunPages<PagedCopy<T, kElemBytes>::kRunsPerThread> lookup_runs(
    const PrefillParams& p, const KvSource<T>& src, int32_t n_block, bool& fault) {
  using C = PagedCopy<T, kElemBytes>;
  RunPages<C::kRunsPerThread> ids;
  const int32_t key0 = n_block * T::kBlockN;
#pragma unroll
  for (int j = 0; j < C::kRunsPerThread; ++j) {
    const int u = static_cast<int>(threadIdx.x) + j * T::kThreads;
    const int32_t page = (key0 + C::run_row(u)) >> src.page_shift;
    const bool live = src.fast_pages && (C::kRuns % T::kThreads == 0 || u < C::kRuns) &&
                      (page << src.page_shift) < src.kv_len;
    int32_t id = -1;
    if (live) {
      id = p.kv.block_table[src.work_row_offset(p) + page];
      if (static_cast<uint32_t>(id) >= static_cast<uint32_t>(p.kv.num_blocks)) {
        fault = true;
        id = -1;
      }
    }
    ids.id[j] = id;
  }
  return ids;
}

// Issues the cp.async copies of key block `n_block` from the paged cache (K and V when kTwo).
// kTwo: V lands kDst1Bytes after K in smem (a compile-time distance: no second smem address).
// The cache's rows of one KV head are KvLayout::token_stride_bytes apart (HND: a row, NHD: the
// Hkv rows of a token), from the head's first row at kv_head x head_stride_bytes.
// A run whose id is -1 copies zeros. The per-chunk copy (cyclic caches) reads its block ids here
// and guards them as lookup_runs does (`fault`).
template <class T, int kElemBytes, bool kTwo, int kDst1Bytes = 0>
__device__ __forceinline__ void load_rows_paged(
    const PrefillParams& p, const KvSource<T>& src, int32_t n_block,
    const RunPages<PagedCopy<T, kElemBytes>::kRunsPerThread>& ids, const uint8_t* cache0,
    uint8_t* dst0, const uint8_t* cache1, bool& fault) {
  using C = PagedCopy<T, kElemBytes>;
  constexpr bool kSwz = kElemBytes == 2 && T::kSwizzle;
  constexpr int kDstRowBytes = kElemBytes == 1 ? T::kHeadDim : T::kRowBytes;
  const int32_t key0 = n_block * T::kBlockN;
  const int tid = threadIdx.x;
  if (src.fast_pages) {
#pragma unroll
    for (int j = 0; j < C::kRunsPerThread; ++j) {
      const int u = tid + j * T::kThreads;
      if (C::kRuns % T::kThreads == 0 || u < C::kRuns) {
        const int run0 = C::run_row(u);
        const int ch = C::run_chunk(u);
        const int32_t token = (key0 + run0) & ((1 << src.page_shift) - 1);
        const int32_t entry = ids.id[j];
        const int64_t pitch = p.kv.token_stride_bytes;
        const int64_t off =
            (entry < 0 ? 0 : static_cast<int64_t>(entry) * p.kv.block_stride_bytes) +
            src.kv_head * p.kv.head_stride_bytes + token * pitch + ch * 16;
        const uint8_t* g0 = cache0 + off;
        const uint8_t* g1 = kTwo ? cache1 + off : nullptr;
        // A bad page (entry -1 from lookup_runs) copies no row.
        const int32_t rows_left = entry < 0 ? 0 : src.kv_len - key0 - run0;
        // run0 is a multiple of kRun (a power of two <= 8): the swizzle phase of row run0 + i is
        // (run0 & 7) ^ i, so the chunk bits flip by a constant per row.
        const uint32_t s0 = smem_u32(dst0) + run0 * kDstRowBytes;
        const uint32_t ch_phase = (kSwz ? ch ^ (run0 & 7) : ch) * 16;
#pragma unroll
        for (int i = 0; i < C::kRun; ++i) {
          const bool valid = i < rows_left;
          const uint32_t d = i * kDstRowBytes + (kSwz ? ch_phase ^ (i * 16) : ch_phase);
          cp_async_16(s0 + d, g0 + i * pitch, valid);
          if constexpr (kTwo) cp_async_16(s0 + kDst1Bytes + d, g1 + i * pitch, valid);
        }
      }
    }
    return;
  }
  // A cyclic window or a contiguous cache: every chunk resolves its own slot.
  constexpr int kIters = (C::kChunks + T::kThreads - 1) / T::kThreads;
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    const int c = tid + i * T::kThreads;
    if (C::kChunks % T::kThreads == 0 || c < C::kChunks) {
      const int r = c / C::kChunksPerRow;
      const int ch = c % C::kChunksPerRow;
      bool valid = key0 + r < src.kv_len;
      int64_t off = 0;
      if (valid) {
        // One table entry and one compare per chunk: this copy serves cyclic caches only (a
        // contiguous cache reads no table).
        const int64_t slot = p.kv.slot_of(key0 + r);
        int64_t block = src.batch, token = slot;
        if (p.kv.block_table != nullptr) {
          block = p.kv.block_table[src.work_row_offset(p) + (slot >> src.page_shift)];
          token = slot & ((int64_t{1} << src.page_shift) - 1);
          if (static_cast<uint64_t>(block) >= static_cast<uint64_t>(p.kv.num_blocks)) {
            fault = true;
            valid = false;
            block = 0;
          }
        }
        off = p.kv.row_offset(block, token, src.kv_head) + ch * 16;
      }
      const uint32_t d = kElemBytes == 1 ? r * T::kHeadDim + ch * 16 : T::offset(r, ch);
      cp_async_16(smem_u32(dst0) + d, cache0 + off, valid);
      if constexpr (kTwo) cp_async_16(smem_u32(dst0) + kDst1Bytes + d, cache1 + off, valid);
    }
  }
}

template <int kHeadDim, PrefillTile kTile, DType kDType, bool kMasked, bool kQuantKv, bool kPaged,
          bool kSwizzle, bool kRunsOnly, bool kSkipDeadBlocks, bool kSplitWarps, bool kSkipSoftmax>
__global__ void __launch_bounds__(PrefillTraits<kHeadDim, kTile, kSwizzle>::kThreads,
                                  PrefillTraits<kHeadDim, kTile, kSwizzle>::kMinBlocksPerSm)
    prefill_kernel(const __grid_constant__ PrefillParams p) {
  static_assert(kPaged || !kQuantKv, "8-bit K/V come only from the paged cache");
  static_assert(kPaged || !kRunsOnly, "row runs are a paged copy");
  using T = PrefillTraits<kHeadDim, kTile, kSwizzle>;
  using Tag = typename TagOf<kDType>::Type;
  using Elem = uint16_t;
  // Pipelines: kQuantKv: one raw 8-bit stage, widened into one K and one V tile; kOverlapKv: one
  // K and one V buffer (FA2); else a kStages ring of K+V tiles.
  constexpr bool kOverlap = !kQuantKv && T::kOverlapKv;
  constexpr bool kRing = !kQuantKv && !T::kOverlapKv;
  constexpr int kKvBufs = kRing ? T::kStages : 1;
  constexpr int kKvElemBytes = kQuantKv ? 1 : 2;
  // Edge tiles and the other tiles run separate copies of the tile step, the latter without mask
  // code, in the packed kernels of the 128-key tile (head_dim 64) and the masked head_dim 256
  // kernels. Measured on H200 (bf16 grid, twice each, same run, TFLOP/s, one copy -> split):
  // head_dim 64 causal 1k-16k 203.1 -> 209.3, 251.4 -> 259.9, 284.4 -> 293.7, 305.5 -> 317.5,
  // 311.4 -> 321.5 (512: 149.6 -> 150.0), non-causal +0.3-1.6%; head_dim 256 causal +0.1-4.4%
  // (8k 335.2 -> 345.5). Not kept: head_dim 128 (-0.7 to -4.4% at S <= 1k, -0.3 to +1.5% from
  // 2k), head_dim 256 non-causal (S=512 277 -> 272), the 64-key tile at head_dim 64 (1k causal
  // 210.0 -> 206.3) and the paged kernels (page 64 causal 287 -> 267).
  constexpr bool kSplitEdge = !kPaged && (T::kBlockN == 128 || (T::kHeadDim == 256 && kMasked));
  // kSkipDeadBlocks (prefill_tile_step.inc): in the 128-row, 64-key tile (kM128W4) under a causal
  // mask a query block's last key tile lies past its first 64 rows, and the tile before it has
  // every key attended by its last 64 rows. A warp's two 16-row blocks are interleaved across the
  // warps (rows 16 w and 16 (w + 4)), and a block whose rows all lie before a tile's first key
  // skips the tile's MMAs and softmax: every warp keeps one live block on the diagonal, so no warp
  // waits at the barrier for another's full tile. Dispatch: prefill_dispatch.cc.
  static_assert(!kSkipDeadBlocks ||
                    (kMasked && !kPaged && T::kMAtoms == 2 && T::kBlockN < T::kBlockM && kRing),
                "dead row blocks: packed causal kernels of the 128-row 64-key tile");
  // kSplitWarps (head_dim 256 kM64, prefill_tile_split.inc): warps 2 r and 2 r + 1 share query rows
  // 32 r .. 32 r + 31; for S = Q K^T warp h takes keys 32 h .. 32 h + 31 of the tile, for O += P V
  // dims 128 h .. 128 h + 127. Every K/V fragment read from smem then feeds two MMA row blocks
  // (100 ldmatrix per warp and tile instead of 144); the pair trades its row maxima and its half
  // of P through smem (s_split) at the cost of one 64-thread barrier per tile.
  static_assert(!kSplitWarps || (T::kHeadDim == 256 && T::kWarps == 4 && kOverlap && !kPaged),
                "split warps: packed head_dim 256, 16 rows per warp in the plain layout");
  // kSkipSoftmax (prefill_tile_skip.inc): the skip-softmax policy of docs/diffusion.md on the
  // CTA's kBlockM x kBlockN tile. After S = Q K^T the CTA votes (one bar.red.and) whether every
  // row that attends a key of the tile has its tile maximum below its running maximum by more
  // than ln(lambda); a skipped tile loads no V and takes no exponentials and no P V. K streams
  // ahead as usual; V is loaded after the vote, under the softmax. Packed / dense 16-bit K/V in the
  // plain row layout; every CTA adds its tile counts to p.skip_counts.
  static_assert(!kSkipSoftmax || (!kPaged && !kSkipDeadBlocks && !kSplitWarps),
                "skip-softmax: packed K/V, the plain row layout");
  constexpr int kPRowBytes = T::kPRowBytes;
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* s_q = smem;
  uint8_t* s_k = smem + T::kQBytes;
  uint8_t* s_v = s_k + kKvBufs * T::kKvTileBytes;
  uint8_t* s_raw_k = s_v + kKvBufs * T::kKvTileBytes;
  uint8_t* s_raw_v = s_raw_k + T::kRawTileBytes;
  uint16_t* s_lut = reinterpret_cast<uint16_t*>(s_raw_v + T::kRawTileBytes);
  // kSplitWarps: P [kBlockM][kBlockN] with kPRowBytes rows, then float row statistics [2][kBlockM].
  uint8_t* s_split = s_v + kKvBufs * T::kKvTileBytes;
  float* s_stat = reinterpret_cast<float*>(s_split + T::kBlockM * kPRowBytes);

  const PrefillWorkTile work = LongestFirstScheduler::get(p);
  // A sequence whose metadata faults comes back without rows or without keys (sequence_info);
  // thread 0 of its head-0 query block 0 records the fault when it leaves (record_work_faults).
  const SequenceInfo seq = sequence_info(p, work.batch, kPaged);
  const int32_t m0 = work.m_block * T::kBlockM;
  if (seq.fault || m0 >= seq.q_len) {
    if (seq.fault && work.head == 0 && work.m_block == 0 && threadIdx.x == 0) {
      record_work_faults<T::kBlockM, T::kBlockN, kMasked>(p, work.batch, 0, kPaged, true, false);
    }
    if (m0 >= seq.q_len) return;
  }

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int g = lane / 4;
  const int t4 = lane % 4;
  const int32_t head = work.head;
  const int32_t kv_head = head / p.group_size;
  const int32_t rows_valid = min(T::kBlockM, seq.q_len - m0);
  const int32_t q_pos0 = seq.kv_len - seq.q_len;  // position of query 0 (bottom-right aligned)
  const int32_t p_lo = q_pos0 + m0;
  const int32_t p_hi = q_pos0 + m0 + rows_valid - 1;
  const KeyBlockRange range = key_block_range<T::kBlockN, kMasked>(p, seq.kv_len, p_lo, p_hi);
  const int32_t num_tiles = range.count();

  // ---- Q tile -> smem (rows past the sequence are zero) ----
  {
    const Elem* q = static_cast<const Elem*>(p.q) + seq.q_offset + head * p.q_head_stride;
    for (int c = tid; c < T::kBlockM * T::kChunksPerRow; c += T::kThreads) {
      const int r = c / T::kChunksPerRow;
      const int ch = c % T::kChunksPerRow;
      const bool valid = r < rows_valid;
      const Elem* src = q + (valid ? (m0 + r) * p.q_tok_stride : 0) + ch * 8;
      cp_async_16(smem_u32(s_q + T::offset(r, ch)), src, valid);
    }
  }

  // The LUT serves fp8 caches where the sm89 cvt is missing (sm80).
  const bool use_lut = !p.kv_is_int8 && !kHasFp8Cvt;
  if constexpr (kQuantKv) {
    for (int v = use_lut ? tid : 256; v < 256; v += T::kThreads) {
      const float x = p.kv_is_int8 ? static_cast<float>(static_cast<int8_t>(v))
                                   : numerics::fp8_e4m3_bits_to_float(static_cast<uint8_t>(v));
      // Exact: every fp8 e4m3 and int8 value is representable in bf16 and f16.
      s_lut[v] =
          kDType == DType::kBF16 ? numerics::float_to_bf16_bits(x) : numerics::float_to_f16_bits(x);
    }
  }

  KvSource<T> src;
  src.kv_len = seq.kv_len;
  src.batch = work.batch;
  src.kv_head = kv_head;
  src.page_shift = p.kv_page_shift;
  // kRunsOnly: the host launches this kernel only for a block table without a cyclic window, so
  // the per-chunk slot copy is not compiled in.
  src.fast_pages = kPaged && (kRunsOnly || (p.kv.block_table != nullptr && p.kv.window_slots == 0));
  src.k_packed = nullptr;
  src.v_packed = nullptr;
  src.k_tok_bytes = p.k_tok_stride * 2;
  src.v_tok_bytes = p.v_tok_stride * 2;
  if constexpr (!kPaged) {
    src.k_packed = reinterpret_cast<const uint8_t*>(static_cast<const Elem*>(p.k) + seq.k_offset +
                                                    kv_head * p.k_head_stride);
    src.v_packed = reinterpret_cast<const uint8_t*>(static_cast<const Elem*>(p.v) + seq.v_offset +
                                                    kv_head * p.v_head_stride);
  }
  // Paged: set when a block-table entry this thread read for the work item is not a block of the
  // pool (lookup_runs, load_rows_paged); the CTA then writes its rows as zeros.
  [[maybe_unused]] bool kv_fault = false;
  // Issues tile t's K (and V) copies: packed rows, or paged row runs whose block ids (`entry`)
  // were read one tile earlier.
  using PagedIds = RunPages<PagedCopy<T, kKvElemBytes>::kRunsPerThread>;
  struct NoPages {};
  using Entry = std::conditional_t<kPaged, PagedIds, NoPages>;
  auto load_k = [&](int32_t t, Entry entry, int buf) {
    if constexpr (kPaged) {
      load_rows_paged<T, kKvElemBytes, false>(p, src, range.block(t), entry, p.kv.k_base,
                                              s_k + buf * T::kKvTileBytes, nullptr, kv_fault);
    } else {
      load_rows<T, false>(src.kv_len, range.block(t), src.k_packed, src.k_tok_bytes,
                          s_k + buf * T::kKvTileBytes, nullptr, 0, nullptr);
    }
  };
  auto load_v = [&](int32_t t, Entry entry) {
    if constexpr (kPaged) {
      // V takes the entries K took (`entry_v`): its faults are K's, recorded once.
      load_rows_paged<T, kKvElemBytes, false>(p, src, range.block(t), entry, p.kv.v_base, s_v,
                                              nullptr, kv_fault);
    } else {
      load_rows<T, false>(src.kv_len, range.block(t), src.v_packed, src.v_tok_bytes, s_v, nullptr,
                          0, nullptr);
    }
  };
  auto load_kv = [&](int32_t t, Entry entry, int buf) {
    if constexpr (kQuantKv) {
      static_assert(T::kRawTileBytes > 0);  // s_raw_v = s_raw_k + kRawTileBytes
      load_rows_paged<T, 1, true, T::kRawTileBytes>(p, src, range.block(t), entry, p.kv.k_base,
                                                    s_raw_k, p.kv.v_base, kv_fault);
    } else if constexpr (kPaged) {
      // s_v = s_k + kKvBufs * kKvTileBytes
      load_rows_paged<T, 2, true, kKvBufs * T::kKvTileBytes>(
          p, src, range.block(t), entry, p.kv.k_base, s_k + buf * T::kKvTileBytes, p.kv.v_base,
          kv_fault);
    } else {
      load_rows<T, true>(src.kv_len, range.block(t), src.k_packed, src.k_tok_bytes,
                         s_k + buf * T::kKvTileBytes, src.v_packed, src.v_tok_bytes,
                         s_v + buf * T::kKvTileBytes);
    }
  };
  auto lookup = [&](int32_t t) {
    if constexpr (kPaged) {
      return t < num_tiles ? lookup_runs<T, kKvElemBytes>(p, src, range.block(t), kv_fault)
                           : PagedIds{};
    } else {
      return NoPages{};
    }
  };

  // Widens the raw 8-bit K/V into the 16-bit tiles (exact): fp8 with the sm89+ cvt, int8 with
  // float arithmetic, fp8 on sm80 through the LUT. Measured on H200 (D=128, causal): +11-12% for
  // fp8 and +13-15% for int8 over the LUT, whose random 2-byte reads conflict on the smem banks.
  auto widen_kv = [&]() {
    constexpr int kUnits = T::kBlockN * T::kHeadDim / 8;  // 8 elements each
#pragma unroll 4
    for (int u = tid; u < 2 * kUnits; u += T::kThreads) {
      const bool is_v = u >= kUnits;
      const int rem = is_v ? u - kUnits : u;
      const int r = rem / (T::kHeadDim / 8);
      const int c8 = rem % (T::kHeadDim / 8);
      const uint8_t* raw = is_v ? s_raw_v : s_raw_k;
      const uint2 bytes = *reinterpret_cast<const uint2*>(raw + r * T::kHeadDim + c8 * 8);
      uint4 out;
      if (use_lut) {
        out.x = s_lut[bytes.x & 0xff] | (uint32_t(s_lut[(bytes.x >> 8) & 0xff]) << 16);
        out.y = s_lut[(bytes.x >> 16) & 0xff] | (uint32_t(s_lut[bytes.x >> 24]) << 16);
        out.z = s_lut[bytes.y & 0xff] | (uint32_t(s_lut[(bytes.y >> 8) & 0xff]) << 16);
        out.w = s_lut[(bytes.y >> 16) & 0xff] | (uint32_t(s_lut[bytes.y >> 24]) << 16);
      } else if (p.kv_is_int8) {
        const uint2 lo = widen_int8x4<kDType>(bytes.x);
        const uint2 hi = widen_int8x4<kDType>(bytes.y);
        out = make_uint4(lo.x, lo.y, hi.x, hi.y);
      } else {
        out.x = widen_fp8x2<kDType>(bytes.x & 0xffffu);
        out.y = widen_fp8x2<kDType>(bytes.x >> 16);
        out.z = widen_fp8x2<kDType>(bytes.y & 0xffffu);
        out.w = widen_fp8x2<kDType>(bytes.y >> 16);
      }
      *reinterpret_cast<uint4*>((is_v ? s_v : s_k) + T::offset(r, c8)) = out;
    }
  };

  // Prologue: Q and the first tile(s) in flight. `entry` holds the block-table entries of the
  // next tile to load (K's, in the overlapped pipeline; V reuses them as `entry_v`).
  Entry entry = lookup(0);
  Entry entry_v{};
  if constexpr (kSkipSoftmax) {
    // K of the first kKvBufs tiles, as the groups K(0), {}, K(1), ..., {}, K(kKvBufs - 1) that
    // prefill_tile_skip.inc counts on; V waits for the vote of its tile.
#pragma unroll
    for (int s = 0; s < kKvBufs; ++s) {
      if (s > 0) cp_async_commit();
      if (s < num_tiles) load_k(s, entry, s);
      cp_async_commit();
    }
  } else if constexpr (kRing) {
#pragma unroll
    for (int s = 0; s < T::kStages - 1; ++s) {
      if (s < num_tiles) load_kv(s, entry, s);
      entry = lookup(s + 1);
      cp_async_commit();
    }
  } else {
    if (num_tiles > 0) {
      if constexpr (kQuantKv) {
        load_kv(0, entry, 0);
      } else {
        load_k(0, entry, 0);
      }
    }
    entry_v = entry;
    entry = lookup(1);
    cp_async_commit();
  }

  // Scales: the cache's K scale folds into the logit scale, its V scale into the epilogue. Without
  // logit modifiers the scale (in log2 units) folds into the exponent's FFMA; with them the
  // logits are modified in natural units first.
  const float k_scale = p.k_scale ? p.k_scale[p.k_scale_per_head ? kv_head : 0] : 1.f;
  const float v_scale = p.v_scale ? p.v_scale[p.v_scale_per_head ? kv_head : 0] : 1.f;
  const float logit_scale = p.softmax_scale * k_scale;
  // A non-positive scale would not commute with the row max: it takes the modifier path.
  const bool has_mods = p.softcap > 0.f || p.alibi || !(logit_scale > 0.f);
  const float exp_scale = has_mods ? kLog2e : logit_scale * kLog2e;
  const float alibi_slope = p.alibi ? p.alibi_slopes[head] : 0.f;
  const float inv_softcap = p.softcap > 0.f ? 1.f / p.softcap : 0.f;

  constexpr int kA = kSplitWarps ? 2 : T::kMAtoms;
  constexpr int kODTiles = kSplitWarps ? T::kDTiles / 2 : T::kDTiles;  // n8 tiles of O per warp
  uint32_t q_frag[T::kQInRegs ? T::kKSteps : 1][kA][4];
  float o_acc[kA][kODTiles][4];
#pragma unroll
  for (int a = 0; a < kA; ++a)
#pragma unroll
    for (int i = 0; i < kODTiles; ++i)
      o_acc[a][i][0] = o_acc[a][i][1] = o_acc[a][i][2] = o_acc[a][i][3] = 0.f;
  float row_max[kA][2];  // log2 units (scaled)
  float row_sum[kA][2];  // this thread's partial sums
  // Row block a of this warp starts at query row warp_row + a * kAtomStride of the CTA: the warp's
  // rows are contiguous, or (kSkipDeadBlocks) its two blocks interleaved across the warps.
  constexpr int kAtomStride = kSkipDeadBlocks ? 16 * T::kWarps : 16;
  const int warp_row =
      kSplitWarps ? 32 * (warp >> 1) : (kSkipDeadBlocks ? 16 * warp : warp * T::kRowsPerWarp);
  const int half = warp & 1;  // kSplitWarps: this warp's key half of S and dim half of O
  // Query position of this thread's row i (g, g + 8) of row block a; recomputed, not kept live.
  auto pos_row = [&](int a, int i) { return p_lo + warp_row + a * kAtomStride + g + 8 * i; };
#pragma unroll
  for (int a = 0; a < kA; ++a) {
    row_max[a][0] = row_max[a][1] = -INFINITY;
    row_sum[a][0] = row_sum[a][1] = 0.f;
  }
  // kSkipSoftmax: the row maxima of the tile's vote (scaled logits, not yet in log2 units), which
  // the softmax of a kept tile reuses, and the tiles the CTA skipped.
  [[maybe_unused]] float tile_mx[kA][2];
  [[maybe_unused]] int32_t tiles_skipped = 0;
  [[maybe_unused]] const float log2_lambda =
      p.skip_per_kv_len ? p.skip_log2_lambda - log2f(static_cast<float>(seq.kv_len))
                        : p.skip_log2_lambda;

  // ldmatrix lane offsets at chunk step 0 (Q from s_q, K and V from their tile).
  const uint32_t s_q_addr = smem_u32(s_q);
  const uint32_t q_lane_off = T::offset(warp_row + lane % 16, lane / 16);
  const uint32_t k_lane_off = T::offset(lane % 8 + (lane / 16) * 8, (lane / 8) % 2);
  const uint32_t v_lane_off = T::offset(lane % 8 + ((lane / 8) % 2) * 8, lane / 16);

  // One key tile (prefill_tile_step.inc): S = Q K^T, mask, online softmax, O += P V. kEdgeTile: the
  // tile may need a mask (the partial last block, the causal diagonal, a window's far edge, sinks);
  // false: a copy of the step without any mask code (kSplitEdge kernels). The unsplit loop includes
  // the step itself rather than calling the lambda: through the lambda the 30 head_dim 128 bf16
  // kernels compile to different SASS (other register allocation and scheduling; checked with
  // cuobjdump), and this form is the one measured on the H200.
  if constexpr (kSplitEdge) {
    auto tile_step = [&](const int32_t it, auto edge) {
      constexpr bool kEdgeTile = decltype(edge)::value;
#include "cuda/prefill/prefill_tile_step.inc"
    };
    // The edge tiles come first in the visiting order (from the diagonal backwards): every tile
    // under a window (its far edge and the sinks are masked too); else the blocks past the last
    // full block below min(kv_len, p_lo + 1).
    int32_t edge_tiles = num_tiles;
    if (!kMasked || p.window == 0) {
      const int32_t limit = kMasked ? min(seq.kv_len, p_lo + 1) : seq.kv_len;
      const int32_t full_end = max(range.n_begin, min(range.n_end, limit / T::kBlockN));
      edge_tiles = range.n_end - full_end;
    }
    int32_t it = 0;
    for (; it < edge_tiles; ++it) tile_step(it, std::true_type{});
    for (; it < num_tiles; ++it) tile_step(it, std::false_type{});
  } else {
    for (int32_t it = 0; it < num_tiles; ++it) {
      constexpr bool kEdgeTile = true;
#include "cuda/prefill/prefill_tile_step.inc"
    }
  }
  cp_async_wait<0>();
  if constexpr (kSkipSoftmax) {
    if (tid == 0 && p.skip_counts != nullptr) {
      atomicAdd(p.skip_counts, static_cast<unsigned long long>(num_tiles));
      atomicAdd(p.skip_counts + 1, static_cast<unsigned long long>(tiles_skipped));
    }
  }
  // A bad block id read by any thread of the CTA (paged kernels): every row of this query block is
  // written as zeros with LSE -inf (docs/safety.md). The rows that attend a page are those of the
  // query blocks whose key range holds it; the others of the sequence are computed as usual.
  // The head-0 CTA's thread 0 records the first bad entry of the tiles it visited, at the end.
  bool tile_fault = false;
  if constexpr (kPaged) {
    tile_fault = __syncthreads_or(kv_fault) != 0;
  } else {
    __syncthreads();
  }

  if constexpr (kSplitWarps) {
#include "cuda/prefill/prefill_split_epilogue.inc"
  } else {
    // ---- epilogue: normalize, stage the warp's rows in its own Q rows, 16-byte stores ----
    uint8_t* stage_rows = s_q + warp_row * T::kRowBytes;
#pragma unroll
    for (int a = 0; a < kA; ++a) {
      float inv_sum[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float sum = row_sum[a][i];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        row_sum[a][i] = sum;
        // A fully masked row (no attended key) outputs zeros.
        inv_sum[i] = sum > 0.f ? v_scale / sum : 0.f;
      }
#pragma unroll
      for (int dt = 0; dt < T::kDTiles; ++dt) {
        // warp_row is a multiple of 16: the warp's local rows keep the swizzle phase.
        *reinterpret_cast<uint32_t*>(stage_rows + T::offset(a * kAtomStride + g, dt) + t4 * 4) =
            pack_pair<Tag>(o_acc[a][dt][0] * inv_sum[0], o_acc[a][dt][1] * inv_sum[0]);
        *reinterpret_cast<uint32_t*>(stage_rows + T::offset(a * kAtomStride + g + 8, dt) + t4 * 4) =
            pack_pair<Tag>(o_acc[a][dt][2] * inv_sum[1], o_acc[a][dt][3] * inv_sum[1]);
      }
    }
    __syncwarp();
    Elem* out = static_cast<Elem*>(p.out) + seq.o_offset + head * p.o_head_stride;
    for (int c = lane; c < T::kRowsPerWarp * T::kChunksPerRow; c += 32) {
      const int rw = c / T::kChunksPerRow;  // the warp's rw-th row
      const int r = kAtomStride == 16 ? rw : rw / 16 * kAtomStride + rw % 16;
      const int ch = c % T::kChunksPerRow;
      const int32_t row = m0 + warp_row + r;
      if (row < seq.q_len) {
        uint4 chunk = *reinterpret_cast<const uint4*>(stage_rows + T::offset(r, ch));
        if (tile_fault) chunk = make_uint4(0u, 0u, 0u, 0u);
        *reinterpret_cast<uint4*>(out + row * p.o_tok_stride + ch * 8) = chunk;
      }
    }
    if (p.lse != nullptr && t4 == 0) {
#pragma unroll
      for (int a = 0; a < kA; ++a)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int32_t row = m0 + warp_row + a * kAtomStride + g + 8 * i;
          if (row < seq.q_len) {
            p.lse[seq.lse_offset + row * p.lse_tok_stride + head * p.lse_head_stride] =
                row_sum[a][i] > 0.f && !tile_fault ? (row_max[a][i] + __log2f(row_sum[a][i])) * kLn2
                                                   : -INFINITY;
          }
        }
    }
  }
  if constexpr (kPaged) {
    if (tile_fault && head == 0 && tid == 0) {
      record_work_faults<T::kBlockM, T::kBlockN, kMasked>(p, work.batch, work.m_block, true, false,
                                                          true);
    }
  }
}

template <int kHeadDim, PrefillTile kTile, DType kDType, bool kMasked, bool kQuantKv, bool kPaged,
          bool kSwizzle, bool kRunsOnly, bool kSkipDeadBlocks, bool kSplitWarps, bool kSkipSoftmax>
void launch_prefill(const PrefillParams& params, cudaStream_t stream) {
  using T = PrefillTraits<kHeadDim, kTile, kSwizzle>;
  static_assert(tile_exists(kHeadDim, kTile), "no such prefill tile for this head_dim");
  constexpr int kSmem = kSplitWarps ? T::kSplitSmemBytes : T::smem_bytes(kQuantKv);
  auto kernel = prefill_kernel<kHeadDim, kTile, kDType, kMasked, kQuantKv, kPaged, kSwizzle,
                               kRunsOnly, kSkipDeadBlocks, kSplitWarps, kSkipSoftmax>;
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem),
             "prefill: cudaFuncSetAttribute(max dynamic shared memory)");
  kernel<<<LongestFirstScheduler::grid(params), T::kThreads, kSmem, stream>>>(params);
  check_launch("prefill: kernel launch");
}

}  // namespace attnkit::cuda::prefill

// One instantiation of every (tile, kMasked, K/V source) for a head_dim and dtype: packed 16-bit,
// paged 16-bit and 8-bit with both copies (contiguous and cyclic caches).
#define ATTNKIT_PREFILL_INSTANTIATE_TILE(D, TILE, DT)                                  \
  template void launch_prefill<D, TILE, DT, false, false, false>(const PrefillParams&, \
                                                                 cudaStream_t);        \
  template void launch_prefill<D, TILE, DT, true, false, false>(const PrefillParams&,  \
                                                                cudaStream_t);         \
  template void launch_prefill<D, TILE, DT, false, false, true>(const PrefillParams&,  \
                                                                cudaStream_t);         \
  template void launch_prefill<D, TILE, DT, true, false, true>(const PrefillParams&,   \
                                                               cudaStream_t);          \
  template void launch_prefill<D, TILE, DT, false, true, true>(const PrefillParams&,   \
                                                               cudaStream_t);          \
  template void launch_prefill<D, TILE, DT, true, true, true>(const PrefillParams&, cudaStream_t);

// The paged kernels that hold only the row-run copy (kRunsOnly: a block table without a cyclic
// window), 16-bit and 8-bit caches, both masks; the head dims of runs_compiled().
#define ATTNKIT_PREFILL_INSTANTIATE_RUNS(D, TILE, DT)                                      \
  template void launch_prefill<D, TILE, DT, false, false, true, swizzle_default(D), true>( \
      const PrefillParams&, cudaStream_t);                                                 \
  template void launch_prefill<D, TILE, DT, true, false, true, swizzle_default(D), true>(  \
      const PrefillParams&, cudaStream_t);                                                 \
  template void launch_prefill<D, TILE, DT, false, true, true, swizzle_default(D), true>(  \
      const PrefillParams&, cudaStream_t);                                                 \
  template void launch_prefill<D, TILE, DT, true, true, true, swizzle_default(D), true>(   \
      const PrefillParams&, cudaStream_t);

// The packed causal kM128W4 kernel with interleaved row blocks and dead-block skip.
#define ATTNKIT_PREFILL_INSTANTIATE_SKIP(D, DT)                                       \
  template void launch_prefill<D, PrefillTile::kM128W4, DT, true, false, false,       \
                               swizzle_default(D), false, true>(const PrefillParams&, \
                                                                cudaStream_t);

// The skip-softmax kernels of a tile (kSkipSoftmax): packed / dense 16-bit K/V, both masks.
#define ATTNKIT_PREFILL_INSTANTIATE_SKIP_SOFTMAX(D, TILE, DT)                                      \
  template void launch_prefill<D, TILE, DT, false, false, false, swizzle_default(D), false, false, \
                               false, true>(const PrefillParams&, cudaStream_t);                   \
  template void launch_prefill<D, TILE, DT, true, false, false, swizzle_default(D), false, false,  \
                               false, true>(const PrefillParams&, cudaStream_t);

// The packed head_dim 256 kM64 kernel without a mask, with split warps.
#define ATTNKIT_PREFILL_INSTANTIATE_SPLIT(DT)                                                \
  template void launch_prefill<256, PrefillTile::kM64, DT, false, false, false, true, false, \
                               false, true>(const PrefillParams&, cudaStream_t);
