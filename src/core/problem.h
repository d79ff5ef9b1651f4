// Validated problem descriptions. validate_*() check every argument of an entry point (shapes,
// strides, dtypes, devices and, for tensors in host memory, values such as lengths and block
// ids) and return the derived sizes; backends receive only validated calls.
#pragma once

#include <cstdint>

#include "attnkit/attention.h"

namespace attnkit::detail {

struct PrefillProblem {
  Device device{};
  DType dtype = DType::kBF16;      // q / out (and packed k / v)
  DType kv_dtype = DType::kBF16;   // packed: == dtype; paged: the cache dtype
  DType out_dtype = DType::kBF16;  // == dtype, except for fp8 q (bf16 or f16)
  bool paged = false;
  int32_t batch = 0;
  int64_t total_q = 0;
  int64_t total_kv = 0;  // packed mode only
  int32_t max_seqlen_q = 0;
  int32_t max_seqlen_kv = 0;
  bool has_lse = false;
};
PrefillProblem validate_prefill(const AttentionSpec& spec, const PrefillArgs& args);

struct DecodeProblem {
  Device device{};
  DType dtype = DType::kBF16;
  DType kv_dtype = DType::kBF16;
  int64_t num_rows = 0;  // sequences x beams
  int32_t beam_width = 1;
  int32_t max_seq_len = 0;  // upper bound of seq_lens
  bool has_lse = false;
  bool has_indirection = false;
};
DecodeProblem validate_decode(const AttentionSpec& spec, const DecodeArgs& args);

struct AppendKvProblem {
  Device device{};
  DType dtype = DType::kBF16;
  DType kv_dtype = DType::kBF16;
  int64_t num_tokens = 0;
  bool fused_qkv = true;
  bool has_bias = false;
};
AppendKvProblem validate_append_kv(const AttentionSpec& spec, const AppendKvArgs& args);

struct ForwardProblem {
  Device device{};
  DType dtype = DType::kBF16;
  DType kv_dtype = DType::kBF16;
  int64_t num_tokens = 0;
  int64_t num_context_tokens = 0;
  int32_t num_context = 0;         // context requests
  int32_t num_generation = 0;      // generation requests
  int32_t max_context_len = 0;     // longest chunk
  int32_t max_kv_len = 0;          // longest row after the step
  int32_t max_context_kv_len = 0;  // longest context request's row after the step
  bool has_lse = false;
};
ForwardProblem validate_forward(const AttentionSpec& spec, const ForwardArgs& args);

struct DenseProblem {
  Device device{};
  DType dtype = DType::kBF16;
  int32_t batch = 0;
  int32_t seqlen_q = 0;
  int32_t seqlen_kv = 0;
  bool has_lse = false;
};
DenseProblem validate_dense(const AttentionSpec& spec, const DenseArgs& args);

struct MergeStatesProblem {
  Device device{};
  DType dtype = DType::kF32;
  int64_t num_tokens = 0;
  int32_t num_heads = 0;
  int32_t head_dim = 0;
  bool has_lse = false;
};
MergeStatesProblem validate_merge_states(const MergeStatesArgs& args);

}  // namespace attnkit::detail
