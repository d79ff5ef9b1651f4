// The read-only bandwidth ceiling of `attnkit bench` (docs/bench.md): one launch of a reduction
// that reads `bytes` once. CUDA builds only.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace attnkit::tools {

// Reads `bytes` (a multiple of 16) from `data`; `sink` receives a word only when the reduction hits
// a value that random or constant data practically never gives, so the loads cannot be elided.
// Returns the launch status.
cudaError_t launch_read_reduction(const void* data, size_t bytes, unsigned* sink,
                                  cudaStream_t stream);

}  // namespace attnkit::tools
