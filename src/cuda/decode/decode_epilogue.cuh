// The mma.sync decode kernel's output store: the warps' merged states (merge_o, weighted by
// merge_w) written as this CTA's output, directly (one split: the query's type) or as the split's
// partial (f32, merged by the last CTA or decode_merge). The accumulating merge's store stays in
// decode_kernel.
#pragma once

#include <cstdint>

#include "cuda/decode/decode_params.h"

namespace attnkit::cuda {

// Stores the kItems output items of this thread (items threadIdx.x + j kThreads of the CTA's
// heads_here x kD outputs). The items are computed with unguarded shared loads (rows of padding
// heads exist and are finite) so that their loads issue together, then stored: one item after
// another's stores took ~700 cycles of the split epilogue. The kernel's values come by const
// reference: passed by value, `split` reached the kernel's fault check after the store as
// blockIdx.x / head_blocks, which was compared again (3 more PTX instructions) and renumbered the
// registers of every head_dim-128 kernel; by reference, the SASS is the inline store's.
template <typename Traits, typename QT, int kItems>
__device__ __forceinline__ void decode_store_output(const DecodeParams& p, float4* const& merge_w,
                                                    float* const& merge_o, const int& row,
                                                    const int& split, const int& first_head,
                                                    const int& out_items) {
  constexpr int kD = Traits::kHeadDim;
  constexpr int kM = Traits::kM;
  constexpr int kMB = kDecodeHeadsPerCta;
  constexpr int kMergeStride = Traits::kMergeStride;
  float value[kItems];
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int i = min(static_cast<int>(threadIdx.x) + j * Traits::kThreads, kM * kD - 1);
    const int r = i / kD, d = i % kD;
    const int w0 = (r / kMB) * Traits::kKeyWarps, rr = r % kMB;
    const float4 w = merge_w[r];
    const float* o_w = merge_o + (w0 * kMB + rr) * kMergeStride + d;
    value[j] = w.x * o_w[0] + w.y * o_w[kMB * kMergeStride] + w.z * o_w[2 * kMB * kMergeStride] +
               w.w * o_w[3 * kMB * kMergeStride];
  }
  if (p.num_splits == 1) {
    QT* out = static_cast<QT*>(p.out) + row * p.out_row_stride + first_head * p.out_head_stride;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int i = threadIdx.x + j * Traits::kThreads;
      if (i < out_items) out[(i / kD) * p.out_head_stride + i % kD] = QT(value[j]);
    }
  } else {
    // The split's output stays f32: rounding it to the query's type (as FlashInfer's tmp_v in
    // the output type) halved the bytes the merge reads (bf16 1 x 32k +1.4%) but rounded every
    // output twice, and that extra rounding, relative to the split's mean (larger than the
    // row's where the splits' means cancel), broke the error bound of docs/testing.md on fresh
    // data (`DecodeSplit.PartialsKeepTheRangeOfTheOutputType`: 388.7 against a bound of 366.9).
    float* out =
        p.partial_out +
        ((static_cast<int64_t>(split) * p.num_rows + row) * p.num_q_heads + first_head) * kD;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int i = threadIdx.x + j * Traits::kThreads;
      if (i < out_items) out[i] = value[j];
    }
  }
}

}  // namespace attnkit::cuda
