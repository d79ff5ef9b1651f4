// The attention entry points. Every function validates all of its arguments before it writes
// anything and throws attnkit::Error naming the argument; CPU tensors run on the reference
// backend, CUDA tensors on the backend that spec.backend selects (docs/configuration.md).
// `stream` is a cudaStream_t passed as void* (nullptr = the legacy default stream); it is
// ignored for CPU tensors. No entry point synchronizes the stream on the host, except in checked
// mode (docs/safety.md: metadata in device memory is checked by the kernels, which record a
// fault for attnkit::check_device_errors() in include/attnkit/device_errors.h).
//
// Shapes use: B sequences (requests), Hq query heads, Hkv KV heads, D head_dim, and packed
// ("varlen") token dimensions without padding.
#pragma once

#include <cstdint>

#include "attnkit/kv_cache.h"
#include "attnkit/spec.h"
#include "attnkit/types.h"

namespace attnkit {

using Stream = void*;

// ---------------------------------------------------------------------------------------------
// SkipStats: the skip-softmax statistics of one prefill() call (docs/diffusion.md), laid out as
// PrefillArgs::skip_stats holds them on the device: int64 {tiles_total, tiles_skipped, block_m,
// block_n}. The call overwrites the buffer in stream order and never synchronizes; copy its 32
// bytes into a SkipStats once the stream has reached them (e.g. cudaMemcpyAsync + an event).
struct SkipStats {
  int64_t tiles_total = 0;    // (query tile, key tile) pairs visited, counted per query head
  int64_t tiles_skipped = 0;  // of them, the pairs skip-softmax skipped
  int64_t block_m = 0;        // the tile the counts refer to: block_m query rows x block_n keys
  int64_t block_n = 0;        // (the kernel's own tile on the fused backend)
  double skipped_fraction() const {
    return tiles_total ? static_cast<double>(tiles_skipped) / tiles_total : 0.0;
  }
};
static_assert(sizeof(SkipStats) == 4 * sizeof(int64_t), "SkipStats mirrors an int64 [4] buffer");

// ---------------------------------------------------------------------------------------------
// prefill: packed variable-length context attention.
//
// Queries of sequence i are the last n_i = cu_seqlens_q[i+1] - cu_seqlens_q[i] tokens of its
// kv_len_i keys, at positions kv_len_i - n_i .. kv_len_i - 1 (bottom-right aligned, as in
// FlashAttention); with kv_len_i == n_i this is ordinary self-attention. K/V come either from
// packed tensors (k, v, cu_seqlens_kv) or, when `kv_cache` is set, from the cache (kv_len_i =
// kv_cache->seq_lens[i], row i of its block table): chunked context and prefix reuse.
//
// FP8 context attention (CUDA, sm90, head_dim 128 / 256; docs/semantics.md "FP8 attention"): q
// fp8_e4m3 codes with k / v fp8_e4m3 (packed mode) or an fp8_e4m3 kv_cache (paged mode); out bf16
// or f16. The logits are (q . k) x q_descale x k_descale x scale, the output (P V) x v_descale,
// P rounded to fp8 e4m3 on the way (as FlashAttention-3's FP8 forward).
struct PrefillArgs {
  TensorView q;                           // [total_q, Hq, D] bf16/f16 (f32 on CPU; fp8_e4m3)
  TensorView cu_seqlens_q;                // int32 [B + 1], cu_seqlens_q[0] == 0, non-decreasing
  TensorView k;                           // [total_kv, Hkv, D], same dtype as q (packed mode)
  TensorView v;                           // [total_kv, Hkv, D] (packed mode)
  TensorView cu_seqlens_kv;               // int32 [B + 1] (packed mode)
  const KvCacheView* kv_cache = nullptr;  // paged mode: K/V of sequence i from row i
  TensorView out;                         // [total_q, Hq, D], same dtype as q (fp8 q: bf16 or f16)
  TensorView lse;  // optional float32 [total_q, Hq], natural log; -inf for empty rows
  // fp8 q only (optional, 1 where absent): float32 [1] (per tensor) or [B, Hkv] (per sequence and
  // KV head: q_descale then applies to the group's query heads), on q's device. A paged call's
  // k / v descales are the cache's k_scale / v_scale (k_descale / v_descale must be absent).
  TensorView q_descale;
  TensorView k_descale;
  TensorView v_descale;
  // Upper bounds of the per-sequence query / key lengths. Required (> 0) for CUDA tensors, whose
  // cu_seqlens live on the device and are never read back; computed from the data on the CPU.
  int32_t max_seqlen_q = 0;
  int32_t max_seqlen_kv = 0;
  // Skip-softmax (spec.skip_softmax, mask none or causal; docs/diffusion.md). `timestep`: the
  // call's normalized diffusion timestep in [0, 1] for the disabled_until_timestep gate (LLM
  // prefill leaves it 0: the gate is open). `block_m` x `block_n`: the tiles the reference and
  // vanilla backends take the skip decisions on (16, 32, 64, 128 or 256; the fused kernels take
  // their own and report them in skip_stats).
  double timestep = 0.0;
  int32_t block_m = 128;
  int32_t block_n = 128;
  // Optional int64 [4], contiguous, in the memory of q: overwritten in stream order with the
  // call's SkipStats (also without skip_softmax: then tiles_skipped = 0). No host synchronization.
  TensorView skip_stats;
  // Checked mode for this call (docs/safety.md; also on for every call with ATTNKIT_CHECKED=1):
  // a CUDA call synchronizes its stream after enqueueing its work and throws DeviceFaultError at
  // once for a fault the kernels recorded. No effect on CPU calls.
  bool checked = false;
};
void prefill(const AttentionSpec& spec, const PrefillArgs& args, Stream stream = nullptr);

// ---------------------------------------------------------------------------------------------
// DecodeWorkspace: caller-owned device memory for split-KV decode (the fused CUDA kernel), as a
// serving engine keeps one per stream. Without one, every split call takes its workspace with
// cudaMallocAsync and zeroes its arrival counters with cudaMemsetAsync (three extra graph nodes,
// ~2-4 us a call at batch 1 on the H200, docs/decode_design.md). With one, the counters are
// zeroed once here and the merging CTA of each (row, KV head) sets its counter back to zero, so
// a call enqueues its kernels only (the decode kernel, and for large groups the merge kernel,
// which uses no counters).
//
// Rules:
// - Not shared by calls that may run at the same time (other streams, graphs replayed on other
//   streams): use one workspace per stream or per concurrently running call. Calls on one stream
//   (eager or replayed graphs) may all use the same one.
// - A split call fits when its zeroed words (rows x KV heads x head blocks counters; with
//   deterministic = false also rows x Hq x (D + 1) sums and 4 outlier words a counter) fit
//   counter_capacity() and splits x rows x Hq x (D + 1) <= partial_capacity() (each split's output
//   and LSE are kept in f32); for the spec it was sized for, every call of <= max_rows rows and <=
//   max_splits splits fits (max_splits = 128, the kernel's limit, fits any split count). A call
//   that does not fit throws naming `workspace` (decode) or `decode_workspace` (forward) before
//   anything is enqueued. Calls that do not split do not use it.
// - A call that throws leaves the counters zero (nothing was enqueued, or the kernel did not
//   start). A kernel that faults on the device loses the CUDA context and the workspace with it;
//   reset() re-zeroes the counters (stream ordered) for a caller who wants to be certain.
// - The destructor frees the memory with cudaFree (which waits for the device): destroy it after
//   the calls that use it.
class DecodeWorkspace {
 public:
  static constexpr int32_t kMaxSplits = 128;
  // Capacity for decode calls of spec's heads (Hq query heads, head_dim D): max_rows x Hq x
  // (D + 6) zeroed words (counters and the accumulating merge's sums) and max_rows x max_splits x
  // Hq x (D + 1) 4-byte words of partials (f32 outputs and LSEs).
  DecodeWorkspace(const AttentionSpec& spec, int64_t max_rows, int32_t max_splits, Device device);
  ~DecodeWorkspace();
  DecodeWorkspace(const DecodeWorkspace&) = delete;
  DecodeWorkspace& operator=(const DecodeWorkspace&) = delete;

  const Device& device() const { return device_; }
  int64_t bytes() const { return bytes_; }
  int64_t counter_capacity() const { return counters_; }       // zeroed words (counters, sums)
  int64_t partial_capacity() const { return partial_words_; }  // 4-byte words of (O, LSE)
  // Enqueues a zeroing of the counters (the whole zeroed region) on `stream` (cudaStream_t as
  // void*).
  void reset(Stream stream = nullptr);

  // Device pointers (for the backend): the counters, then the partials.
  int32_t* counters() const { return static_cast<int32_t*>(memory_); }
  float* partials() const { return partials_; }

 private:
  Device device_;
  void* memory_ = nullptr;
  float* partials_ = nullptr;
  int64_t bytes_ = 0;
  int64_t counters_ = 0;
  int64_t partial_words_ = 0;
};

// ---------------------------------------------------------------------------------------------
// decode: one new token per row (sequence, or beam of a sequence) over the KV cache, whose
// seq_lens already count the new token. The query of row r sits at position seq_lens[r] - 1.
// With beams, row r = s * beam_width + b and key position t is read from row
// s * beam_width + cache_indirection[s][b][t].
struct DecodeArgs {
  TensorView q;  // [num_rows, Hq, D] bf16/f16 (f32 on CPU); num_rows = kv_cache.num_rows()
  KvCacheView kv_cache;
  int32_t beam_width = 1;
  TensorView cache_indirection;  // optional int32 [num_rows / beam_width, beam_width, max_seq]
  TensorView out;                // [num_rows, Hq, D], same dtype as q
  TensorView lse;                // optional float32 [num_rows, Hq]
  // Split-KV: 0 = heuristic (batch x kv_heads against the SM count, and the context length);
  // n >= 1 forces n splits (1 = no split).
  int32_t num_splits = 0;
  // Upper bound of seq_lens for the split heuristic; 0 = the cache's row capacity.
  int32_t max_seq_len = 0;
  // Optional (CUDA): the split-KV workspace of this call's stream (see DecodeWorkspace); on the
  // device of q. nullptr: a per-call workspace (allocation and counter memset on the stream).
  DecodeWorkspace* workspace = nullptr;
  // true: the same inputs give the same output bits on every run. false lets split calls merge
  // over f32 sums that the splits add in L2 in the order they finish (1-3% faster at batch 1 on
  // long contexts, docs/decode_design.md); outputs then vary in their last bits from run to run,
  // within the same error bound.
  bool deterministic = true;
  // true: a row's output and LSE are bitwise identical whether it runs alone or inside any batch
  // (any other rows, lengths and batch size, any max_seq_len that bounds the lengths): splits of a
  // fixed 1024 keys, one kernel for the spec and dtypes whatever the batch, a merge whose order
  // depends on the split index only (docs/semantics.md, "Batch-invariant decode"). Implies
  // deterministic; requires num_splits = 0. The reference and vanilla backends are
  // batch-invariant already.
  bool batch_invariant = false;
  bool checked = false;  // checked mode for this call (see PrefillArgs::checked)
};
void decode(const AttentionSpec& spec, const DecodeArgs& args, Stream stream = nullptr);

// ---------------------------------------------------------------------------------------------
// append_kv: fused QKV pre-processing. Adds the bias, applies spec.rope to Q and K at each
// token's absolute position, writes K and V into the cache (quantized with its scales) and
// writes the rotated Q. Token t goes to block-table row row_of_token[t] at position
// positions[t] (slot kv_cache.slot_of(position)).
struct AppendKvArgs {
  TensorView qkv;  // [num_tokens, (Hq + 2 * Hkv) * D]: Q heads, then K heads, then V heads
  // Alternatively separate inputs (qkv not given): q [num_tokens, Hq, D],
  // k / v [num_tokens, Hkv, D].
  TensorView q, k, v;
  TensorView qkv_bias;      // optional [(Hq + 2 * Hkv) * D], same dtype as the input
  TensorView positions;     // int32 [num_tokens]
  TensorView row_of_token;  // int32 [num_tokens]: block-table row of each token
  KvCacheView kv_cache;     // destination (seq_lens is not read)
  TensorView q_out;         // [num_tokens, Hq, D], same dtype as the input
  bool checked = false;     // checked mode for this call (see PrefillArgs::checked)
};
void append_kv(const AttentionSpec& spec, const AppendKvArgs& args, Stream stream = nullptr);

// ---------------------------------------------------------------------------------------------
// forward: the in-flight-batching op (one call per layer per step). The batch holds
// num_context context requests (chunks of prompts) followed by generation requests, each of
// which contributes beam_width tokens (one per beam). Block-table rows: one per context request
// (rows 0 .. num_context-1), then beam_width per generation request.
//
// Runs append_kv on every token, prefill over the cache for the context part, decode for the
// generation part, and writes the packed output.
struct ForwardArgs {
  TensorView qkv;           // [num_tokens, (Hq + 2 * Hkv) * D]
  TensorView qkv_bias;      // optional [(Hq + 2 * Hkv) * D]
  int32_t num_context = 0;  // context requests (the first ones)
  int32_t beam_width = 1;   // tokens per generation request
  // int32 [num_requests + 1], host memory: token offsets of the requests in qkv.
  TensorView cu_seqlens_q;
  // int32 [num_requests], host memory: tokens cached before this step (c of each request).
  TensorView past_lens;
  // The cache; seq_lens is int32 [num_rows] with the lengths after this step (past + new).
  KvCacheView kv_cache;
  TensorView cache_indirection;  // optional int32 [num_generation, beam_width, max_seq]
  TensorView out;                // [num_tokens, Hq, D]
  TensorView lse;                // optional float32 [num_tokens, Hq]
  TensorView workspace;          // CUDA only, optional: int8 bytes for the rotated Q and metadata
  int32_t num_splits = 0;        // decode split-KV override (see DecodeArgs)
  DecodeWorkspace* decode_workspace = nullptr;  // optional, for the decode rows (see DecodeArgs)
  bool deterministic = true;                    // for the decode rows (see DecodeArgs)
  bool batch_invariant = false;                 // for the decode rows (see DecodeArgs)
  bool checked = false;  // checked mode for this call (see PrefillArgs::checked)
};
void forward(const AttentionSpec& spec, const ForwardArgs& args, Stream stream = nullptr);

// ---------------------------------------------------------------------------------------------
// dense: [B, S, H, D] attention with no mask (diffusion, encoders, cross attention), with the
// skip-softmax and SAGE options of spec.
struct DenseStats {
  int64_t tiles_total = 0;    // tiles of block_m x block_n considered
  int64_t tiles_skipped = 0;  // tiles skipped by skip-softmax
  // The tile the counts refer to: args.block_m x block_n on the reference and vanilla backends,
  // the kernel's own skip tile on the fused one (sm90: 64 rows x its key tile).
  int32_t block_m = 0;
  int32_t block_n = 0;
  double skipped_fraction() const {
    return tiles_total ? static_cast<double>(tiles_skipped) / tiles_total : 0.0;
  }
};
struct DenseArgs {
  TensorView q;           // [B, Sq, Hq, D]
  TensorView k;           // [B, Skv, Hkv, D]
  TensorView v;           // [B, Skv, Hkv, D]
  TensorView out;         // [B, Sq, Hq, D], same dtype as q
  TensorView lse;         // optional float32 [B, Sq, Hq]
  double timestep = 0.0;  // normalized diffusion timestep in [0, 1] (skip-softmax gate)
  // Tile sizes the skip decisions are taken on (the fused kernel reports its own).
  int32_t block_m = 128;
  int32_t block_n = 128;
  // Optional: filled with the skip statistics of the call. On CUDA, a call that skips tiles
  // synchronizes the stream to fill it; skip_stats gives the counts without a synchronization.
  DenseStats* stats = nullptr;
  // Optional int64 [2] on q's device: overwritten, in stream order, with {tiles_total,
  // tiles_skipped} (the tiles of DenseStats::block_m x block_n). No host synchronization.
  TensorView skip_stats;
  bool checked = false;  // checked mode for this call (see PrefillArgs::checked)
};
void dense(const AttentionSpec& spec, const DenseArgs& args, Stream stream = nullptr);

// ---------------------------------------------------------------------------------------------
// merge_states: combine partial results of the same queries over disjoint key sets:
// lse = log(exp(lse_a) + exp(lse_b)), out = (exp(lse_a) out_a + exp(lse_b) out_b) / exp(lse).
// Rows where both lse are -inf give zeros and -inf.
struct MergeStatesArgs {
  TensorView out_a;      // [N, H, D]
  TensorView lse_a;      // float32 [N, H]
  TensorView out_b;      // [N, H, D]
  TensorView lse_b;      // float32 [N, H]
  TensorView out;        // [N, H, D]
  TensorView lse;        // optional float32 [N, H]
  bool checked = false;  // checked mode for this call (see PrefillArgs::checked)
};
void merge_states(const MergeStatesArgs& args, Stream stream = nullptr);

}  // namespace attnkit
