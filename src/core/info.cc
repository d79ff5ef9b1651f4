#include "attnkit/info.h"

#include "core/problem.h"
#include "cuda/cuda_backend.h"

namespace attnkit {

const char* version() { return ATTNKIT_VERSION; }

bool built_with_cuda() {
#if defined(ATTNKIT_WITH_CUDA)
  return true;
#else
  return false;
#endif
}

std::string cuda_architectures() { return ATTNKIT_CUDA_ARCHS; }

std::vector<DeviceInfo> cuda_devices() { return cuda::devices(); }

const char* op_name(Op op) {
  switch (op) {
    case Op::kPrefill:
      return "prefill";
    case Op::kDecode:
      return "decode";
    case Op::kAppendKv:
      return "append_kv";
    case Op::kForward:
      return "forward";
    case Op::kDense:
      return "dense";
    case Op::kMergeStates:
      return "merge_states";
  }
  return "?";
}

std::string unsupported_reason(const SupportQuery& query) {
  if (query.device.is_cpu()) {
    if (query.backend == Backend::kFused) return "the fused kernels need CUDA tensors";
    return "";
  }
  if (!built_with_cuda()) return "attnkit was built without the CUDA backend";
  if (query.backend == Backend::kVanilla || query.op == Op::kMergeStates) return "";
  AttentionSpec spec;
  spec.num_q_heads = 32;
  spec.num_kv_heads = 8;
  spec.head_dim = query.head_dim;
  // The op's problem with the query's device and dtypes (dense has no cache dtype).
  auto problem = [&query](auto p) {
    p.device = query.device;
    p.dtype = query.q_dtype;
    if constexpr (requires { p.kv_dtype; }) p.kv_dtype = query.kv_dtype;
    return p;
  };
  std::string reason;
  switch (query.op) {
    case Op::kPrefill: {
      detail::PrefillProblem p = problem(detail::PrefillProblem{});
      p.paged = query.kv_dtype != query.q_dtype;
      reason = cuda::fused_prefill_unsupported(spec, p);
      break;
    }
    case Op::kDecode:
      reason = cuda::fused_decode_unsupported(spec, problem(detail::DecodeProblem{}));
      break;
    case Op::kAppendKv:
      reason = cuda::fused_append_kv_unsupported(spec, problem(detail::AppendKvProblem{}));
      break;
    case Op::kForward:
      reason = cuda::fused_forward_unsupported(spec, problem(detail::ForwardProblem{}));
      break;
    case Op::kDense:
      spec.num_kv_heads = spec.num_q_heads;
      spec.mask.kind = MaskKind::kNone;
      reason = cuda::fused_dense_unsupported(spec, problem(detail::DenseProblem{}));
      break;
    case Op::kMergeStates:
      break;
  }
  // auto falls back to the naive GPU kernels: always served.
  if (query.backend == Backend::kAuto) return "";
  return reason;
}

std::string selected_kernel(const SupportQuery& query, int32_t seqlen) {
  if (query.device.is_cpu() || !built_with_cuda()) return "";
  AttentionSpec spec;
  spec.num_q_heads = 32;
  spec.num_kv_heads = 8;
  spec.head_dim = query.head_dim;
  if (query.op == Op::kPrefill) {
    detail::PrefillProblem p;
    p.device = query.device;
    p.dtype = query.q_dtype;
    p.kv_dtype = query.kv_dtype;
    p.paged = query.kv_dtype != query.q_dtype;
    return cuda::fused_prefill_kernel(spec, p, seqlen);
  }
  if (query.op == Op::kDense) {
    spec.num_kv_heads = spec.num_q_heads;
    spec.mask.kind = MaskKind::kNone;
    detail::DenseProblem p;
    p.device = query.device;
    p.dtype = query.q_dtype;
    return cuda::fused_dense_kernel(spec, p, seqlen);
  }
  return "";
}

}  // namespace attnkit
