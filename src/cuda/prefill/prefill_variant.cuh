// The parts of the context FMHA that every mainloop shares (the mma.sync kernel of sm80 and the
// warpgroup kernel of sm90a): the 16-bit element tag, a sequence's geometry, the key blocks a query
// block visits, the mask (causal bottom-right, sliding window with sinks, none) and the logit
// modifiers (soft-cap, ALiBi). The mask is a compile-time property (kMasked) of a kernel; the
// window and sinks are run-time values inside it, so one masked kernel serves causal and windowed
// calls. docs/semantics.md states the rules these functions implement.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "attnkit/types.h"
#include "cuda/common/device_fault.cuh"
#include "cuda/common/fast_math.cuh"
#include "cuda/common/mma_sm80.cuh"
#include "cuda/prefill/prefill_params.h"

namespace attnkit::cuda::prefill {

template <DType kDType>
struct TagOf;
template <>
struct TagOf<DType::kBF16> {
  using Type = Bf16Tag;
};
template <>
struct TagOf<DType::kF16> {
  using Type = F16Tag;
};
template <>
struct TagOf<DType::kFp8E4M3> {
  using Type = Fp8Tag;
};
template <>
struct TagOf<DType::kInt8> {
  using Type = Int8Tag;
};

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// tanh from one exp2 and one fast division (absolute error ~1e-7): a fraction of tanhf's code,
// which the fully unrolled soft-cap path would otherwise inline once per logit of the tile.
// (tanh.approx.f32 is one MUFU but has a relative error of 2^-11: at a cap of 50 that moves a
// logit by ~0.02, a 2% error in its probability.)
__device__ __forceinline__ float fast_tanh(float y) {
  const float e = fast_exp2(-2.f * kLog2e * fabsf(y));
  return copysignf(__fdividef(1.f - e, 1.f + e), y);
}

// Per-sequence geometry, resolved once per work item.
struct SequenceInfo {
  int64_t q_offset;    // elements from q to token 0 of this sequence
  int64_t o_offset;    // elements from out
  int64_t lse_offset;  // elements from lse
  int64_t k_offset;    // elements from k (packed / dense)
  int64_t v_offset;
  int32_t q_start;  // token index of query 0 in the packed q (0 in dense mode)
  int32_t k_start;  // token index of key 0 in the packed k (0 in dense and paged mode)
  int32_t q_len;
  int32_t kv_len;
  bool fault;  // a guard of this sequence's metadata failed (record_sequence_faults records it)
};

// Records the faults of sequence b's metadata (sequence_info found one): each bad entry once, by
// the sequence that ends at it (cu[b + 1]; cu[0] by sequence 0). Part of record_work_faults.
__device__ __forceinline__ void record_sequence_faults(const PrefillParams& p, int b, bool paged) {
  // guard_cu_seqlens' rules: a range fault before an order fault; row = the entry's sequence.
  auto entry = [&](FaultArg arg, int index, int32_t value, int32_t previous, int32_t extent) {
    if (value < 0 || value > extent) {
      record_fault_inline(p.fault, FaultKind::kCuSeqlensRange, arg, index - 1, index, value,
                          extent);
    } else if (value < previous) {
      record_fault_inline(p.fault, FaultKind::kCuSeqlensOrder, arg, index - 1, index, value,
                          previous);
    }
  };
  auto entries = [&](const int32_t* cu, FaultArg arg, int32_t extent) {
    const int32_t start = cu[b], end = cu[b + 1];
    const bool start_ok = start >= 0 && start <= extent;
    if (b == 0 && !start_ok) entry(arg, b, start, 0, extent);
    entry(arg, b + 1, end, start_ok ? start : 0, extent);
  };
  if (p.cu_seqlens_q) entries(p.cu_seqlens_q, FaultArg::kCuSeqlensQ, p.total_q);
  if (paged) {
    const int32_t len = p.kv_seq_lens[b];
    const int64_t capacity = p.kv.window_slots > 0 ? INT64_MAX : p.kv.row_capacity();
    if (len < 0 || len > capacity) {
      record_fault_inline(p.fault, FaultKind::kSeqLen, FaultArg::kSeqLens, b, 0, len, capacity);
    }
  } else if (p.cu_seqlens_kv) {
    entries(p.cu_seqlens_kv, FaultArg::kCuSeqlensKv, p.total_kv);
  }
}

// The geometry of sequence b, with the guards of its device metadata (docs/safety.md, prefill):
// - cu_seqlens_q: 0 <= cu[b] <= cu[b + 1] <= total_q and cu[b - 1] <= cu[b]. A sequence that fails
//   names no rows the kernel could write: q_len = 0, nothing of it is read or written (its rows of
//   out / lse keep what they held). The predecessor's entry is compared too, so that a sequence
//   next to an out-of-order entry does not write rows of an earlier one.
// - cu_seqlens_kv (packed): 0 <= cu[b] <= cu[b + 1] <= total_kv; kv_seq_lens (paged):
//   0 <= len <= the row's capacity (table_cols x tokens_per_block; a cyclic cache wraps its slots,
//   so only len >= 0). A sequence that fails has no keys: kv_len = 0, its query rows are zeros and
//   LSE -inf, no K/V is read.
// `fault` says a guard failed; one work item of the sequence (head 0, query block 0, one thread)
// records it with record_work_faults. Dense mode (no cu_seqlens) reads no metadata. Loads and
// compares once per work item.
__device__ __forceinline__ SequenceInfo sequence_info(const PrefillParams& p, int b, bool paged) {
  SequenceInfo s;
  bool ok = true;
  if (p.cu_seqlens_q) {
    const int32_t start = p.cu_seqlens_q[b];
    const int32_t end = p.cu_seqlens_q[b + 1];
    const int32_t before = b > 0 ? p.cu_seqlens_q[b - 1] : 0;
    const bool q_ok = start >= 0 && start <= end && end <= p.total_q && before <= start;
    ok = q_ok;
    s.q_start = q_ok ? start : 0;
    s.q_len = q_ok ? end - start : 0;
    s.q_offset = s.q_start * p.q_tok_stride;
    s.o_offset = s.q_start * p.o_tok_stride;
    s.lse_offset = s.q_start * p.lse_tok_stride;
  } else {
    s.q_start = 0;
    s.q_len = p.seqlen_q;
    s.q_offset = b * p.q_batch_stride;
    s.o_offset = b * p.o_batch_stride;
    s.lse_offset = b * p.lse_batch_stride;
  }
  s.k_start = 0;
  s.k_offset = 0;
  s.v_offset = 0;
  if (paged) {
    const int32_t len = p.kv_seq_lens[b];
    const bool kv_ok = len >= 0 && (p.kv.window_slots > 0 || len <= p.kv.row_capacity());
    ok = ok && kv_ok;
    s.kv_len = kv_ok ? len : 0;
  } else if (p.cu_seqlens_kv) {
    const int32_t start = p.cu_seqlens_kv[b];
    const int32_t end = p.cu_seqlens_kv[b + 1];
    const bool kv_ok = start >= 0 && start <= end && end <= p.total_kv;
    ok = ok && kv_ok;
    s.k_start = kv_ok ? start : 0;
    s.kv_len = kv_ok ? end - start : 0;
    s.k_offset = s.k_start * p.k_tok_stride;
    s.v_offset = s.k_start * p.v_tok_stride;
  } else {
    s.kv_len = p.seqlen_kv;
    s.k_offset = b * p.k_batch_stride;
    s.v_offset = b * p.v_batch_stride;
  }
  s.fault = !ok;
  return s;
}

// The key blocks a query block visits: [n_begin, n_end) walked backwards (the masked diagonal
// first: its maximum is the row's largest in most rows, so later tiles rarely rescale O), then the
// sink blocks [0, n_sink) that lie before the window.
struct KeyBlockRange {
  int32_t n_begin, n_end, n_sink;
  __device__ int32_t count() const { return (n_end - n_begin) + n_sink; }
  __device__ int32_t block(int32_t i) const {
    const int32_t main = n_end - n_begin;
    return i < main ? n_end - 1 - i : n_sink - 1 - (i - main);
  }
};

// The key blocks of kBlockN keys that query positions [p_lo, p_hi] attend.
template <int kBlockN, bool kMasked>
__device__ __forceinline__ KeyBlockRange key_block_range(const PrefillParams& p, int32_t kv_len,
                                                         int32_t p_lo, int32_t p_hi) {
  int32_t key_begin = 0, key_end = kv_len, sink_end = 0;
  if constexpr (kMasked) {
    key_end = min(kv_len, p_hi + 1);
    if (p.window > 0) {
      key_begin = max(0, p_lo - p.window + 1);
      sink_end = min(p.sink_tokens, key_begin);
    }
  }
  // Sinks lie before key_begin <= p_lo, so they are causal for every row; an empty range (no
  // key at all: p_hi < 0 or kv_len == 0) has no sinks either.
  KeyBlockRange r{0, 0, 0};
  if (key_end > key_begin) {
    r.n_begin = key_begin / kBlockN;
    r.n_end = (key_end + kBlockN - 1) / kBlockN;
    r.n_sink = min((sink_end + kBlockN - 1) / kBlockN, r.n_begin);
  }
  return r;
}

// The cold path of the guards, called once where a kernel leaves a work item (a call inside a
// mainloop would constrain its register allocation): records sequence b's metadata faults when
// `sequence` (sequence_info's fault; one work item of the sequence asks), and when `pages` the
// first block-table entry of row b read for the key blocks of query block m_block (kBlockM rows,
// kBlockN keys a block) that is not a block of the pool (the kernels flag a bad entry where they
// read it and skip its rows). The geometry is recomputed here, so the caller keeps nothing live
// for it; cyclic caches wrap the slots as the copies do.
template <int kBlockM, int kBlockN, bool kMasked>
__device__ __forceinline__ void record_work_faults(const PrefillParams& p, int b, int m_block,
                                                   bool paged, bool sequence, bool pages) {
  if (sequence) record_sequence_faults(p, b, paged);
  if (!pages || p.kv.block_table == nullptr) return;
  const SequenceInfo seq = sequence_info(p, b, paged);
  // Query tokens of the block (a GQA-packed block holds kBlockM >> q_pack_log2 of them).
  const int32_t t0 = (m_block * kBlockM) >> p.q_pack_log2;
  const int32_t p_lo = seq.kv_len - seq.q_len + t0;
  const int32_t p_hi = p_lo + min(kBlockM >> p.q_pack_log2, seq.q_len - t0) - 1;
  const KeyBlockRange range = key_block_range<kBlockN, kMasked>(p, seq.kv_len, p_lo, p_hi);
  const int64_t token_mask = (int64_t{1} << p.kv_page_shift) - 1;
  for (int32_t i = 0; i < range.count(); ++i) {
    const int32_t key0 = range.block(i) * kBlockN;
    const int32_t key_end = min(seq.kv_len, key0 + kBlockN);
    for (int32_t key = key0; key < key_end; ++key) {
      const int64_t slot = p.kv.slot_of(key);
      if (key != key0 && (slot & token_mask) != 0) continue;  // once a page
      const int64_t page = slot >> p.kv_page_shift;
      const int32_t block = p.kv.block_table[b * p.kv.block_table_row_stride + page];
      if (static_cast<uint32_t>(block) >= static_cast<uint32_t>(p.kv.num_blocks)) {
        record_fault_inline(p.fault, FaultKind::kBlockId, FaultArg::kBlockTable, b, page, block,
                            p.kv.num_blocks);
        return;
      }
    }
  }
}

// Whether query position `pos` attends key `key`.
template <bool kMasked>
__device__ __forceinline__ bool attends(const PrefillParams& p, int32_t pos, int32_t key,
                                        int32_t kv_len) {
  if (key >= kv_len) return false;
  if constexpr (kMasked) {
    if (key > pos) return false;
    if (p.window > 0 && key <= pos - p.window && key >= p.sink_tokens) return false;
  }
  return true;
}

// Whether some key of [key0, key0 + block_n) is masked for some query of [p_lo, p_hi]: the
// partial last block, the causal diagonal, a window's far edge (sink blocks lie there too). Tiles
// for which this is false skip the per-logit mask.
template <bool kMasked>
__device__ __forceinline__ bool tile_needs_mask(const PrefillParams& p, int32_t key0,
                                                int32_t block_n, int32_t kv_len, int32_t p_lo,
                                                int32_t p_hi) {
  bool needs = key0 + block_n > kv_len;
  if constexpr (kMasked) {
    needs = needs || key0 + block_n - 1 > p_lo || (p.window > 0 && key0 <= p_hi - p.window);
  }
  return needs;
}

// Skip-softmax's test for one row of a tile (docs/diffusion.md), in log2 units of the scaled
// logits: tile_max - running_max < log2(lambda). A row that has seen no key (running max -inf)
// never votes to skip (+inf, or NaN for a row without a key in this tile either: both false).
__device__ __forceinline__ bool skips_row(float tile_max, float running_max, float log2_lambda) {
  return tile_max - running_max < log2_lambda;
}

// The logit modifiers of a call, resolved per work item: x = q.k * logit_scale, then the soft-cap
// cap * tanh(x / cap), then the ALiBi bias slope * (key - pos), in that order.
struct LogitMods {
  float logit_scale;  // softmax_scale x the cache's K scale
  float softcap;      // 0: off
  float inv_softcap;
  float alibi_slope;  // 0: off

  __device__ static LogitMods make(const PrefillParams& p, float logit_scale, int head) {
    LogitMods m;
    m.logit_scale = logit_scale;
    m.softcap = p.softcap;
    m.inv_softcap = p.softcap > 0.f ? 1.f / p.softcap : 0.f;
    m.alibi_slope = p.alibi ? p.alibi_slopes[head] : 0.f;
    return m;
  }
  // The modified logit in natural units.
  __device__ float apply(float qk, int32_t pos, int32_t key) const {
    float x = qk * logit_scale;
    if (softcap > 0.f) x = softcap * fast_tanh(x * inv_softcap);
    return x + alibi_slope * static_cast<float>(key - pos);
  }
};

}  // namespace attnkit::cuda::prefill
