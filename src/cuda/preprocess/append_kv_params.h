// Runtime parameters of the append_kv kernels (fused and vanilla): bias + RoPE on Q and K at
// per-token positions, K and V into the cache (quantized with its scales), rotated Q out.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "attnkit/attention.h"
#include "core/kv_access.h"
#include "core/problem.h"
#include "core/rope.h"
#include "cuda/common/device_fault.cuh"

namespace attnkit::cuda {

// rotary_dim / 2 for head_dim <= 512: the size of the inverse-frequency table.
inline constexpr int kAppendKvMaxRotaryHalf = 256;
// Units (16-byte vectors or NeoX pairs of them) whose loads one thread of the fused kernel
// issues together, and the CTA size bounds of its plan.
inline constexpr int kAppendKvSteps = 6;
inline constexpr int kAppendKvMaxThreads = 512;
inline constexpr int kAppendKvMinCtaThreads = 64;

// Launch shape of the fused kernel (plan_fused_append_kv): a CTA is units_per_head x
// heads_per_pass x tokens_per_cta threads; thread (w, y, z) moves vector unit w of heads
// y, y + heads_per_pass, ... of token blockIdx.x * tokens_per_cta + z.
struct FusedAppendKvPlan {
  int32_t units_per_head = 0;  // NeoX: paired units, then pass-through vectors; else D / 8
  int32_t paired_units = 0;    // NeoX: rotary_dim / 16 units of two vectors (d, d + rotary/2)
  int32_t heads_per_pass = 0;
  int32_t tokens_per_cta = 0;
  int32_t page_shift = 0;  // paged cache: tokens_per_block == 1 << page_shift
};

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
  // Bounds of the guards (append_kv_destination.cuh), clamped to int32 (positions are int32).
  int32_t num_rows;   // rows row_of_token may name: block-table rows or a contiguous cache's blocks
  int32_t row_slots;  // slots of a row: table_cols x tokens_per_block
  FaultSite fault;    // where a token with a row, position or block outside the cache is recorded
  DType kv_dtype;
  const float* k_scale;  // optional [1] or [Hkv]: stored = round(x / scale)
  const float* v_scale;
  bool k_scale_per_head, v_scale_per_head;

  void* q_out;  // [num_tokens, Hq, D]
  int64_t q_out_stride_token, q_out_stride_head;

  int64_t num_tokens;
  int32_t num_q_heads, num_kv_heads, head_dim;
  detail::RopeParams rope;
  // Scaled inverse frequencies of the rotary pairs, computed on the host in double exactly like
  // the reference (rope_inv_freq<double>), so the kernel never evaluates pow.
  double inv_freq[kAppendKvMaxRotaryHalf];
  FusedAppendKvPlan plan;
};

AppendKvParams make_append_kv_params(const AttentionSpec& spec, const AppendKvArgs& args,
                                     const detail::AppendKvProblem& p);

// Fills params.plan for the fused kernel: each thread moves up to `steps` heads of a token in one
// round of loads, and tokens share a CTA until it has min_cta_threads.
void plan_fused_append_kv(AppendKvParams& params, int32_t steps = kAppendKvSteps,
                          int32_t min_cta_threads = kAppendKvMinCtaThreads);

void launch_vanilla_append_kv(const AppendKvParams& params, cudaStream_t stream);

// Fused kernel, one explicit instantiation file per input dtype (append_kv_fused_<dtype>.cu).
template <DType kIn>
void launch_fused_append_kv(const AppendKvParams& params, cudaStream_t stream);

}  // namespace attnkit::cuda
