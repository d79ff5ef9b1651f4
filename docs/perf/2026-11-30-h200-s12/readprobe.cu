// Pure-read rate at decode's byte counts, timed as `attnkit bench decode` times (a CUDA graph of
// back-to-back calls): does a kernel that only reads reach the same TB/s at fp8 64 x 4k's bytes
// (537 MB) as at bf16's (1074 MB)? The grid-stride read is the bench's read ceiling kernel
// (tools/read_ceiling.cu, included; in call 1 the probe held a copy of it). Built from this folder:
// nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -I../../../tools readprobe.cu
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "read_ceiling.cu"
#define CK(x)                                        \
  do {                                               \
    cudaError_t e = (x);                             \
    if (e != cudaSuccess) {                          \
      printf("%s: %s\n", #x, cudaGetErrorString(e)); \
      return 1;                                      \
    }                                                \
  } while (0)

// One contiguous chunk a CTA (decode's one item a CTA), 128 threads, 8 loads in flight a thread.
__global__ void __launch_bounds__(128)
    chunk_read(const uint4* __restrict__ d, size_t per_cta, unsigned* sink) {
  const uint4* p = d + blockIdx.x * per_cta;
  unsigned acc = 0;
  for (size_t i = threadIdx.x; i + 7 * 128 < per_cta; i += 8 * 128) {
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) v[u] = __ldcs(p + i + u * 128);
#pragma unroll
    for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x9e3779b9u) atomicAdd(sink, 1u);
}

template <typename F>
double graph_us(F launch, cudaStream_t s, int calls = 20) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
  for (int i = 0; i < calls; ++i) launch();
  cudaStreamEndCapture(s, &g);
  cudaGraphInstantiate(&ge, g, 0);
  cudaGraphLaunch(ge, s);
  cudaStreamSynchronize(s);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> t;
  for (int r = 0; r < 9; ++r) {
    cudaEventRecord(a, s);
    cudaGraphLaunch(ge, s);
    cudaEventRecord(b, s);
    cudaEventSynchronize(b);
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    t.push_back(ms * 1000.f / calls);
  }
  std::sort(t.begin(), t.end());
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  return t[t.size() / 2];
}

int main() {
  int sms;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const size_t maxb = size_t{2} << 30;
  uint4* d;
  unsigned* sink;
  CK(cudaMalloc(&d, maxb));
  CK(cudaMalloc(&sink, 4));
  CK(cudaMemset(d, 0x3c, maxb));
  cudaStream_t s;
  cudaStreamCreate(&s);
  using attnkit::tools::launch_read_reduction;
  const int blocks4 = attnkit::tools::read_reduction_blocks(1);  // 4 loads in flight a thread
  const int blocks8 = attnkit::tools::read_reduction_blocks(2);  // 8
  const size_t sizes[] = {size_t{268435456}, size_t{536870912}, size_t{1073741824},
                          size_t{2147483648}};
  for (size_t bytes : sizes) {
    const size_t n = bytes / 16;
    double u4 = graph_us([&] { launch_read_reduction(1, blocks4, d, bytes, sink, s); }, s);
    double u8 = graph_us([&] { launch_read_reduction(2, blocks8, d, bytes, sink, s); }, s);
    printf("stride  %5zu MB: unroll4 %7.2f us %.3f TB/s | unroll8 %7.2f us %.3f TB/s\n",
           bytes >> 20, u4, bytes / u4 * 1e-6, u8, bytes / u8 * 1e-6);
    for (int ctas : {256, 512, 1024, 2048}) {
      double u = graph_us([&] { chunk_read<<<ctas, 128, 0, s>>>(d, n / ctas, sink); }, s);
      printf("chunk   %5zu MB %4d CTAs: %7.2f us %.3f TB/s\n", bytes >> 20, ctas, u,
             bytes / u * 1e-6);
    }
  }
  CK(cudaGetLastError());
  return 0;
}
