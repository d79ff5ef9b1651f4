// merge_states on CUDA: one warp per (token, head); the weights come from the two LSEs in fp32.
#include <cmath>

#include "cuda/common/cuda_status.h"
#include "cuda/common/element_io.cuh"
#include "cuda/cuda_backend.h"

namespace attnkit::cuda {
namespace {

constexpr int kMergeThreads = 128;

struct StridedOut {
  void* data;
  DType dtype;
  int64_t stride_token, stride_head;  // elements; d is contiguous-or-strided below
  int64_t stride_d;
};
struct StridedLse {
  float* data;  // nullptr: not given
  int64_t stride_token, stride_head;
};

struct MergeStatesParams {
  StridedOut out_a, out_b, out;  // [N, H, D]
  StridedLse lse_a, lse_b, lse;  // float32 [N, H]
  int64_t num_tokens;
  int32_t num_heads;
  int32_t head_dim;
};

__device__ int64_t out_offset(const StridedOut& t, int64_t n, int32_t h, int32_t d) {
  return n * t.stride_token + h * t.stride_head + d * t.stride_d;
}

__global__ void __launch_bounds__(kMergeThreads)
    merge_states_kernel(const __grid_constant__ MergeStatesParams params) {
  const int64_t pair = static_cast<int64_t>(blockIdx.x) * (kMergeThreads / 32) + threadIdx.x / 32;
  if (pair >= params.num_tokens * params.num_heads) return;
  const int64_t n = pair / params.num_heads;
  const int32_t h = static_cast<int32_t>(pair % params.num_heads);
  const float la = params.lse_a.data[n * params.lse_a.stride_token + h * params.lse_a.stride_head];
  const float lb = params.lse_b.data[n * params.lse_b.stride_token + h * params.lse_b.stride_head];
  const float m = fmaxf(la, lb);
  const bool empty = m == -INFINITY;
  const float wa = empty ? 0.0f : expf(la - m);
  const float wb = empty ? 0.0f : expf(lb - m);
  const float sum = wa + wb;
  const float inv = empty ? 0.0f : 1.0f / sum;
  for (int d = threadIdx.x % 32; d < params.head_dim; d += 32) {
    float value = 0.0f;
    // A side with weight 0 is not read: its output may be anything (even NaN) for an empty set.
    if (wa > 0.0f)
      value += wa * load_element(params.out_a.data, params.out_a.dtype,
                                 out_offset(params.out_a, n, h, d));
    if (wb > 0.0f)
      value += wb * load_element(params.out_b.data, params.out_b.dtype,
                                 out_offset(params.out_b, n, h, d));
    store_element(params.out.data, params.out.dtype, out_offset(params.out, n, h, d), value * inv);
  }
  if (params.lse.data != nullptr && threadIdx.x % 32 == 0) {
    params.lse.data[n * params.lse.stride_token + h * params.lse.stride_head] =
        empty ? -INFINITY : m + logf(sum);
  }
}

StridedOut strided_out(const TensorView& t) {
  return {t.data, t.dtype, t.strides[0], t.strides[1], t.strides[2]};
}
StridedLse strided_lse(const TensorView& t) {
  if (!t.defined()) return {nullptr, 0, 0};
  return {static_cast<float*>(t.data), t.strides[0], t.strides[1]};
}

}  // namespace

void merge_states(const MergeStatesArgs& args, const detail::MergeStatesProblem& p, Stream stream) {
  MergeStatesParams params{};
  params.out_a = strided_out(args.out_a);
  params.out_b = strided_out(args.out_b);
  params.out = strided_out(args.out);
  params.lse_a = strided_lse(args.lse_a);
  params.lse_b = strided_lse(args.lse_b);
  params.lse = strided_lse(args.lse);
  params.num_tokens = p.num_tokens;
  params.num_heads = p.num_heads;
  params.head_dim = p.head_dim;
  const int64_t pairs = p.num_tokens * p.num_heads;
  if (pairs == 0) return;
  const int64_t blocks = (pairs + kMergeThreads / 32 - 1) / (kMergeThreads / 32);
  merge_states_kernel<<<static_cast<unsigned>(blocks), kMergeThreads, 0, as_cuda_stream(stream)>>>(
      params);
  check_launch("merge_states_kernel");
}

}  // namespace attnkit::cuda
