// KvCacheManager: the host-side owner of the paged KV-cache pool (docs/kv_cache.md). It hands
// out blocks to sequences, shares full blocks between sequences through prefix-hash chains,
// shares blocks between forks by reference count with copy-on-write, evicts unreferenced cached
// blocks (LRU, leaves first) optionally to a host tier, recycles the blocks of sliding-window
// sequences, and exports the block tables / KvCacheView objects the attention entry points read.
//
// Pool layout: one pool for all layers, [num_blocks, L, 2, Hkv, T, D] (config.layout HND, the
// default) or [num_blocks, L, 2, T, Hkv, D] (NHD) elements of `dtype`, so block b of layer l holds
// K ([Hkv, T, D] or [T, Hkv, D]) at pool + b * block_bytes + l * 2 * Hkv*T*D*elt and V right after
// it. layer_view(l, ...) differs between layers only in k_base / v_base (and, for sliding-window
// layers, window_slots).
//
// The manager never writes K/V itself except when it copies whole blocks (copy-on-write, host
// offload / onboard). The engine writes the KV of the tokens it adds (append_kv / forward) into
// the slots the exported tables give, in the forward step that follows add() / append().
//
// Threading contract: every public member function takes one internal mutex, so calls from
// several threads are safe and each call is atomic (it fully happens or, when it throws,
// changes nothing). Copies on a CUDA pool are enqueued on config.stream in call order; the
// manager never synchronizes that stream except in its destructor and in read_block().
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "attnkit/kv_cache.h"
#include "attnkit/types.h"

namespace attnkit {

using SeqId = int64_t;

struct KvCacheManagerConfig {
  int32_t num_layers = 1;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t tokens_per_block = 16;  ///< T: 8, 16, 32, 64 or 128
  DType dtype = DType::kBF16;     ///< kBF16, kF16, kFp8E4M3 or kInt8
  /// The order of a block's K (and V) elements: HND [Hkv, T, D] or NHD [T, Hkv, D]
  /// (KvCacheView::layout); every view the manager exports carries it.
  KvCacheLayout layout = KvCacheLayout::kHND;
  Device device{};  ///< cpu: host memory (reference backend); cuda:N: device memory

  /// Pool sizing. max_tokens (rounded up to whole blocks) and max_bytes (rounded down) are
  /// explicit limits (0 = not given; the smaller wins when both are given). On CUDA the pool is
  /// also limited to free_gpu_memory_fraction of the free device memory (cudaMemGetInfo) and the
  /// smallest of the given limits is used; on the CPU an explicit limit is required.
  int64_t max_tokens = 0;
  int64_t max_bytes = 0;
  double free_gpu_memory_fraction = 0.9;  ///< in (0, 1]; CUDA pools only

  /// Host tier: > 0 turns eviction of a cached block into a copy to host memory (pinned for CUDA
  /// pools) of floor(host_cache_bytes / block_bytes) blocks; a later prefix hit copies it back.
  int64_t host_cache_bytes = 0;

  /// Longest sequence in tokens; appending beyond it throws. Sets the block-table width.
  int32_t max_seq_len = 0;

  /// Sliding windows per layer, repeating over the layers ([4096, 256] alternates); 0 = full
  /// attention; empty = every layer full. When every layer has a window the cache is cyclic
  /// (docs/semantics.md): layer l uses window_slots = cyclic_window_slots(W_l, T) after
  /// sink_tokens sink slots, a sequence holds at most ceil((S + max W') / T) blocks, and blocks
  /// that leave the window go back to the pool. With a mix of full and windowed layers the table
  /// must keep every block for the full layers, so windowed layers use linear slots (window_slots
  /// = 0) and only the attention mask applies the window.
  std::vector<int32_t> layer_windows;
  int32_t sink_tokens = 0;  ///< S (cyclic caches only)

  bool enable_prefix_reuse = true;
  void* stream = nullptr;  ///< cudaStream_t for the copies of a CUDA pool (nullptr: legacy stream)
};

struct KvCacheStats {
  int64_t hits = 0;        ///< prompt blocks found cached by add() (device or host tier)
  int64_t misses = 0;      ///< full prompt blocks add() did not find
  int64_t evictions = 0;   ///< cached blocks taken back from the device pool
  int64_t offloads = 0;    ///< evictions that copied the block to the host tier
  int64_t onboards = 0;    ///< host-tier hits copied back into the pool
  int64_t cow_copies = 0;  ///< blocks copied on write (forks, sliding-window recycling)
  int32_t num_blocks = 0;
  int32_t free_blocks = 0;    ///< holding nothing
  int32_t cached_blocks = 0;  ///< unreferenced but reusable (the eviction candidates)
  int32_t used_blocks = 0;    ///< referenced by at least one sequence
  int64_t host_blocks = 0;    ///< capacity of the host tier in blocks
  int64_t host_cached_blocks = 0;
};

/// A copy of the bookkeeping for tests (model comparison); cheap: O(blocks + table entries).
struct KvCacheSnapshot {
  struct Sequence {
    SeqId id = 0;
    int64_t length = 0;
    std::vector<int32_t> blocks;  ///< table entries in order
  };
  std::vector<int32_t> ref_count;  ///< [num_blocks]
  std::vector<uint8_t> is_free;    ///< [num_blocks]: in the free list
  std::vector<uint8_t> is_cached;  ///< [num_blocks]: registered in the prefix index
  std::vector<Sequence> sequences;
};

/// Owning host copy of exported block tables, for the CPU reference backend (CUDA callers copy
/// `table` and `seq_lens` to the device and call layer_view with device views).
struct KvBlockTables {
  int64_t num_rows = 0;
  int32_t max_blocks = 0;
  std::vector<int32_t> table;     ///< int32 [num_rows, max_blocks], -1 past each row's blocks
  std::vector<int32_t> seq_lens;  ///< int32 [num_rows]: tokens of each row
  TensorView table_view() const;
  TensorView seq_lens_view() const;
};

class KvCacheManager {
 public:
  /// Throws Error naming the field when the configuration is invalid or the pool is empty.
  explicit KvCacheManager(const KvCacheManagerConfig& config);
  ~KvCacheManager();
  KvCacheManager(const KvCacheManager&) = delete;
  KvCacheManager& operator=(const KvCacheManager&) = delete;

  // ---- sequence lifecycle --------------------------------------------------------------------
  /// Starts sequence `seq` with its prompt token ids and allocates blocks for all of them, reusing
  /// the longest cached chain of full blocks with the same tokens and salt. Returns how many
  /// leading tokens already hold valid KV (a multiple of T, at most prompt.size() - 1 so that the
  /// last prompt token is always computed). `priority`: cached blocks of higher priority are
  /// evicted later. Full blocks become reusable by other sequences right away: add() / append()
  /// exactly the tokens whose KV the next forward step writes (for chunked context: one chunk).
  int64_t add(SeqId seq, std::span<const int32_t> prompt, uint64_t salt = 0, int32_t priority = 0);
  /// Appends tokens (generated tokens or the next context chunk); copies a shared partial block
  /// first (copy-on-write). Throws when the sequence would exceed max_seq_len or the pool is full.
  void append(SeqId seq, std::span<const int32_t> tokens);
  /// New sequence `dst` sharing every block of `src` by reference count (beam search, parallel
  /// sampling); the partial last block is copied when either of them appends.
  void fork(SeqId src, SeqId dst);
  /// Drops the sequence; its registered full blocks stay cached (reusable) until evicted.
  void release(SeqId seq);
  /// Beam search: `beams` are the beam_width sequences of one request in beam order (b = index).
  /// After a step in which beam b continued the history of beam parents[b], beam b reads every
  /// cached position from where parents[b] read it (cache_indirection). Not for cyclic caches.
  void reorder_beams(std::span<const SeqId> beams, std::span<const int32_t> parents);

  // ---- queries -------------------------------------------------------------------------------
  bool contains(SeqId seq) const;
  int64_t length(SeqId seq) const;               ///< tokens
  std::vector<int32_t> blocks(SeqId seq) const;  ///< table entries of the sequence
  /// Tokens add() would report cached for this prompt now, without changing anything.
  int64_t probe_prefix(std::span<const int32_t> prompt, uint64_t salt = 0) const;
  KvCacheStats stats() const;
  int32_t num_blocks() const;
  int64_t block_bytes() const;  ///< L * 2 * Hkv * T * D * dtype_size
  void* pool_data() const;      ///< base of the pool (device memory for CUDA pools)
  /// Copies block `block` (all layers, block_bytes) to host memory `out`; synchronizes the stream.
  void read_block(int32_t block, void* out) const;

  // ---- export for the kernels ----------------------------------------------------------------
  /// Width of the block tables: ceil(max_seq_len / T), or the cyclic capacity in blocks.
  int32_t max_blocks_per_seq() const;
  /// Writes rows.size() rows of int32 block ids (row_stride elements apart, -1 past the
  /// sequence's blocks, max_blocks_per_seq() entries per row) and, if seq_lens != nullptr,
  /// int32 [rows.size()] lengths. Host memory.
  void fill_block_tables(std::span<const SeqId> rows, int32_t* block_table, int64_t row_stride,
                         int32_t* seq_lens) const;
  KvBlockTables block_tables(std::span<const SeqId> rows) const;
  /// int32 [beams.size() / beam_width, beam_width, max_seq]: entry [s][b][t] is the beam whose
  /// row holds position t for beam b of request s (beams = the requests' beams, flattened).
  std::vector<int32_t> cache_indirection(std::span<const SeqId> beams, int32_t beam_width,
                                         int32_t max_seq) const;
  /// The KvCacheView of layer `layer` over block_table int32 [rows, max_blocks_per_seq()] and
  /// seq_lens int32 [rows] (host views for CPU pools, device views for CUDA pools). The caller
  /// sets k_scale / v_scale for fp8 / int8 caches.
  KvCacheView layer_view(int32_t layer, TensorView block_table, TensorView seq_lens) const;
  int32_t window_slots(int32_t layer) const;  ///< 0 for linear layers

  // ---- testing -------------------------------------------------------------------------------
  /// Throws Error describing the first broken invariant: no block both free and referenced,
  /// reference counts equal the table entries holding each block, pool accounting (free + cached
  /// + used == num_blocks), prefix-index and host-tier consistency.
  void check_invariants() const;
  KvCacheSnapshot snapshot() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace attnkit
