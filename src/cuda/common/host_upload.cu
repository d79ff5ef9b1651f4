#include "cuda/common/cuda_status.h"
#include "cuda/common/host_upload.h"

namespace attnkit::cuda {
namespace {

// 4 KiB of kernel parameters at most (the classic limit) per launch.
constexpr int kUploadChunk = 1000;

struct UploadParams {
  int32_t* dst;  // [count]
  int32_t count;
  int32_t values[kUploadChunk];
};

__global__ void upload_int32_kernel(const __grid_constant__ UploadParams params) {
  for (int i = threadIdx.x; i < params.count; i += blockDim.x) params.dst[i] = params.values[i];
}

}  // namespace

void upload_int32_async(const int32_t* host, int64_t count, int32_t* device_dst,
                        cudaStream_t stream) {
  for (int64_t begin = 0; begin < count; begin += kUploadChunk) {
    UploadParams params;
    params.dst = device_dst + begin;
    params.count =
        static_cast<int32_t>(count - begin < kUploadChunk ? count - begin : kUploadChunk);
    for (int i = 0; i < params.count; ++i) params.values[i] = host[begin + i];
    upload_int32_kernel<<<1, 256, 0, stream>>>(params);
    check_launch("upload_int32_kernel");
  }
}

}  // namespace attnkit::cuda
