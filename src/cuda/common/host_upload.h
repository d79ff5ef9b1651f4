// Small host arrays (per-request metadata) reach the device through kernel parameters: the values
// are copied at launch, so there is no staging buffer to keep alive, no host synchronization, and
// a CUDA graph captures them by value.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace attnkit::cuda {

// Enqueues writes of host[0 .. count) to device_dst[0 .. count) on `stream` (one launch per
// kUploadChunk values).
void upload_int32_async(const int32_t* host, int64_t count, int32_t* device_dst,
                        cudaStream_t stream);

}  // namespace attnkit::cuda
