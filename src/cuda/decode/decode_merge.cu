// The split-KV merge as a kernel of its own, for split calls whose items (row, KV head, head
// block) hold so many partials that one merging CTA each would be the call's tail
// (decode_separate_merge): one warp, or for calls of few (row, query head) pairs one CTA of four
// warps, per (row, query head), so that the merge is spread over the SMs. The decode grid then
// writes its partials and returns (no counters); this kernel follows it on the stream, on sm_90+
// as a programmatic dependent whose CTAs wait (griddepcontrol.wait) for the decode grid to
// complete before reading its partials.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "core/check.h"
#include "cuda/common/cuda_status.h"
#include "cuda/common/launch.cuh"
#include "cuda/common/memory_sm90.cuh"
#include "cuda/decode/decode_launch.h"
#include "cuda/decode/split_weights.cuh"

namespace attnkit::cuda {
namespace {

constexpr int kMergeWarps = 4;
constexpr int kLsePerLane = kDecodeMaxSplits / 32;
// Partial vectors a lane loads before it adds any: the loads of one batch are in flight together
// (a merge of 64 splits over four warps is one batch a lane).
constexpr int kLoadBatch = 8;

// out[row, head] = sum_s w_s partial_s with w_s = exp(lse_s - m) / sum_s' exp(lse_s' - m),
// lse = m + log(sum); splits without keys have LSE -inf (and zero outputs): weight 0. A row whose
// splits are all empty gives zeros and LSE -inf, and so does a (row, head) whose splits include
// one that a device guard stopped (its LSE holds decode_faulted_lse()). The kernel reads no device
// metadata itself: the split count and the workspace's extent come from the host, so no length
// can take it outside the partials. kWarpsPerItem warps share one (row, head): the
// first computes the weights, each sums its share of the splits, the first adds the shares. The
// bound's 4 CTAs an SM frees ptxas's register budget: without it, it sank the batch's loads
// between the adds (one load in flight a lane, 43 registers); with it, the 8 issue together (72).
template <typename QT, int kWarpsPerItem>
__global__ void __launch_bounds__(kMergeWarps * 32, 4)
    decode_merge_splits_kernel(const __grid_constant__ DecodeParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (p.pdl) {
    griddep_wait();
    griddep_launch_dependents();
  }
#endif
  constexpr int kItemsPerCta = kMergeWarps / kWarpsPerItem;
  __shared__ float weights[kItemsPerCta][kDecodeMaxSplits];
  // Per warp: the output sums of each lane (at most 32 lanes of 8 floats).
  __shared__ float sums[kMergeWarps][32 * 8];
  // Per item: a split holds the faulted mark (split_weights.cuh): zeros and LSE -inf.
  __shared__ int faulted_item[kItemsPerCta];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int local = warp / kWarpsPerItem, part = warp % kWarpsPerItem;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kItemsPerCta + local;  // row x Hq + head
  // No early return: the warps of an item meet at barriers.
  const bool valid = item < static_cast<int64_t>(p.num_rows) * p.num_q_heads;
  const int row = static_cast<int>(item / p.num_q_heads);
  const int head = static_cast<int>(item % p.num_q_heads);
  const int num_splits = p.num_splits;
  const int64_t split_stride = static_cast<int64_t>(p.num_rows) * p.num_q_heads;

  if (valid && part == 0) {
    float lse[kLsePerLane];
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < kLsePerLane; ++i) {
      const int s = lane + 32 * i;
      lse[i] = s < num_splits ? __ldcg(p.partial_lse + s * split_stride + item) : -INFINITY;
      m = fmaxf(m, lse[i]);
    }
    bool faulted;
    const float sum = split_weights(lse, m, num_splits, lane, weights[local], faulted);
    if (lane == 0) {
      faulted_item[local] = faulted;
      if (p.lse != nullptr) {
        p.lse[row * p.lse_row_stride + head * p.lse_head_stride] =
            sum > 0.0f ? m + logf(sum) : -INFINITY;
      }
    }
  }
  __syncthreads();

  // The head's D values are `vecs` vectors of 8 floats (two 16-byte loads); a warp's lanes form
  // `groups` groups of `vecs` lanes (head_dim 80 and 96 leave lanes idle), the item's warps
  // kWarpsPerItem x groups groups in all; lane (group, v) sums vector v over the splits group,
  // group + all_groups, ...
  const int vecs = p.head_dim / 8;
  const int groups = 32 / vecs;
  const int all_groups = groups * kWarpsPerItem;
  const int g = lane / vecs, v = lane % vecs;
  const int group = part * groups + g;
  float acc[8] = {};
  if (valid && g < groups) {
    const float4* src = reinterpret_cast<const float4*>(p.partial_out + item * p.head_dim) + 2 * v;
    const int64_t step = split_stride * (p.head_dim / 4);  // one split, in 16-byte loads
    for (int first = group; first < num_splits; first += kLoadBatch * all_groups) {
      // The batch's weights first, then its loads unpredicated (past the last split: the last
      // split again, weight 0), so that all of them issue before the first add.
      float w[kLoadBatch];
#pragma unroll
      for (int j = 0; j < kLoadBatch; ++j) {
        const int s = first + j * all_groups;
        w[j] = s < num_splits ? weights[local][s] : 0.0f;
      }
      float4 raw[kLoadBatch][2];
#pragma unroll
      for (int j = 0; j < kLoadBatch; ++j) {
        const float4* at = src + min(first + j * all_groups, num_splits - 1) * step;
        raw[j][0] = __ldcg(at);
        raw[j][1] = __ldcg(at + 1);
      }
#pragma unroll
      for (int j = 0; j < kLoadBatch; ++j) {
        acc[0] += w[j] * raw[j][0].x;
        acc[1] += w[j] * raw[j][0].y;
        acc[2] += w[j] * raw[j][0].z;
        acc[3] += w[j] * raw[j][0].w;
        acc[4] += w[j] * raw[j][1].x;
        acc[5] += w[j] * raw[j][1].y;
        acc[6] += w[j] * raw[j][1].z;
        acc[7] += w[j] * raw[j][1].w;
      }
    }
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) sums[warp][lane * 8 + k] = acc[k];
  __syncthreads();
  if (!valid || part != 0 || g != 0) return;
  float out_value[8] = {};
  for (int w = 0; w < kWarpsPerItem; ++w) {
    for (int other = 0; other < groups; ++other) {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        out_value[k] += sums[local * kWarpsPerItem + w][(other * vecs + v) * 8 + k];
      }
    }
  }
  const bool faulted = faulted_item[local] != 0;
  QT* out = static_cast<QT*>(p.out) + row * p.out_row_stride + head * p.out_head_stride + 8 * v;
#pragma unroll
  for (int k = 0; k < 8; ++k) out[k] = QT(faulted ? 0.0f : out_value[k]);
}

template <typename QT>
void launch_merge(const DecodeParams& params, bool programmatic, int warps_per_item,
                  cudaStream_t stream) {
  const int64_t items = static_cast<int64_t>(params.num_rows) * params.num_q_heads;
  const int64_t items_per_cta = kMergeWarps / warps_per_item;
  const dim3 grid(static_cast<unsigned>((items + items_per_cta - 1) / items_per_cta));
  auto kernel = warps_per_item == 1 ? decode_merge_splits_kernel<QT, 1>
                                    : decode_merge_splits_kernel<QT, kMergeWarps>;
  launch_maybe_programmatic(kernel, grid, dim3(kMergeWarps * 32), 0, stream, programmatic, params,
                            "decode_merge_splits_kernel");
}

}  // namespace

int decode_merge_warps_per_item(int64_t items, int sm_count) {
  return items >= sm_count ? 1 : kMergeWarps;
}

void launch_decode_merge(const DecodeParams& p, DType q_dtype, bool programmatic,
                         int warps_per_item, cudaStream_t stream) {
  ATTNKIT_CHECK(warps_per_item == 1 || warps_per_item == kMergeWarps,
                "decode: split merge warps_per_item must be 1 or ", kMergeWarps, ", got ",
                warps_per_item);
  DecodeParams params = p;
  params.pdl = programmatic ? 1 : 0;
  if (q_dtype == DType::kBF16) {
    launch_merge<__nv_bfloat16>(params, programmatic, warps_per_item, stream);
  } else if (q_dtype == DType::kF16) {
    launch_merge<__half>(params, programmatic, warps_per_item, stream);
  } else {
    detail::fail("decode: no split merge for q dtype ", dtype_name(q_dtype));
  }
}

}  // namespace attnkit::cuda
