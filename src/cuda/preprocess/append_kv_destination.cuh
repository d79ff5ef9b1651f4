// Where an append_kv token writes, with the guards of docs/safety.md: the token's row_of_token,
// its position's slot and the block-table entry of that slot are compared with the cache before
// any address is formed. Shared by the fused and the vanilla kernel, once per token.
#pragma once

#include <cstdint>

#include "cuda/common/device_fault.cuh"
#include "cuda/preprocess/append_kv_params.h"

namespace attnkit::cuda {

// Block id and slot inside the block that token `token` (at `position`) writes.
struct AppendKvDestination {
  int32_t block;
  int32_t in_block;
};

// The 32-bit slot of `position` in a row (cyclic caches wrap after the sinks).
__device__ __forceinline__ int32_t append_kv_slot(const detail::KvLayout& layout,
                                                  int32_t position) {
  if (layout.window_slots == 0 || position < layout.sink_tokens) return position;
  return layout.sink_tokens +
         static_cast<int32_t>(static_cast<uint32_t>(position - layout.sink_tokens) %
                              static_cast<uint32_t>(layout.window_slots));
}

// True with the token's destination, false when it has none: row_of_token outside
// [0, num_rows), a slot outside [0, row capacity) (a linear row's position past its table, a
// negative position; a cyclic slot wraps inside the row), or a block-table entry outside
// [0, num_blocks). A refused token writes nothing to the cache and zeros to q_out; its fault is
// recorded by record_append_kv_fault(). No call on this path: the kernels check while their
// input loads are in flight, and a call there would make the compiler keep them in registers
// around it. page_shift: log2(tokens_per_block) of a paged cache (unused for a contiguous one).
__device__ __forceinline__ bool append_kv_destination(const AppendKvParams& params, int64_t token,
                                                      int32_t position, int32_t page_shift,
                                                      AppendKvDestination* dst) {
  const detail::KvLayout& layout = params.layout;
  // Unsigned compares: a negative row or slot is a large one.
  const int32_t row = params.row_of_token[token];
  if (static_cast<uint32_t>(row) >= static_cast<uint32_t>(params.num_rows)) return false;
  const int32_t slot = append_kv_slot(layout, position);
  if (static_cast<uint32_t>(slot) >= static_cast<uint32_t>(params.row_slots)) return false;
  if (layout.block_table == nullptr) {  // contiguous: row r is block r, and row < num_blocks
    dst->block = row;
    dst->in_block = slot;
    return true;
  }
  const int32_t block =
      layout.block_table[row * layout.block_table_row_stride + (slot >> page_shift)];
  if (static_cast<uint32_t>(block) >= static_cast<uint32_t>(layout.num_blocks)) return false;
  dst->block = block;
  dst->in_block = slot & ((1 << page_shift) - 1);
  return true;
}

// Records the fault of a token that append_kv_destination() refused: the first failed check, in
// its order (kRowIndex on row_of_token, kPosition on positions with the row's capacity as the
// bound, kBlockId on the block table with the page as the index). Cold: after the token's
// zeros are written, once per token. It reads the token's metadata again rather than have the
// kernel keep it in registers until then.
__device__ __forceinline__ void record_append_kv_fault(const AppendKvParams& params, int64_t token,
                                                       int32_t page_shift) {
  const FaultSite& site = params.fault;
  const detail::KvLayout& layout = params.layout;
  const int32_t position = params.positions[token];
  const int32_t row = params.row_of_token[token];
  if (!guard_index(site, FaultKind::kRowIndex, FaultArg::kRowOfToken, row, params.num_rows, row,
                   token)) {
    return;
  }
  const int32_t slot = append_kv_slot(layout, position);
  if (static_cast<uint32_t>(slot) >= static_cast<uint32_t>(params.row_slots)) {
    record_fault(site, FaultKind::kPosition, FaultArg::kPositions, row, token, position,
                 layout.row_capacity());
    return;
  }
  if (layout.block_table != nullptr) guarded_block(site, layout, row, slot >> page_shift);
}

}  // namespace attnkit::cuda
