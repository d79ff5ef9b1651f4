// ShardedKvCache: one rank's share of sharded sequences in its KvCacheManager.
#include <algorithm>

#include "attnkit/context_parallel.h"
#include "core/check.h"

namespace attnkit::cp {

ShardedKvCache::ShardedKvCache(KvCacheManager& manager, const DecodeShardLayout& layout,
                               int32_t rank)
    : manager_(manager), layout_(layout), rank_(rank) {
  layout.validate();
  ATTNKIT_CHECK(rank >= 0 && rank < layout.world_size, "ShardedKvCache: rank must be in [0, ",
                layout.world_size, ") (DecodeShardLayout.world_size), got ", rank);
}

int64_t ShardedKvCache::length(SeqId seq) const {
  for (const auto& [id, len] : lengths_) {
    if (id == seq) return len;
  }
  return 0;
}

int64_t ShardedKvCache::local_length(SeqId seq) const {
  return layout_.local_length(rank_, length(seq));
}

void ShardedKvCache::extend(SeqId seq, std::span<const int32_t> tokens) {
  const int64_t begin = length(seq);
  const std::vector<int32_t> local = layout_.local_tokens(rank_, begin, tokens);
  if (!local.empty()) {
    if (manager_.contains(seq)) {
      manager_.append(seq, local);
    } else {
      manager_.add(seq, local);
    }
  }
  const int64_t end = begin + static_cast<int64_t>(tokens.size());
  const auto it = std::find_if(lengths_.begin(), lengths_.end(),
                               [&](const auto& entry) { return entry.first == seq; });
  if (it == lengths_.end()) {
    lengths_.emplace_back(seq, end);
  } else {
    it->second = end;
  }
}

void ShardedKvCache::release(SeqId seq) {
  if (manager_.contains(seq)) manager_.release(seq);
  std::erase_if(lengths_, [&](const auto& entry) { return entry.first == seq; });
}

KvBlockTables ShardedKvCache::block_tables(std::span<const SeqId> rows) const {
  KvBlockTables tables;
  tables.num_rows = static_cast<int64_t>(rows.size());
  tables.max_blocks = manager_.max_blocks_per_seq();
  tables.table.assign(static_cast<size_t>(tables.num_rows * tables.max_blocks), -1);
  tables.seq_lens.assign(rows.size(), 0);
  for (size_t i = 0; i < rows.size(); ++i) {
    if (!manager_.contains(rows[i])) continue;
    manager_.fill_block_tables(rows.subspan(i, 1), tables.table.data() + i * tables.max_blocks,
                               tables.max_blocks, tables.seq_lens.data() + i);
  }
  return tables;
}

}  // namespace attnkit::cp
