// CUDA backend entry points that are not yet implemented by kernels (placeholder; the kernel
// issues replace each one) and the device queries.
#include <cuda_runtime.h>

#include "core/check.h"
#include "cuda/cuda_backend.h"

namespace attnkit::cuda {
namespace {
[[noreturn]] void todo(const char* what) {
  throw Error(std::string(what) + ": not implemented on CUDA in this build");
}
}  // namespace

return "no fused prefill kernel yet";
}
std::string fused_decode_unsupported(const AttentionSpec&, const detail::DecodeProblem&) {
  return "no fused decode kernel yet";
}
std::string fused_append_kv_unsupported(const AttentionSpec&, const detail::AppendKvProblem&) {
  return "no fused append_kv kernel yet";
}
return "no fused dense kernel yet";
}
std::string fused_forward_unsupported(const AttentionSpec&, const detail::ForwardProblem&) {
  return "no fused forward yet";
}
                   Stream) {
  todo("prefill");
}
                   void fused_decode(const AttentionSpec&, const DecodeArgs&,
                                     const detail::DecodeProblem&, Stream) {
                     todo("decode");
                   }
                   void fused_append_kv(const AttentionSpec&, const AppendKvArgs&,
                                        const detail::AppendKvProblem&, Stream) {
                     todo("append_kv");
                   }
                   todo("dense");
                   }
                   void vanilla_prefill(const AttentionSpec&, const PrefillArgs&,
                                        const detail::PrefillProblem&, Stream) {
                     todo("prefill");
                   }
                   void vanilla_decode(const AttentionSpec&, const DecodeArgs&,
                                       const detail::DecodeProblem&, Stream) {
                     todo("decode");
                   }
                   void vanilla_append_kv(const AttentionSpec&, const AppendKvArgs&,
                                          const detail::AppendKvProblem&, Stream) {
                     todo("append_kv");
                   }
                   void vanilla_dense(const AttentionSpec&, const DenseArgs&,
                                      const detail::DenseProblem&, Stream) {
                     todo("dense");
                   }
                   void forward(const AttentionSpec&, const ForwardArgs&,
                                const detail::ForwardProblem&, bool, Stream) {
                     todo("forward");
                   }
                   void merge_states(const MergeStatesArgs&, const detail::MergeStatesProblem&,
                                     Stream) {
                     todo("merge_states");
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
