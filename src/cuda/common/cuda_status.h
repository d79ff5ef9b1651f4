// CUDA error checks for the backend's host code: every runtime call and every launch is checked
// and a failure becomes attnkit::Error naming the operation (never a silent sticky error).
#pragma once

#include <cuda_runtime.h>

#include "core/check.h"

namespace attnkit::cuda {

inline void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    cudaGetLastError();  // clear a non-sticky error so later calls do not report it again
    detail::fail(what, ": CUDA error ", cudaGetErrorName(status), " (", cudaGetErrorString(status),
                 ")");
  }
}

// After a <<<...>>> launch: reports configuration errors (grid, shared memory, parameters).
inline void check_launch(const char* kernel) { check_cuda(cudaGetLastError(), kernel); }

inline cudaStream_t as_cuda_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

// The calling thread's current device: the one read when its entry-point call began
// (CudaCallScope, cuda_backend.h), else cudaGetDevice (a failure throws Error naming `what`).
int current_device(const char* what);

// Makes `device` current for a scope and restores the caller's device after it. With `what` a
// failed switch throws attnkit::Error naming it; with nullptr (destructors, which must not throw)
// the failure is left to the next checked call.
class DeviceScope {
 public:
  DeviceScope(int device, const char* what) {
    cudaGetDevice(&previous_);
    const cudaError_t status = cudaSetDevice(device);
    if (what != nullptr) check_cuda(status, what);
  }
  ~DeviceScope() { cudaSetDevice(previous_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace attnkit::cuda
