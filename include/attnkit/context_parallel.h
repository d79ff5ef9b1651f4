// Context parallelism: a batch of sequences split by tokens across R ranks (GPUs), as ring
// attention and TensorRT-LLM's context parallelism do (docs/context_parallel.md).
//
// - ZigzagPlan: which tokens of a packed varlen batch each rank holds for prefill (each sequence
//   cut into 2R chunks, rank r holding chunks r and 2R-1-r: causal load balance).
// - ring_schedule(): which K/V shard a rank holds at each ring step and which (Q chunk, KV chunk)
//   blocks it computes; fully masked blocks are skipped, the causal diagonal is masked.
// - ring_prefill(): the prefill of a rank's shard, K/V travelling around the ring through a
//   Communicator, partial (O, LSE) merged with merge_states().
// - DecodeShardLayout / sharded_decode(): every sequence's KV cache sharded by blocks (block i
//   on rank i mod R); each rank attends its shard, the partial (O, LSE) are all-gathered and
//   merged in rank order, so every rank gets the same output bits.
// - Communicator: the transport (send / receive to the ring neighbours, all-gather), over NCCL or
//   in-process (threads of one process, host or device memory).
//
// Without a communicator (Options::comm == nullptr) the drivers run as the only rank of a group
// of one: ring_prefill() is one prefill() call on the whole batch, sharded_decode() is decode().
// The existing entry points of attention.h are unchanged.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "attnkit/attention.h"
#include "attnkit/kv_cache_manager.h"
#include "attnkit/spec.h"
#include "attnkit/types.h"

namespace attnkit::cp {

// ---------------------------------------------------------------------------------------------
// Communicator: the ranks of one context-parallel group. Every member that moves data is a
// collective: every rank of the group calls it, in the same order, with matching sizes. The
// transfers are enqueued on `stream` (cudaStream_t as void*, ignored for CPU ranks) and are
// complete, on the host for CPU ranks and in stream order for CUDA ranks, when the call returns;
// the buffers may be reused after that (in stream order). The in-process group checks that the
// sizes match between the ranks and throws Error on every rank when they do not; NCCL does not
// check (a mismatch is an NCCL usage error).
struct RingTransfer {
  const void* send = nullptr;  // sent to rank (rank + 1) % R
  int64_t send_bytes = 0;
  void* recv = nullptr;  // received from rank (rank + R - 1) % R
  int64_t recv_bytes = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int32_t rank() const = 0;
  virtual int32_t world_size() const = 0;
  // The device of this rank's buffers (cpu for an in-process group over host memory).
  virtual Device device() const = 0;
  // A stream of this rank reserved for communication, so that the drivers overlap the transfer
  // of the next K/V block with the attention of the one in hand; nullptr for CPU ranks.
  virtual Stream comm_stream() const = 0;
  // Every transfer at once (NCCL: one group of sends and receives).
  virtual void ring_exchange(std::span<const RingTransfer> transfers, Stream stream) = 0;
  // recv[q * bytes, (q + 1) * bytes) = rank q's send[0, bytes), for every rank q.
  virtual void all_gather(const void* send, void* recv, int64_t bytes, Stream stream) = 0;
};

// R communicators over the ranks of one process, rank i on devices[i] (every rank may share one
// device: several CUDA streams of one GPU). Each rank must be driven from its own thread, since a
// collective waits on the host until every rank has called it. Transfers are memcpy (cpu) or
// cudaMemcpyAsync ordered by events (cuda). A rank that waits more than `timeout_seconds` for
// the others throws Error, and the group then refuses every later call.
std::vector<std::unique_ptr<Communicator>> make_in_process_group(std::span<const Device> devices,
                                                                 double timeout_seconds = 300.0);

// NCCL. libnccl.so.2 is loaded at the first use (dlopen: the one a process such as PyTorch has
// loaded already, else the library found when attnkit was built), so libattnkit does not depend
// on NCCL unless a communicator is created. Built only with ATTNKIT_WITH_NCCL (docs/building.md);
// otherwise these throw Error.
struct NcclUniqueId {
  std::array<char, 128> bytes{};  // ncclUniqueId (NCCL_UNIQUE_ID_BYTES)
};
bool nccl_available();  // built with NCCL and the library loads
// Rank 0 creates the id and sends it to the other ranks out of band (e.g. torch.distributed).
NcclUniqueId nccl_unique_id();
// Collective over the world_size processes (or threads) that call it with the same id: a new
// NCCL communicator of rank `rank` on CUDA device `device`, with a communication stream of its
// own. Throws Error for a rank outside [0, world_size) or an NCCL failure.
std::unique_ptr<Communicator> make_nccl_communicator(const NcclUniqueId& id, int32_t rank,
                                                     int32_t world_size, int device);
// Wraps an existing ncclComm_t (passed as void*), which the caller keeps alive and destroys; its
// rank, size and device are read from NCCL.
std::unique_ptr<Communicator> wrap_nccl_communicator(void* nccl_comm);

// ---------------------------------------------------------------------------------------------
// ZigzagPlan: the prefill sharding of a packed batch (cu_seqlens int32 [B + 1], host memory, the
// global token offsets) over world_size ranks.
//
// With R > 1 sequence s of length L is cut into 2R chunks, chunk c holding its tokens
// [floor(c L / 2R), floor((c + 1) L / 2R)) (lengths differ by at most one; short sequences have
// empty chunks). Rank r holds chunks r and 2R-1-r of every sequence: its slot 0 and slot 1. Its
// local tensors (q, k, v, out, lse of ring_prefill) hold slot 0 of every sequence in batch order,
// then slot 1 of every sequence, packed. With R = 1 there is one slot, the whole sequences in
// batch order, so the local tensors are the global ones.
class ZigzagPlan {
 public:
  // Throws Error naming `cu_seqlens` (not [0, ...] non-decreasing) or `world_size` (< 1).
  ZigzagPlan(std::span<const int32_t> cu_seqlens, int32_t world_size);

  int32_t world_size() const { return world_size_; }
  int32_t num_sequences() const { return static_cast<int32_t>(cu_seqlens_.size()) - 1; }
  int32_t num_slots() const { return world_size_ == 1 ? 1 : 2; }
  int32_t num_chunks() const { return world_size_ == 1 ? 1 : 2 * world_size_; }
  int64_t total_tokens() const { return cu_seqlens_.back(); }
  const std::vector<int32_t>& cu_seqlens() const { return cu_seqlens_; }

  // The chunk that slot `slot` of rank `rank` holds: r for slot 0, 2R-1-r for slot 1.
  int32_t chunk_of(int32_t rank, int32_t slot) const;
  // Chunk `chunk` of sequence `seq`: positions [chunk_begin, chunk_begin + chunk_length) in the
  // sequence (the global packed row is cu_seqlens[seq] + position).
  int64_t chunk_begin(int32_t seq, int32_t chunk) const;
  int64_t chunk_length(int32_t seq, int32_t chunk) const;

  // The local layout of `rank`.
  int64_t local_tokens(int32_t rank) const;
  int64_t max_local_tokens() const;
  int64_t slot_offset(int32_t rank, int32_t slot) const;  // first local row of the slot
  int64_t slot_tokens(int32_t rank, int32_t slot) const;
  int32_t slot_max_seqlen(int32_t rank, int32_t slot) const;  // longest chunk of the slot
  // int32 [B + 1]: offsets of the sequences' chunks inside the slot (from 0).
  std::vector<int32_t> slot_cu_seqlens(int32_t rank, int32_t slot) const;
  // For each local row of `rank`, its global packed row: local[i] = global[global_rows(rank)[i]]
  // (a gather; the inverse scatter puts out / lse back in global order).
  std::vector<int32_t> global_rows(int32_t rank) const;

 private:
  int32_t world_size_;
  std::vector<int32_t> cu_seqlens_;
};

// ---------------------------------------------------------------------------------------------
// The ring schedule of one rank. At step t (0 .. R-1) the rank holds the K/V shard of rank
// kv_rank = (rank - t) mod R (step 0: its own), sends it on to rank + 1 and receives the next one
// from rank - 1. Each block pairs one of its Q slots with one slot of the K/V shard in hand:
// kFull attends every key of the K/V chunk (an earlier chunk under a causal mask, or any chunk
// without a mask), kCausalDiagonal is a chunk against itself under the causal mask. A block whose
// K/V chunk follows its Q chunk under a causal mask is fully masked and not listed.
enum class BlockKind : uint8_t { kFull, kCausalDiagonal };
struct RingBlock {
  int32_t q_slot = 0;
  int32_t kv_slot = 0;
  int32_t q_chunk = 0;
  int32_t kv_chunk = 0;
  BlockKind kind = BlockKind::kFull;
};
struct RingStep {
  int32_t kv_rank = 0;
  std::vector<RingBlock> blocks;  // by q_slot, then kv_slot
};
// Throws Error for world_size < 1 or a rank outside [0, world_size).
std::vector<RingStep> ring_schedule(int32_t world_size, int32_t rank, bool causal);

// ---------------------------------------------------------------------------------------------
// The drivers.
struct Options {
  Communicator* comm = nullptr;  // nullptr: a group of one rank (single-GPU behaviour)
};

// Prefill of this rank's shard: self-attention of every sequence of the plan (packed K/V, query
// positions = key positions), each rank holding the rows the plan gives it. Tensors are on
// comm->device() (any device without a communicator):
//   q   [plan.local_tokens(rank), Hq, D] bf16 / f16 (f32 on CPU)
//   k,v [plan.local_tokens(rank), Hkv, D], the dtype of q, contiguous (they are sent as bytes)
//   out [plan.local_tokens(rank), Hq, D], the dtype of q; lse optional float32 [local, Hq]
// spec.mask must be causal or none, without ALiBi (both depend on absolute positions that the
// per-block calls do not see: docs/context_parallel.md). Every block is one prefill() call over
// all sequences at once, so spec.backend / fused_kernel choose its kernel as for prefill().
// Partials are merged in step order with merge_states() in the output dtype. Every argument is
// checked, and every block's prefill call validated, before anything is sent, so a rejected call
// throws on every rank before any communication. Enqueued on `stream`; the ring transfers run on
// comm->comm_stream(), ordered with `stream` by events. Scratch memory (two K/V shards, one
// partial and one accumulator of the local size) is taken with cudaMallocAsync on `stream`
// (host memory on the CPU).
struct RingPrefillArgs {
  TensorView q, k, v;
  TensorView out;
  TensorView lse;        // optional
  bool checked = false;  // checked mode for each prefill / merge call (PrefillArgs::checked)
};
void ring_prefill(const AttentionSpec& spec, const ZigzagPlan& plan, const RingPrefillArgs& args,
                  const Options& options, Stream stream = nullptr);

// ---------------------------------------------------------------------------------------------
// DecodeShardLayout: every sequence's KV cache sharded by blocks. Block i of a sequence's tokens
// (tokens [i T, (i + 1) T)) lives on rank i mod R, so every rank holds within one block of L / R
// tokens of a sequence of length L at any length, and a growing sequence fills the ranks in turn.
// On its rank, position p is local position (p / T / R) T + p mod T: each rank's KvCacheManager
// holds a local sequence made of its blocks in order (docs/context_parallel.md shows the add /
// append calls).
struct DecodeShardLayout {
  int32_t world_size = 1;
  int32_t tokens_per_block = 16;

  // Throws Error naming the field when world_size < 1 or tokens_per_block < 1.
  void validate() const;
  int32_t rank_of_position(int64_t position) const;
  int64_t local_position(int64_t position) const;
  // Tokens of a sequence of `length` tokens that `rank` holds.
  int64_t local_length(int32_t rank, int64_t length) const;
  // The tokens of positions [begin, begin + tokens.size()) that `rank` holds, in order: what
  // that rank's KvCacheManager::add (begin = 0) or append receives.
  std::vector<int32_t> local_tokens(int32_t rank, int64_t begin,
                                    std::span<const int32_t> tokens) const;
};

// One rank's share of sharded sequences, kept in that rank's KvCacheManager. The manager holds
// the rank's local sequence (its blocks in order) under the sequence's id; a sequence enters a
// rank's manager with its first local token (add()), later tokens are appended. The manager must
// be configured with enable_prefix_reuse = false: its prefix chains would see the rank's own
// blocks only, not the tokens of the other ranks' blocks between them, so two sequences that
// differ there would share KV they must not share. Not synchronized beyond the manager: one
// owner (the rank's scheduler thread) calls it.
class ShardedKvCache {
 public:
  // Throws Error naming the layout field when layout is invalid or rank is outside it.
  ShardedKvCache(KvCacheManager& manager, const DecodeShardLayout& layout, int32_t rank);

  const DecodeShardLayout& layout() const { return layout_; }
  int32_t rank() const { return rank_; }
  // Adds tokens at the end of sequence `seq` (a new sequence starts at position 0) and hands the
  // rank's share to the manager. Every rank is given the same calls. Throws what the manager
  // throws (pool exhausted, max_seq_len) and then leaves the sequence as it was.
  void extend(SeqId seq, std::span<const int32_t> tokens);
  // Drops the sequence on this rank (its manager's release() where it holds any token).
  void release(SeqId seq);
  int64_t length(SeqId seq) const;        // global tokens; 0 for an unknown sequence
  int64_t local_length(SeqId seq) const;  // tokens on this rank
  // Block tables of `rows` for sharded_decode's kv_cache: the manager's rows, and for a sequence
  // that has no token on this rank yet a row of -1 with length 0.
  KvBlockTables block_tables(std::span<const SeqId> rows) const;

 private:
  KvCacheManager& manager_;
  DecodeShardLayout layout_;
  int32_t rank_;
  std::vector<std::pair<SeqId, int64_t>> lengths_;  // global length of each known sequence
};

// Decode over a sharded cache. args is this rank's call: q [num_rows, Hq, D] the same rows on
// every rank, args.kv_cache this rank's shard (seq_lens = local lengths, which may be 0), out and
// lse the full results, identical on every rank. spec.mask must not be a sliding window and
// spec.alibi must be off (both read absolute positions); no beams (beam_width 1, no
// cache_indirection). The local decode runs as decode() with args' split options and workspace;
// (O, LSE) partials in the output dtype are all-gathered on `stream` and merged in rank order.
// Scratch: R + 2 partials (this rank's, the gathered ones, the running merge), cudaMallocAsync
// on `stream` (host memory on the CPU).
void sharded_decode(const AttentionSpec& spec, const DecodeArgs& args, const Options& options,
                    Stream stream = nullptr);

}  // namespace attnkit::cp
