// The split-KV merge's weights of one (row, query head), shared by the in-kernel merge
// (decode_kernel.cuh) and the merge kernel of its own (decode_merge.cu).
#pragma once

#include <cmath>

namespace attnkit::cuda {

// The head's split LSEs are spread over a warp, kPerLane a lane (split lane + 32 i; -inf past the
// split count and for empty splits, which wrote zero outputs), and `m` holds each lane's max of
// them on entry. Writes weights[s] = exp(lse_s - m) / sum_s' exp(lse_s' - m) for s < num_splits (0
// for -inf) with m the warp's max, and returns the sum (0 when every split is empty), m then the
// warp's max: the head's LSE is m + log(sum).
template <int kPerLane>
__device__ __forceinline__ float split_weights(float (&lse)[kPerLane], float& m, int num_splits,
                                               int lane, float* weights) {
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
  const float inv_sum = sum > 0.0f ? 1.0f / sum : 0.0f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int s = lane + 32 * i;
    if (s < num_splits) weights[s] = lse[i] * inv_sum;
  }
  return sum;
}

}  // namespace attnkit::cuda
