// DecodeWorkspace: argument checks shared by the CUDA and the CPU-only builds.
#pragma once

#include "attnkit/attention.h"
#include "core/check.h"

namespace attnkit::detail {

struct DecodeWorkspaceSize {
  int64_t counters = 0;       // zeroed 4-byte words: arrival counters, accumulated sums
  int64_t partial_words = 0;  // 4-byte words of the partial outputs and LSEs
};

// 4-byte words of one (split, row, query head)'s partial output, D f32 values (the decode kernel
// stores a split's output unrounded, decode_kernel.cuh), and of the whole partial with its f32
// LSE. The workspace lays out every output, then every LSE.
constexpr int64_t decode_partial_output_words(int64_t head_dim) { return head_dim; }
constexpr int64_t decode_partial_words(int64_t head_dim) {
  return decode_partial_output_words(head_dim) + 1;
}

// Validates the constructor's arguments (naming each) and returns the capacities.
inline DecodeWorkspaceSize decode_workspace_size(const AttentionSpec& spec, int64_t max_rows,
                                                 int32_t max_splits, const Device& device) {
  spec.validate();
  ATTNKIT_CHECK(device.is_cuda(), "DecodeWorkspace: device must be a CUDA device, got ",
                device.str());
  ATTNKIT_CHECK(max_rows >= 1, "DecodeWorkspace: max_rows must be >= 1, got ", max_rows);
  ATTNKIT_CHECK(max_splits >= 2 && max_splits <= DecodeWorkspace::kMaxSplits,
                "DecodeWorkspace: max_splits must be in [2, ", DecodeWorkspace::kMaxSplits,
                "] (calls with one split use no workspace), got ", max_splits);
  DecodeWorkspaceSize size;
  // Head blocks per row (KV heads x head blocks of a group) never exceed the query heads.
  // The zeroed region: per (row, query head) at most a counter and 4 outlier words (head blocks
  // never exceed the query heads), D sums and a denominator of the accumulating merge.
  size.counters = max_rows * spec.num_q_heads * (spec.head_dim + 6);
  size.partial_words =
      max_rows * max_splits * spec.num_q_heads * decode_partial_words(spec.head_dim);
  return size;
}

}  // namespace attnkit::detail
