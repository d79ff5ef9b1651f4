// Helpers of the KV-cache manager tests: the test plays the engine and writes a stamp (token id,
// position, salt) into the K slot of every token it adds, so that reading the slots back through
// the exported block tables proves which KV a sequence sees (reuse, copy-on-write, offload).
#pragma once

#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "attnkit/kv_cache_manager.h"
#include "core/kv_access.h"

namespace attnkit::test {

struct Stamp {
  int32_t token = 0;
  int32_t position = 0;
  int32_t salt = 0;
  bool operator==(const Stamp&) const = default;
};

// Accessor of one sequence's slots in one layer (valid until the next manager call).
class SlotAccess {
 public:
  SlotAccess(const KvCacheManager& manager, SeqId seq, int32_t layer) {
    const SeqId rows[1] = {seq};
    tables_ = manager.block_tables(rows);
    layout_ = detail::make_kv_layout(
        manager.layer_view(layer, tables_.table_view(), tables_.seq_lens_view()));
  }
  void write(int64_t position, const Stamp& stamp) const {
    std::memcpy(layout_.k_ptr(0, position, 0), &stamp, sizeof(Stamp));
  }
  Stamp read(int64_t position) const {
    Stamp s;
    std::memcpy(&s, layout_.k_ptr(0, position, 0), sizeof(Stamp));
    return s;
  }
  int64_t length() const { return tables_.seq_lens[0]; }

 private:
  KvBlockTables tables_;
  detail::KvLayout layout_;
};

}  // namespace attnkit::test
