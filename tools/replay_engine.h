// The engine of `attnkit replay`: a synthetic serving trace replayed through forward() and the
// KvCacheManager (docs/replay.md). Factored out of the command so that a cpu test can run a tiny
// trace in-process.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "attnkit/kv_cache_manager.h"
#include "attnkit/spec.h"
#include "attnkit/types.h"

namespace attnkit::tools {

struct ReplayProgress {
  int64_t step = 0;
  int32_t finished = 0;
  int32_t total = 0;
  int32_t running = 0;
  int32_t waiting = 0;
  int64_t tokens = 0;          ///< prompt (computed) + generated so far
  int64_t forward_tokens = 0;  ///< context + generation-row tokens run through forward()
  double seconds = 0;          ///< wall time so far
  double forward_seconds = 0;  ///< of which inside forward()
};

struct ReplayOptions {
  // Attention stack: Llama-3-8B's attention shape (32 layers, GQA 32/8, D = 128).
  int32_t layers = 32;
  int32_t num_q_heads = 32;
  int32_t num_kv_heads = 8;
  int32_t head_dim = 128;

  // Trace.
  uint64_t seed = 1;
  int32_t requests = 64;
  double arrival_rate = 1.0;   ///< mean arrivals per scheduler step (exponential gaps)
  int32_t system_prompts = 4;  ///< distinct shared system prompts (prefix reuse)
  int32_t system_prompt_len = 256;
  int32_t min_user_len = 16;  ///< own prompt tokens after the system prompt
  int32_t max_user_len = 512;
  int32_t min_output_len = 16;
  int32_t max_output_len = 128;
  double beam_fraction = 0.25;  ///< share of requests decoded with beam search
  int32_t beam_width = 4;
  int32_t vocab = 32000;

  // Scheduler.
  int32_t max_batch_tokens = 2048;  ///< token budget of one step (generation tokens first)
  int32_t max_batch_requests = 64;  ///< requests in flight at once

  // Cache.
  int32_t tokens_per_block = 16;
  DType kv_dtype = DType::kBF16;
  int64_t cache_tokens = 0;  ///< pool size in tokens; 0 = 0.9 of free GPU memory (CUDA only)
  double host_cache_mb = 0;  ///< host offload tier
  bool prefix_reuse = true;

  // Execution and checking.
  Device device{};  ///< cpu: the reference backend; cuda:N: CUDA tensors, backend below
  Backend backend = Backend::kAuto;
  int32_t check_every = 8;     ///< check every Nth step (0 = never)
  int32_t check_max_seqs = 0;  ///< sequences checked per checked batch (0 = all), spread evenly
  /// Query rows checked per checked context chunk (0 = all), evenly spaced, the chunk's last one
  /// included; each sampled row is recomputed alone over the keys up to it.
  int32_t check_rows = 0;
  /// Host threads that run the checks beside the step loop (0 = inline, in the step loop). The
  /// step loop waits for them only when 4 checks per thread are pending, and at the end.
  int32_t check_threads = 0;
  /// Corrupts one element of the checked layer's output before comparing (tests the checker).
  bool inject_fault = false;

  /// Called after every step (progress display); may be empty.
  std::function<void(const ReplayProgress&)> on_step;
};

/// One scheduler step: the tokens its forward() batches ran and the time inside forward().
struct ReplayStep {
  int32_t context_tokens = 0;     ///< prompt-chunk tokens
  int32_t generation_tokens = 0;  ///< generation-row tokens (one per beam)
  double forward_seconds = 0;     ///< every batch and layer of the step
};

/// Batch kinds of a step: context chunks only, generation rows only, or both.
enum class StepKind : int32_t { kPrefill = 0, kDecode = 1, kMixed = 2 };
StepKind step_kind(const ReplayStep& step);
const char* step_kind_name(StepKind kind);  ///< "prefill", "decode", "mixed"

/// Forward time per step (nearest-rank percentiles) and token mix of a set of steps.
struct StepStats {
  int64_t steps = 0;
  double forward_seconds = 0;
  double p50_seconds = 0, p90_seconds = 0, p99_seconds = 0, max_seconds = 0;
  double mean_context_tokens = 0;     ///< per step
  double mean_generation_tokens = 0;  ///< per step
};
/// The steps of `kind`, or every step when kind is empty.
StepStats summarize_steps(const std::vector<ReplayStep>& steps, const StepKind* kind = nullptr);

struct ReplayResult {
  int32_t requests = 0;
  int32_t beam_requests = 0;
  int64_t steps = 0;
  int64_t forward_calls = 0;
  int64_t prompt_tokens = 0;  ///< prompt tokens of all requests
  int64_t reused_tokens = 0;  ///< prompt tokens served from the cache (prefix reuse)
  int64_t computed_prompt_tokens = 0;
  int64_t context_chunks = 0;
  int64_t generated_tokens = 0;  ///< sampled tokens, counting every beam
  int64_t decode_tokens = 0;     ///< generation-row tokens run through forward()
  double prefill_seconds = 0;    ///< forward() time attributed to context tokens
  double decode_seconds = 0;     ///< forward() time attributed to generation tokens
  double forward_seconds = 0;    ///< all time inside forward() (CUDA: events around the layers)
  double wall_seconds = 0;
  /// Wall time the step loop spent on checks: running them (inline) or waiting for the check
  /// threads (when 4 checks per thread were pending, and at the end).
  double check_seconds = 0;
  double check_cpu_seconds = 0;  ///< time spent computing checks, summed over threads
  int32_t check_threads = 0;
  std::vector<ReplayStep> step_log;  ///< every step, in order
  int32_t max_running = 0;
  KvCacheStats cache;
  int64_t checks_passed = 0;
  int64_t checks_failed = 0;
  double max_check_error = 0;         ///< largest |out - ref| seen by a check (0 when bit-exact)
  std::vector<std::string> failures;  ///< the first few failed checks, described
  uint64_t trace_digest = 0;          ///< hash of every request's final beams (order-independent)
  std::string device;
  std::string backend;
};

/// Runs the trace. Throws attnkit::Error for inconsistent options (naming the option).
ReplayResult run_replay(const ReplayOptions& options);

}  // namespace attnkit::tools
