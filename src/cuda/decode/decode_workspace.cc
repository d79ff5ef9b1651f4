// DecodeWorkspace (include/attnkit/attention.h): the split-KV counters and partials of the fused
// decode in one cudaMalloc block, counters zeroed once here; the merging CTA of every split call
// sets its counter back to zero (decode_kernel.cuh), so calls need no memset.
#include <cuda_runtime.h>

#include "attnkit/attention.h"
#include "core/check.h"
#include "core/decode_workspace_check.h"
#include "cuda/common/cuda_status.h"

namespace attnkit {
namespace {

constexpr int64_t kAlign = 256;

}  // namespace

DecodeWorkspace::DecodeWorkspace(const AttentionSpec& spec, int64_t max_rows, int32_t max_splits,
                                 Device device)
    : device_(device) {
  const detail::DecodeWorkspaceSize size =
      detail::decode_workspace_size(spec, max_rows, max_splits, device);
  int count = 0;
  cuda::check_cuda(cudaGetDeviceCount(&count), "DecodeWorkspace: cudaGetDeviceCount");
  ATTNKIT_CHECK(device.index >= 0 && device.index < count, "DecodeWorkspace: device ", device.str(),
                " does not exist (", count, " CUDA devices)");
  const int64_t counter_bytes = (size.counters * 4 + kAlign - 1) / kAlign * kAlign;
  bytes_ = counter_bytes + size.partial_words * 4;
  cuda::DeviceScope scope(device.index, "DecodeWorkspace: cudaSetDevice");
  cuda::check_cuda(cudaMalloc(&memory_, static_cast<size_t>(bytes_)),
                   "DecodeWorkspace: cudaMalloc");
  // Zeroed and finished before the constructor returns: calls on any stream (non-blocking ones
  // included) find the counters at zero.
  cudaError_t status = cudaMemset(memory_, 0, static_cast<size_t>(counter_bytes));
  if (status == cudaSuccess) status = cudaDeviceSynchronize();
  if (status != cudaSuccess) {
    cudaFree(memory_);
    cuda::check_cuda(status, "DecodeWorkspace: zeroing the counters");
  }
  partials_ = reinterpret_cast<float*>(static_cast<char*>(memory_) + counter_bytes);
  counters_ = size.counters;
  partial_words_ = size.partial_words;
}

DecodeWorkspace::~DecodeWorkspace() {
  if (memory_ == nullptr) return;
  cuda::DeviceScope scope(device_.index, nullptr);
  cudaFree(memory_);
}

void DecodeWorkspace::reset(Stream stream) {
  cuda::DeviceScope scope(device_.index, "DecodeWorkspace::reset: cudaSetDevice");
  cuda::check_cuda(
      cudaMemsetAsync(memory_, 0, static_cast<size_t>(counters_) * 4, cuda::as_cuda_stream(stream)),
      "DecodeWorkspace::reset: cudaMemsetAsync");
}

}  // namespace attnkit
