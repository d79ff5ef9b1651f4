// The split-KV merge's weights of one (row, query head), shared by the in-kernel merge
// (decode_kernel.cuh) and the merge kernel of its own (decode_merge.cu), and the mark of a split
// whose guards failed.
#pragma once

#include <cmath>
#include <cstdint>

namespace attnkit::cuda {

// The LSE a split writes for every head of its (row, KV head, head block) when a device guard
// failed in its keys (a block id outside the pool, a cache_indirection entry outside the beams):
// a NaN whose payload no arithmetic produces (the GPU's arithmetic NaN is 0x7fffffff). A merge
// that meets it in any split of an item writes the item's outputs as zeros and its LSEs as -inf,
// whatever the other splits hold, so a fault found by one split zeroes the whole row (every KV
// head's CTAs read the same block-table and indirection entries, so each item of the row meets
// the fault in the same split).
constexpr uint32_t kDecodeFaultedLseBits = 0x7fc0fa17u;

#if defined(__CUDACC__)

__device__ __forceinline__ float decode_faulted_lse() {
  return __uint_as_float(kDecodeFaultedLseBits);
}
__device__ __forceinline__ bool decode_lse_faulted(float lse) {
  return __float_as_uint(lse) == kDecodeFaultedLseBits;
}

// The head's split LSEs are spread over a warp, kPerLane a lane (split lane + 32 i; -inf past the
// split count and for empty splits, which wrote zero outputs), and `m` holds each lane's max of
// them on entry. Writes weights[s] = exp(lse_s - m) / sum_s' exp(lse_s' - m) for s < num_splits (0
// for -inf) with m the warp's max, and returns the sum (0 when every split is empty), m then the
// warp's max: the head's LSE is m + log(sum). When any split holds the faulted mark
// (decode_faulted_lse), `faulted` is set (in every lane), every weight is 0 and the sum is 0.
// Called by whole warps.
template <int kPerLane>
__device__ __forceinline__ float split_weights(float (&lse)[kPerLane], float& m, int num_splits,
                                               int lane, float* weights, bool& faulted) {
  bool mark = false;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) mark = mark || decode_lse_faulted(lse[i]);
  faulted = __any_sync(0xffffffffu, mark);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));
  }
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    lse[i] = lse[i] == -INFINITY ? 0.0f : __expf(lse[i] - m);
    sum += lse[i];
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (faulted) sum = 0.0f;
  const float inv_sum = sum > 0.0f ? 1.0f / sum : 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int s = lane + 32 * i;
    if (s < num_splits) weights[s] = faulted ? 0.0f : lse[i] * inv_sum;
  }
  return sum;
}

#endif  // __CUDACC__

}  // namespace attnkit::cuda
