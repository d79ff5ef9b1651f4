// Index maps of the FP8 kernel (Sm90PrefillTraits::kFp8, docs/prefill_design.md "FP8"): the V
// transpose of the producer (staging ring -> V^T ring) and the P registers of the consumers.
// Host-includable, so that tests/cpu/prefill_fp8_layout_test.cc checks on the CPU that the
// transpose writes every V^T byte once, conflict-free, and that P V pairs each probability with
// the V row of its own key.
#pragma once

#include <cstdint>

#include "core/numerics.h"  // ATTNKIT_HD

namespace attnkit::cuda::prefill::fp8_layout {

// A V tile of 128 keys, transposed: V^T is [head_dim rows x 128 keys], one 128-byte swizzled row
// a head dim (16-byte chunk c of row d at chunk c ^ (d % 8)).
constexpr int kVtKeys = 128;

// The key that V^T column k holds. In each 32-key step the columns are permuted so that the
// 8-bit A operand of P V takes the S accumulator's values as they lie: a thread holds, in a row,
// the keys {2t, 2t+1, 8+2t, 9+2t} (+16) of a step, and the A operand's k = 4t..4t+3 (+16).
ATTNKIT_HD int vt_key(int k) {
  return (k & ~31) | (k & 16) | (((k >> 1) & 1) << 3) | (((k >> 2) & 3) << 1) | (k & 1);
}

// The inverse of vt_key: the column (of its 32-key step) that holds key k.
ATTNKIT_HD int vt_column_of_key(int k) {
  return (k & ~31) | (k & 16) | (((k >> 3) & 1) << 1) | (((k >> 1) & 3) << 2) | (k & 1);
}

// P registers: byte j of A-operand register r (0..3) of a k32 step is the step's accumulator
// element p_source(r, j) (of 16: element 4 i + 2 rr + e is n8 block i, row half rr, column
// 2 t + e). Register r covers row half r % 2, k = 16 (r / 2) + 4 t + j.
ATTNKIT_HD int p_source(int r, int j) { return 8 * (r / 2) + 2 * (r % 2) + (j % 2) + 4 * (j / 2); }

// The transpose's work split: step (n, m) of lane 4a + b moves head dims d0..d0+3 of the four
// keys of V^T column quad q (columns 4q..4q+3).
ATTNKIT_HD int transpose_d0(int lane, int n) { return 4 * (lane / 4 + 8 * n); }
ATTNKIT_HD int transpose_quad(int lane, int m) { return 4 * ((lane / 4 + m) % 8) + lane % 4; }
// Key j (0..3) of column quad q: vt_key(4 q + j).
ATTNKIT_HD int quad_key(int q, int j) {
  return 32 * (q >> 3) + 16 * ((q >> 2) & 1) + 2 * (q & 3) + (j & 1) + 8 * (j >> 1);
}

// Byte offset of head dims d0..d0+3 of key `key` in the staged tile ([128 keys x head_dim] as
// TMA writes it: 128-byte swizzled column blocks of 128 dims, col_block_bytes apart).
ATTNKIT_HD uint32_t staged_offset(int key, int d0, int col_block_bytes) {
  return static_cast<uint32_t>((d0 / 128) * col_block_bytes + key * 128 +
                               ((((d0 % 128) / 16) ^ (key & 7)) << 4) + d0 % 16);
}

// Byte offset of columns k0..k0+3 of V^T row d.
ATTNKIT_HD uint32_t vt_offset(int d, int k0) {
  return static_cast<uint32_t>(d * 128 + (((k0 / 16) ^ (d & 7)) << 4) + k0 % 16);
}

}  // namespace attnkit::cuda::prefill::fp8_layout
