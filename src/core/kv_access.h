// KvLayout: the one accessor of a (paged or contiguous, possibly cyclic) KV cache, shared by the
// reference backend (host) and the CUDA kernels (device). A trivially copyable struct that goes
// into kernel Params as it is. See include/attnkit/kv_cache.h for the addressing rules: an element
// lies at block * block_stride_bytes + token * token_stride_bytes + head * head_stride_bytes +
// d * element_bytes, whichever layout (HND or NHD) the strides come from.
#pragma once

#include <cstdint>

#include "attnkit/kv_cache.h"
#include "core/numerics.h"

namespace attnkit::detail {

struct KvLayout {
  uint8_t* k_base = nullptr;  // K of block 0
  uint8_t* v_base = nullptr;  // V of block 0
  int64_t block_stride_bytes = 0;
  int64_t token_stride_bytes = 0;  // slot t to t + 1 of a block: HND D * elt, NHD Hkv * D * elt
  int64_t head_stride_bytes = 0;   // KV head h to h + 1: HND T * D * elt, NHD D * elt
  const int32_t* block_table = nullptr;  // [rows, block_table_row_stride]; nullptr: contiguous
  int64_t block_table_row_stride = 0;    // elements between rows of block_table
  int32_t num_blocks = 0;                // valid block ids: [0, num_blocks)
  int32_t table_cols = 1;                // block-table columns (max blocks of a row); 1: contiguous
  int32_t tokens_per_block = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t element_bytes = 0;
  int32_t window_slots = 0;  // 0: not cyclic
  int32_t sink_tokens = 0;

  // Slots of a row: what a linear row's length may reach (a cyclic row wraps inside it).
  ATTNKIT_HD int64_t row_capacity() const {
    return static_cast<int64_t>(table_cols) * tokens_per_block;
  }
  ATTNKIT_HD int64_t slot_of(int64_t position) const {
    if (window_slots == 0 || position < sink_tokens) return position;
    return sink_tokens + (position - sink_tokens) % window_slots;
  }
  // Block id that holds logical slot `slot` of block-table row `row`.
  ATTNKIT_HD int64_t block_of(int64_t row, int64_t slot) const {
    return block_table ? block_table[row * block_table_row_stride + slot / tokens_per_block] : row;
  }
  // Byte offset, from k_base or v_base, of element 0 of KV head `head` at slot `token` of block
  // `block` (the start of one head's head_dim elements).
  ATTNKIT_HD int64_t row_offset(int64_t block, int64_t token, int32_t head) const {
    return block * block_stride_bytes + token * token_stride_bytes +
           static_cast<int64_t>(head) * head_stride_bytes;
  }
  // Byte offset, from k_base or v_base, of element d of KV head `head` at logical slot `slot`.
  ATTNKIT_HD int64_t byte_offset(int64_t row, int64_t slot, int32_t head, int32_t d) const {
    return row_offset(block_of(row, slot), slot % tokens_per_block, head) +
           static_cast<int64_t>(d) * element_bytes;
  }
  ATTNKIT_HD uint8_t* k_ptr(int64_t row, int64_t position, int32_t head, int32_t d = 0) const {
    return k_base + byte_offset(row, slot_of(position), head, d);
  }
  ATTNKIT_HD uint8_t* v_ptr(int64_t row, int64_t position, int32_t head, int32_t d = 0) const {
    return v_base + byte_offset(row, slot_of(position), head, d);
  }
};

inline KvLayout make_kv_layout(const KvCacheView& view) {
  KvLayout layout;
  layout.k_base = static_cast<uint8_t*>(view.k_base);
  layout.v_base = static_cast<uint8_t*>(view.v_base);
  layout.block_stride_bytes = view.block_stride_bytes;
  if (view.paged) {
    layout.block_table = static_cast<const int32_t*>(view.block_table.data);
    layout.block_table_row_stride = view.block_table.strides[0];
  }
  layout.num_blocks = view.num_blocks;
  layout.table_cols = static_cast<int32_t>(view.max_blocks_per_row());
  layout.tokens_per_block = view.tokens_per_block;
  layout.num_kv_heads = view.num_kv_heads;
  layout.head_dim = view.head_dim;
  layout.element_bytes = static_cast<int32_t>(dtype_size(view.dtype));
  layout.token_stride_bytes = view.token_stride() * layout.element_bytes;
  layout.head_stride_bytes = view.head_stride() * layout.element_bytes;
  layout.window_slots = view.window_slots;
  layout.sink_tokens = view.sink_tokens;
  return layout;
}

}  // namespace attnkit::detail
