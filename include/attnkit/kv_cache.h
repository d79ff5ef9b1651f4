// KvCacheView: how the kernels and the reference address a paged (or contiguous) KV cache.
//
// Block b holds K at k_base + b * block_stride_bytes and V likewise at v_base + b *
// block_stride_bytes, in one of two layouts (`layout`):
//   HND: [num_kv_heads, tokens_per_block, head_dim] (a head's tokens are contiguous; the default)
//   NHD: [tokens_per_block, num_kv_heads, head_dim] (a token's heads are contiguous: vLLM's,
//        flash_attn's and FlashInfer's default paged layout)
// so element d of KV head h at slot t of the block is at byte
//   b * block_stride_bytes + (t * token_stride() + h * head_stride() + d) * element size.
// With one pool per layer, [num_blocks, 2, <block>] gives v_base = k_base + Hkv*T*D*elt and a
// stride of 2*Hkv*T*D*elt; one pool for all layers ([num_blocks, L, 2, <block>]) only changes the
// base and the stride.
//
// A sequence (a block-table row) with seq_lens[r] tokens stores position p in logical slot
//   slot(p) = p                                      (no cyclic window)
//   slot(p) = p < S ? p : S + (p - S) % window_slots (cyclic sliding-window cache, S sinks)
// and logical slot s lives in block block_table[r][s / T] at offset s % T. Entries of -1 are
// never read.
#pragma once

#include <cstdint>

#include "attnkit/types.h"

namespace attnkit {

// The order of a block's elements (see above). Every kernel and the reference read both.
enum class KvCacheLayout : int32_t {
  kHND = 0,  // [Hkv, T, D]
  kNHD = 1,  // [T, Hkv, D]
};
// "HND" / "NHD" ("unknown" for a value outside the enum).
const char* kv_layout_name(KvCacheLayout layout);

struct KvCacheView {
  void* k_base = nullptr;          // K of block 0
  void* v_base = nullptr;          // V of block 0
  int64_t block_stride_bytes = 0;  // bytes from block b to block b + 1 (same for K and V)
  int32_t num_blocks = 0;          // valid block ids are 0 .. num_blocks - 1
  DType dtype = DType::kBF16;      // kBF16, kF16, kFp8E4M3 or kInt8
  Device device{};
  int32_t num_kv_heads = 0;
  int32_t tokens_per_block = 0;  // paged: 8, 16, 32, 64 or 128; contiguous: the capacity
  int32_t head_dim = 0;
  bool paged = true;  // false: contiguous, row r uses block r and block_table is not read
  KvCacheLayout layout = KvCacheLayout::kHND;  // the order of a block's elements

  // int32 [num_rows, max_blocks_per_seq]: block ids of each row (sequence or beam).
  TensorView block_table;
  // int32 [num_rows]: tokens of each row, counting the ones written by this step.
  TensorView seq_lens;

  // float32 [1] (per tensor) or [num_kv_heads] (per KV head); required for kFp8E4M3 / kInt8,
  // optional (default 1) for kBF16 / kF16. stored = round(x / scale), x = stored * scale.
  TensorView k_scale;
  TensorView v_scale;

  // Cyclic sliding-window cache: 0 = not cyclic. Otherwise W' slots after the sink tokens
  // (W rounded up to whole blocks plus one block, see docs/semantics.md).
  int32_t window_slots = 0;
  int32_t sink_tokens = 0;  // S: positions < S keep slots 0 .. S-1 (cyclic cache only)

  int64_t num_rows() const { return seq_lens.defined() ? seq_lens.shape[0] : 0; }
  // A contiguous cache has one block (of tokens_per_block slots) per row; its block_table is
  // never read, even when given.
  int64_t max_blocks_per_row() const {
    return paged && block_table.defined() ? block_table.shape[1] : 1;
  }
  // Logical slot of absolute position p (see above).
  int64_t slot_of(int64_t position) const {
    if (window_slots == 0 || position < sink_tokens) return position;
    return sink_tokens + (position - sink_tokens) % window_slots;
  }
  // Capacity of a row in tokens (slots).
  int64_t row_capacity() const { return max_blocks_per_row() * tokens_per_block; }
  // Elements from slot t to slot t + 1 of a block, and from KV head h to h + 1 (see above).
  int64_t token_stride() const {
    return layout == KvCacheLayout::kNHD ? int64_t{num_kv_heads} * head_dim : int64_t{head_dim};
  }
  int64_t head_stride() const {
    return layout == KvCacheLayout::kNHD ? int64_t{head_dim} : int64_t{tokens_per_block} * head_dim;
  }
};

// The cyclic capacity W' for a window of `window` tokens (docs/semantics.md): the window
// rounded up to whole blocks plus one block. Windows up to INT32_MAX - 2 * tokens_per_block
// give a W' that fits (KvCacheManager rejects larger ones).
inline int32_t cyclic_window_slots(int32_t window, int32_t tokens_per_block) {
  const int64_t t = tokens_per_block;
  return static_cast<int32_t>(((int64_t{window} + t - 1) / t + 1) * t);
}

}  // namespace attnkit
