// DecodeWorkspace: argument checks shared by the CUDA and the CPU-only builds.
#pragma once

#include "attnkit/attention.h"
#include "core/check.h"

namespace attnkit::detail {

struct DecodeWorkspaceSize {
  int64_t counters = 0;        // int32 arrival counters
  int64_t partial_floats = 0;  // float partial outputs and LSEs
};

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
  size.counters = max_rows * spec.num_q_heads;
  size.partial_floats = max_rows * max_splits * spec.num_q_heads * (spec.head_dim + 1);
  return size;
}

}  // namespace attnkit::detail
