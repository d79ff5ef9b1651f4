// append_kv on CUDA: the support query of the fused kernel, its launch, and the vanilla launch.
#include <algorithm>
#include <limits>
#include <string>

#include "core/check.h"
#include "cuda/common/cuda_status.h"
#include "cuda/common/device_fault.h"
#include "cuda/cuda_backend.h"
#include "cuda/preprocess/append_kv_params.h"

namespace attnkit::cuda {
namespace {

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Why the fused kernel's 16-byte vectors cannot address this call ("" when they can).
std::string fused_alignment_problem(const AppendKvParams& params) {
  const int64_t strides[] = {params.q_stride_token,     params.q_stride_head,
                             params.k_stride_token,     params.k_stride_head,
                             params.v_stride_token,     params.v_stride_head,
                             params.q_out_stride_token, params.q_out_stride_head};
  for (int64_t stride : strides) {
    if (stride % 8 != 0) {
      return detail::concat(
          "token and head strides of qkv / q / k / v / q_out must be multiples of ",
          "8 elements (16 bytes), got a stride of ", stride);
    }
  }
  const void* pointers[] = {params.q_in,  params.k_in,          params.v_in,
                            params.q_out, params.layout.k_base, params.layout.v_base};
  for (const void* ptr : pointers) {
    if (!aligned16(ptr)) return "tensor and cache base pointers must be 16-byte aligned";
  }
  if (params.bias != nullptr && !aligned16(params.bias)) return "qkv_bias must be 16-byte aligned";
  if (params.layout.block_stride_bytes % 16 != 0) {
    return detail::concat("kv_cache.block_stride_bytes must be a multiple of 16, got ",
                          params.layout.block_stride_bytes);
  }
  return "";
}

}  // namespace

AppendKvParams make_append_kv_params(const AttentionSpec& spec, const AppendKvArgs& args,
                                     const detail::AppendKvProblem& p) {
  AppendKvParams params{};
  const int64_t hq = spec.num_q_heads, hkv = spec.num_kv_heads, dim = spec.head_dim;
  if (p.fused_qkv) {
    const int64_t elt = dtype_size(args.qkv.dtype);
    const auto* base = static_cast<const uint8_t*>(args.qkv.data);
    const int64_t token = args.qkv.strides[0];
    const int64_t head = dim * args.qkv.strides[1];
    params.q_in = base;
    params.k_in = base + hq * head * elt;
    params.v_in = base + (hq + hkv) * head * elt;
    params.q_stride_token = params.k_stride_token = params.v_stride_token = token;
    params.q_stride_head = params.k_stride_head = params.v_stride_head = head;
  } else {
    params.q_in = args.q.data;
    params.k_in = args.k.data;
    params.v_in = args.v.data;
    params.q_stride_token = args.q.strides[0];
    params.q_stride_head = args.q.strides[1];
    params.k_stride_token = args.k.strides[0];
    params.k_stride_head = args.k.strides[1];
    params.v_stride_token = args.v.strides[0];
    params.v_stride_head = args.v.strides[1];
  }
  params.bias = p.has_bias ? args.qkv_bias.data : nullptr;
  params.in_dtype = p.dtype;
  params.positions = static_cast<const int32_t*>(args.positions.data);
  params.row_of_token = static_cast<const int32_t*>(args.row_of_token.data);
  params.layout = detail::make_kv_layout(args.kv_cache);
  const int64_t rows =
      args.kv_cache.paged ? args.kv_cache.block_table.shape[0] : args.kv_cache.num_blocks;
  constexpr int64_t kMaxInt32 = std::numeric_limits<int32_t>::max();
  params.num_rows = static_cast<int32_t>(std::min(rows, kMaxInt32));
  params.row_slots = static_cast<int32_t>(std::min(params.layout.row_capacity(), kMaxInt32));
  params.fault = fault_site(Op::kAppendKv);
  params.kv_dtype = args.kv_cache.dtype;
  params.k_scale = static_cast<const float*>(args.kv_cache.k_scale.data);
  params.v_scale = static_cast<const float*>(args.kv_cache.v_scale.data);
  params.k_scale_per_head = args.kv_cache.k_scale.defined() && args.kv_cache.k_scale.numel() > 1;
  params.v_scale_per_head = args.kv_cache.v_scale.defined() && args.kv_cache.v_scale.numel() > 1;
  params.q_out = args.q_out.data;
  params.q_out_stride_token = args.q_out.strides[0];
  params.q_out_stride_head = args.q_out.strides[1];
  params.num_tokens = p.num_tokens;
  params.num_q_heads = spec.num_q_heads;
  params.num_kv_heads = spec.num_kv_heads;
  params.head_dim = spec.head_dim;
  params.rope = detail::make_rope_params(spec);
  if (params.rope.style != RopeStyle::kNone) {
    const int32_t rotary_half = std::min(params.rope.rotary_dim / 2, kAppendKvMaxRotaryHalf);
    for (int32_t i = 0; i < rotary_half; ++i) {
      params.inv_freq[i] = detail::rope_inv_freq<double>(params.rope, i);
    }
  }
  return params;
}

void plan_fused_append_kv(AppendKvParams& params, int32_t steps, int32_t min_cta_threads) {
  constexpr int32_t kVec = 8;
  constexpr int32_t kMaxTableBytes = 16 * 1024;
  FusedAppendKvPlan& plan = params.plan;
  const bool neox = params.rope.style == RopeStyle::kGptNeox;
  const int32_t rotary_half =
      params.rope.style == RopeStyle::kNone ? 0 : params.rope.rotary_dim / 2;
  plan.paired_units = neox ? rotary_half / kVec : 0;
  plan.units_per_head = neox ? plan.paired_units + (params.head_dim - 2 * rotary_half) / kVec
                             : params.head_dim / kVec;
  // As few heads per pass as lets every thread load all its heads in one round (48 heads, 6
  // steps: 8 heads of 8 units, 64 threads a token); more passes run as further rounds.
  const int32_t total_heads = params.num_q_heads + 2 * params.num_kv_heads;
  const int32_t max_heads = std::max(1, kAppendKvMaxThreads / plan.units_per_head);
  plan.heads_per_pass = std::min((total_heads + steps - 1) / steps, max_heads);
  // Small tokens (few heads) share a CTA, each with its own cos/sin table.
  const int32_t per_token = plan.units_per_head * plan.heads_per_pass;
  int32_t tokens = std::clamp(min_cta_threads / per_token, 1, kAppendKvMaxThreads / per_token);
  if (rotary_half > 0) {
    tokens =
        std::min(tokens, kMaxTableBytes / (rotary_half * static_cast<int32_t>(sizeof(float2))));
  }
  tokens = static_cast<int32_t>(
      std::min<int64_t>({tokens, 64, std::max<int64_t>(params.num_tokens, 1)}));
  plan.tokens_per_cta = std::max(tokens, 1);
  plan.page_shift = 0;
  if (params.layout.block_table != nullptr) {
    while ((1 << plan.page_shift) < params.layout.tokens_per_block) ++plan.page_shift;
  }
}

std::string fused_append_kv_unsupported(const AttentionSpec& spec,
                                        const detail::AppendKvProblem& p) {
  if (p.dtype != DType::kBF16 && p.dtype != DType::kF16) {
    return detail::concat("fused append_kv takes bf16 or f16 inputs, got ", dtype_name(p.dtype));
  }
#if defined(ATTNKIT_KERNEL_SUBSET)
  if (p.dtype != DType::kBF16) {
    return "fused append_kv for f16 inputs: not compiled in this build (ATTNKIT_KERNEL_SUBSET)";
  }
#endif
  if (p.kv_dtype != p.dtype && p.kv_dtype != DType::kFp8E4M3 && p.kv_dtype != DType::kInt8) {
    return detail::concat("fused append_kv writes caches of the input dtype (", dtype_name(p.dtype),
                          "), fp8_e4m3 or int8, got ", dtype_name(p.kv_dtype));
  }
  if (spec.head_dim % 8 != 0 || spec.head_dim > 512) {
    return detail::concat("fused append_kv needs head_dim a multiple of 8 and <= 512, got ",
                          spec.head_dim);
  }
  if (spec.rope.style == RopeStyle::kGptNeox && spec.effective_rotary_dim() % 16 != 0) {
    return detail::concat(
        "fused append_kv with GPT-NeoX RoPE needs rotary_dim a multiple of 16, got ",
        spec.effective_rotary_dim());
  }
  return "";
}

void fused_append_kv(const AttentionSpec& spec, const AppendKvArgs& args,
                     const detail::AppendKvProblem& p, Stream stream) {
  AppendKvParams params = make_append_kv_params(spec, args, p);
  const std::string misaligned = fused_alignment_problem(params);
  if (!misaligned.empty()) {
    // The caller asked for the fused kernel explicitly: say why it cannot run. With backend=auto
    // the vanilla kernel computes the same values.
    ATTNKIT_CHECK(spec.backend != Backend::kFused,
                  "append_kv: backend 'fused' cannot serve this call: ", misaligned);
    return launch_vanilla_append_kv(params, as_cuda_stream(stream));
  }
  plan_fused_append_kv(params);
  if (p.dtype == DType::kBF16)
    return launch_fused_append_kv<DType::kBF16>(params, as_cuda_stream(stream));
#if !defined(ATTNKIT_KERNEL_SUBSET)
  if (p.dtype == DType::kF16)
    return launch_fused_append_kv<DType::kF16>(params, as_cuda_stream(stream));
#endif
  detail::fail("append_kv: backend 'fused' cannot serve this call: ",
               fused_append_kv_unsupported(spec, p));
}

void vanilla_append_kv(const AttentionSpec& spec, const AppendKvArgs& args,
                       const detail::AppendKvProblem& p, Stream stream) {
  launch_vanilla_append_kv(make_append_kv_params(spec, args, p), as_cuda_stream(stream));
}

}  // namespace attnkit::cuda
