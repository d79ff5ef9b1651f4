// The read-only bandwidth ceiling of `attnkit bench` (docs/bench.md): one launch of a reduction
// that reads `bytes` once. CUDA builds only.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace attnkit::tools {

constexpr int kReadReductionVariants = 3;  // 2, 4 or 8 loads of 16 bytes in flight per thread

// The grid of variant `variant` (0 .. variants - 1): one wave of fully occupied SMs of the
// current device. Queried once, outside the timed launches.
int read_reduction_blocks(int variant);

// Reads `bytes` (a multiple of 16) from `data` with `blocks` CTAs of variant `variant`; `sink`
// receives a word only when the reduction hits a value that random or constant data practically
// never gives, so the loads cannot be elided. Returns the launch status.
cudaError_t launch_read_reduction(int variant, int blocks, const void* data, size_t bytes,
                                  unsigned* sink, cudaStream_t stream);

}  // namespace attnkit::tools
