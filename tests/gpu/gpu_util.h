// GPU test helpers: device copies of HostTensors, the skip-without-GPU guard, CUDA error checks.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "common/test_util.h"

#define ATTNKIT_CUDA_OK(expr)                                                        \
  do {                                                                               \
    const cudaError_t status_ = (expr);                                              \
    ASSERT_EQ(status_, cudaSuccess) << #expr << ": " << cudaGetErrorString(status_); \
  } while (0)

// Every gpu test starts with this: without a GPU it skips with a visible message.
#define ATTNKIT_SKIP_WITHOUT_GPU()                                            \
  do {                                                                        \
    if (!::attnkit::test::gpu_available())                                    \
      GTEST_SKIP() << "no CUDA device visible: gpu test skipped (label gpu)"; \
  } while (0)

namespace attnkit::test {

inline bool gpu_available() {
  static const bool available = [] {
    int count = 0;
    const bool ok = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
    cudaGetLastError();
    return ok;
  }();
  return available;
}

// A device copy of a HostTensor with the same dtype, shape and strides (contiguous).
class DeviceTensor {
 public:
  DeviceTensor() = default;
  explicit DeviceTensor(const HostTensor& host) : view_(host.view()) {
    bytes_ = static_cast<size_t>(host.numel()) * dtype_size(host.dtype());
    if (cudaMalloc(&view_.data, bytes_ + 16) != cudaSuccess) {
      std::fprintf(stderr, "cudaMalloc of %zu bytes failed\n", bytes_);
      std::abort();
    }
    view_.device = Device::cuda(0);
    upload(host);
  }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  DeviceTensor(DeviceTensor&& other) noexcept { *this = std::move(other); }
  DeviceTensor& operator=(DeviceTensor&& other) noexcept {
    std::swap(view_, other.view_);
    std::swap(bytes_, other.bytes_);
    return *this;
  }
  ~DeviceTensor() {
    if (view_.data) cudaFree(view_.data);
  }

  void upload(const HostTensor& host) {
    cudaMemcpy(view_.data, host.view().data, bytes_, cudaMemcpyHostToDevice);
  }
  // Copies the device contents into `host` (same shape and dtype).
  void download(HostTensor& host) const {
    cudaMemcpy(host.view().data, view_.data, bytes_, cudaMemcpyDeviceToHost);
  }
  TensorView view() const { return view_; }
  operator TensorView() const { return view_; }  // NOLINT: convenient in argument structs
  void* data() const { return view_.data; }
  size_t bytes() const { return bytes_; }

 private:
  TensorView view_;
  size_t bytes_ = 0;
};

}  // namespace attnkit::test
