// Host-memory backing of CPU pools (the reference backend reads these blocks directly) and of the
// host tier of CPU pools. Both are anonymous mappings, so a pool sized for the worst case costs
// only the pages its blocks have been written to.
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

#include "core/check.h"
#include "kv_cache/kv_memory.h"

namespace attnkit::detail {
namespace {

// `bytes` of zeroed memory, reserved but not committed (MAP_NORESERVE); pages are committed when
// first written.
class LazyBytes {
 public:
  LazyBytes(int64_t bytes, const char* what) : bytes_(static_cast<size_t>(bytes)) {
    if (bytes_ == 0) return;
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      fail("KvCacheManagerConfig.", what, ": cannot map ", bytes, " bytes of host memory (",
           std::strerror(errno), ")");
    }
    data_ = static_cast<uint8_t*>(p);
  }
  ~LazyBytes() {
    if (data_ != nullptr) munmap(data_, bytes_);
  }
  LazyBytes(const LazyBytes&) = delete;
  LazyBytes& operator=(const LazyBytes&) = delete;
  uint8_t* data() const { return data_; }

 private:
  size_t bytes_;
  uint8_t* data_ = nullptr;
};

class HostKvMemory final : public KvMemory {
 public:
  HostKvMemory(int32_t num_blocks, int64_t host_slots, int64_t block_bytes)
      : block_bytes_(block_bytes),
        pool_(int64_t{num_blocks} * block_bytes, "max_tokens / max_bytes (the pool)"),
        host_(host_slots * block_bytes, "host_cache_bytes") {}

  uint8_t* pool() const override { return pool_.data(); }
  void copy_block(int32_t dst_block, int32_t src_block) override {
    std::memcpy(block(dst_block), block(src_block), block_bytes_);
  }
  void offload(int32_t block_id, int64_t host_slot) override {
    std::memcpy(host_.data() + host_slot * block_bytes_, block(block_id), block_bytes_);
  }
  void onboard(int64_t host_slot, int32_t block_id) override {
    std::memcpy(block(block_id), host_.data() + host_slot * block_bytes_, block_bytes_);
  }
  void read_block(int32_t block_id, void* out) const override {
    std::memcpy(out, pool_.data() + block_id * block_bytes_, block_bytes_);
  }

 private:
  uint8_t* block(int32_t id) { return pool_.data() + id * block_bytes_; }

  int64_t block_bytes_;
  LazyBytes pool_;
  LazyBytes host_;
};

}  // namespace

std::unique_ptr<KvMemory> make_host_kv_memory(int32_t num_blocks, int64_t host_slots,
                                              int64_t block_bytes) {
  return std::make_unique<HostKvMemory>(num_blocks, host_slots, block_bytes);
}

int64_t host_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_size <= 0) return INT64_MAX;  // unknown: no limit of our own
  return static_cast<int64_t>(pages) * page_size;
}

}  // namespace attnkit::detail
