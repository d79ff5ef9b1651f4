// Pure-read rates at decode's byte counts, timed as `attnkit bench decode` times rows (a CUDA graph
// of 20 back-to-back calls, median of 9 graph launches). Two experiments:
//   readprobe sizes   (call 1): does a kernel that only reads reach the same TB/s at fp8 64 x 4k's
//                     bytes (537 MB) as at bf16's (1074 MB)? Grid-stride and one chunk a CTA.
//   readprobe split   (call 5): at those bytes, what does a one-chunk-a-CTA grid (decode's
//                     decomposition) lose against grid-stride, by bytes and warps in flight, and
//                     does claiming pieces from a counter (dynamic balance) win it back?
//   readprobe cpasync (session 13): the same grid copying with cp.async into a shared ring, as
//                     the decode kernels do, by 128 or 256 threads at the same bytes in flight;
//                     and at batch 1 x 32k's 134 MB, 2 CTAs an SM against 1 with a deeper ring.
// The grid-stride read is the bench's read ceiling kernel (tools/read_ceiling.cu, included; in
// call 1 the probe held a copy of it, and call 5 ran this file's split mode as probe2.cu, with a
// 16 KB piece row that read nothing: 16 KB is less than one step of 128 threads x 16 loads).
// Built from this folder:
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -I../../../tools readprobe.cu
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "read_ceiling.cu"

// XOR of `count` vectors from p (the part past the last whole step of kU loads is not read), kU
// loads in flight a thread.
template <int kT, int kU>
__device__ __forceinline__ void read_range(const uint4* __restrict__ p, size_t count,
                                           unsigned& acc) {
  for (size_t i = threadIdx.x; i + (kU - 1) * kT < count; i += kU * kT) {
    uint4 v[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) v[u] = __ldcs(p + i + u * kT);
#pragma unroll
    for (int u = 0; u < kU; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
}

// One contiguous chunk of `per_cta` vectors a CTA, kU loads in flight a thread.
template <int kT, int kU>
__global__ void __launch_bounds__(kT)
    chunk_read(const uint4* __restrict__ d, size_t per_cta, unsigned* sink) {
  const uint4* p = d + blockIdx.x * per_cta;
  unsigned acc = 0;
  read_range<kT, kU>(p, per_cta, acc);
  if (acc == 0x9e3779b9u) atomicAdd(sink, 1u);
}

// Persistent CTAs claim pieces of `piece` vectors (at least kU * kT) from *counter; the next
// claim is issued before the current piece is read.
template <int kT, int kU>
__global__ void __launch_bounds__(kT)
    dynamic_read(const uint4* __restrict__ d, size_t pieces, size_t piece, unsigned* counter,
                 unsigned* sink) {
  __shared__ unsigned next[2];
  unsigned acc = 0;
  if (threadIdx.x == 0) next[0] = atomicAdd(counter, 1u);
  __syncthreads();
  for (int buf = 0;; buf ^= 1) {
    const unsigned c = next[buf];
    if (c >= pieces) break;
    if (threadIdx.x == 0) next[buf ^ 1] = atomicAdd(counter, 1u);
    const uint4* p = d + c * piece;
    read_range<kT, kU>(p, piece, acc);
    __syncthreads();
  }
  if (acc == 0x9e3779b9u) atomicAdd(sink, 1u);
}

// One contiguous chunk a CTA copied by cp.async (16 bytes, .cg) into a shared ring of kStages
// groups of kU copies a thread, as the decode kernels copy: kStages - 1 groups in flight while one
// is read back (one word a copy, so the copies cannot be elided).
template <int kT, int kU, int kStages>
__global__ void __launch_bounds__(kT)
    chunk_cp_async(const uint4* __restrict__ d, size_t per_cta, unsigned* sink) {
  extern __shared__ uint4 ring[];  // [kStages][kU][kT]
  const uint4* p = d + blockIdx.x * per_cta;
  const size_t steps = per_cta / (kU * kT);
  unsigned acc = 0;
  // Copies of step `step` into its ring slot, as one committed group; past the chunk's end an
  // empty group, so that the wait below keeps counting groups.
  auto issue = [&](size_t step) {
    if (step < steps) {
      uint4* dst = ring + (step % kStages) * kU * kT;
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const unsigned addr =
            static_cast<unsigned>(__cvta_generic_to_shared(dst + u * kT + threadIdx.x));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(addr),
                     "l"(p + step * kU * kT + u * kT + threadIdx.x));
      }
    }
    asm volatile("cp.async.commit_group;\n" ::);
  };
  for (int st = 0; st < kStages - 1; ++st) issue(st);
  for (size_t step = 0; step < steps; ++step) {
    issue(step + kStages - 1);
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 1));
    const uint4* src = ring + (step % kStages) * kU * kT;
#pragma unroll
    for (int u = 0; u < kU; ++u) acc ^= src[u * kT + threadIdx.x].x;
  }
  if (acc == 0x9e3779b9u) atomicAdd(sink, 1u);
}

constexpr int kCalls = 20;

// Median microseconds a call of `launch(call)` over a graph of kCalls calls; `counters` (kCalls
// words, one a call) are zeroed by a memset node at the graph's start.
template <typename F>
double graph_us(F launch, cudaStream_t s, unsigned* counters = nullptr) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
  if (counters != nullptr) cudaMemsetAsync(counters, 0, kCalls * sizeof(unsigned), s);
  for (int i = 0; i < kCalls; ++i) launch(i);
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
    t.push_back(ms * 1000.f / kCalls);
  }
  std::sort(t.begin(), t.end());
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  return t[t.size() / 2];
}

int main(int argc, char** argv) {
  const bool split_mode = argc > 1 && std::strcmp(argv[1], "split") == 0;
  const bool cp_async_mode = argc > 1 && std::strcmp(argv[1], "cpasync") == 0;
  int sms;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const size_t max_bytes = size_t{2} << 30;
  uint4* d;
  unsigned *sink, *counters;
  cudaMalloc(&d, max_bytes);
  cudaMalloc(&sink, sizeof(unsigned));
  cudaMalloc(&counters, kCalls * sizeof(unsigned));
  cudaMemset(d, 0x3c, max_bytes);
  cudaStream_t s;
  cudaStreamCreate(&s);
  using attnkit::tools::launch_read_reduction;
  const int blocks4 = attnkit::tools::read_reduction_blocks(1);  // 4 loads in flight a thread
  const int blocks8 = attnkit::tools::read_reduction_blocks(2);  // 8
  std::vector<size_t> sizes = {size_t{536870912}, size_t{1073741824}};
  if (!split_mode && !cp_async_mode) sizes = {size_t{268435456}, sizes[0], sizes[1], max_bytes};
  if (cp_async_mode) sizes.insert(sizes.begin(), size_t{134217728});
  for (size_t bytes : sizes) {
    const size_t n = bytes / 16;
    auto report = [&](const char* what, double us) {
      printf("%5zu MB %-42s %8.2f us %.3f TB/s\n", bytes >> 20, what, us, bytes / us * 1e-6);
    };
    report("grid-stride, 4 loads a thread",
           graph_us([&](int) { launch_read_reduction(1, blocks4, d, bytes, sink, s); }, s));
    if (cp_async_mode) {
      // 512 CTAs (fp8 64 x 4k's grid), 4 an SM, 32 KB of copies in flight a CTA (the 4-CTA 8-bit
      // kernel's two 16 KB halves) by 128 or 256 threads; and 48 KB by 128, whose 64 KB ring
      // leaves room for 3 CTAs an SM (two waves).
      auto run = [&](const char* what, auto kernel, int threads, int ring_bytes, int ctas = 512) {
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, ring_bytes);
        report(
            what,
            graph_us([&](int) { kernel<<<ctas, threads, ring_bytes, s>>>(d, n / ctas, sink); }, s));
      };
      // Batch 1 x 32k's grids (134 MB bf16): 256 CTAs, 2 an SM, 6 halves of 16 KB in flight
      // (the 2-CTA kernel), against 128 CTAs, 1 an SM, 11 in flight by 4 or 8 warps.
      run("cp.async 256 x 128 thr x 8 x 7 st. (96 KB, 2/SM)", chunk_cp_async<128, 8, 7>, 128,
          7 * 8 * 128 * 16, 256);
      run("cp.async 128 x 128 thr x 8 x 12 st. (176 KB, 1/SM)", chunk_cp_async<128, 8, 12>, 128,
          12 * 8 * 128 * 16, 128);
      run("cp.async 128 x 256 thr x 4 x 12 st. (176 KB, 1/SM)", chunk_cp_async<256, 4, 12>, 256,
          12 * 4 * 256 * 16, 128);
      if (bytes < (size_t{256} << 20)) continue;
      run("cp.async 512 x 128 thr x 8 x 3 stages (32 KB)", chunk_cp_async<128, 8, 3>, 128,
          3 * 8 * 128 * 16);
      run("cp.async 512 x 256 thr x 4 x 3 stages (32 KB)", chunk_cp_async<256, 4, 3>, 256,
          3 * 4 * 256 * 16);
      run("cp.async 512 x 128 thr x 8 x 4 st. (48 KB, 3/SM)", chunk_cp_async<128, 8, 4>, 128,
          4 * 8 * 128 * 16);
      continue;
    }
    if (!split_mode) {
      report("grid-stride, 8 loads a thread",
             graph_us([&](int) { launch_read_reduction(2, blocks8, d, bytes, sink, s); }, s));
      for (int ctas : {256, 512, 1024, 2048}) {
        char what[64];
        std::snprintf(what, sizeof(what), "%d chunks x 128 thr x 8 (16 KB)", ctas);
        report(
            what,
            graph_us([&](int) { chunk_read<128, 8><<<ctas, 128, 0, s>>>(d, n / ctas, sink); }, s));
      }
      continue;
    }
    report("512 chunks x 128 thr x 8 (16 KB)",
           graph_us([&](int) { chunk_read<128, 8><<<512, 128, 0, s>>>(d, n / 512, sink); }, s));
    report("512 chunks x 128 thr x 16 (32 KB)",
           graph_us([&](int) { chunk_read<128, 16><<<512, 128, 0, s>>>(d, n / 512, sink); }, s));
    report("512 chunks x 256 thr x 8 (32 KB)",
           graph_us([&](int) { chunk_read<256, 8><<<512, 256, 0, s>>>(d, n / 512, sink); }, s));
    report("264 chunks x 256 thr x 16 (64 KB)",
           graph_us([&](int) { chunk_read<256, 16><<<264, 256, 0, s>>>(d, n / 264, sink); }, s));
    report("1056 chunks x 128 thr x 8 (16 KB)",
           graph_us([&](int) { chunk_read<128, 8><<<1056, 128, 0, s>>>(d, n / 1056, sink); }, s));
    for (size_t piece_kb : {64, 256}) {
      const size_t piece = piece_kb * 1024 / 16, pieces = n / piece;
      char what[64];
      std::snprintf(what, sizeof(what), "dynamic %d x 128 thr x 16, %zu KB pieces", 4 * sms,
                    piece_kb);
      report(what, graph_us(
                       [&](int call) {
                         dynamic_read<128, 16>
                             <<<4 * sms, 128, 0, s>>>(d, pieces, piece, counters + call, sink);
                       },
                       s, counters));
    }
  }
  std::printf("%s\n", cudaGetErrorString(cudaGetLastError()));
  return 0;
}
