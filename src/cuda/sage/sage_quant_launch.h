// Host side of the SAGE quantize pass and of the fp8 V transposes (sage_quant_params.h has the
// layouts they write). Internal to the CUDA backend: dense() / prefill() validate the user's
// arguments first; these functions check their own preconditions again (an attnkit::Error naming
// the field, before anything is enqueued) and check every CUDA call.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "attnkit/info.h"
#include "attnkit/kv_cache.h"
#include "attnkit/spec.h"
#include "cuda/sage/sage_quant_params.h"

namespace attnkit::cuda::sage {

inline constexpr int32_t kMaxHeadDim = 256;

// The sizes that fix the workspace's layout.
struct SageQuantShape {
  int32_t batch = 0;
  int64_t total_q = 0;  // packed query tokens (uniform: batch x seqlen_q)
  int64_t total_kv = 0;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  SageQuantSpec quant;
};

// Byte offsets of the pass's buffers in one workspace allocation (each 256-byte aligned).
struct SageWorkspaceLayout {
  size_t q = 0, k = 0, v_t = 0;
  size_t q_scale = 0, k_scale = 0, stats = 0;  // contiguous: one memset zeroes all three
  size_t zeroed_bytes = 0;                     // from q_scale to the end of stats
  size_t v_scale = 0, k_mean = 0;
  size_t bytes = 0;  // the workspace size
  int64_t q_scale_stride = 0, k_scale_stride = 0, v_t_stride = 0;
};

// Throws Error naming the field when the pass cannot serve the shape.
SageWorkspaceLayout sage_workspace_layout(const SageQuantShape& shape);
inline size_t sage_workspace_bytes(const SageQuantShape& shape) {
  return sage_workspace_layout(shape).bytes;
}
// The result pointers inside `workspace` (device memory of sage_workspace_bytes(shape)).
SageQuantized sage_quantized_views(const SageQuantShape& shape, void* workspace);

struct SageQuantArgs {
  SageQuantShape shape;
  DType input_dtype = DType::kBF16;  // q, k, v: bf16 or f16
  SageInput q, k, v;                 // element strides; base 16-byte aligned, strides % 8 == 0
  // Packed sequences: device int32 [batch + 1]. nullptr: uniform, sequence b at token b x seqlen.
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_kv = nullptr;
  // Uniform: the sequence lengths (total = batch x seqlen). Packed: upper bounds on the lengths,
  // trusted for the grid only (every token is processed whatever they say; 0 = the total).
  int64_t seqlen_q = 0;
  int64_t seqlen_kv = 0;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  Op op = Op::kDense;  // the call whose device faults (bad cu_seqlens entries) the pass records
};

// Enqueues the pass on `stream` and returns where its results lie in args.workspace.
SageQuantized launch_sage_quantize(const SageQuantArgs& args, cudaStream_t stream);

// fp8 e4m3 V [tokens, Hkv, D] (packed or uniform, byte strides) -> V^T [Hkv][D][v_t_stride]
// with v_t_stride = vt_row_stride(total_kv, batch); the codes are copied, not rescaled.
struct Fp8TransposeArgs {
  SageInput v;  // byte strides; base 16-byte aligned, strides % 16 == 0
  int32_t batch = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int64_t total_kv = 0;
  const int32_t* cu_seqlens_kv = nullptr;  // device [batch + 1]; nullptr: uniform
  int64_t seqlen_kv = 0;                   // as SageQuantArgs::seqlen_kv
  uint8_t* v_t = nullptr;
  size_t v_t_bytes = 0;  // at least fp8_vt_bytes(num_kv_heads, head_dim, total_kv, batch)
  Op op = Op::kPrefill;
};
// Bytes of a V^T of `columns` tokens in `seqs` sequences (block-table rows).
inline size_t fp8_vt_bytes(int64_t num_kv_heads, int64_t head_dim, int64_t columns, int64_t seqs) {
  return static_cast<size_t>(num_kv_heads * head_dim * vt_row_stride(columns, seqs));
}
void launch_fp8_transpose_v(const Fp8TransposeArgs& args, cudaStream_t stream);

// The V pages of an fp8 e4m3 KvCacheView (paged pages in either layout, HND [num_blocks, Hkv,
// page_size, D] or NHD [num_blocks, page_size, Hkv, D], or a contiguous cache; not cyclic), each
// block-table row's seq_lens[r] tokens gathered to V^T columns vt_column(kv_offsets[r], r, t);
// kv_offsets (device int32 [rows + 1], the exclusive prefix sum of the lengths) is written by the
// pass. Every block-table entry read and every length is guarded against the pool
// (docs/safety.md): a bad entry's tokens are written as zeros, a bad length counts as 0; both are
// recorded.
struct PagedFp8TransposeArgs {
  KvCacheView cache;  // dtype fp8_e4m3; seq_lens: int32 [rows] on the device
  // Columns V^T is sized for: a bound on the rows' total tokens, trusted like max_seqlen (tokens
  // past it are not written and kv_offsets stops at it). At most INT32_MAX - 15.
  int64_t v_t_columns = 0;
  int32_t max_seqlen_kv = 0;  // upper bound on a row's length, for the grid (0: the row capacity)
  uint8_t* v_t = nullptr;
  size_t v_t_bytes = 0;  // at least fp8_vt_bytes(Hkv, D, v_t_columns, rows)
  int32_t* kv_offsets = nullptr;
  Op op = Op::kPrefill;
};
void launch_paged_fp8_transpose_v(const PagedFp8TransposeArgs& args, cudaStream_t stream);

}  // namespace attnkit::cuda::sage
