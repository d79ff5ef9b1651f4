// forward() on CUDA: append_kv on every token (rotated Q into a workspace), prefill over the
// cache for the context requests, decode for the generation rows, all enqueued on one stream with
// no host synchronization. The per-request metadata (host arrays) reaches the device through
// kernel parameters (cuda/common/host_upload.h); per-token positions and rows are computed there.
//
// Device faults (docs/safety.md): cu_seqlens_q and past_lens were validated on the host, so the
// metadata kernel below reads only checked values and the positions and rows it writes are
// inside the cache. What stays on the device (the block table, seq_lens, cache_indirection) is
// checked by the append_kv, prefill and decode kernels as they read it; their faults are
// recorded under Op::kForward with the rows of the caller's cache (FaultOpScope).
#include <string>

#include "core/check.h"
#include "cuda/common/cuda_status.h"
#include "cuda/common/device_fault.h"
#include "cuda/common/host_upload.h"
#include "cuda/common/stream_buffer.h"
#include "cuda/cuda_backend.h"

namespace attnkit::cuda {
namespace {

constexpr int64_t kWorkspaceAlign = 256;

int64_t align_up(int64_t bytes) {
  return (bytes + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
}

struct TokenMetaParams {
  const int32_t* cu_seqlens_q;  // int32 [num_requests + 1]
  const int32_t* past_lens;     // int32 [num_requests]
  int32_t* positions;           // int32 [num_tokens]
  int32_t* row_of_token;        // int32 [num_tokens]
  int64_t num_tokens;
  int32_t num_requests;
  int32_t num_context;
  int32_t beam_width;
};

// Token t of context request i sits at past_lens[i] + (t - cu[i]) in row i; the b-th token of
// generation request i (one per beam) at past_lens[i] in row num_context + (i - num_context) *
// beam_width + b.
__global__ void forward_token_meta_kernel(const __grid_constant__ TokenMetaParams params) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= params.num_tokens) return;
  int lo = 0, hi = params.num_requests;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (params.cu_seqlens_q[mid] <= t)
      lo = mid;
    else
      hi = mid;
  }
  const int32_t offset = static_cast<int32_t>(t - params.cu_seqlens_q[lo]);
  if (lo < params.num_context) {
    params.positions[t] = params.past_lens[lo] + offset;
    params.row_of_token[t] = lo;
  } else {
    params.positions[t] = params.past_lens[lo];
    params.row_of_token[t] =
        params.num_context + (lo - params.num_context) * params.beam_width + offset;
  }
}

// Rows [first, first + count) of the cache as a cache of their own.
KvCacheView cache_rows(const KvCacheView& cache, int64_t first, int64_t count) {
  KvCacheView view = cache;
  if (cache.paged) {
    view.block_table.data =
        static_cast<int32_t*>(cache.block_table.data) + first * cache.block_table.strides[0];
    view.block_table.shape[0] = count;
  } else {
    view.k_base = static_cast<uint8_t*>(cache.k_base) + first * cache.block_stride_bytes;
    view.v_base = static_cast<uint8_t*>(cache.v_base) + first * cache.block_stride_bytes;
  }
  view.seq_lens.data =
      static_cast<int32_t*>(cache.seq_lens.data) + first * cache.seq_lens.strides[0];
  view.seq_lens.shape[0] = count;
  return view;
}

// Tokens [first, first + count) of a [tokens, ...] tensor.
TensorView token_rows(const TensorView& t, int64_t first, int64_t count) {
  if (!t.defined()) return t;
  TensorView view = t;
  view.data = static_cast<uint8_t*>(t.data) +
              first * t.strides[0] * static_cast<int64_t>(dtype_size(t.dtype));
  view.shape[0] = count;
  return view;
}

detail::AppendKvProblem append_problem_of(const detail::ForwardProblem& p, bool has_bias) {
  detail::AppendKvProblem a;
  a.device = p.device;
  a.dtype = p.dtype;
  a.kv_dtype = p.kv_dtype;
  a.num_tokens = p.num_tokens;
  a.fused_qkv = true;
  a.has_bias = has_bias;
  return a;
}

// The context part's problem: prefill over the cache rows of the context requests.
detail::PrefillProblem prefill_problem_of(const detail::ForwardProblem& p) {
  detail::PrefillProblem pp;
  pp.device = p.device;
  pp.dtype = p.dtype;
  pp.kv_dtype = p.kv_dtype;
  pp.paged = true;
  pp.batch = p.num_context;
  pp.total_q = p.num_context_tokens;
  pp.max_seqlen_q = p.max_context_len;
  pp.max_seqlen_kv = p.max_context_kv_len;  // the context part's kernel choice: its own rows
  pp.has_lse = p.has_lse;
  return pp;
}

// The generation part's problem: decode over the generation rows.
detail::DecodeProblem decode_problem_of(const detail::ForwardProblem& p, const ForwardArgs& args) {
  detail::DecodeProblem dp;
  dp.device = p.device;
  dp.dtype = p.dtype;
  dp.kv_dtype = p.kv_dtype;
  dp.num_rows = static_cast<int64_t>(p.num_generation) * args.beam_width;
  dp.beam_width = args.beam_width;
  dp.max_seq_len = p.max_kv_len;
  dp.has_lse = p.has_lse;
  dp.has_indirection = args.cache_indirection.defined();
  return dp;
}

}  // namespace

std::string fused_forward_unsupported(const AttentionSpec& spec, const detail::ForwardProblem& p) {
  // The attention parts pick the fused kernels where they serve the call, else the naive ones.
  return fused_append_kv_unsupported(spec, append_problem_of(p, false));
}

void forward(const AttentionSpec& spec, const ForwardArgs& args, const detail::ForwardProblem& p,
             bool fused, Stream stream) {
  const FaultOpScope fault_op(Op::kForward);
  const cudaStream_t cuda_stream = as_cuda_stream(stream);
  const int64_t num_tokens = p.num_tokens;
  const int32_t num_requests = p.num_context + p.num_generation;
  const int64_t ctx_tokens = p.num_context_tokens;
  const int64_t gen_rows = static_cast<int64_t>(p.num_generation) * args.beam_width;
  const int64_t hq = spec.num_q_heads, dim = spec.head_dim;

  // Workspace: rotated Q, then the metadata arrays.
  const int64_t q_bytes =
      align_up(num_tokens * hq * dim * static_cast<int64_t>(dtype_size(p.dtype)));
  const int64_t cu_bytes = align_up((num_requests + 1) * 4);
  const int64_t past_bytes = align_up(num_requests * 4);
  const int64_t token_bytes = align_up(num_tokens * 4);
  const int64_t needed = q_bytes + cu_bytes + past_bytes + 2 * token_bytes;

  // Which kernels the parts run: the fused ones where they serve the part. backend 'auto' runs
  // the naive kernels for a part the fused ones cannot serve; an explicit 'fused' raises instead,
  // before anything is enqueued (no silent fallback: docs/configuration.md).
  const detail::PrefillProblem pp = prefill_problem_of(p);
  const detail::DecodeProblem dp = decode_problem_of(p, args);
  const bool has_context = p.num_context > 0 && ctx_tokens > 0;
  const std::string prefill_reason =
      fused && has_context ? fused_prefill_unsupported(spec, pp) : std::string();
  const std::string decode_reason =
      fused && gen_rows > 0 ? fused_decode_unsupported(spec, dp) : std::string();
  if (spec.backend == Backend::kFused) {
    ATTNKIT_CHECK(prefill_reason.empty(),
                  "forward: backend 'fused' cannot serve the context requests: ", prefill_reason);
    ATTNKIT_CHECK(decode_reason.empty(),
                  "forward: backend 'fused' cannot serve the generation requests: ", decode_reason);
  }
  const bool fused_prefill_call = fused && has_context && prefill_reason.empty();
  const bool fused_decode_call = fused && gen_rows > 0 && decode_reason.empty();

  // The decode part's arguments, and its split workspace checked before anything is enqueued.
  DecodeArgs decode;
  if (gen_rows > 0) {
    decode.kv_cache = cache_rows(args.kv_cache, p.num_context, gen_rows);
    decode.beam_width = args.beam_width;
    decode.cache_indirection = args.cache_indirection;
    decode.num_splits = args.num_splits;
    decode.max_seq_len = p.max_kv_len;
    decode.workspace = args.decode_workspace;
    decode.deterministic = args.deterministic;
    decode.batch_invariant = args.batch_invariant;
    if (fused_decode_call) {
      fused_decode_check_workspace(spec, decode, dp, "forward: decode_workspace");
    }
  }

  StreamBuffer owned;
  uint8_t* workspace = nullptr;
  if (args.workspace.defined()) {
    const int64_t given =
        args.workspace.numel() * static_cast<int64_t>(dtype_size(args.workspace.dtype));
    ATTNKIT_CHECK(args.workspace.device.is_cuda() && args.workspace.is_contiguous(),
                  "forward: workspace must be a contiguous CUDA tensor, got one on ",
                  args.workspace.device.str());
    ATTNKIT_CHECK(
        given >= needed, "forward: workspace needs at least ", needed,
        " bytes (rotated Q num_tokens*Hq*D*elt plus int32 metadata, each part aligned to ",
        kWorkspaceAlign, " bytes), got ", given);
    ATTNKIT_CHECK(reinterpret_cast<uintptr_t>(args.workspace.data) % kWorkspaceAlign == 0,
                  "forward: workspace must be ", kWorkspaceAlign, "-byte aligned");
    workspace = static_cast<uint8_t*>(args.workspace.data);
  } else {
    owned.allocate(static_cast<size_t>(needed), cuda_stream,
                   "forward: cudaMallocAsync of the workspace");
    workspace = static_cast<uint8_t*>(owned.get());
  }
  auto* q_rot = workspace;
  auto* cu_dev = reinterpret_cast<int32_t*>(workspace + q_bytes);
  auto* past_dev = reinterpret_cast<int32_t*>(workspace + q_bytes + cu_bytes);
  auto* positions = reinterpret_cast<int32_t*>(workspace + q_bytes + cu_bytes + past_bytes);
  auto* rows =
      reinterpret_cast<int32_t*>(workspace + q_bytes + cu_bytes + past_bytes + token_bytes);

  // ---- metadata: per-request arrays up, per-token positions and rows on the device.
  upload_int32_async(static_cast<const int32_t*>(args.cu_seqlens_q.data), num_requests + 1, cu_dev,
                     cuda_stream);
  upload_int32_async(static_cast<const int32_t*>(args.past_lens.data), num_requests, past_dev,
                     cuda_stream);
  if (num_tokens > 0) {
    TokenMetaParams meta{cu_dev,     past_dev,     positions,     rows,
                         num_tokens, num_requests, p.num_context, args.beam_width};
    forward_token_meta_kernel<<<static_cast<unsigned>((num_tokens + 255) / 256), 256, 0,
                                cuda_stream>>>(meta);
    check_launch("forward_token_meta_kernel");
  }

  // ---- append_kv on every token.
  AppendKvArgs append;
  append.qkv = args.qkv;
  append.qkv_bias = args.qkv_bias;
  append.positions = TensorView(positions, DType::kInt32, {num_tokens}, p.device);
  append.row_of_token = TensorView(rows, DType::kInt32, {num_tokens}, p.device);
  append.kv_cache = args.kv_cache;
  append.q_out = TensorView(q_rot, p.dtype, {num_tokens, hq, dim}, p.device);
  const detail::AppendKvProblem append_problem = append_problem_of(p, args.qkv_bias.defined());
  if (fused && fused_append_kv_unsupported(spec, append_problem).empty()) {
    AttentionSpec auto_spec = spec;  // misaligned inputs fall back inside forward, not raise
    auto_spec.backend = Backend::kAuto;
    fused_append_kv(auto_spec, append, append_problem, stream);
  } else {
    vanilla_append_kv(spec, append, append_problem, stream);
  }

  // ---- context requests: prefill over the cache (rows 0 .. num_context - 1).
  if (has_context) {
    const KvCacheView ctx_cache = cache_rows(args.kv_cache, 0, p.num_context);
    PrefillArgs prefill;
    prefill.q = TensorView(q_rot, p.dtype, {ctx_tokens, hq, dim}, p.device);
    prefill.cu_seqlens_q = TensorView(cu_dev, DType::kInt32, {p.num_context + 1}, p.device);
    prefill.kv_cache = &ctx_cache;
    prefill.out = token_rows(args.out, 0, ctx_tokens);
    prefill.lse = token_rows(args.lse, 0, ctx_tokens);
    prefill.max_seqlen_q = p.max_context_len;
    prefill.max_seqlen_kv = p.max_context_kv_len;
    if (fused_prefill_call) {
      fused_prefill(spec, prefill, pp, stream);
    } else {
      vanilla_prefill(spec, prefill, pp, stream);
    }
  }

  // ---- generation rows: decode (rows num_context .. num_context + gen_rows - 1).
  if (gen_rows > 0) {
    decode.q = TensorView(q_rot + ctx_tokens * hq * dim * static_cast<int64_t>(dtype_size(p.dtype)),
                          p.dtype, {gen_rows, hq, dim}, p.device);
    decode.out = token_rows(args.out, ctx_tokens, gen_rows);
    decode.lse = token_rows(args.lse, ctx_tokens, gen_rows);
    // The decode part's rows are rows num_context .. of the caller's cache.
    const FaultOpScope decode_rows(Op::kForward, p.num_context);
    if (fused_decode_call) {
      fused_decode(spec, decode, dp, stream);
    } else {
      vanilla_decode(spec, decode, dp, stream);
    }
  }
}

}  // namespace attnkit::cuda
