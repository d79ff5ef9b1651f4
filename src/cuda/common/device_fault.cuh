// Device side of the fault status word (include/attnkit/device_errors.h, docs/safety.md): what a
// guarded kernel calls when a value it read from device memory (a block id, a length, a position,
// a cu_seqlens or cache_indirection entry) would take it outside its tensors. The caller skips
// the access and writes the row as zeros; record_fault() keeps the first fault for the host.
//
// Kernels get the word through a FaultSite in their Params (cuda::fault_site(), launch side in
// device_fault.h). A guard costs a compare per page or tile, not per element: check the block
// id once where the page's address is formed, the length once per row.
#pragma once

#include <cstdint>

#include "attnkit/device_errors.h"
#include "core/kv_access.h"

namespace attnkit::cuda {

// The status word of the launching device and the op (attnkit::Op) the kernel serves. A
// default-constructed site records nothing (the guards still skip the access).
struct FaultSite {
  DeviceFault* word = nullptr;
  int32_t op = 0;
  // Added to the block-table row of a kBlockTable, kSeqLens or kPositions fault: a launch over
  // the rows [table_row_offset, ...) of the caller's cache (forward()'s decode part) reports
  // the caller's row.
  int32_t table_row_offset = 0;
};

#if defined(__CUDACC__)

// Keeps the first fault since the last check whole (state 0 -> 1 -> 2 under an atomicCAS) and
// counts every fault. Cold path: call it only after a guard failed. The inlined form is for
// kernels at the 255-register bound (the portable prefill kM128W4 kernels), where a call's ABI
// registers move ptxas' allocation and add spills even where the call is never taken; they call
// it at a work item's exits only. Everything else calls record_fault().
__device__ __forceinline__ void record_fault_inline(const FaultSite& site, FaultKind kind,
                                                    FaultArg arg, int64_t row, int64_t index,
                                                    int64_t value, int64_t bound) {
  DeviceFault* word = site.word;
  if (word == nullptr) return;
  atomicAdd(&word->count, 1ull);
  if (atomicCAS(&word->state, 0, 1) != 0) return;
  word->kind = static_cast<int32_t>(kind);
  word->op = site.op;
  word->arg = static_cast<int32_t>(arg);
  const bool table_row =
      arg == FaultArg::kBlockTable || arg == FaultArg::kSeqLens || arg == FaultArg::kPositions;
  word->row = table_row ? row + site.table_row_offset : row;
  word->index = index;
  word->value = value;
  word->bound = bound;
  __threadfence();  // the fields before the state that publishes them
  atomicExch(&word->state, 2);
}
inline __device__ __noinline__ void record_fault(const FaultSite& site, FaultKind kind,
                                                 FaultArg arg, int64_t row, int64_t index,
                                                 int64_t value, int64_t bound) {
  record_fault_inline(site, kind, arg, row, index, value, bound);
}

// The guards. Each returns true when the value is in range and otherwise records the fault.

// A block id read from a block table: valid ids are [0, num_blocks); -1 (no block) is a fault
// where the block is read.
__device__ __forceinline__ bool guard_block_id(const FaultSite& site, int32_t block,
                                               int32_t num_blocks, int64_t row, int64_t column) {
  if (static_cast<uint32_t>(block) < static_cast<uint32_t>(num_blocks)) return true;
  record_fault(site, FaultKind::kBlockId, FaultArg::kBlockTable, row, column, block, num_blocks);
  return false;
}

// The block that holds page `page` (< kv.table_cols: the caller checked the row's length) of
// block-table row `row`, or -1 after recording a fault when the entry is not a block of the pool.
// A contiguous cache (no table) answers `row`. One load and one compare per page.
__device__ __forceinline__ int32_t guarded_block(const FaultSite& site, const detail::KvLayout& kv,
                                                 int64_t row, int64_t page) {
  if (kv.block_table == nullptr) return static_cast<int32_t>(row);
  const int32_t block = kv.block_table[row * kv.block_table_row_stride + page];
  return guard_block_id(site, block, kv.num_blocks, row, page) ? block : -1;
}

// A row length in [0, capacity] (capacity = max_blocks_per_seq x tokens_per_block for a linear
// cache; a cyclic cache passes INT64_MAX).
__device__ __forceinline__ bool guard_seq_len(const FaultSite& site, int64_t seq_len,
                                              int64_t capacity, int64_t row) {
  if (seq_len >= 0 && seq_len <= capacity) return true;
  record_fault(site, FaultKind::kSeqLen, FaultArg::kSeqLens, row, 0, seq_len, capacity);
  return false;
}

// A value in [0, bound) of `kind` (positions' slots, row_of_token, cache_indirection beams).
__device__ __forceinline__ bool guard_index(const FaultSite& site, FaultKind kind, FaultArg arg,
                                            int64_t value, int64_t bound, int64_t row,
                                            int64_t index) {
  if (value >= 0 && value < bound) return true;
  record_fault(site, kind, arg, row, index, value, bound);
  return false;
}

// cu_seqlens[index] = value after cu_seqlens[index - 1] = previous, within [0, extent].
__device__ __forceinline__ bool guard_cu_seqlens(const FaultSite& site, FaultArg arg, int64_t index,
                                                 int64_t value, int64_t previous, int64_t extent) {
  if (value < 0 || value > extent) {
    record_fault(site, FaultKind::kCuSeqlensRange, arg, index - 1, index, value, extent);
    return false;
  }
  if (value < previous) {
    record_fault(site, FaultKind::kCuSeqlensOrder, arg, index - 1, index, value, previous);
    return false;
  }
  return true;
}

#endif  // __CUDACC__

}  // namespace attnkit::cuda
