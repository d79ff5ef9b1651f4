// KvCacheManager (include/attnkit/kv_cache_manager.h). Block states: free (in free_list_),
// cached (unreferenced but registered in the prefix index: the eviction candidates in
// evictable_) and used (ref > 0, registered or not). Every mutating call checks what it needs
// before it changes anything, so a rejected call leaves the state as it was.
#include "attnkit/kv_cache_manager.h"

#include <algorithm>
#include <mutex>
#include <new>
#include <set>
#include <tuple>
#include <unordered_map>

#include "core/check.h"
#include "kv_cache/kv_memory.h"

namespace attnkit {
namespace {

using detail::fail;

uint64_t mix64(uint64_t x) {  // splitmix64 finalizer
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

uint64_t root_hash(uint64_t salt) { return mix64(salt ^ 0x243f6a8885a308d3ULL); }

uint64_t block_hash(uint64_t parent, const int32_t* tokens, int32_t count) {
  uint64_t h = mix64(parent);
  for (int32_t i = 0; i < count; ++i) h = mix64(h ^ static_cast<uint32_t>(tokens[i]));
  return h;
}

// a >= 0, b > 0; no a + b - 1 that could overflow (max_tokens may be INT64_MAX).
int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0); }

}  // namespace

TensorView KvBlockTables::table_view() const {
  return TensorView(const_cast<int32_t*>(table.data()), DType::kInt32, {num_rows, max_blocks});
}
TensorView KvBlockTables::seq_lens_view() const {
  return TensorView(const_cast<int32_t*>(seq_lens.data()), DType::kInt32, {num_rows});
}

struct KvCacheManager::Impl {
  // Eviction order: lower priority, then leaves (no registered child) before inner blocks, then
  // least recently used.
  using EvictKey = std::tuple<int32_t, int32_t, int64_t, int32_t>;

  struct Block {
    int32_t ref = 0;
    bool free = true;
    bool registered = false;
    bool evictable = false;
    EvictKey key{};
    uint64_t hash = 0;
    uint64_t parent_hash = 0;
    uint64_t salt = 0;
    std::vector<int32_t> tokens;  // registered blocks: token ids, compared on every hit
    int64_t last_used = 0;
    int32_t priority = 0;
  };
  struct HostEntry {
    int64_t slot = 0;
    uint64_t parent_hash = 0;
    uint64_t salt = 0;
    std::vector<int32_t> tokens;
    int64_t tick = 0;
  };
  struct Sequence {
    std::vector<int32_t> tokens;
    std::vector<int32_t> blocks;
    std::vector<uint64_t> chain;  // hash of each full block (prefix chain)
    uint64_t salt = 0;
    int32_t priority = 0;
    bool beam_search = false;       // reordered beams: their blocks are not registered
    std::vector<int32_t> beam_src;  // cache_indirection of positions < beam_src.size()
  };
  // One prefix-index hit of add(): a pool block, or a host-tier entry (block == -1).
  struct Hit {
    int32_t block = -1;
    uint64_t hash = 0;
  };

  KvCacheManagerConfig config;
  int32_t T = 0;
  int64_t layer_bytes = 0;  // 2 * Hkv * T * D * elt
  int64_t block_bytes = 0;
  int32_t num_blocks = 0;
  int32_t max_blocks = 0;
  bool cyclic = false;
  std::vector<int32_t> layer_slots;     // window_slots of each layer (0: linear)
  std::vector<int32_t> distinct_slots;  // cyclic: distinct window_slots values
  int32_t min_slots = 0, max_slots = 0, sinks = 0;
  int32_t cyclic_entries = 0;  // ceil((S + max W') / T)

  std::unique_ptr<detail::KvMemory> memory;
  std::vector<Block> blocks;
  std::vector<int32_t> free_list;
  std::set<EvictKey> evictable;
  std::unordered_map<uint64_t, int32_t> index;     // hash -> registered pool block
  std::unordered_map<uint64_t, int32_t> children;  // parent hash -> registered pool children
  int64_t host_capacity = 0;
  int64_t host_untouched = 0;      // slots [host_untouched, host_capacity) were never used
  std::vector<int64_t> host_free;  // used slots given back
  std::unordered_map<uint64_t, HostEntry> host_index;
  std::set<std::pair<int64_t, uint64_t>> host_lru;  // (tick, hash) of unpinned entries
  std::unordered_map<SeqId, Sequence> seqs;
  int64_t tick = 0;
  KvCacheStats counters;
  mutable std::mutex mutex;

  explicit Impl(const KvCacheManagerConfig& c);

  // ---- helpers ----
  int64_t entries_for(int64_t length) const {
    const int64_t n = ceil_div(length, T);
    return cyclic ? std::min<int64_t>(n, cyclic_entries) : n;
  }
  static int64_t slot_of(int64_t position, int32_t slots, int32_t sink) {
    if (slots == 0 || position < sink) return position;
    return sink + (position - sink) % slots;
  }
  // Whether full block k of a sequence of `length` tokens still holds positions kT .. kT+T-1
  // in every layer (cyclic caches overwrite it once a layer wraps around).
  bool intact(int64_t k, int64_t length) const {
    if (!cyclic) return true;
    if ((k + 1) * T > sinks + min_slots) return false;
    return length <= min_slots + std::max<int64_t>(k * T, sinks);
  }
  int64_t available() const { return static_cast<int64_t>(free_list.size() + evictable.size()); }
  Sequence& seq_or_fail(SeqId seq, const char* fn) {
    auto it = seqs.find(seq);
    if (it == seqs.end()) fail("KvCacheManager::", fn, ": seq ", seq, " is not in the cache");
    return it->second;
  }
  const Sequence& seq_or_fail(SeqId seq, const char* fn) const {
    return const_cast<Impl*>(this)->seq_or_fail(seq, fn);
  }

  void refresh_evictable(int32_t b) {
    Block& blk = blocks[b];
    if (blk.evictable) {
      evictable.erase(blk.key);
      blk.evictable = false;
    }
    if (blk.ref == 0 && blk.registered) {
      auto it = children.find(blk.hash);
      const int32_t has_children = it != children.end() && it->second > 0;
      blk.key = {blk.priority, has_children, blk.last_used, b};
      evictable.insert(blk.key);
      blk.evictable = true;
    }
  }
  void refresh_parent(uint64_t parent_hash) {
    auto it = index.find(parent_hash);
    if (it != index.end()) refresh_evictable(it->second);
  }
  bool known(uint64_t hash) const { return index.count(hash) || host_index.count(hash); }

  void register_block(int32_t b, uint64_t hash, uint64_t parent_hash, uint64_t salt,
                      const int32_t* tokens) {
    if (known(hash)) return;  // the same chain is cached already (or a hash collision)
    Block& blk = blocks[b];
    blk.registered = true;
    blk.hash = hash;
    blk.parent_hash = parent_hash;
    blk.salt = salt;
    blk.tokens.assign(tokens, tokens + T);
    index[hash] = b;
    ++children[parent_hash];
    refresh_parent(parent_hash);
    refresh_evictable(b);
  }
  void unregister_block(int32_t b) {
    Block& blk = blocks[b];
    index.erase(blk.hash);
    if (--children[blk.parent_hash] == 0) children.erase(blk.parent_hash);
    blk.registered = false;
    blk.tokens.clear();
    refresh_parent(blk.parent_hash);
    refresh_evictable(b);
  }

  int64_t take_host_slot() {
    if (!host_free.empty()) {
      const int64_t slot = host_free.back();
      host_free.pop_back();
      return slot;
    }
    if (host_untouched < host_capacity) return host_untouched++;
    if (host_lru.empty()) return -1;
    const uint64_t hash = host_lru.begin()->second;
    host_lru.erase(host_lru.begin());
    auto it = host_index.find(hash);
    const int64_t slot = it->second.slot;
    host_index.erase(it);
    return slot;
  }

  // Evicts cached block b (offloading it to the host tier when there is one).
  void evict(int32_t b) {
    Block& blk = blocks[b];
    ++counters.evictions;
    if (host_capacity > 0) {
      const int64_t slot = take_host_slot();
      if (slot >= 0) {
        memory->offload(b, slot);
        HostEntry entry{slot, blk.parent_hash, blk.salt, blk.tokens, ++tick};
        const uint64_t hash = blk.hash;
        unregister_block(b);
        host_lru.insert({entry.tick, hash});
        host_index.emplace(hash, std::move(entry));
        ++counters.offloads;
      } else {
        unregister_block(b);
      }
    } else {
      unregister_block(b);
    }
    blk.priority = 0;
  }

  // A block with ref 1 for the caller; the caller checked available() first.
  int32_t take_block(int32_t priority) {
    int32_t b;
    if (!free_list.empty()) {
      b = free_list.back();
      free_list.pop_back();
    } else {
      b = std::get<3>(*evictable.begin());
      evict(b);
    }
    Block& blk = blocks[b];
    blk.free = false;
    blk.ref = 1;
    blk.priority = priority;
    return b;
  }
  void acquire(int32_t b, int32_t priority) {
    Block& blk = blocks[b];
    ++blk.ref;
    blk.priority = std::max(blk.priority, priority);
    if (blk.ref == 1) refresh_evictable(b);
  }
  void release_ref(int32_t b) {
    Block& blk = blocks[b];
    if (--blk.ref > 0) return;
    if (blk.registered) {
      blk.last_used = ++tick;
      refresh_evictable(b);
    } else {
      blk.free = true;
      blk.priority = 0;
      free_list.push_back(b);
    }
  }

  // Hash of every full block of `tokens` (the prefix chain).
  std::vector<uint64_t> chain_of(std::span<const int32_t> tokens, uint64_t salt) const {
    std::vector<uint64_t> chain;
    uint64_t parent = root_hash(salt);
    for (size_t k = 0; (k + 1) * T <= tokens.size(); ++k) {
      parent = block_hash(parent, tokens.data() + k * T, T);
      chain.push_back(parent);
    }
    return chain;
  }
  // The longest cached chain of `prompt` that add() may reuse.
  std::vector<Hit> match(std::span<const int32_t> prompt, uint64_t salt,
                         const std::vector<uint64_t>& chain) const {
    std::vector<Hit> hits;
    if (!config.enable_prefix_reuse || prompt.empty()) return hits;
    // Cyclic: reuse only prompts that do not wrap around, so no reused block is overwritten.
    if (cyclic && static_cast<int64_t>(prompt.size()) > sinks + min_slots) return hits;
    const size_t limit = (prompt.size() - 1) / T;  // the last prompt token is always computed
    uint64_t parent = root_hash(salt);
    for (size_t k = 0; k < limit; ++k) {
      const uint64_t hash = chain[k];
      const int32_t* tokens = prompt.data() + k * T;
      auto same = [&](uint64_t p, uint64_t s, const std::vector<int32_t>& t) {
        return p == parent && s == salt && std::equal(t.begin(), t.end(), tokens);
      };
      if (auto it = index.find(hash); it != index.end()) {
        const Block& blk = blocks[it->second];
        if (!same(blk.parent_hash, blk.salt, blk.tokens)) break;
        hits.push_back({it->second, hash});
      } else if (auto h = host_index.find(hash); h != host_index.end()) {
        if (!same(h->second.parent_hash, h->second.salt, h->second.tokens)) break;
        hits.push_back({-1, hash});
      } else {
        break;
      }
      parent = hash;
    }
    return hits;
  }

  void register_full_blocks(Sequence& s, size_t first_full) {
    if (!config.enable_prefix_reuse || s.beam_search) return;
    const int64_t length = static_cast<int64_t>(s.tokens.size());
    const uint64_t root = root_hash(s.salt);
    for (size_t k = first_full; k < s.chain.size() && k < s.blocks.size(); ++k) {
      if (!intact(static_cast<int64_t>(k), length) || blocks[s.blocks[k]].registered) continue;
      register_block(s.blocks[k], s.chain[k], k ? s.chain[k - 1] : root, s.salt,
                     s.tokens.data() + k * T);
    }
  }

  // ---- operations ----
  int64_t add(SeqId seq, std::span<const int32_t> prompt, uint64_t salt, int32_t priority);
  void append(SeqId seq, std::span<const int32_t> tokens);
  void check_invariants() const;
};

KvCacheManager::Impl::Impl(const KvCacheManagerConfig& c) : config(c) {
  ATTNKIT_CHECK(c.num_layers >= 1, "KvCacheManagerConfig.num_layers: must be >= 1, got ",
                c.num_layers);
  ATTNKIT_CHECK(c.num_kv_heads >= 1, "KvCacheManagerConfig.num_kv_heads: must be >= 1, got ",
                c.num_kv_heads);
  ATTNKIT_CHECK(c.head_dim >= 1, "KvCacheManagerConfig.head_dim: must be >= 1, got ", c.head_dim);
  const int32_t t = c.tokens_per_block;
  ATTNKIT_CHECK(t == 8 || t == 16 || t == 32 || t == 64 || t == 128,
                "KvCacheManagerConfig.tokens_per_block: accepted 8, 16, 32, 64 or 128, got ", t);
  ATTNKIT_CHECK(c.dtype == DType::kBF16 || c.dtype == DType::kF16 || c.dtype == DType::kFp8E4M3 ||
                    c.dtype == DType::kInt8,
                "KvCacheManagerConfig.dtype: accepted bf16, f16, fp8_e4m3 or int8, got ",
                dtype_name(c.dtype));
  ATTNKIT_CHECK(c.layout == KvCacheLayout::kHND || c.layout == KvCacheLayout::kNHD,
                "KvCacheManagerConfig.layout: accepted HND or NHD, got the value ",
                static_cast<int32_t>(c.layout));
  ATTNKIT_CHECK(c.max_seq_len >= 1, "KvCacheManagerConfig.max_seq_len: must be >= 1, got ",
                c.max_seq_len);
  ATTNKIT_CHECK(c.max_tokens >= 0, "KvCacheManagerConfig.max_tokens: must be >= 0, got ",
                c.max_tokens);
  ATTNKIT_CHECK(c.max_bytes >= 0, "KvCacheManagerConfig.max_bytes: must be >= 0, got ",
                c.max_bytes);
  ATTNKIT_CHECK(c.host_cache_bytes >= 0,
                "KvCacheManagerConfig.host_cache_bytes: must be >= 0, got ", c.host_cache_bytes);
  ATTNKIT_CHECK(c.free_gpu_memory_fraction > 0.0 && c.free_gpu_memory_fraction <= 1.0,
                "KvCacheManagerConfig.free_gpu_memory_fraction: accepted (0, 1], got ",
                c.free_gpu_memory_fraction);
  ATTNKIT_CHECK(c.sink_tokens >= 0, "KvCacheManagerConfig.sink_tokens: must be >= 0, got ",
                c.sink_tokens);
  for (size_t i = 0; i < c.layer_windows.size(); ++i) {
    ATTNKIT_CHECK(c.layer_windows[i] >= 0, "KvCacheManagerConfig.layer_windows[", i,
                  "]: must be >= 0 (0 = full attention), got ", c.layer_windows[i]);
  }
  T = t;
  {
    // 2 x Hkv x T x D x elt per layer, times the layers, in int64 or not at all (a count that
    // wrapped to 0 was once divided by).
    int64_t bytes = 2 * static_cast<int64_t>(dtype_size(c.dtype));
    const bool fits = !__builtin_mul_overflow(bytes, int64_t{c.num_kv_heads}, &bytes) &&
                      !__builtin_mul_overflow(bytes, int64_t{T}, &bytes) &&
                      !__builtin_mul_overflow(bytes, int64_t{c.head_dim}, &bytes);
    layer_bytes = bytes;
    ATTNKIT_CHECK(fits && !__builtin_mul_overflow(bytes, int64_t{c.num_layers}, &block_bytes),
                  "KvCacheManagerConfig: a block of num_layers x 2 x num_kv_heads x "
                  "tokens_per_block x head_dim x element size = ",
                  c.num_layers, " x 2 x ", c.num_kv_heads, " x ", T, " x ", c.head_dim, " x ",
                  dtype_size(c.dtype), " bytes does not fit in int64");
  }

  cyclic = !c.layer_windows.empty() && std::all_of(c.layer_windows.begin(), c.layer_windows.end(),
                                                   [](int32_t w) { return w > 0; });
  ATTNKIT_CHECK(c.sink_tokens == 0 || cyclic,
                "KvCacheManagerConfig.sink_tokens: only meaningful when every layer has a "
                "window (a cyclic cache); got ",
                c.sink_tokens, " sink tokens without one");
  if (cyclic) {
    // Every slot index (sinks + window slots) must stay an int32: they are table positions.
    for (size_t i = 0; i < c.layer_windows.size(); ++i) {
      const int64_t w = c.layer_windows[i];
      const int64_t slots = ((w + T - 1) / T + 1) * T;
      ATTNKIT_CHECK(slots <= INT32_MAX, "KvCacheManagerConfig.layer_windows[", i, "]: a window of ",
                    w, " tokens needs ", slots,
                    " cyclic slots (the window rounded up to whole blocks plus one block), more "
                    "than int32 holds; windows up to ",
                    INT32_MAX - 2 * int64_t{T}, " (INT32_MAX - 2 x tokens_per_block) fit");
      ATTNKIT_CHECK(int64_t{c.sink_tokens} + slots <= INT32_MAX,
                    "KvCacheManagerConfig.sink_tokens: sink_tokens + the cyclic slots of "
                    "layer_windows[",
                    i, "] = ", c.sink_tokens, " + ", slots, " is more than int32 holds");
    }
  }
  // Pool sizing: the smallest of the given limits.
  int64_t limit = -1;
  const char* limited_by = "max_tokens";
  auto take_min = [&](int64_t n, const char* field) {
    if (limit < 0 || n < limit) {
      limit = n;
      limited_by = field;
    }
  };
  if (c.max_tokens > 0) take_min(ceil_div(c.max_tokens, T), "max_tokens");
  if (c.max_bytes > 0) take_min(c.max_bytes / block_bytes, "max_bytes");
  if (c.device.is_cuda()) {
    const int64_t free_bytes = detail::cuda_free_memory_bytes(c.device.index);
    take_min(static_cast<int64_t>(c.free_gpu_memory_fraction * static_cast<double>(free_bytes)) /
                 block_bytes,
             "free_gpu_memory_fraction");
  }
  ATTNKIT_CHECK(limit >= 0,
                "KvCacheManagerConfig: a cpu pool needs max_tokens or max_bytes (> 0); both are 0");
  ATTNKIT_CHECK(limit >= 1, "KvCacheManagerConfig: the pool holds no block of ", block_bytes,
                " bytes (max_tokens ", c.max_tokens, ", max_bytes ", c.max_bytes,
                ", free_gpu_memory_fraction ", c.free_gpu_memory_fraction, ")");
  ATTNKIT_CHECK(limit <= INT32_MAX, "KvCacheManagerConfig: the pool would hold ", limit,
                " blocks; at most ", INT32_MAX, " are addressable by int32 block tables");
  num_blocks = static_cast<int32_t>(limit);
  host_capacity = c.host_cache_bytes / block_bytes;

  // Host memory. A cpu pool and the host tier are mapped without committing their pages (they
  // are committed as blocks are written), but neither may exceed the host's memory, and neither
  // may the bookkeeping, which grows with the blocks and layers.
  const int64_t host_memory = detail::host_memory_bytes();
  if (c.device.is_cpu()) {
    int64_t pool_bytes = 0;
    const bool fits = !__builtin_mul_overflow(int64_t{num_blocks}, block_bytes, &pool_bytes);
    ATTNKIT_CHECK(fits && pool_bytes <= host_memory, "KvCacheManagerConfig.", limited_by,
                  ": a cpu pool of ", num_blocks, " blocks of ", block_bytes,
                  " bytes is more than the host's memory (", host_memory, " bytes)");
  }
  const int64_t host_tier_bytes = host_capacity * block_bytes;  // <= host_cache_bytes
  ATTNKIT_CHECK(host_tier_bytes <= host_memory,
                "KvCacheManagerConfig.host_cache_bytes: a host tier of ", host_tier_bytes,
                " bytes (", host_capacity, " blocks) is more than the host's memory (", host_memory,
                " bytes)");
  constexpr int64_t kBookkeepingBytesPerBlock = 256;  // Block, free list, eviction and index nodes
  const int64_t bookkeeping =
      int64_t{num_blocks} * kBookkeepingBytesPerBlock + int64_t{c.num_layers} * 4;
  ATTNKIT_CHECK(bookkeeping <= host_memory / 2, "KvCacheManagerConfig.", limited_by, ": ",
                num_blocks, " blocks and ", c.num_layers, " layers need about ", bookkeeping,
                " bytes of host memory for their bookkeeping, more than the host's memory allows (",
                host_memory, " bytes)");

  try {
    layer_slots.resize(c.num_layers, 0);
    memory = c.device.is_cuda()
                 ? detail::make_cuda_kv_memory(c.device.index, num_blocks, host_capacity,
                                               block_bytes, c.stream)
                 : detail::make_host_kv_memory(num_blocks, host_capacity, block_bytes);
    blocks.resize(num_blocks);
    free_list.reserve(num_blocks);
  } catch (const std::bad_alloc&) {
    detail::fail("KvCacheManagerConfig: out of host memory for a pool of ", num_blocks,
                 " blocks of ", block_bytes, " bytes (", limited_by, ") and a host tier of ",
                 host_capacity, " blocks");
  }
  // Low ids are handed out first (free_list is a stack).
  for (int32_t b = num_blocks - 1; b >= 0; --b) free_list.push_back(b);
  if (cyclic) {
    sinks = c.sink_tokens;
    min_slots = INT32_MAX;
    for (int32_t l = 0; l < c.num_layers; ++l) {
      const int32_t w = c.layer_windows[l % c.layer_windows.size()];
      layer_slots[l] = cyclic_window_slots(w, T);
      min_slots = std::min(min_slots, layer_slots[l]);
      max_slots = std::max(max_slots, layer_slots[l]);
      if (std::find(distinct_slots.begin(), distinct_slots.end(), layer_slots[l]) ==
          distinct_slots.end()) {
        distinct_slots.push_back(layer_slots[l]);
      }
    }
    cyclic_entries = static_cast<int32_t>(ceil_div(int64_t{sinks} + max_slots, T));
  }
  const int64_t linear_entries = ceil_div(c.max_seq_len, T);
  max_blocks = static_cast<int32_t>(cyclic ? std::min<int64_t>(linear_entries, cyclic_entries)
                                           : linear_entries);

  counters.num_blocks = num_blocks;
  counters.host_blocks = host_capacity;
}

int64_t KvCacheManager::Impl::add(SeqId seq, std::span<const int32_t> prompt, uint64_t salt,
                                  int32_t priority) {
  ATTNKIT_CHECK(!seqs.count(seq), "KvCacheManager::add: seq ", seq,
                " is already in the cache (release it first, or fork to copy it)");
  const int64_t n = static_cast<int64_t>(prompt.size());
  ATTNKIT_CHECK(n >= 1, "KvCacheManager::add: prompt of seq ", seq, " is empty (>= 1 token)");
  ATTNKIT_CHECK(n <= config.max_seq_len, "KvCacheManager::add: prompt of seq ", seq, " has ", n,
                " tokens, more than max_seq_len ", config.max_seq_len);

  std::vector<uint64_t> chain = chain_of(prompt, salt);
  const std::vector<Hit> hits = match(prompt, salt, chain);
  int64_t pinned = 0;  // matched pool blocks that are eviction candidates now
  int64_t host_hits = 0;
  for (const Hit& h : hits) {
    if (h.block < 0) {
      ++host_hits;
    } else if (blocks[h.block].ref == 0) {
      ++pinned;
    }
  }
  const int64_t pool_hits = static_cast<int64_t>(hits.size()) - host_hits;
  const int64_t needed = entries_for(n) - pool_hits;
  const int64_t have = available() - pinned;
  ATTNKIT_CHECK(needed <= have, "KvCacheManager::add: pool exhausted: prompt of seq ", seq, " (", n,
                " tokens, ", hits.size(), " blocks reused) needs ", needed, " new blocks but only ",
                have, " of ", num_blocks,
                " are free or evictable; release sequences or enlarge the pool");

  Sequence s;
  s.salt = salt;
  s.priority = priority;
  for (const Hit& h : hits) {
    if (h.block >= 0) acquire(h.block, priority);
  }
  // Pin the host hits so that offloads made while onboarding cannot drop them.
  for (const Hit& h : hits) {
    if (h.block < 0) host_lru.erase({host_index.at(h.hash).tick, h.hash});
  }
  for (const Hit& h : hits) {
    if (h.block >= 0) {
      s.blocks.push_back(h.block);
      continue;
    }
    auto node = host_index.extract(h.hash);
    HostEntry& entry = node.mapped();
    const int32_t b = take_block(priority);
    memory->onboard(entry.slot, b);
    host_free.push_back(entry.slot);
    ++counters.onboards;
    register_block(b, h.hash, entry.parent_hash, entry.salt, entry.tokens.data());
    s.blocks.push_back(b);
  }
  while (static_cast<int64_t>(s.blocks.size()) < entries_for(n)) {
    s.blocks.push_back(take_block(priority));
  }
  s.tokens.assign(prompt.begin(), prompt.end());
  s.chain = std::move(chain);
  if (config.enable_prefix_reuse) {
    counters.hits += static_cast<int64_t>(hits.size());
    counters.misses += static_cast<int64_t>(s.chain.size() - hits.size());
  }
  register_full_blocks(s, hits.size());
  seqs.emplace(seq, std::move(s));
  return static_cast<int64_t>(hits.size()) * T;
}

void KvCacheManager::Impl::append(SeqId seq, std::span<const int32_t> tokens) {
  Sequence& s = seq_or_fail(seq, "append");
  const int64_t old_len = static_cast<int64_t>(s.tokens.size());
  const int64_t m = static_cast<int64_t>(tokens.size());
  if (m == 0) return;
  ATTNKIT_CHECK(old_len + m <= config.max_seq_len, "KvCacheManager::append: seq ", seq, " has ",
                old_len, " tokens; appending ", m, " would exceed max_seq_len ", config.max_seq_len,
                " (", max_blocks, " blocks per sequence)");

  // Existing table entries this append writes into: they must be private to the sequence.
  std::vector<int64_t> must_copy, may_copy;
  auto consider = [&](int64_t e) {
    const Block& blk = blocks[s.blocks[e]];
    if (blk.ref > 1) {
      must_copy.push_back(e);
    } else if (blk.registered) {
      may_copy.push_back(e);
    }
  };
  if (!cyclic) {
    if (old_len % T != 0) consider(old_len / T);  // the partial last block
  } else {
    std::vector<uint8_t> touched(s.blocks.size(), 0);
    const int64_t end = std::min(old_len + m, old_len + static_cast<int64_t>(max_slots) + T);
    for (int64_t p = old_len; p < end; ++p) {
      for (int32_t w : distinct_slots) {
        const int64_t e = slot_of(p, w, sinks) / T;
        if (e < static_cast<int64_t>(touched.size())) touched[e] = 1;
      }
    }
    for (size_t e = 0; e < touched.size(); ++e) {
      if (touched[e]) consider(static_cast<int64_t>(e));
    }
  }
  const int64_t new_entries = entries_for(old_len + m) - static_cast<int64_t>(s.blocks.size());
  const int64_t needed = new_entries + static_cast<int64_t>(must_copy.size());
  ATTNKIT_CHECK(needed <= available(), "KvCacheManager::append: pool exhausted: appending ", m,
                " tokens to seq ", seq, " needs ", needed, " new blocks but only ", available(),
                " of ", num_blocks,
                " are free or evictable; release sequences or enlarge the pool");

  auto copy_on_write = [&](int64_t e) {
    const int32_t old_block = s.blocks[e];
    const int32_t b = take_block(s.priority);  // old_block is held, so it is not evicted
    memory->copy_block(b, old_block);
    ++counters.cow_copies;
    s.blocks[e] = b;
    release_ref(old_block);
  };
  for (int64_t e : must_copy) copy_on_write(e);
  // A registered block about to be overwritten stays cached for reuse when a block is left to
  // replace it; otherwise it leaves the prefix index and is overwritten in place.
  for (int64_t e : may_copy) {
    if (available() - new_entries > 0) {
      copy_on_write(e);
    } else {
      unregister_block(s.blocks[e]);
    }
  }
  for (int64_t i = 0; i < new_entries; ++i) s.blocks.push_back(take_block(s.priority));

  const size_t first_full = s.chain.size();
  s.tokens.insert(s.tokens.end(), tokens.begin(), tokens.end());
  uint64_t parent = s.chain.empty() ? root_hash(s.salt) : s.chain.back();
  for (size_t k = s.chain.size(); (k + 1) * T <= s.tokens.size(); ++k) {
    parent = block_hash(parent, s.tokens.data() + k * T, T);
    s.chain.push_back(parent);
  }
  register_full_blocks(s, first_full);
}

void KvCacheManager::Impl::check_invariants() const {
  auto broken = [](auto&&... parts) {
    fail("KvCacheManager::check_invariants: ", std::forward<decltype(parts)>(parts)...);
  };
  std::vector<int32_t> holders(num_blocks, 0);
  for (const auto& [id, s] : seqs) {
    const int64_t len = static_cast<int64_t>(s.tokens.size());
    if (static_cast<int64_t>(s.blocks.size()) != entries_for(len)) {
      broken("seq ", id, " of ", len, " tokens holds ", s.blocks.size(), " blocks, expected ",
             entries_for(len));
    }
    if (s.chain.size() != s.tokens.size() / T) broken("seq ", id, " has a stale hash chain");
    for (int32_t b : s.blocks) {
      if (b < 0 || b >= num_blocks) broken("seq ", id, " holds invalid block id ", b);
      ++holders[b];
    }
  }
  int64_t free_count = 0, cached_count = 0, used_count = 0;
  std::vector<uint8_t> in_free(num_blocks, 0);
  for (int32_t b : free_list) {
    if (b < 0 || b >= num_blocks || in_free[b]) broken("free list holds block ", b, " twice");
    in_free[b] = 1;
  }
  std::unordered_map<uint64_t, int32_t> child_count;
  for (int32_t b = 0; b < num_blocks; ++b) {
    const Block& blk = blocks[b];
    if (blk.ref != holders[b]) {
      broken("block ", b, " has reference count ", blk.ref, " but ", holders[b],
             " table entries hold it");
    }
    if (blk.free != static_cast<bool>(in_free[b])) broken("block ", b, " free flag mismatch");
    if (blk.free && (blk.ref != 0 || blk.registered)) {
      broken("block ", b, " is free and referenced (", blk.ref, ") or registered");
    }
    const bool should_be_evictable = blk.ref == 0 && blk.registered;
    if (blk.evictable != should_be_evictable || (blk.evictable && !evictable.count(blk.key))) {
      broken("block ", b, " eviction-candidate state is wrong");
    }
    if (blk.registered) {
      auto it = index.find(blk.hash);
      if (it == index.end() || it->second != b) broken("block ", b, " missing from the index");
      ++child_count[blk.parent_hash];
    }
    if (!blk.free && blk.ref == 0 && !blk.registered) broken("block ", b, " leaked");
    free_count += blk.free;
    cached_count += !blk.free && blk.ref == 0;
    used_count += blk.ref > 0;
  }
  if (free_count + cached_count + used_count != num_blocks) {
    broken("free ", free_count, " + cached ", cached_count, " + used ", used_count,
           " != pool size ", num_blocks);
  }
  if (static_cast<int64_t>(evictable.size()) != cached_count) {
    broken("eviction set holds ", evictable.size(), " blocks, ", cached_count, " are cached");
  }
  for (const auto& [hash, b] : index) {
    if (b < 0 || b >= num_blocks || !blocks[b].registered || blocks[b].hash != hash) {
      broken("index entry points to block ", b, " which does not hold it");
    }
    if (host_index.count(hash)) broken("a hash is both in the pool and the host tier");
  }
  for (const auto& [parent, count] : children) {
    auto it = child_count.find(parent);
    if (it == child_count.end() || it->second != count) broken("child counts are stale");
  }
  if (child_count.size() != children.size()) broken("child counts are stale");
  if (host_untouched < 0 || host_untouched > host_capacity) {
    broken("host tier: ", host_untouched, " slots touched of ", host_capacity);
  }
  std::vector<uint8_t> slot_used(static_cast<size_t>(host_untouched), 0);
  for (int64_t slot : host_free) {
    if (slot < 0 || slot >= host_untouched || slot_used[slot]) {
      broken("host slot ", slot, " twice");
    }
    slot_used[slot] = 1;
  }
  for (const auto& [hash, entry] : host_index) {
    if (entry.slot < 0 || entry.slot >= host_untouched || slot_used[entry.slot]) {
      broken("host slot ", entry.slot, " is both used and free");
    }
    slot_used[entry.slot] = 1;
  }
  if (static_cast<int64_t>(host_free.size() + host_index.size()) != host_untouched) {
    broken("host tier: free ", host_free.size(), " + cached ", host_index.size(), " != used slots ",
           host_untouched);
  }
  if (host_lru.size() != host_index.size()) broken("host LRU list is stale");
}

// ---- public interface ------------------------------------------------------------------------

KvCacheManager::KvCacheManager(const KvCacheManagerConfig& config)
    : impl_(std::make_unique<Impl>(config)) {}
KvCacheManager::~KvCacheManager() = default;

int64_t KvCacheManager::add(SeqId seq, std::span<const int32_t> prompt, uint64_t salt,
                            int32_t priority) {
  std::lock_guard lock(impl_->mutex);
  return impl_->add(seq, prompt, salt, priority);
}

void KvCacheManager::append(SeqId seq, std::span<const int32_t> tokens) {
  std::lock_guard lock(impl_->mutex);
  impl_->append(seq, tokens);
}

void KvCacheManager::fork(SeqId src, SeqId dst) {
  std::lock_guard lock(impl_->mutex);
  const Impl::Sequence& s = impl_->seq_or_fail(src, "fork");
  ATTNKIT_CHECK(!impl_->seqs.count(dst), "KvCacheManager::fork: dst seq ", dst,
                " is already in the cache");
  Impl::Sequence copy = s;
  for (int32_t b : copy.blocks) impl_->acquire(b, copy.priority);
  impl_->seqs.emplace(dst, std::move(copy));
}

void KvCacheManager::release(SeqId seq) {
  std::lock_guard lock(impl_->mutex);
  Impl::Sequence& s = impl_->seq_or_fail(seq, "release");
  // Tail first: the last blocks of a chain get the oldest LRU stamps and are evicted first.
  for (auto it = s.blocks.rbegin(); it != s.blocks.rend(); ++it) impl_->release_ref(*it);
  impl_->seqs.erase(seq);
}

void KvCacheManager::reorder_beams(std::span<const SeqId> beams, std::span<const int32_t> parents) {
  std::lock_guard lock(impl_->mutex);
  ATTNKIT_CHECK(!impl_->cyclic,
                "KvCacheManager::reorder_beams: beam search is not supported with a cyclic "
                "(sliding-window) cache");
  ATTNKIT_CHECK(parents.size() == beams.size(), "KvCacheManager::reorder_beams: parents has ",
                parents.size(), " entries, expected one per beam (", beams.size(), ")");
  std::vector<Impl::Sequence*> rows;
  for (SeqId id : beams) rows.push_back(&impl_->seq_or_fail(id, "reorder_beams"));
  const size_t len = rows.empty() ? 0 : rows[0]->tokens.size();
  for (size_t b = 0; b < rows.size(); ++b) {
    ATTNKIT_CHECK(rows[b]->tokens.size() == len, "KvCacheManager::reorder_beams: beam ", b,
                  " (seq ", beams[b], ") has ", rows[b]->tokens.size(), " tokens, beam 0 has ", len,
                  "; beams must have equal lengths");
    ATTNKIT_CHECK(parents[b] >= 0 && parents[b] < static_cast<int32_t>(rows.size()),
                  "KvCacheManager::reorder_beams: parents[", b, "] must be in [0, ", rows.size(),
                  "), got ", parents[b]);
  }
  std::vector<std::vector<int32_t>> sources(rows.size());
  for (size_t b = 0; b < rows.size(); ++b) {
    const int32_t p = parents[b];
    sources[b] = rows[p]->beam_src;
    sources[b].resize(len, p);
  }
  for (size_t b = 0; b < rows.size(); ++b) {
    rows[b]->beam_src = std::move(sources[b]);
    rows[b]->beam_search = true;
  }
}

bool KvCacheManager::contains(SeqId seq) const {
  std::lock_guard lock(impl_->mutex);
  return impl_->seqs.count(seq) != 0;
}

int64_t KvCacheManager::length(SeqId seq) const {
  std::lock_guard lock(impl_->mutex);
  return static_cast<int64_t>(impl_->seq_or_fail(seq, "length").tokens.size());
}

std::vector<int32_t> KvCacheManager::blocks(SeqId seq) const {
  std::lock_guard lock(impl_->mutex);
  return impl_->seq_or_fail(seq, "blocks").blocks;
}

int64_t KvCacheManager::probe_prefix(std::span<const int32_t> prompt, uint64_t salt) const {
  std::lock_guard lock(impl_->mutex);
  return static_cast<int64_t>(impl_->match(prompt, salt, impl_->chain_of(prompt, salt)).size()) *
         impl_->T;
}

KvCacheStats KvCacheManager::stats() const {
  std::lock_guard lock(impl_->mutex);
  KvCacheStats s = impl_->counters;
  s.free_blocks = static_cast<int32_t>(impl_->free_list.size());
  s.cached_blocks = static_cast<int32_t>(impl_->evictable.size());
  s.used_blocks = s.num_blocks - s.free_blocks - s.cached_blocks;
  s.host_cached_blocks = static_cast<int64_t>(impl_->host_index.size());
  return s;
}

int32_t KvCacheManager::num_blocks() const { return impl_->num_blocks; }
int64_t KvCacheManager::block_bytes() const { return impl_->block_bytes; }
void* KvCacheManager::pool_data() const { return impl_->memory->pool(); }

void KvCacheManager::read_block(int32_t block, void* out) const {
  std::lock_guard lock(impl_->mutex);
  ATTNKIT_CHECK(block >= 0 && block < impl_->num_blocks, "KvCacheManager::read_block: block ",
                block, " is outside [0, ", impl_->num_blocks, ")");
  impl_->memory->read_block(block, out);
}

int32_t KvCacheManager::max_blocks_per_seq() const { return impl_->max_blocks; }

void KvCacheManager::fill_block_tables(std::span<const SeqId> rows, int32_t* block_table,
                                       int64_t row_stride, int32_t* seq_lens) const {
  std::lock_guard lock(impl_->mutex);
  ATTNKIT_CHECK(row_stride >= impl_->max_blocks, "KvCacheManager::fill_block_tables: row_stride ",
                row_stride, " is smaller than max_blocks_per_seq ", impl_->max_blocks);
  std::vector<const Impl::Sequence*> found;
  for (SeqId id : rows) found.push_back(&impl_->seq_or_fail(id, "fill_block_tables"));
  for (size_t r = 0; r < found.size(); ++r) {
    int32_t* row = block_table + static_cast<int64_t>(r) * row_stride;
    std::fill(row, row + impl_->max_blocks, -1);
    std::copy(found[r]->blocks.begin(), found[r]->blocks.end(), row);
    if (seq_lens) seq_lens[r] = static_cast<int32_t>(found[r]->tokens.size());
  }
}

KvBlockTables KvCacheManager::block_tables(std::span<const SeqId> rows) const {
  KvBlockTables t;
  t.num_rows = static_cast<int64_t>(rows.size());
  t.max_blocks = impl_->max_blocks;
  t.table.assign(static_cast<size_t>(t.num_rows) * t.max_blocks, -1);
  t.seq_lens.assign(rows.size(), 0);
  fill_block_tables(rows, t.table.data(), t.max_blocks, t.seq_lens.data());
  return t;
}

std::vector<int32_t> KvCacheManager::cache_indirection(std::span<const SeqId> beams,
                                                       int32_t beam_width, int32_t max_seq) const {
  std::lock_guard lock(impl_->mutex);
  ATTNKIT_CHECK(!impl_->cyclic,
                "KvCacheManager::cache_indirection: beam search is not supported with a cyclic "
                "(sliding-window) cache");
  ATTNKIT_CHECK(beam_width >= 1 && beams.size() % beam_width == 0,
                "KvCacheManager::cache_indirection: beam_width must be >= 1 and divide the ",
                beams.size(), " beams, got ", beam_width);
  std::vector<int32_t> out(beams.size() * static_cast<size_t>(std::max(max_seq, 0)));
  for (size_t r = 0; r < beams.size(); ++r) {
    const Impl::Sequence& s = impl_->seq_or_fail(beams[r], "cache_indirection");
    ATTNKIT_CHECK(static_cast<int64_t>(s.tokens.size()) <= max_seq,
                  "KvCacheManager::cache_indirection: max_seq ", max_seq, " is shorter than seq ",
                  beams[r], " (", s.tokens.size(), " tokens)");
    const int32_t own = static_cast<int32_t>(r % beam_width);
    int32_t* row = out.data() + r * max_seq;
    for (int32_t t = 0; t < max_seq; ++t) {
      row[t] = t < static_cast<int32_t>(s.beam_src.size()) ? s.beam_src[t] : own;
    }
  }
  return out;
}

KvCacheView KvCacheManager::layer_view(int32_t layer, TensorView block_table,
                                       TensorView seq_lens) const {
  const Impl& m = *impl_;
  ATTNKIT_CHECK(layer >= 0 && layer < m.config.num_layers, "KvCacheManager::layer_view: layer ",
                layer, " is outside [0, ", m.config.num_layers, ")");
  KvCacheView v;
  uint8_t* base = m.memory->pool() + layer * m.layer_bytes;
  v.k_base = base;
  v.v_base = base + m.layer_bytes / 2;
  v.block_stride_bytes = m.block_bytes;
  v.num_blocks = m.num_blocks;
  v.dtype = m.config.dtype;
  v.device = m.config.device;
  v.num_kv_heads = m.config.num_kv_heads;
  v.tokens_per_block = m.T;
  v.head_dim = m.config.head_dim;
  v.paged = true;
  v.layout = m.config.layout;
  v.block_table = block_table;
  v.seq_lens = seq_lens;
  v.window_slots = m.layer_slots[layer];
  v.sink_tokens = m.cyclic ? m.sinks : 0;
  return v;
}

int32_t KvCacheManager::window_slots(int32_t layer) const {
  ATTNKIT_CHECK(layer >= 0 && layer < impl_->config.num_layers,
                "KvCacheManager::window_slots: layer ", layer, " is outside [0, ",
                impl_->config.num_layers, ")");
  return impl_->layer_slots[layer];
}

void KvCacheManager::check_invariants() const {
  std::lock_guard lock(impl_->mutex);
  impl_->check_invariants();
}

KvCacheSnapshot KvCacheManager::snapshot() const {
  std::lock_guard lock(impl_->mutex);
  KvCacheSnapshot snap;
  for (const Impl::Block& b : impl_->blocks) {
    snap.ref_count.push_back(b.ref);
    snap.is_free.push_back(b.free);
    snap.is_cached.push_back(b.registered);
  }
  for (const auto& [id, s] : impl_->seqs) {
    snap.sequences.push_back({id, static_cast<int64_t>(s.tokens.size()), s.blocks});
  }
  return snap;
}

}  // namespace attnkit
