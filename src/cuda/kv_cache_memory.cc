// Device-memory backing of CUDA KvCacheManager pools: the pool in cudaMalloc memory, the host
// tier in pinned memory (cudaMallocHost) so that offload / onboard copies run asynchronously;
// every copy is enqueued on the manager's stream, in call order, so a block is never reused
// before the copy out of it has run.
#include <cuda_runtime.h>

#include "core/check.h"
#include "cuda/common/cuda_status.h"
#include "kv_cache/kv_memory.h"

namespace attnkit::detail {
namespace {

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    fail("KvCacheManager: ", what, " failed: ", cudaGetErrorString(status));
  }
}

class CudaKvMemory final : public KvMemory {
 public:
  CudaKvMemory(int device, int32_t num_blocks, int64_t host_slots, int64_t block_bytes,
               void* stream)
      : device_(device), block_bytes_(block_bytes), stream_(static_cast<cudaStream_t>(stream)) {
    cuda::DeviceScope scope(device, "KvCacheManager: cudaSetDevice");
    const size_t pool_bytes = static_cast<size_t>(num_blocks) * block_bytes;
    check_cuda(cudaMalloc(&pool_, pool_bytes), "cudaMalloc");
    // Zeros once, finished before the constructor returns (the caller's kernels may write the pool
    // on any stream): a block's slots past its tokens are then defined when a copy-on-write or an
    // offload moves the whole block (compute-sanitizer's initcheck stays clean), and a new pool
    // never shows what an earlier allocation left there. One memset at creation (about 30 ms for
    // 100 GiB).
    cudaError_t zeroed = cudaMemsetAsync(pool_, 0, pool_bytes, stream_);
    if (zeroed == cudaSuccess) zeroed = cudaStreamSynchronize(stream_);
    if (zeroed != cudaSuccess) {
      cudaFree(pool_);
      check_cuda(zeroed, "cudaMemsetAsync (zeroing the pool)");
    }
    if (host_slots > 0) {
      const cudaError_t status =
          cudaMallocHost(&host_, static_cast<size_t>(host_slots) * block_bytes);
      if (status != cudaSuccess) {
        cudaFree(pool_);
        check_cuda(status, "cudaMallocHost (host_cache_bytes)");
      }
    }
  }
  ~CudaKvMemory() override {
    cuda::DeviceScope scope(device_, nullptr);  // a destructor: never throws
    cudaStreamSynchronize(stream_);             // copies out of the pool may still be in flight
    if (host_) cudaFreeHost(host_);
    cudaFree(pool_);
  }

  uint8_t* pool() const override { return pool_; }
  void copy_block(int32_t dst_block, int32_t src_block) override {
    check_cuda(cudaMemcpyAsync(block(dst_block), block(src_block), block_bytes_,
                               cudaMemcpyDeviceToDevice, stream_),
               "cudaMemcpyAsync (copy-on-write)");
  }
  void offload(int32_t block_id, int64_t host_slot) override {
    check_cuda(cudaMemcpyAsync(host_ + host_slot * block_bytes_, block(block_id), block_bytes_,
                               cudaMemcpyDeviceToHost, stream_),
               "cudaMemcpyAsync (offload)");
  }
  void onboard(int64_t host_slot, int32_t block_id) override {
    check_cuda(cudaMemcpyAsync(block(block_id), host_ + host_slot * block_bytes_, block_bytes_,
                               cudaMemcpyHostToDevice, stream_),
               "cudaMemcpyAsync (onboard)");
  }
  void read_block(int32_t block_id, void* out) const override {
    check_cuda(cudaMemcpyAsync(out, pool_ + block_id * block_bytes_, block_bytes_,
                               cudaMemcpyDeviceToHost, stream_),
               "cudaMemcpyAsync (read_block)");
    check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }

 private:
  uint8_t* block(int32_t id) const { return pool_ + id * block_bytes_; }

  int device_;
  int64_t block_bytes_;
  cudaStream_t stream_;
  uint8_t* pool_ = nullptr;
  uint8_t* host_ = nullptr;
};

}  // namespace

std::unique_ptr<KvMemory> make_cuda_kv_memory(int device, int32_t num_blocks, int64_t host_slots,
                                              int64_t block_bytes, void* stream) {
  return std::make_unique<CudaKvMemory>(device, num_blocks, host_slots, block_bytes, stream);
}

int64_t cuda_free_memory_bytes(int device) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    count = 0;
  }
  ATTNKIT_CHECK(device >= 0 && device < count, "KvCacheManagerConfig.device: cuda:", device,
                " is not present (", count, " CUDA devices visible)");
  cuda::DeviceScope scope(device, "KvCacheManager: cudaSetDevice");
  size_t free_bytes = 0, total_bytes = 0;
  check_cuda(cudaMemGetInfo(&free_bytes, &total_bytes),
             "cudaMemGetInfo (free_gpu_memory_fraction)");
  return static_cast<int64_t>(free_bytes);
}

}  // namespace attnkit::detail
