// PLACEHOLDER CUDA entry points (replaced by the kernels of the decode issue) and device queries.
#include <cuda_runtime.h>

#include "core/check.h"
#include "cuda/cuda_backend.h"

namespace attnkit::cuda {

std::string fused_decode_unsupported(const AttentionSpec&, const detail::DecodeProblem&) {
  return "no fused kernel in this build";
}
std::string fused_append_kv_unsupported(const AttentionSpec&, const detail::AppendKvProblem&) {
  return "no fused kernel in this build";
}
std::string fused_forward_unsupported(const AttentionSpec&, const detail::ForwardProblem&) {
  return "no fused kernel in this build";
}
void fused_decode(const AttentionSpec&, const DecodeArgs&, const detail::DecodeProblem&, Stream) {
  throw Error("fused_decode: not implemented on CUDA in this build");
}
void fused_append_kv(const AttentionSpec&, const AppendKvArgs&, const detail::AppendKvProblem&,
                     Stream) {
  throw Error("fused_append_kv: not implemented on CUDA in this build");
}
void vanilla_prefill(const AttentionSpec&, const PrefillArgs&, const detail::PrefillProblem&,
                     Stream) {
  throw Error("vanilla_prefill: not implemented on CUDA in this build");
}
void vanilla_decode(const AttentionSpec&, const DecodeArgs&, const detail::DecodeProblem&, Stream) {
  throw Error("vanilla_decode: not implemented on CUDA in this build");
}
void vanilla_append_kv(const AttentionSpec&, const AppendKvArgs&, const detail::AppendKvProblem&,
                       Stream) {
  throw Error("vanilla_append_kv: not implemented on CUDA in this build");
}
void vanilla_dense(const AttentionSpec&, const DenseArgs&, const detail::DenseProblem&, Stream) {
  throw Error("vanilla_dense: not implemented on CUDA in this build");
}
void forward(const AttentionSpec&, const ForwardArgs&, const detail::ForwardProblem&, bool,
             Stream) {
  throw Error("forward: not implemented on CUDA in this build");
}
void merge_states(const MergeStatesArgs&, const detail::MergeStatesProblem&, Stream) {
  throw Error("merge_states: not implemented on CUDA in this build");
}

std::vector<DeviceInfo> devices() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver or no GPU: report none
    return {};
  }
  std::vector<DeviceInfo> result;
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    DeviceInfo info;
    info.ordinal = i;
    info.name = prop.name;
    info.cc_major = prop.major;
    info.cc_minor = prop.minor;
    info.sm_count = prop.multiProcessorCount;
    info.total_memory = prop.totalGlobalMem;
    info.l2_bytes = static_cast<size_t>(prop.l2CacheSize);
    result.push_back(info);
  }
  return result;
}

}  // namespace attnkit::cuda
