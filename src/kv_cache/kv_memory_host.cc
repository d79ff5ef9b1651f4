// Host-memory backing of CPU pools (the reference backend reads these blocks directly).
#include <cstring>
#include <vector>

#include "core/check.h"
#include "kv_cache/kv_memory.h"

namespace attnkit::detail {
namespace {

class HostKvMemory final : public KvMemory {
 public:
  HostKvMemory(int32_t num_blocks, int64_t host_slots, int64_t block_bytes)
      : block_bytes_(block_bytes),
        pool_(static_cast<size_t>(num_blocks) * block_bytes),
        host_(static_cast<size_t>(host_slots) * block_bytes) {}

  uint8_t* pool() const override { return const_cast<uint8_t*>(pool_.data()); }
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
  std::vector<uint8_t> pool_;
  std::vector<uint8_t> host_;
};

}  // namespace

std::unique_ptr<KvMemory> make_host_kv_memory(int32_t num_blocks, int64_t host_slots,
                                              int64_t block_bytes) {
  return std::make_unique<HostKvMemory>(num_blocks, host_slots, block_bytes);
}

}  // namespace attnkit::detail
