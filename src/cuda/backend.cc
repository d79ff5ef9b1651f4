// Device queries of the CUDA backend.
#include <cuda_runtime.h>

#include "cuda/cuda_backend.h"

namespace attnkit::cuda {

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
