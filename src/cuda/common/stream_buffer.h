// StreamBuffer: device memory taken with cudaMallocAsync on a stream and given back with
// cudaFreeAsync on the same stream when the holder goes out of scope, also when a launch between
// the two throws. The per-call workspaces of forward(), the SAGE calls and the skip statistics.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "cuda/common/cuda_status.h"

namespace attnkit::cuda {

class StreamBuffer {
 public:
  StreamBuffer() = default;
  StreamBuffer(size_t bytes, cudaStream_t stream, const char* what) {
    allocate(bytes, stream, what);
  }
  StreamBuffer(const StreamBuffer&) = delete;
  StreamBuffer& operator=(const StreamBuffer&) = delete;
  ~StreamBuffer() {
    if (ptr_ != nullptr) cudaFreeAsync(ptr_, stream_);
  }

  // Takes `bytes` on `stream`; throws naming `what` when cudaMallocAsync fails. Once only.
  void allocate(size_t bytes, cudaStream_t stream, const char* what) {
    stream_ = stream;
    check_cuda(cudaMallocAsync(&ptr_, bytes, stream), what);
  }
  void* get() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_ = nullptr;
};

}  // namespace attnkit::cuda
