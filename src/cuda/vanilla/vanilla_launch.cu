// backend=vanilla on CUDA tensors: prefill, decode and dense through the naive kernel.
#include <algorithm>
#include <limits>

#include "core/check.h"
#include "cuda/common/cuda_status.h"
#include "cuda/common/device_fault.h"
#include "cuda/cuda_backend.h"
#include "cuda/vanilla/vanilla_attention.cuh"

namespace attnkit::cuda {
namespace {

void fill_cache_fields(const KvCacheView& cache, VanillaAttentionParams& params) {
  params.from_cache = true;
  params.layout = detail::make_kv_layout(cache);
  params.kv_dtype = cache.dtype;
  params.seq_lens = static_cast<const int32_t*>(cache.seq_lens.data);
  params.seq_len_bound =
      cache.window_slots > 0 ? std::numeric_limits<int64_t>::max() : cache.row_capacity();
  params.k_scale = static_cast<const float*>(cache.k_scale.data);
  params.v_scale = static_cast<const float*>(cache.v_scale.data);
  params.k_scale_per_head = cache.k_scale.defined() && cache.k_scale.numel() > 1;
  params.v_scale_per_head = cache.v_scale.defined() && cache.v_scale.numel() > 1;
}

void fill_lse(const TensorView& lse, int token_dim, VanillaAttentionParams& params) {
  params.lse = static_cast<float*>(lse.data);
  if (!lse.defined()) return;
  params.lse_stride_batch = token_dim > 0 ? lse.strides[0] : 0;
  params.lse_stride_token = lse.strides[token_dim];
  params.lse_stride_head = lse.strides[token_dim + 1];
}

}  // namespace

void vanilla_prefill(const AttentionSpec& spec, const PrefillArgs& args,
                     const detail::PrefillProblem& p, Stream stream) {
  ATTNKIT_CHECK(!spec.skip_softmax,
                "prefill: backend 'vanilla' on CUDA does not skip tiles; skip_softmax runs on the "
                "fused kernels (backend 'fused' or 'auto') and on the CPU reference");
  VanillaAttentionParams params{};
  fill_vanilla_spec_fields(spec, params);
  params.fault = fault_site(Op::kPrefill);
  params.dtype = p.dtype;
  params.mode = VanillaQueryMode::kVarlen;
  params.num_tokens = p.total_q;
  params.batch = p.batch;
  params.cu_seqlens_q = static_cast<const int32_t*>(args.cu_seqlens_q.data);
  params.q = args.q.data;
  params.q_stride_token = args.q.strides[0];
  params.q_stride_head = args.q.strides[1];
  params.out = args.out.data;
  params.out_stride_token = args.out.strides[0];
  params.out_stride_head = args.out.strides[1];
  fill_lse(args.lse, 0, params);
  if (args.kv_cache != nullptr) {
    fill_cache_fields(*args.kv_cache, params);
  } else {
    params.from_cache = false;
    params.kv_dtype = p.kv_dtype;
    params.k = args.k.data;
    params.v = args.v.data;
    params.k_stride_token = args.k.strides[0];
    params.k_stride_head = args.k.strides[1];
    params.v_stride_token = args.v.strides[0];
    params.v_stride_head = args.v.strides[1];
    params.cu_seqlens_kv = static_cast<const int32_t*>(args.cu_seqlens_kv.data);
    params.total_kv = p.total_kv;
  }
  launch_vanilla_attention(params, as_cuda_stream(stream));
  // The vanilla kernel has no tiles: SkipStats of zeros.
  if (args.skip_stats.defined()) {
    check_cuda(cudaMemsetAsync(args.skip_stats.data, 0, sizeof(SkipStats), as_cuda_stream(stream)),
               "prefill: zeroing skip_stats");
  }
}

void vanilla_decode(const AttentionSpec& spec, const DecodeArgs& args,
                    const detail::DecodeProblem& p, Stream stream) {
  VanillaAttentionParams params{};
  fill_vanilla_spec_fields(spec, params);
  params.fault = fault_site(Op::kDecode);
  params.dtype = p.dtype;
  params.mode = VanillaQueryMode::kDecode;
  params.num_tokens = p.num_rows;
  params.q = args.q.data;
  params.q_stride_token = args.q.strides[0];
  params.q_stride_head = args.q.strides[1];
  params.out = args.out.data;
  params.out_stride_token = args.out.strides[0];
  params.out_stride_head = args.out.strides[1];
  fill_lse(args.lse, 0, params);
  fill_cache_fields(args.kv_cache, params);
  params.beam_width = args.beam_width;
  if (args.cache_indirection.defined()) {
    params.cache_indirection = static_cast<const int32_t*>(args.cache_indirection.data);
    params.ind_stride_seq = args.cache_indirection.strides[0];
    params.ind_stride_beam = args.cache_indirection.strides[1];
    params.ind_stride_token = args.cache_indirection.strides[2];
    // Key t of a row reads cache_indirection[s, b, t]: t < seq_len <= max_seq.
    params.seq_len_bound = std::min(params.seq_len_bound, args.cache_indirection.shape[2]);
  }
  launch_vanilla_attention(params, as_cuda_stream(stream));
}

void vanilla_dense(const AttentionSpec& spec, const DenseArgs& args, const detail::DenseProblem& p,
                   Stream stream) {
  ATTNKIT_CHECK(!spec.skip_softmax && !spec.quant,
                "vanilla dense on CUDA: skip_softmax/SAGE not implemented; use the CPU reference "
                "(spec.skip_softmax is ",
                spec.skip_softmax ? "set" : "unset", ", spec.quant is ",
                spec.quant ? "set" : "unset", ")");
  VanillaAttentionParams params{};
  fill_vanilla_spec_fields(spec, params);
  params.dtype = p.dtype;
  params.kv_dtype = p.dtype;
  params.mode = VanillaQueryMode::kDense;
  params.num_tokens = static_cast<int64_t>(p.batch) * p.seqlen_q;
  params.dense_seqlen_q = p.seqlen_q;
  params.dense_seqlen_kv = p.seqlen_kv;
  params.q = args.q.data;
  params.q_stride_batch = args.q.strides[0];
  params.q_stride_token = args.q.strides[1];
  params.q_stride_head = args.q.strides[2];
  params.out = args.out.data;
  params.out_stride_batch = args.out.strides[0];
  params.out_stride_token = args.out.strides[1];
  params.out_stride_head = args.out.strides[2];
  fill_lse(args.lse, 1, params);
  params.from_cache = false;
  params.k = args.k.data;
  params.v = args.v.data;
  params.k_stride_batch = args.k.strides[0];
  params.k_stride_token = args.k.strides[1];
  params.k_stride_head = args.k.strides[2];
  params.v_stride_batch = args.v.strides[0];
  params.v_stride_token = args.v.strides[1];
  params.v_stride_head = args.v.strides[2];
  launch_vanilla_attention(params, as_cuda_stream(stream));
  // Nothing is skipped, and the vanilla kernel has no tiles: zero counts.
  if (args.stats != nullptr) *args.stats = DenseStats{};
  if (args.skip_stats.defined()) {
    check_cuda(
        cudaMemsetAsync(args.skip_stats.data, 0, 2 * sizeof(int64_t), as_cuda_stream(stream)),
        "dense: zeroing skip_stats");
  }
}

}  // namespace attnkit::cuda
