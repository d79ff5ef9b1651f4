// Runtime parameters of the append_kv kernels (fused and vanilla): bias + RoPE on Q and K at
// per-token positions, K and V into the cache (quantized with its scales), rotated Q out.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "attnkit/attention.h"
#include "core/kv_access.h"
#include "core/problem.h"
#include "core/rope.h"

namespace attnkit::cuda {

struct AppendKvParams {
  // Inputs, element offset token * stride_token + head * stride_head + d. With a fused qkv
  // tensor the three point into it (K after Hq heads, V after Hq + Hkv heads).
  const void* q_in;  // [num_tokens, Hq, D]
  const void* k_in;  // [num_tokens, Hkv, D]
  const void* v_in;  // [num_tokens, Hkv, D]
  int64_t q_stride_token, q_stride_head;
  int64_t k_stride_token, k_stride_head;
  int64_t v_stride_token, v_stride_head;
  const void* bias;  // optional [(Hq + 2 * Hkv) * D]: Q heads, K heads, V heads
  DType in_dtype;    // inputs, bias and q_out

  const int32_t* positions;     // int32 [num_tokens]: absolute position of each token
  const int32_t* row_of_token;  // int32 [num_tokens]: block-table row of each token

  detail::KvLayout layout;  // destination cache
  DType kv_dtype;
  const float* k_scale;  // optional [1] or [Hkv]: stored = round(x / scale)
  const float* v_scale;
  bool k_scale_per_head, v_scale_per_head;

  void* q_out;  // [num_tokens, Hq, D]
  int64_t q_out_stride_token, q_out_stride_head;

  int64_t num_tokens;
  int32_t num_q_heads, num_kv_heads, head_dim;
  detail::RopeParams rope;
};

AppendKvParams make_append_kv_params(const AttentionSpec& spec, const AppendKvArgs& args,
                                     const detail::AppendKvProblem& p);

void launch_vanilla_append_kv(const AppendKvParams& params, cudaStream_t stream);

// Fused kernel, one explicit instantiation file per input dtype (append_kv_fused_<dtype>.cu).
template <DType kIn>
void launch_fused_append_kv(const AppendKvParams& params, cudaStream_t stream);

}  // namespace attnkit::cuda
