// A streaming reduction: every thread keeps several 16-byte loads in flight per iteration, one wave
// of fully occupied SMs, so that the rate measured is the device's read bandwidth and not the
// kernel's. Variants differ in loads in flight per thread; the bench keeps the fastest.
#include <cstdint>

#include "read_ceiling.h"

namespace attnkit::tools {
namespace {

constexpr int kThreads = 256;

template <int kUnroll>
__global__ void __launch_bounds__(kThreads)
    read_reduction_kernel(const uint4* __restrict__ data, size_t count, unsigned* sink) {
  const size_t stride = size_t{gridDim.x} * kThreads;
  size_t i = size_t{blockIdx.x} * kThreads + threadIdx.x;
  unsigned acc = 0;
  for (; i + (kUnroll - 1) * stride < count; i += kUnroll * stride) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = __ldcs(data + i + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < count; i += stride) {
    const uint4 v = __ldcs(data + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) atomicAdd(sink, 1u);
}

template <int kUnroll>
int blocks_for() {
  int device = 0, sms = 0, blocks_per_sm = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, read_reduction_kernel<kUnroll>,
                                                kThreads, 0);
  return sms * (blocks_per_sm > 0 ? blocks_per_sm : 1);
}

template <int kUnroll>
cudaError_t launch(int blocks, const void* data, size_t bytes, unsigned* sink,
                   cudaStream_t stream) {
  read_reduction_kernel<kUnroll><<<blocks, kThreads, 0, stream>>>(static_cast<const uint4*>(data),
                                                                  bytes / sizeof(uint4), sink);
  return cudaGetLastError();
}

}  // namespace

int read_reduction_blocks(int variant) {
  return variant == 0 ? blocks_for<2>() : variant == 1 ? blocks_for<4>() : blocks_for<8>();
}

cudaError_t launch_read_reduction(int variant, int blocks, const void* data, size_t bytes,
                                  unsigned* sink, cudaStream_t stream) {
  return variant == 0   ? launch<2>(blocks, data, bytes, sink, stream)
         : variant == 1 ? launch<4>(blocks, data, bytes, sink, stream)
                        : launch<8>(blocks, data, bytes, sink, stream);
}

}  // namespace attnkit::tools
