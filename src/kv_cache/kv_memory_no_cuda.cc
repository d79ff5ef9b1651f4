// CPU-only builds: CUDA pools are rejected (src/cuda/kv_cache_memory.cc replaces this file's
// definitions when attnkit is built with CUDA).
#ifndef ATTNKIT_WITH_CUDA

#include "core/check.h"
#include "kv_cache/kv_memory.h"

namespace attnkit::detail {

std::unique_ptr<KvMemory> make_cuda_kv_memory(int device, int32_t, int64_t, int64_t, void*) {
  fail(
      "KvCacheManagerConfig.device: attnkit was built without the CUDA backend, so only cpu "
      "pools are accepted; got cuda:",
      device);
}

int64_t cuda_free_memory_bytes(int device) {
  fail("KvCacheManagerConfig.free_gpu_memory_fraction: no CUDA in this build (device cuda:", device,
       ")");
}

}  // namespace attnkit::detail

#endif  // ATTNKIT_WITH_CUDA
