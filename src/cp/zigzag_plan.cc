// ZigzagPlan and ring_schedule(): the prefill sharding of context parallelism and the blocks each
// rank computes at each ring step (docs/context_parallel.md).
#include <algorithm>
#include <limits>

#include "attnkit/context_parallel.h"
#include "core/check.h"

namespace attnkit::cp {
namespace {

void check_rank(const char* what, int32_t world_size, int32_t rank) {
  ATTNKIT_CHECK(world_size >= 1, what, ": world_size must be >= 1, got ", world_size);
  ATTNKIT_CHECK(rank >= 0 && rank < world_size, what, ": rank must be in [0, ", world_size,
                "), got ", rank);
}

}  // namespace

ZigzagPlan::ZigzagPlan(std::span<const int32_t> cu_seqlens, int32_t world_size)
    : world_size_(world_size), cu_seqlens_(cu_seqlens.begin(), cu_seqlens.end()) {
  ATTNKIT_CHECK(world_size >= 1, "ZigzagPlan: world_size must be >= 1, got ", world_size);
  ATTNKIT_CHECK(
      !cu_seqlens_.empty() && cu_seqlens_[0] == 0,
      "ZigzagPlan: cu_seqlens must have B + 1 >= 1 entries starting at 0, got ",
      cu_seqlens_.empty() ? "none" : "a first entry of " + std::to_string(cu_seqlens_[0]));
  for (size_t i = 1; i < cu_seqlens_.size(); ++i) {
    ATTNKIT_CHECK(cu_seqlens_[i] >= cu_seqlens_[i - 1],
                  "ZigzagPlan: cu_seqlens must be non-decreasing, got cu_seqlens[", i,
                  "] = ", cu_seqlens_[i], " after ", cu_seqlens_[i - 1]);
  }
}

int32_t ZigzagPlan::chunk_of(int32_t rank, int32_t slot) const {
  check_rank("ZigzagPlan::chunk_of", world_size_, rank);
  ATTNKIT_CHECK(slot >= 0 && slot < num_slots(), "ZigzagPlan::chunk_of: slot must be in [0, ",
                num_slots(), "), got ", slot);
  return slot == 0 ? rank : 2 * world_size_ - 1 - rank;
}

int64_t ZigzagPlan::chunk_begin(int32_t seq, int32_t chunk) const {
  const int64_t length = int64_t{cu_seqlens_[seq + 1]} - cu_seqlens_[seq];
  return chunk * length / num_chunks();
}

int64_t ZigzagPlan::chunk_length(int32_t seq, int32_t chunk) const {
  return chunk_begin(seq, chunk + 1) - chunk_begin(seq, chunk);
}

int64_t ZigzagPlan::slot_tokens(int32_t rank, int32_t slot) const {
  const int32_t chunk = chunk_of(rank, slot);
  int64_t tokens = 0;
  for (int32_t s = 0; s < num_sequences(); ++s) tokens += chunk_length(s, chunk);
  return tokens;
}

int64_t ZigzagPlan::slot_offset(int32_t rank, int32_t slot) const {
  return slot == 0 ? 0 : slot_tokens(rank, 0);
}

int64_t ZigzagPlan::local_tokens(int32_t rank) const {
  int64_t tokens = 0;
  for (int32_t slot = 0; slot < num_slots(); ++slot) tokens += slot_tokens(rank, slot);
  return tokens;
}

int64_t ZigzagPlan::max_local_tokens() const {
  int64_t tokens = 0;
  for (int32_t r = 0; r < world_size_; ++r) tokens = std::max(tokens, local_tokens(r));
  return tokens;
}

int32_t ZigzagPlan::slot_max_seqlen(int32_t rank, int32_t slot) const {
  const int32_t chunk = chunk_of(rank, slot);
  int64_t longest = 0;
  for (int32_t s = 0; s < num_sequences(); ++s) longest = std::max(longest, chunk_length(s, chunk));
  return static_cast<int32_t>(longest);
}

std::vector<int32_t> ZigzagPlan::slot_cu_seqlens(int32_t rank, int32_t slot) const {
  const int32_t chunk = chunk_of(rank, slot);
  std::vector<int32_t> cu{0};
  for (int32_t s = 0; s < num_sequences(); ++s) {
    cu.push_back(cu.back() + static_cast<int32_t>(chunk_length(s, chunk)));
  }
  return cu;
}

std::vector<int32_t> ZigzagPlan::global_rows(int32_t rank) const {
  std::vector<int32_t> rows;
  rows.reserve(static_cast<size_t>(local_tokens(rank)));
  for (int32_t slot = 0; slot < num_slots(); ++slot) {
    const int32_t chunk = chunk_of(rank, slot);
    for (int32_t s = 0; s < num_sequences(); ++s) {
      const int64_t first = cu_seqlens_[s] + chunk_begin(s, chunk);
      for (int64_t i = 0; i < chunk_length(s, chunk); ++i) {
        rows.push_back(static_cast<int32_t>(first + i));
      }
    }
  }
  return rows;
}

std::vector<RingStep> ring_schedule(int32_t world_size, int32_t rank, bool causal) {
  check_rank("ring_schedule", world_size, rank);
  const int32_t slots = world_size == 1 ? 1 : 2;
  const auto chunk = [&](int32_t r, int32_t slot) {
    return slot == 0 ? r : 2 * world_size - 1 - r;
  };
  std::vector<RingStep> steps(static_cast<size_t>(world_size));
  for (int32_t t = 0; t < world_size; ++t) {
    RingStep& step = steps[t];
    step.kv_rank = (rank - t + world_size) % world_size;
    for (int32_t qs = 0; qs < slots; ++qs) {
      for (int32_t ks = 0; ks < slots; ++ks) {
        const int32_t a = chunk(rank, qs), b = chunk(step.kv_rank, ks);
        // Under a causal mask chunk a sees the whole of every earlier chunk, itself causally, and
        // nothing of a later one.
        if (causal && b > a) continue;
        const BlockKind kind = causal && a == b ? BlockKind::kCausalDiagonal : BlockKind::kFull;
        step.blocks.push_back({qs, ks, a, b, kind});
      }
    }
  }
  return steps;
}

void DecodeShardLayout::validate() const {
  ATTNKIT_CHECK(world_size >= 1, "DecodeShardLayout.world_size: must be >= 1, got ", world_size);
  ATTNKIT_CHECK(tokens_per_block >= 1, "DecodeShardLayout.tokens_per_block: must be >= 1, got ",
                tokens_per_block);
}

int32_t DecodeShardLayout::rank_of_position(int64_t position) const {
  return static_cast<int32_t>((position / tokens_per_block) % world_size);
}

int64_t DecodeShardLayout::local_position(int64_t position) const {
  const int64_t t = tokens_per_block;
  return (position / t / world_size) * t + position % t;
}

int64_t DecodeShardLayout::local_length(int32_t rank, int64_t length) const {
  const int64_t t = tokens_per_block, r = world_size;
  const int64_t full_blocks = length / t;
  // Blocks rank, rank + R, ... below full_blocks are whole; the block at full_blocks is partial.
  const int64_t whole = full_blocks > rank ? (full_blocks - rank + r - 1) / r : 0;
  const int64_t partial = full_blocks % r == rank ? length % t : 0;
  return whole * t + partial;
}

std::vector<int32_t> DecodeShardLayout::local_tokens(int32_t rank, int64_t begin,
                                                     std::span<const int32_t> tokens) const {
  std::vector<int32_t> local;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (rank_of_position(begin + static_cast<int64_t>(i)) == rank) local.push_back(tokens[i]);
  }
  return local;
}

}  // namespace attnkit::cp
