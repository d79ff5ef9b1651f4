// KvMemory: where the bytes of a KvCacheManager pool (and its host tier) live. Host memory for
// CPU pools (kv_memory_host.cc); device memory + pinned host memory through the CUDA runtime for
// CUDA pools (src/cuda/kv_cache_memory.cc, only in CUDA builds; kv_memory_no_cuda.cc otherwise).
#pragma once

#include <cstdint>
#include <memory>

namespace attnkit::detail {

class KvMemory {
 public:
  virtual ~KvMemory() = default;
  // Base of num_blocks * block_bytes bytes.
  virtual uint8_t* pool() const = 0;
  // Whole-block copies, stream-ordered on CUDA.
  virtual void copy_block(int32_t dst_block, int32_t src_block) = 0;
  virtual void offload(int32_t block, int64_t host_slot) = 0;  // pool -> host tier
  virtual void onboard(int64_t host_slot, int32_t block) = 0;  // host tier -> pool
  // Block bytes to host memory `out`; waits for earlier copies.
  virtual void read_block(int32_t block, void* out) const = 0;
};

// Host pools and host tiers are anonymous mappings: zero, and committed page by page as blocks
// are written. Throws Error when the mapping cannot be made.
std::unique_ptr<KvMemory> make_host_kv_memory(int32_t num_blocks, int64_t host_slots,
                                              int64_t block_bytes);
// The host's physical memory in bytes.
int64_t host_memory_bytes();
// CUDA pools; throw Error in builds without CUDA.
std::unique_ptr<KvMemory> make_cuda_kv_memory(int device, int32_t num_blocks, int64_t host_slots,
                                              int64_t block_bytes, void* stream);
// Free memory of CUDA device `device` in bytes (cudaMemGetInfo).
int64_t cuda_free_memory_bytes(int device);

}  // namespace attnkit::detail
