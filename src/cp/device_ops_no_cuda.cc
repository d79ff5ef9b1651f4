// CPU-only builds: CUDA devices are rejected (src/cuda/cp/device_ops_cuda.cc replaces this file's
// definitions when attnkit is built with CUDA).
#ifndef ATTNKIT_WITH_CUDA

#include "core/check.h"
#include "cp/device_ops.h"

namespace attnkit::cp::detail::cuda_ops {
namespace {

[[noreturn]] void no_cuda(int device) {
  attnkit::detail::fail(
      "context parallelism: attnkit was built without the CUDA backend, so only cpu tensors and "
      "communicators are accepted; got cuda:",
      device);
}

}  // namespace

void* malloc_async(int device, int64_t, Stream) { no_cuda(device); }
void free_async(int, void*, Stream) {}
void* event_create(int device) { no_cuda(device); }
void event_destroy(int, void*) {}
void event_record(int device, void*, Stream) { no_cuda(device); }
void stream_wait_event(int device, Stream, void*) { no_cuda(device); }
void copy_async(int device, void*, const void*, int64_t, Stream) { no_cuda(device); }
void upload_int32_async(int device, const int32_t*, int64_t, int32_t*, Stream) { no_cuda(device); }
Stream stream_create(int device) { no_cuda(device); }
void stream_destroy(int, Stream) {}

}  // namespace attnkit::cp::detail::cuda_ops

#endif  // ATTNKIT_WITH_CUDA
