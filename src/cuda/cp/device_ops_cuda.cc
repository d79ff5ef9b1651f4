// The CUDA side of the context-parallel device operations (src/cp/device_ops.h). Every call makes
// its device current for its duration: the ranks of an in-process group may live on different
// devices, and a rank's thread may have another device current.
#include <cuda_runtime.h>

#include "cp/device_ops.h"
#include "cuda/common/cuda_status.h"
#include "cuda/common/host_upload.h"

namespace attnkit::cp::detail::cuda_ops {
namespace {

cudaStream_t as_stream(Stream stream) { return static_cast<cudaStream_t>(stream); }

}  // namespace

void* malloc_async(int device, int64_t bytes, Stream stream) {
  const cuda::DeviceScope scope(device, "context parallelism: cudaSetDevice");
  void* data = nullptr;
  cuda::check_cuda(cudaMallocAsync(&data, static_cast<size_t>(bytes), as_stream(stream)),
                   "context parallelism: cudaMallocAsync (scratch memory)");
  return data;
}

void free_async(int device, void* data, Stream stream) {
  const cuda::DeviceScope scope(device, nullptr);
  cudaFreeAsync(data, as_stream(stream));
}

void* event_create(int device) {
  const cuda::DeviceScope scope(device, "context parallelism: cudaSetDevice");
  cudaEvent_t event = nullptr;
  cuda::check_cuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
                   "context parallelism: cudaEventCreateWithFlags");
  return event;
}

void event_destroy(int device, void* event) {
  const cuda::DeviceScope scope(device, nullptr);
  cudaEventDestroy(static_cast<cudaEvent_t>(event));
}

void event_record(int device, void* event, Stream stream) {
  const cuda::DeviceScope scope(device, "context parallelism: cudaSetDevice");
  cuda::check_cuda(cudaEventRecord(static_cast<cudaEvent_t>(event), as_stream(stream)),
                   "context parallelism: cudaEventRecord");
}

void stream_wait_event(int device, Stream stream, void* event) {
  const cuda::DeviceScope scope(device, "context parallelism: cudaSetDevice");
  cuda::check_cuda(cudaStreamWaitEvent(as_stream(stream), static_cast<cudaEvent_t>(event), 0),
                   "context parallelism: cudaStreamWaitEvent");
}

void copy_async(int device, void* dst, const void* src, int64_t bytes, Stream stream) {
  const cuda::DeviceScope scope(device, "context parallelism: cudaSetDevice");
  cuda::check_cuda(
      cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDefault, as_stream(stream)),
      "context parallelism: cudaMemcpyAsync");
}

void upload_int32_async(int device, const int32_t* host, int64_t count, int32_t* dst,
                        Stream stream) {
  const cuda::DeviceScope scope(device, "context parallelism: cudaSetDevice");
  cuda::upload_int32_async(host, count, dst, as_stream(stream));
}

Stream stream_create(int device) {
  const cuda::DeviceScope scope(device, "context parallelism: cudaSetDevice");
  cudaStream_t stream = nullptr;
  cuda::check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                   "context parallelism: cudaStreamCreateWithFlags (communication stream)");
  return stream;
}

void stream_destroy(int device, Stream stream) {
  const cuda::DeviceScope scope(device, nullptr);
  cudaStreamSynchronize(as_stream(stream));
  cudaStreamDestroy(as_stream(stream));
}

}  // namespace attnkit::cp::detail::cuda_ops
