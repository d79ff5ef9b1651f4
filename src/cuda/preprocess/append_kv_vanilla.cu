// The naive append_kv: one block per (token, head), the head vector in shared memory, every dtype
// and RoPE variant at run time.
#include "cuda/common/cuda_status.h"
#include "cuda/common/element_io.cuh"
#include "cuda/preprocess/append_kv_destination.cuh"
#include "cuda/preprocess/append_kv_params.h"

namespace attnkit::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kMaxHeadDim = 512;

__global__ void __launch_bounds__(kThreads)
    vanilla_append_kv_kernel(const __grid_constant__ AppendKvParams params) {
  __shared__ float x[kMaxHeadDim];
  const int64_t token = blockIdx.x;
  const int32_t head = blockIdx.y;  // Q heads, then K heads, then V heads
  const int32_t hq = params.num_q_heads, hkv = params.num_kv_heads, dim = params.head_dim;
  const bool is_q = head < hq;
  const bool is_k = !is_q && head < hq + hkv;
  const int32_t local = is_q ? head : (is_k ? head - hq : head - hq - hkv);
  const void* in = is_q ? params.q_in : (is_k ? params.k_in : params.v_in);
  const int64_t in_offset =
      is_q ? token * params.q_stride_token + local * params.q_stride_head
           : (is_k ? token * params.k_stride_token + local * params.k_stride_head
                   : token * params.v_stride_token + local * params.v_stride_head);
  for (int d = threadIdx.x; d < dim; d += kThreads) {
    float value = load_element(in, params.in_dtype, in_offset + d);
    if (params.bias != nullptr)
      value += load_element(params.bias, params.in_dtype, int64_t{head} * dim + d);
    x[d] = value;
  }
  __syncthreads();
  const int64_t position = params.positions[token];
  // Every block of the token checks where the token writes; the first Q head's block records.
  const int32_t page_shift = __ffs(params.layout.tokens_per_block) - 1;  // paged: a power of 2
  AppendKvDestination dst_slot;
  const bool writes =
      append_kv_destination(params, token, static_cast<int32_t>(position), page_shift, &dst_slot);
  if (!writes && head == 0 && threadIdx.x == 0) {
    record_append_kv_fault(params, token, page_shift);
  }
  if (!(is_q || is_k) || params.rope.style == RopeStyle::kNone) {
  } else {
    for (int i = threadIdx.x; i < params.rope.rotary_dim / 2; i += kThreads) {
      // In double like the reference: the naive kernel trades speed for agreement.
      double c, s;
      detail::rope_cos_sin<double>(params.rope, position, i, &c, &s);
      int32_t a, b;
      detail::rope_pair_dims(params.rope, i, &a, &b);
      const double xa = x[a], xb = x[b];
      x[a] = static_cast<float>(xa * c - xb * s);
      x[b] = static_cast<float>(xb * c + xa * s);
    }
    __syncthreads();
  }
  if (is_q) {
    // A faulting token's rotated Q is zeros (docs/safety.md).
    const int64_t out_offset = token * params.q_out_stride_token + local * params.q_out_stride_head;
    for (int d = threadIdx.x; d < dim; d += kThreads)
      store_element(params.q_out, params.in_dtype, out_offset + d, writes ? x[d] : 0.0f);
    return;
  }
  if (!writes) return;
  const float scale = is_k ? kv_scale_of(params.k_scale, params.k_scale_per_head, local)
                           : kv_scale_of(params.v_scale, params.v_scale_per_head, local);
  const detail::KvLayout& layout = params.layout;
  uint8_t* dst = (is_k ? layout.k_base : layout.v_base) +
                 layout.row_offset(dst_slot.block, dst_slot.in_block, local);
  for (int d = threadIdx.x; d < dim; d += kThreads)
    store_element(dst, params.kv_dtype, d, x[d] / scale);
}

}  // namespace

void launch_vanilla_append_kv(const AppendKvParams& params, cudaStream_t stream) {
  if (params.num_tokens == 0) return;
  ATTNKIT_CHECK(params.head_dim <= kMaxHeadDim,
                "vanilla append_kv on CUDA: head_dim must be <= ", kMaxHeadDim, ", got ",
                params.head_dim);
  const dim3 grid(static_cast<unsigned>(params.num_tokens),
                  static_cast<unsigned>(params.num_q_heads + 2 * params.num_kv_heads));
  vanilla_append_kv_kernel<<<grid, kThreads, 0, stream>>>(params);
  check_launch("vanilla_append_kv_kernel");
}

}  // namespace attnkit::cuda
