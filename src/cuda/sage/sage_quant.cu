// The SAGE quantize pass (docs/diffusion.md, "The quantize pass on the GPU"): Q, K and V of a
// dense or packed call to the codes and scales of sage_quant_params.h, bit for bit those of the
// CPU reference (src/reference/dense_ref.cc). Three kernels:
//   1. stats + Q:  per (sequence, KV head, channel) the fp64 sum, |sum| and lowest set bit of K and
//                  max |V| (atomics into a zeroed buffer); Q per block (it needs no statistic).
//   2. finalize:   k_mean and v_scale per (sequence, KV head, channel).
//   3. K + V:      K - mean per block; V / v_scale to fp8, transposed into V^T.
// K and V are read twice (the mean and the channel amax span the whole sequence), Q once.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "core/check.h"
#include "cuda/common/cuda_status.h"
#include "cuda/common/device_fault.h"
#include "cuda/sage/sage_quant_kernels.cuh"
#include "cuda/sage/sage_quant_launch.h"

namespace attnkit::cuda::sage {
namespace {

// ---- kernels ------------------------------------------------------------------------------------

// blockIdx.x = sequence x (Hkv + Hq) roles: KV head h (statistics) or query head (codes).
template <DType kIn, bool kInt8>
__global__ void __launch_bounds__(kThreads)
    sage_stats_and_q_kernel(const __grid_constant__ SageQuantParams p) {
  __shared__ double buffer[kThreads * 8];
  const int32_t roles = p.num_kv_heads + p.num_q_heads;
  const int64_t b = blockIdx.x / roles;
  const int32_t role = blockIdx.x % roles;
  // One thread of one CTA per sequence records each side's bad entries.
  const bool recorder = blockIdx.y == 0 && threadIdx.x == 0;
  if (role < p.num_kv_heads) {
    const SeqSpan span = sequence_span(p.kv_seqs, b, recorder && role == 0 ? &p.fault : nullptr);
    if (static_cast<int64_t>(blockIdx.y) * kTokensPerCta >= span.len) return;
    accumulate_kv_stats<kIn>(p, b, role, span, buffer);
    return;
  }
  const int32_t h = role - p.num_kv_heads;
  const SeqSpan span = sequence_span(p.q_seqs, b, recorder && h == 0 ? &p.fault : nullptr);
  if (!span.ok) return;
  const int64_t row = static_cast<int64_t>(p.num_q_heads) * p.head_dim;
  quantize_blocks<kIn, kInt8, false>(
      p.q.data, input_base(p.q, p.q_seqs, b, span, h), p.q.stride_token,
      static_cast<uint8_t*>(p.out.q) + span.start * row + static_cast<int64_t>(h) * p.head_dim, row,
      p.out.q_scale + h * p.out.q_scale_stride + scale_slot(span.start, b, 0, p.q_block_size),
      span.len, p.q_block_size, p.head_dim, nullptr);
}

// One thread per (sequence, KV head, channel).
template <DType kIn>
__global__ void __launch_bounds__(kThreads)
    sage_finalize_kernel(const __grid_constant__ SageQuantParams p) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int32_t dim = p.head_dim;
  if (i >= static_cast<int64_t>(p.batch) * p.num_kv_heads * dim) return;
  const int32_t d = static_cast<int32_t>(i % dim);
  const int32_t h = static_cast<int32_t>(i / dim % p.num_kv_heads);
  const int64_t b = i / (static_cast<int64_t>(dim) * p.num_kv_heads);
  const SeqSpan span = sequence_span(p.kv_seqs, b, nullptr);
  if (!span.ok) return;
  const SageKvStats stats = p.stats[i];
  double sum = stats.k_sum;
  if (!k_sum_is_exact(stats)) {
    // Rounding happened somewhere: only the reference's own order gives its bits. Rare (values
    // spanning more than 2^52 of range), and then one channel's tokens in order.
    sum = 0.0;
    const int64_t base = input_base(p.k, p.kv_seqs, b, span, h) + d;
    for (int64_t t = 0; t < span.len; ++t) sum += load1<kIn>(p.k.data, base + t * p.k.stride_token);
  }
  p.out.k_mean[i] = span.len > 0 ? static_cast<float>(sum / static_cast<double>(span.len)) : 0.0f;
  p.out.v_scale[i] = codes::fp8_block_scale(__uint_as_float(stats.v_amax_bits));
}

// V of one (sequence, KV head) / v_scale to fp8 codes, through the shared tile into V^T.
template <DType kIn>
__device__ __forceinline__ void quantize_v_transposed(const SageQuantParams& p, int64_t b,
                                                      int32_t h, const SeqSpan& span, uint8_t* tile,
                                                      const float* v_scale) {
  const int32_t dim = p.head_dim;
  const TokenLanes lanes = token_lanes(dim, 8);
  const int64_t base = input_base(p.v, p.kv_seqs, b, span, h) + lanes.c;
  uint8_t* dst =
      p.out.v_t + static_cast<int64_t>(h) * dim * p.out.v_t_stride + vt_seq_column(span.start, b);
  for_each_vt_tile(span.len, tile, dst, p.out.v_t_stride, dim, [&](int64_t t0, int cols) {
    if (lanes.r >= lanes.rows) return;
    for (int tt = lanes.r; tt < cols; tt += lanes.rows) {
      float x[8];
      load8<kIn>(p.v.data, base + (t0 + tt) * p.v.stride_token, x);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        tile[(lanes.c + i) * kVtTilePitch + tt] = codes::quantize_fp8(x[i], v_scale[lanes.c + i]);
      }
    }
  });
}

// blockIdx.x = sequence x 2 Hkv roles: K codes of KV head h, or V^T of KV head h.
template <DType kIn, bool kInt8>
__global__ void __launch_bounds__(kThreads)
    sage_k_and_v_kernel(const __grid_constant__ SageQuantParams p) {
  __shared__ __align__(16) uint8_t tile[kMaxDim * kVtTilePitch];
  __shared__ float channel[kMaxDim];  // K: the mean; V: the scale
  const int32_t dim = p.head_dim;
  const int32_t roles = 2 * p.num_kv_heads;
  const int64_t b = blockIdx.x / roles;
  const int32_t h = blockIdx.x % roles % p.num_kv_heads;
  const bool is_v = blockIdx.x % roles >= p.num_kv_heads;
  const SeqSpan span = sequence_span(p.kv_seqs, b, nullptr);
  if (!span.ok) return;
  const int64_t first = (b * p.num_kv_heads + h) * dim;
  for (int d = threadIdx.x; d < dim; d += kThreads) {
    channel[d] = is_v ? p.out.v_scale[first + d] : p.out.k_mean[first + d];
  }
  __syncthreads();
  if (is_v) return quantize_v_transposed<kIn>(p, b, h, span, tile, channel);
  const int64_t row = static_cast<int64_t>(p.num_kv_heads) * dim;
  quantize_blocks<kIn, kInt8, true>(
      p.k.data, input_base(p.k, p.kv_seqs, b, span, h), p.k.stride_token,
      static_cast<uint8_t*>(p.out.k) + span.start * row + static_cast<int64_t>(h) * dim, row,
      p.out.k_scale + h * p.out.k_scale_stride + scale_slot(span.start, b, 0, p.k_block_size),
      span.len, p.k_block_size, dim, channel);
}

// ---- host ---------------------------------------------------------------------------------------

constexpr size_t kRegionAlign = 256;
constexpr int64_t kMaxGridY = 65535;

size_t align_region(size_t bytes) {
  return (bytes + kRegionAlign - 1) / kRegionAlign * kRegionAlign;
}

bool is_block_size(int32_t size) { return size == 1 || size == 4 || size == 16; }

void check_shape(const SageQuantShape& s) {
  constexpr const char* kWhat = "sage quantize";
  ATTNKIT_CHECK(s.batch >= 0, kWhat, ": batch: accepted >= 0, got ", s.batch);
  ATTNKIT_CHECK(s.total_q >= 0 && s.total_q <= INT32_MAX, kWhat,
                ": total_q: accepted 0 .. 2147483647 tokens, got ", s.total_q);
  ATTNKIT_CHECK(s.total_kv >= 0 && s.total_kv <= INT32_MAX - kVtColumnAlign, kWhat,
                ": total_kv: accepted 0 .. 2147483632 tokens, got ", s.total_kv);
  ATTNKIT_CHECK(s.num_q_heads >= 1 && s.num_kv_heads >= 1, kWhat,
                ": num_q_heads and num_kv_heads: accepted >= 1, got ", s.num_q_heads, " and ",
                s.num_kv_heads);
  ATTNKIT_CHECK(s.head_dim >= 16 && s.head_dim <= kMaxHeadDim && s.head_dim % 16 == 0, kWhat,
                ": head_dim: accepted multiples of 16 in 16 .. 256, got ", s.head_dim);
  ATTNKIT_CHECK(s.quant.dtype_qk == DType::kInt8 || s.quant.dtype_qk == DType::kFp8E4M3, kWhat,
                ": quant.dtype_qk: accepted int8 or fp8_e4m3, got ", dtype_name(s.quant.dtype_qk));
  ATTNKIT_CHECK(is_block_size(s.quant.q_block_size) && is_block_size(s.quant.k_block_size), kWhat,
                ": quant.q_block_size and quant.k_block_size: accepted 1, 4 or 16, got ",
                s.quant.q_block_size, " and ", s.quant.k_block_size);
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// A tensor the 16-byte vector loads can read: base aligned, strides whole vectors of
// `vector_elements` elements.
void check_input(const char* what, const char* name, const SageInput& in, bool read,
                 int64_t vector_elements, bool uniform) {
  if (!read) return;
  ATTNKIT_CHECK(in.data != nullptr, what, ": ", name, ": a device pointer is required");
  ATTNKIT_CHECK(aligned16(in.data), what, ": ", name, ": the base must be 16-byte aligned");
  const int64_t strides[] = {uniform ? in.stride_batch : 0, in.stride_token, in.stride_head};
  for (int64_t stride : strides) {
    ATTNKIT_CHECK(stride >= 0 && stride % vector_elements == 0, what, ": ", name,
                  ": strides must be non-negative multiples of ", vector_elements,
                  " elements (16 bytes), got ", stride);
  }
}

// Uniform sides hold batch x seqlen tokens; packed sides have cu_seqlens. Returns the longest
// sequence the grid is sized for.
int64_t check_sequences(const char* what, const char* name, const int32_t* cu, int64_t seqlen,
                        int32_t batch, int64_t total) {
  ATTNKIT_CHECK(seqlen >= 0, what, ": ", name, ": accepted >= 0, got ", seqlen);
  if (cu == nullptr) {
    ATTNKIT_CHECK(static_cast<int64_t>(batch) * seqlen == total, what, ": ", name,
                  ": without cu_seqlens every sequence holds it: batch x ", name,
                  " must equal the total of ", total, " tokens, got ", batch, " x ", seqlen);
    return seqlen;
  }
  return seqlen > 0 ? std::min(seqlen, total) : total;
}

unsigned grid_rows(int64_t max_len) {
  return static_cast<unsigned>(
      std::clamp<int64_t>((max_len + kTokensPerCta - 1) / kTokensPerCta, 1, kMaxGridY));
}

template <DType kIn, bool kInt8>
void enqueue(const SageQuantParams& params, int64_t max_q, int64_t max_kv, cudaStream_t stream) {
  const int64_t batch = params.batch;
  const dim3 stats_grid(static_cast<unsigned>(batch * (params.num_kv_heads + params.num_q_heads)),
                        grid_rows(std::max(max_q, max_kv)));
  sage_stats_and_q_kernel<kIn, kInt8><<<stats_grid, kThreads, 0, stream>>>(params);
  check_launch("sage_stats_and_q_kernel");
  const int64_t channels = batch * params.num_kv_heads * params.head_dim;
  sage_finalize_kernel<kIn>
      <<<static_cast<unsigned>((channels + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
          params);
  check_launch("sage_finalize_kernel");
  const dim3 kv_grid(static_cast<unsigned>(batch * 2 * params.num_kv_heads), grid_rows(max_kv));
  sage_k_and_v_kernel<kIn, kInt8><<<kv_grid, kThreads, 0, stream>>>(params);
  check_launch("sage_k_and_v_kernel");
}

}  // namespace

SageWorkspaceLayout sage_workspace_layout(const SageQuantShape& s) {
  check_shape(s);
  const auto dim = static_cast<size_t>(s.head_dim);
  const auto channels = static_cast<size_t>(s.batch) * s.num_kv_heads * dim;
  SageWorkspaceLayout layout;
  size_t offset = 0;
  auto take = [&](size_t bytes) {
    const size_t at = offset;
    offset = align_region(offset + bytes);
    return at;
  };
  layout.q_scale_stride = scale_row_stride(s.total_q, s.batch, s.quant.q_block_size);
  layout.k_scale_stride = scale_row_stride(s.total_kv, s.batch, s.quant.k_block_size);
  layout.v_t_stride = vt_row_stride(s.total_kv, s.batch);
  layout.q = take(static_cast<size_t>(s.total_q) * s.num_q_heads * dim);
  layout.k = take(static_cast<size_t>(s.total_kv) * s.num_kv_heads * dim);
  layout.v_t = take(static_cast<size_t>(s.num_kv_heads) * dim * layout.v_t_stride);
  layout.q_scale = take(sizeof(float) * s.num_q_heads * layout.q_scale_stride);
  layout.k_scale = take(sizeof(float) * s.num_kv_heads * layout.k_scale_stride);
  layout.stats = take(sizeof(SageKvStats) * channels);
  layout.zeroed_bytes = offset - layout.q_scale;
  layout.v_scale = take(sizeof(float) * channels);
  layout.k_mean = take(sizeof(float) * channels);
  layout.bytes = offset;
  return layout;
}

SageQuantized sage_quantized_views(const SageQuantShape& shape, void* workspace) {
  const SageWorkspaceLayout layout = sage_workspace_layout(shape);
  auto* base = static_cast<uint8_t*>(workspace);
  SageQuantized out;
  out.q = base + layout.q;
  out.q_scale = reinterpret_cast<float*>(base + layout.q_scale);
  out.q_scale_stride = layout.q_scale_stride;
  out.k = base + layout.k;
  out.k_scale = reinterpret_cast<float*>(base + layout.k_scale);
  out.k_scale_stride = layout.k_scale_stride;
  out.v_t = base + layout.v_t;
  out.v_t_stride = layout.v_t_stride;
  out.v_scale = reinterpret_cast<float*>(base + layout.v_scale);
  out.k_mean = reinterpret_cast<float*>(base + layout.k_mean);
  return out;
}

SageQuantized launch_sage_quantize(const SageQuantArgs& args, cudaStream_t stream) {
  constexpr const char* kWhat = "sage quantize";
  const SageQuantShape& shape = args.shape;
  const SageWorkspaceLayout layout = sage_workspace_layout(shape);
  ATTNKIT_CHECK(args.input_dtype == DType::kBF16 || args.input_dtype == DType::kF16, kWhat,
                ": q, k, v: accepted bf16 or f16, got ", dtype_name(args.input_dtype));
  ATTNKIT_CHECK(args.workspace != nullptr && reinterpret_cast<uintptr_t>(args.workspace) % 256 == 0,
                kWhat, ": workspace: a 256-byte aligned device pointer is required");
  ATTNKIT_CHECK(args.workspace_bytes >= layout.bytes, kWhat, ": workspace: ", layout.bytes,
                " bytes are required (sage_workspace_bytes), got ", args.workspace_bytes);
  const int64_t max_q = check_sequences(kWhat, "seqlen_q", args.cu_seqlens_q, args.seqlen_q,
                                        shape.batch, shape.total_q);
  const int64_t max_kv = check_sequences(kWhat, "seqlen_kv", args.cu_seqlens_kv, args.seqlen_kv,
                                         shape.batch, shape.total_kv);
  check_input(kWhat, "q", args.q, shape.total_q > 0, 8, args.cu_seqlens_q == nullptr);
  check_input(kWhat, "k", args.k, shape.total_kv > 0, 8, args.cu_seqlens_kv == nullptr);
  check_input(kWhat, "v", args.v, shape.total_kv > 0, 8, args.cu_seqlens_kv == nullptr);
  const int64_t roles =
      std::max<int64_t>(shape.num_q_heads + shape.num_kv_heads, 2 * int64_t{shape.num_kv_heads});
  ATTNKIT_CHECK((int64_t{shape.batch} + 1) * roles <= INT32_MAX, kWhat,
                ": batch x (num_q_heads + num_kv_heads) must stay below 2^31, got ", shape.batch,
                " x ", roles);

  const SageQuantized out = sage_quantized_views(shape, args.workspace);
  if (shape.batch == 0) return out;
  SageQuantParams params;
  params.q = args.q;
  params.k = args.k;
  params.v = args.v;
  params.q_seqs = {args.cu_seqlens_q, args.seqlen_q, shape.total_q, FaultArg::kCuSeqlensQ};
  params.kv_seqs = {args.cu_seqlens_kv, args.seqlen_kv, shape.total_kv, FaultArg::kCuSeqlensKv};
  params.batch = shape.batch;
  params.num_q_heads = shape.num_q_heads;
  params.num_kv_heads = shape.num_kv_heads;
  params.head_dim = shape.head_dim;
  params.q_block_size = shape.quant.q_block_size;
  params.k_block_size = shape.quant.k_block_size;
  params.int8 = shape.quant.dtype_qk == DType::kInt8;
  params.out = out;
  params.stats =
      reinterpret_cast<SageKvStats*>(static_cast<uint8_t*>(args.workspace) + layout.stats);
  params.fault = fault_site(args.op);

  auto* base = static_cast<uint8_t*>(args.workspace);
  check_cuda(cudaMemsetAsync(base + layout.q_scale, 0, layout.zeroed_bytes, stream),
             "sage quantize: cudaMemsetAsync (scales and statistics)");
  // Columns of no token (the gaps between sequences, the padding, bad entries, tokens past
  // cu[B]) must read as zeros: the attention kernel's partial key tiles load them.
  check_cuda(cudaMemsetAsync(
                 out.v_t, 0,
                 static_cast<size_t>(shape.num_kv_heads) * shape.head_dim * out.v_t_stride, stream),
             "sage quantize: cudaMemsetAsync (V^T)");
  const bool bf16 = args.input_dtype == DType::kBF16;
  if (bf16 && params.int8) {
    enqueue<DType::kBF16, true>(params, max_q, max_kv, stream);
  } else if (bf16) {
    enqueue<DType::kBF16, false>(params, max_q, max_kv, stream);
  } else if (params.int8) {
    enqueue<DType::kF16, true>(params, max_q, max_kv, stream);
  } else {
    enqueue<DType::kF16, false>(params, max_q, max_kv, stream);
  }
  return out;
}

}  // namespace attnkit::cuda::sage
