// The naive GPU attention kernel behind backend=vanilla on CUDA tensors (prefill, decode, dense)
// and the GPU-side reference of the large gpu tests. One thread block per (query token, query
// head); the scores of a chunk of kVanillaChunk keys are materialized in shared memory and folded
// into the output with an exact fp32 rescaling, so any key length fits. Everything (dtypes, mask,
// ALiBi, soft-cap, paging, beams) is a runtime value: this kernel is the plain reading of
// docs/semantics.md, not a fast path.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "attnkit/spec.h"
#include "core/kv_access.h"
#include "cuda/common/device_fault.cuh"

namespace attnkit::cuda {

constexpr int kVanillaThreads = 128;
constexpr int kVanillaChunk = 1024;      // keys whose scores are held in shared memory at once
constexpr int kVanillaMaxHeadDim = 512;  // kVanillaThreads * 4 accumulators per thread
constexpr int kVanillaMaxAlibiHeads = 256;

enum class VanillaQueryMode : uint8_t {
  kVarlen,  // packed tokens; sequence of token t from cu_seqlens_q (device)
  kDense,   // [B, Sq, H, D]: sequence t / seqlen_q
  kDecode,  // one token per cache row; the query sits at position seq_lens[row] - 1
};

struct VanillaAttentionParams {
  // ---- queries and outputs. Offsets: batch * *_stride_batch + token * *_stride_token +
  // head * *_stride_head (+ d for q / out); `token` is the global token (varlen, decode) or the
  // index inside the sequence (dense).
  const void* q;  // [tokens, Hq, D] or [B, Sq, Hq, D]
  int64_t q_stride_batch, q_stride_token, q_stride_head;
  void* out;  // like q
  int64_t out_stride_batch, out_stride_token, out_stride_head;
  float* lse;  // optional [tokens, Hq] or [B, Sq, Hq]
  int64_t lse_stride_batch, lse_stride_token, lse_stride_head;
  DType dtype;  // q and out
  int32_t num_q_heads;
  int32_t group_size;  // Hq / Hkv
  int32_t head_dim;

  VanillaQueryMode mode;
  int64_t num_tokens;           // grid x
  const int32_t* cu_seqlens_q;  // kVarlen: int32 [batch + 1]
  int32_t batch;                // kVarlen: sequences
  int32_t dense_seqlen_q;       // kDense
  int32_t dense_seqlen_kv;      // kDense

  // ---- keys from packed tensors (kVarlen without cache, kDense).
  bool from_cache;
  const void* k;  // [total_kv, Hkv, D] or [B, Skv, Hkv, D], dtype kv_dtype
  const void* v;
  int64_t k_stride_batch, k_stride_token, k_stride_head;
  int64_t v_stride_batch, v_stride_token, v_stride_head;
  const int32_t* cu_seqlens_kv;  // kVarlen packed: int32 [batch + 1]
  int64_t total_kv;              // kVarlen packed: rows of k and v (cu_seqlens_kv's extent)

  // ---- keys from the KV cache (row = sequence for kVarlen, the row itself for kDecode).
  detail::KvLayout layout;
  const int32_t* seq_lens;  // int32 [rows]
  int64_t seq_len_bound;    // the largest valid seq_lens entry: the row capacity (a cyclic
                            // cache: INT64_MAX), with cache_indirection at most its max_seq
  const float* k_scale;     // optional [1] or [Hkv]
  const float* v_scale;
  bool k_scale_per_head, v_scale_per_head;
  // Beams (kDecode): key t of row r = s * beam_width + b is read from row
  // s * beam_width + cache_indirection[s, b, t].
  const int32_t* cache_indirection;  // optional int32 [rows / beam_width, beam_width, max_seq]
  int64_t ind_stride_seq, ind_stride_beam, ind_stride_token;
  int32_t beam_width;

  DType kv_dtype;
  // ---- logits: q.k * scale, soft-cap, + ALiBi, mask (in this order).
  float softmax_scale;
  float softcap;  // 0 = off
  MaskKind mask;
  int32_t window;
  int32_t sink_tokens;
  bool alibi;
  float alibi_slopes[kVanillaMaxAlibiHeads];

  // Device metadata (cu_seqlens, seq_lens, block ids, indirection) is checked as it is read: a
  // query row whose metadata is bad is written as zeros (LSE -inf), the fault recorded here.
  FaultSite fault;
};

// Fills spec-derived fields (heads, scale, mask, ALiBi); throws Error for unsupported values.
void fill_vanilla_spec_fields(const AttentionSpec& spec, VanillaAttentionParams& params);
void launch_vanilla_attention(const VanillaAttentionParams& params, cudaStream_t stream);

}  // namespace attnkit::cuda
