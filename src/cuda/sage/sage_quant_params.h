// What the SAGE quantize pass (sage_quant.cu) writes and where the attention mainloop finds it:
// the layouts and index formulas of the quantized Q, K, V and their scales (docs/diffusion.md,
// "The quantize pass on the GPU"), and the kernels' runtime parameters. Host-includable; the index
// helpers are ATTNKIT_HD so that a mainloop computes the same addresses on the device.
//
// Shapes (B sequences, Hq / Hkv heads, head_dim D, total_q / total_kv packed tokens; a dense
// [B, S, H, D] call is the packed layout with sequence b at token b * S):
//
//   q          [total_q, Hq, D]   int8 or fp8 e4m3 codes, row-major (D contiguous), the input's
//                                 packed token order: sequence b's token t at cu_seqlens_q[b] + t
//   q_scale    [Hq][q_scale_stride]  float; token t of sequence b, head h:
//                                 q_scale[h * q_scale_stride + scale_slot(cu_q[b], b, t, q_block)]
//   k          [total_kv, Hkv, D] codes of the smoothed K (K minus k_mean), like q
//   k_scale    [Hkv][k_scale_stride] likewise with k_block_size
//   v_t        [Hkv][D][v_t_stride] fp8 e4m3 codes of V, transposed (the K-major B operand of the
//                                 fp8 P*V wgmma): v_t[(h * D + d) * v_t_stride +
//                                 vt_column(cu_kv[b], b, t)]
//   v_scale    [B][Hkv][D]        float, per sequence and channel: V = code * v_scale
//   k_mean     [B][Hkv][D]        float, the mean that was subtracted from K (not needed by the
//                                 attention: it shifts every score of a row by the same amount)
//
// Scale slots: the blocks of sequence b start at slot cu[b] / block + b, so that no prefix sum
// over the lengths is needed (cu[b + 1] / block - cu[b] / block + 1 >= ceil(len / block) slots
// lie between two sequences' first slots). A row holds scale_row_stride() slots: every slot a
// sequence's blocks use, plus the slots of kScaleTailTokens tokens past the last one, so that a
// tile of up to 256 tokens may load its scales without a bound check and mask the columns past
// the sequence. Slots no block uses hold 0 (the pass zeroes the rows first), never NaN.
//
// V^T columns: sequence b's tokens start at column round_up(cu_kv[b] + 48 b, 16) (vt_seq_column),
// and inside each group of 32 tokens the columns are permuted as the FP8 kernel's P registers need
// them (fp8_layout::vt_key: column c of a group holds token vt_key(c)), so that the attention
// kernel loads a key tile of V^T with one TMA box and multiplies it without shuffling P. TMA boxes
// start at 16-byte aligned columns (an unaligned start is an illegal instruction); the 48 columns
// a sequence gets beyond its tokens cover that alignment and a short last group, whose permuted
// columns spread over all 32. Rows are padded to a multiple of 16 bytes (TMA strides). Columns of
// no token (the gaps, the padding, tokens past cu_kv[B], the columns of a sequence whose cu_seqlens
// entries fault) are zero, so P = 0 never meets a NaN code there.
//
// Codes of tokens outside every sequence (and of faulting sequences) are not written.
#pragma once

#include <cstdint>

#include "attnkit/device_errors.h"
#include "attnkit/types.h"
#include "core/kv_access.h"
#include "core/numerics.h"
#include "cuda/common/device_fault.cuh"
#include "cuda/prefill/prefill_sm90_fp8_layout.h"

namespace attnkit::cuda::sage {

inline constexpr int64_t kVtColumnAlign = 16;     // V^T row stride: bytes, for TMA
inline constexpr int64_t kVtSeqGap = 48;          // V^T columns a sequence gets past its tokens
inline constexpr int64_t kScaleTailTokens = 256;  // tokens past a sequence a reader may address
inline constexpr int64_t kScaleRowAlign = 4;      // floats: 16-byte aligned scale rows

ATTNKIT_HD int64_t round_up(int64_t x, int64_t multiple) {
  return (x + multiple - 1) / multiple * multiple;
}

// Columns of one V^T row for total_kv tokens in num_seqs sequences: one gap a sequence, rounded up
// to a multiple of 16 (the last sequence's columns end before total_kv + 48 num_seqs - 1).
ATTNKIT_HD int64_t vt_row_stride(int64_t total_kv, int64_t num_seqs) {
  return round_up(total_kv + kVtSeqGap * num_seqs, kVtColumnAlign);
}

// The V^T column of sequence `seq`'s first token group (the sequence starts at packed token
// `seq_start`; 16-byte aligned, for TMA), and of its token `token`. Consecutive sequences' first
// columns lie at least len + 33 >= round_up(len, 32) apart.
ATTNKIT_HD int64_t vt_seq_column(int64_t seq_start, int64_t seq) {
  return round_up(seq_start + kVtSeqGap * seq, kVtColumnAlign);
}
ATTNKIT_HD int64_t vt_column(int64_t seq_start, int64_t seq, int64_t token) {
  return vt_seq_column(seq_start, seq) + (token & ~int64_t{31}) +
         prefill::fp8_layout::vt_column_of_key(static_cast<int>(token & 31));
}

// Slots of one scale row for total_tokens packed tokens in num_seqs sequences.
ATTNKIT_HD int64_t scale_row_stride(int64_t total_tokens, int64_t num_seqs, int32_t block_size) {
  return round_up((total_tokens + kScaleTailTokens - 1) / block_size + num_seqs + 1,
                  kScaleRowAlign);
}

// The slot of token `token` (of its sequence) of sequence `seq`, which starts at packed token
// `seq_start`.
ATTNKIT_HD int64_t scale_slot(int64_t seq_start, int64_t seq, int64_t token, int32_t block_size) {
  return seq_start / block_size + seq + token / block_size;
}

// The pass's results, device pointers into the caller's workspace (sage_quant_launch.h).
struct SageQuantized {
  void* q = nullptr;  // int8_t or uint8_t (fp8 e4m3 bits)
  float* q_scale = nullptr;
  int64_t q_scale_stride = 0;
  void* k = nullptr;
  float* k_scale = nullptr;
  int64_t k_scale_stride = 0;
  uint8_t* v_t = nullptr;
  int64_t v_t_stride = 0;
  float* v_scale = nullptr;
  float* k_mean = nullptr;
};

// ---- kernel parameters --------------------------------------------------------------------------

// One input tensor: element (b, t, h, d) of sequence b's token t at
//   packed (cu_seqlens given):  data[(cu[b] + t) * stride_token + h * stride_head + d]
//   uniform (no cu_seqlens):    data[b * stride_batch + t * stride_token + h * stride_head + d]
struct SageInput {
  const void* data = nullptr;
  int64_t stride_batch = 0;
  int64_t stride_token = 0;
  int64_t stride_head = 0;
};

// The sequences of one side (queries, or keys and values).
struct SageSequences {
  const int32_t* cu_seqlens = nullptr;  // device [B + 1]; nullptr: every sequence holds seqlen
  int64_t seqlen = 0;                   // uniform: the length; packed: not read
  int64_t total = 0;                    // packed extent: cu entries must lie in [0, total]
  FaultArg arg = FaultArg::kNone;       // the argument a bad entry is reported as
};

// Per (sequence, KV head, channel): what the K mean and the V scale need, accumulated over the
// sequence's tokens by all CTAs that read them (atomics; the buffer starts zeroed).
struct SageKvStats {
  double k_sum = 0.0;      // fp64 sum of K (exact when the check of sage_quant.cu holds)
  double k_abs_sum = 0.0;  // fp64 sum of |K|: bounds every partial sum
  // 400 - (exponent of the lowest set bit over the nonzero K values); 0: every value is zero.
  uint32_t k_low_bit_key = 0;
  uint32_t v_amax_bits = 0;  // float bits of max |V| (non-negative floats order as integers)
};

struct SageQuantParams {
  SageInput q, k, v;
  SageSequences q_seqs, kv_seqs;
  int32_t batch = 0;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t q_block_size = 1;
  int32_t k_block_size = 16;
  bool int8 = true;  // dtype_qk: int8 (else fp8 e4m3)
  SageQuantized out;
  SageKvStats* stats = nullptr;  // [B][Hkv][D]
  FaultSite fault;
};

// fp8 V [tokens, Hkv, D] (packed or uniform) -> V^T, no scaling.
struct Fp8TransposeParams {
  SageInput v;  // strides in bytes (elements of one byte)
  SageSequences kv_seqs;
  int32_t batch = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  uint8_t* v_t = nullptr;
  int64_t v_t_stride = 0;
  FaultSite fault;
};

// The V pages of an fp8 paged (or contiguous) cache -> V^T. Row r's seq_lens[r] tokens go to the
// columns vt_column(kv_offsets[r], r, t), kv_offsets an exclusive prefix sum of the rows' lengths
// the pass computes (a row whose length faults counts 0; offsets are clipped to v_t_columns).
struct PagedTransposeParams {
  detail::KvLayout kv;
  const int32_t* seq_lens = nullptr;  // device [rows]
  int32_t rows = 0;
  int32_t v_t_columns = 0;  // columns the caller sized V^T for
  uint8_t* v_t = nullptr;
  int64_t v_t_stride = 0;
  int32_t* kv_offsets = nullptr;  // device [rows + 1], written by the pass
  FaultSite fault;
};

}  // namespace attnkit::cuda::sage
