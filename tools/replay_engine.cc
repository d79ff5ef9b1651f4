// The replay engine: trace generation, the scheduler loop, forward() per layer, deterministic
// sampling, and the independent re-computation that checks sampled steps (docs/replay.md).
//
// A step runs in two phases so that a GPU spends its time in forward(): launch() enqueues every
// batch of the step (metadata upload, the activation kernel, the layers between two CUDA events,
// the copies of the output rows the host needs) without waiting, then the step waits for the
// stream once and complete() reads the timings, hands the checks over and samples. On the CPU
// launch() runs the reference in place, timed with a clock around each forward() call.
#include "replay_engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <random>
#include <span>
#include <thread>

#include "attnkit/attention.h"
#include "attnkit/kv_cache_manager.h"
#include "core/check.h"
#include "core/element.h"
#include "replay_activations.h"

#if defined(ATTNKIT_WITH_CUDA)
#include <cuda_runtime.h>

#include "replay_device.h"
#endif

namespace attnkit::tools {

StepKind step_kind(const ReplayStep& step) {
  if (step.generation_tokens == 0) return StepKind::kPrefill;
  return step.context_tokens == 0 ? StepKind::kDecode : StepKind::kMixed;
}

const char* step_kind_name(StepKind kind) {
  switch (kind) {
    case StepKind::kPrefill:
      return "prefill";
    case StepKind::kDecode:
      return "decode";
    case StepKind::kMixed:
      return "mixed";
  }
  return "?";
}

StepStats summarize_steps(const std::vector<ReplayStep>& steps, const StepKind* kind) {
  StepStats s;
  std::vector<double> times;
  double context = 0, generation = 0;
  for (const ReplayStep& step : steps) {
    if (kind && step_kind(step) != *kind) continue;
    times.push_back(step.forward_seconds);
    s.forward_seconds += step.forward_seconds;
    context += step.context_tokens;
    generation += step.generation_tokens;
  }
  s.steps = static_cast<int64_t>(times.size());
  if (times.empty()) return s;
  std::sort(times.begin(), times.end());
  // Nearest rank: the smallest time that at least `percent`% of the steps do not exceed (rank
  // ceil(percent * n / 100), in integers).
  auto percentile = [&](size_t percent) {
    const size_t rank = (percent * times.size() + 99) / 100;
    return times[std::clamp<size_t>(rank, 1, times.size()) - 1];
  };
  s.p50_seconds = percentile(50);
  s.p90_seconds = percentile(90);
  s.p99_seconds = percentile(99);
  s.max_seconds = times.back();
  s.mean_context_tokens = context / static_cast<double>(s.steps);
  s.mean_generation_tokens = generation / static_cast<double>(s.steps);
  return s;
}

namespace {

using Clock = std::chrono::steady_clock;
using replay_act::mix64;

uint64_t hash_bytes(const void* data, size_t bytes, uint64_t h) {
  const auto* p = static_cast<const uint8_t*>(data);
  size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    uint64_t word;
    std::memcpy(&word, p + i, 8);
    h = mix64(h ^ word);
  }
  for (; i < bytes; ++i) h = mix64(h ^ p[i]);
  return h;
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// ---- synthetic model ---------------------------------------------------------------------------

struct TraceRequest {
  int32_t arrival_step = 0;
  std::vector<int32_t> prompt;
  int32_t output_len = 1;
  int32_t beam_width = 1;
};

std::vector<TraceRequest> make_trace(const ReplayOptions& o) {
  std::mt19937_64 rng(o.seed);
  auto uniform = [&](int32_t lo, int32_t hi) {
    return std::uniform_int_distribution<int32_t>(lo, std::max(lo, hi))(rng);
  };
  std::vector<std::vector<int32_t>> system(static_cast<size_t>(std::max(o.system_prompts, 0)));
  for (auto& s : system) {
    for (int32_t i = 0; i < o.system_prompt_len; ++i) s.push_back(uniform(0, o.vocab - 1));
  }
  std::exponential_distribution<double> gap(o.arrival_rate > 0 ? o.arrival_rate : 1.0);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::vector<TraceRequest> trace(static_cast<size_t>(o.requests));
  double clock = 0;
  for (TraceRequest& r : trace) {
    r.arrival_step = static_cast<int32_t>(clock);
    clock += o.arrival_rate > 0 ? gap(rng) : 0.0;
    if (!system.empty()) r.prompt = system[static_cast<size_t>(uniform(0, o.system_prompts - 1))];
    const int32_t user = uniform(o.min_user_len, o.max_user_len);
    for (int32_t i = 0; i < user; ++i) r.prompt.push_back(uniform(0, o.vocab - 1));
    r.output_len = uniform(o.min_output_len, o.max_output_len);
    r.beam_width = (o.beam_width > 1 && unit(rng) < o.beam_fraction) ? o.beam_width : 1;
  }
  return trace;
}

// QKV activations on the host (replay_activations.h; a GPU replay runs the same function as a
// kernel): a deterministic function of (token id, position, layer), so a reused prefix must hold
// exactly what recomputation writes.
class Activations {
 public:
  explicit Activations(const ReplayOptions& o)
      : width_(int64_t{o.num_q_heads + 2 * o.num_kv_heads} * o.head_dim),
        seed_key_(replay_act::seed_key(o.seed)) {}
  int64_t width() const { return width_; }
  uint64_t seed_key() const { return seed_key_; }

  // The base row (bf16 bits) of one token.
  void base_row(int32_t token, int32_t position, uint16_t* row) const {
    const uint64_t key = replay_act::row_key(seed_key_, token, position);
    for (int64_t i = 0; i < width_; ++i) row[i] = replay_act::base_element(key, i);
  }
  // Layer `layer`'s row from a base row.
  void layer_row(const uint16_t* base, int32_t layer, uint16_t* row) const {
    const int64_t shift = replay_act::layer_shift(layer, width_);
    std::memcpy(row, base + shift, static_cast<size_t>(width_ - shift) * 2);
    std::memcpy(row + (width_ - shift), base, static_cast<size_t>(shift) * 2);
  }
  // Elements [begin, begin + count) of layer `layer`'s row of one token.
  void layer_elements(int32_t token, int32_t position, int32_t layer, int64_t begin, int64_t count,
                      uint16_t* out) const {
    const uint64_t key = replay_act::row_key(seed_key_, token, position);
    for (int64_t i = 0; i < count; ++i) {
      out[i] = replay_act::layer_element(key, layer, width_, begin + i);
    }
  }

 private:
  int64_t width_;
  uint64_t seed_key_;
};

// The "sampled" token: a hash of the attention output row (bf16 bits, all heads).
int32_t sample_token(const uint16_t* out_row, int64_t elements, uint64_t salt, int32_t vocab) {
  return static_cast<int32_t>(hash_bytes(out_row, static_cast<size_t>(elements) * 2, salt) %
                              static_cast<uint64_t>(vocab));
}

// ---- memory and the stream ---------------------------------------------------------------------

#if defined(ATTNKIT_WITH_CUDA)
void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) detail::fail("replay: ", what, " failed: ", cudaGetErrorString(e));
}
#endif

[[noreturn]] void needs_cuda(const Device& device) {
  detail::fail("replay: --device ", device.str(), " needs a CUDA build of attnkit");
}

// Where the replay's copies run: plain memcpy on the CPU; one CUDA stream otherwise, which the
// KV-cache manager's block copies use too, so that they stay ordered with the forward calls.
class Stream {
 public:
  explicit Stream(const Device& device) : device_(device) {
    if (device.is_cpu()) return;
#if defined(ATTNKIT_WITH_CUDA)
    cuda_check(cudaSetDevice(device.index), "cudaSetDevice");
    cudaStream_t stream = nullptr;
    cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    stream_ = stream;
#else
    needs_cuda(device);
#endif
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  ~Stream() {
#if defined(ATTNKIT_WITH_CUDA)
    if (stream_) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
#endif
  }
  const Device& device() const { return device_; }
  bool cuda() const { return device_.is_cuda(); }
  void* handle() const { return stream_; }

  // Stream-ordered copies and fills (host memory: done at once).
  void copy(void* dst, const void* src, size_t bytes) const {
    if (bytes == 0) return;
    if (!cuda()) {
      std::memcpy(dst, src, bytes);
      return;
    }
#if defined(ATTNKIT_WITH_CUDA)
    cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, cuda_stream()),
               "cudaMemcpyAsync");
#endif
  }
  void fill(void* dst, int value, size_t bytes) const {
    if (bytes == 0) return;
    if (!cuda()) {
      std::memset(dst, value, bytes);
      return;
    }
#if defined(ATTNKIT_WITH_CUDA)
    cuda_check(cudaMemsetAsync(dst, value, bytes, cuda_stream()), "cudaMemsetAsync");
#endif
  }
  void synchronize() const {
#if defined(ATTNKIT_WITH_CUDA)
    if (cuda()) cuda_check(cudaStreamSynchronize(cuda_stream()), "cudaStreamSynchronize");
#endif
  }
#if defined(ATTNKIT_WITH_CUDA)
  cudaStream_t cuda_stream() const { return static_cast<cudaStream_t>(stream_); }
#endif

 private:
  Device device_;
  void* stream_ = nullptr;
};

// Memory on the replay's device (device memory for CUDA, host memory for the CPU), or pinned host
// memory (`pinned`: the staging of copies, plain host memory on the CPU). ensure() grows it
// (contents lost): CUDA buffers are sized up front, before the KV pool takes its share of the
// device, and then never grow; a growing device buffer frees its old memory with cudaFree, which
// waits for the device.
class Buffer {
 public:
  Buffer() = default;
  Buffer(const Device& device, bool pinned, size_t bytes = 0) : device_(device), pinned_(pinned) {
    ensure(bytes);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    std::swap(device_, o.device_);
    std::swap(pinned_, o.pinned_);
    std::swap(bytes_, o.bytes_);
    std::swap(host_, o.host_);
    std::swap(data_, o.data_);
    return *this;
  }
  ~Buffer() { release(); }

  void ensure(size_t bytes) {
    if (bytes <= bytes_ && data_ != nullptr) return;
    release();
    bytes_ = std::max<size_t>(bytes, 1);
    if (device_.is_cpu()) {
      host_.resize(bytes_);
      data_ = host_.data();
      return;
    }
#if defined(ATTNKIT_WITH_CUDA)
    const cudaError_t status =
        pinned_ ? cudaMallocHost(&data_, bytes_) : cudaMalloc(&data_, bytes_);
    if (status != cudaSuccess) {
      data_ = nullptr;
      bytes_ = 0;
      detail::fail("replay: ", pinned_ ? "cudaMallocHost" : "cudaMalloc", " of ", bytes / 1048576,
                   " MiB failed: ", cudaGetErrorString(status),
                   " (the batch buffers grow with --max-batch-tokens, --max-batch-requests, "
                   "--beam-width and --layers)");
    }
#else
    needs_cuda(device_);
#endif
  }
  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void release() {
#if defined(ATTNKIT_WITH_CUDA)
    if (device_.is_cuda() && data_ != nullptr) {
      if (pinned_) {
        cudaFreeHost(data_);
      } else {
        cudaFree(data_);
      }
    }
#endif
    host_.clear();
    host_.shrink_to_fit();
    data_ = nullptr;
    bytes_ = 0;
  }

  Device device_{};
  bool pinned_ = false;
  size_t bytes_ = 0;
  std::vector<uint8_t> host_;
  void* data_ = nullptr;
};

// Two CUDA events around one batch's layers: the time inside forward(), measured on the device.
class ForwardTimer {
 public:
  ForwardTimer() {
#if defined(ATTNKIT_WITH_CUDA)
    cuda_check(cudaEventCreate(&start_), "cudaEventCreate");
    cuda_check(cudaEventCreate(&stop_), "cudaEventCreate");
#endif
  }
  ForwardTimer(const ForwardTimer&) = delete;
  ForwardTimer& operator=(const ForwardTimer&) = delete;
  ~ForwardTimer() {
#if defined(ATTNKIT_WITH_CUDA)
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
#endif
  }
#if defined(ATTNKIT_WITH_CUDA)
  void start(const Stream& s) {
    cuda_check(cudaEventRecord(start_, s.cuda_stream()), "cudaEventRecord");
  }
  void stop(const Stream& s) {
    cuda_check(cudaEventRecord(stop_, s.cuda_stream()), "cudaEventRecord");
  }
  // After the stream has passed stop().
  double seconds() const {
    float ms = 0;
    cuda_check(cudaEventElapsedTime(&ms, start_, stop_), "cudaEventElapsedTime");
    return ms * 1e-3;
  }

 private:
  cudaEvent_t start_ = nullptr;
  cudaEvent_t stop_ = nullptr;
#endif
};

// A tensor in `buffer` with a contiguous shape.
TensorView view_of(const Buffer& buffer, const Device& device, DType dtype,
                   std::initializer_list<int64_t> shape, size_t byte_offset = 0) {
  TensorView v(static_cast<uint8_t*>(buffer.data()) + byte_offset, dtype, shape);
  v.device = device;
  return v;
}

// ---- checks ------------------------------------------------------------------------------------

// One sequence of a checked batch: its history, the query positions checked, and the output rows
// forward() gave for them.
struct CheckItem {
  std::string what;
  int32_t layer = 0;
  std::vector<int32_t> history;  // the tokens with KV at this step, the queries' own included
  std::vector<int64_t> queries;  // checked positions in history, ascending
  bool generation = false;       // a generation row (decode), else a context chunk (prefill)
  // The queries are the last queries.size() positions of the history: one prefill call for all
  // of them (else one call per query, over the keys up to it).
  bool contiguous = false;
  std::vector<int64_t> tokens;  // the batch token (output row) of each query
  std::vector<uint16_t> got;    // [queries, Hq * D]: forward()'s output rows
};

struct CheckOutcome {
  bool passed = false;
  double error = 0;
  std::string failure;
  double seconds = 0;  // time the check took to compute
};

// Host threads that run checks beside the step loop. submit() waits while 4 checks per thread
// are pending, so the memory held by pending checks stays bounded; the destructor runs what is
// queued, then joins.
class CheckPool {
 public:
  explicit CheckPool(int32_t threads) : limit_(4 * static_cast<size_t>(threads)) {
    for (int32_t i = 0; i < threads; ++i) workers_.emplace_back([this] { work(); });
  }
  CheckPool(const CheckPool&) = delete;
  CheckPool& operator=(const CheckPool&) = delete;
  ~CheckPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    ready_.notify_all();
    for (std::thread& t : workers_) t.join();
  }
  // Returns the seconds spent waiting for room.
  double submit(std::function<void()> job) {
    std::unique_lock<std::mutex> lock(mutex_);
    const auto t0 = Clock::now();
    room_.wait(lock, [&] { return pending_ < limit_; });
    const double waited = seconds_since(t0);
    jobs_.push_back(std::move(job));
    ++pending_;
    ready_.notify_one();
    return waited;
  }
  // Waits until every submitted check has finished; returns the seconds waited.
  double drain() {
    std::unique_lock<std::mutex> lock(mutex_);
    const auto t0 = Clock::now();
    room_.wait(lock, [&] { return pending_ == 0; });
    return seconds_since(t0);
  }

 private:
  void work() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        ready_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
      {
        std::lock_guard<std::mutex> lock(mutex_);
        --pending_;
      }
      room_.notify_all();
    }
  }

  const size_t limit_;
  std::mutex mutex_;
  std::condition_variable ready_, room_;
  std::deque<std::function<void()>> jobs_;
  size_t pending_ = 0;  // queued or running
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

// ---- the engine --------------------------------------------------------------------------------

struct Running {
  const TraceRequest* request = nullptr;
  int64_t index = 0;
  std::vector<SeqId> seqs;  // one during the context phase, then beam_width beams
  bool added = false;
  bool in_context = true;
  int64_t computed = 0;  // prompt tokens with KV (cached or computed)
  int32_t generated = 0;
  int64_t reserved_blocks = 0;
  bool done = false;
  std::vector<std::vector<int32_t>> history;  // per beam: tokens, last one not yet in the cache
};

// Output rows of a batch copied to the host: the rows of `tokens` (ascending), one after another.
struct HostRows {
  std::vector<int64_t> tokens;
  const uint16_t* data = nullptr;
  int64_t row_elems = 0;
  const uint16_t* row(int64_t token) const {
    const auto it = std::lower_bound(tokens.begin(), tokens.end(), token);
    return data + (it - tokens.begin()) * row_elems;
  }
};

// One forward() batch of a step: context chunks and generation requests of one beam width.
struct Group {
  int32_t beam_width = 1;
  std::vector<Running*> context;
  std::vector<int64_t> chunk;  // tokens of each context request's chunk
  std::vector<Running*> generation;
  // Filled by build():
  std::vector<SeqId> rows;
  std::vector<int32_t> tokens, positions;  // per packed token
  std::vector<int32_t> cu_seqlens, past_lens;
  // Filled by launch():
  std::vector<CheckItem> checks;
  HostRows sampled, checked;  // last layer's rows that sampling reads; the checked layer's rows
  double forward_seconds = 0;
  size_t slot = 0;
  int64_t num_tokens() const { return static_cast<int64_t>(tokens.size()); }
  int64_t num_context_tokens() const { return cu_seqlens[context.size()]; }
};

// Host staging and timer of the i-th batch of a step (the batches of a step are in flight
// together, so each has its own).
struct BatchSlot {
  Buffer upload;    // metadata, copied to the device in one piece
  Buffer download;  // output rows
  std::unique_ptr<ForwardTimer> timer;
};

// Throws naming the option; runs before the trace is generated.
void validate_options(const ReplayOptions& o) {
  auto need = [](bool ok, const char* option, const std::string& accepted, const auto& given) {
    ATTNKIT_CHECK(ok, "replay: ", option, " must be ", accepted, ", got ", given);
  };
  need(o.layers >= 1, "--layers", ">= 1", o.layers);
  need(o.requests >= 1, "--requests", ">= 1", o.requests);
  need(o.arrival_rate >= 0 && std::isfinite(o.arrival_rate), "--arrival-rate",
       "a finite number >= 0 (0: all at once)", o.arrival_rate);
  need(o.system_prompts >= 0, "--system-prompts", ">= 0", o.system_prompts);
  need(o.system_prompt_len >= 0, "--system-prompt-len", ">= 0", o.system_prompt_len);
  need(o.min_user_len >= 0 && o.max_user_len >= o.min_user_len, "--min-user-len / --max-user-len",
       "0 <= min <= max", std::to_string(o.min_user_len) + ".." + std::to_string(o.max_user_len));
  need((o.system_prompts > 0 ? o.system_prompt_len : 0) + o.min_user_len >= 1, "--min-user-len",
       ">= 1 when there is no system prompt (every prompt needs a token)", o.min_user_len);
  need(o.tokens_per_block == 8 || o.tokens_per_block == 16 || o.tokens_per_block == 32 ||
           o.tokens_per_block == 64 || o.tokens_per_block == 128,
       "--page", "8, 16, 32, 64 or 128", o.tokens_per_block);
  need(o.min_output_len >= 1 && o.max_output_len >= o.min_output_len,
       "--min-output-len / --max-output-len", "1 <= min <= max",
       std::to_string(o.min_output_len) + ".." + std::to_string(o.max_output_len));
  need(o.beam_fraction >= 0 && o.beam_fraction <= 1, "--beam-fraction", "in [0, 1]",
       o.beam_fraction);
  need(o.beam_width >= 1, "--beam-width", ">= 1", o.beam_width);
  need(o.vocab >= 2, "vocab", ">= 2", o.vocab);
  need(o.max_batch_requests >= 1, "--max-batch-requests", ">= 1", o.max_batch_requests);
  need(o.max_batch_tokens >= o.tokens_per_block, "--max-batch-tokens",
       ">= --page (" + std::to_string(o.tokens_per_block) + ")", o.max_batch_tokens);
  need(o.max_batch_tokens >= o.beam_width, "--max-batch-tokens", ">= --beam-width",
       o.max_batch_tokens);
  need(o.check_every >= 0, "--check-every", ">= 0 (0 = never)", o.check_every);
  need(o.check_max_seqs >= 0, "--check-seqs", ">= 0 (0 = all)", o.check_max_seqs);
  need(o.check_rows >= 0, "--check-rows", ">= 0 (0 = all)", o.check_rows);
  need(o.check_threads >= 0 && o.check_threads <= 1024, "--check-threads",
       "in [0, 1024] (0 = inline)", o.check_threads);
  need(o.host_cache_mb >= 0 && std::isfinite(o.host_cache_mb), "--host-cache-mb",
       "a finite number >= 0", o.host_cache_mb);
  need(o.cache_tokens >= 0, "--cache-tokens", ">= 0", o.cache_tokens);
  need(o.kv_dtype == DType::kBF16 || o.kv_dtype == DType::kF16 || o.kv_dtype == DType::kFp8E4M3 ||
           o.kv_dtype == DType::kInt8,
       "--kv-dtype", "bf16, f16, fp8_e4m3 or int8", dtype_name(o.kv_dtype));
  need(o.device.is_cuda() || o.cache_tokens > 0, "--cache-tokens",
       "> 0 on the CPU (the pool needs an explicit size)", o.cache_tokens);
}

// The rotated Q of the queried positions and a fresh contiguous cache with the K/V of a whole
// history, written by the reference's append_kv: what a check compares forward() against.
struct CheckCache {
  std::vector<uint8_t> kv;
  std::vector<int32_t> seq_len = {0};
  std::vector<float> scale = {1.0f};
  std::vector<uint16_t> q_rot;  // [queries, Hq, D] bf16
  KvCacheView view;
};

class Engine {
 public:
  explicit Engine(const ReplayOptions& o);
  ReplayResult run();

 private:
  void check_fits(const TraceRequest& r, int64_t index) const;
  bool admit(Running& r);
  void schedule(std::vector<Group>& groups);
  void build(Group& g);
  void launch(Group& g, size_t slot, bool check);
  void complete(Group& g);
  void sample(Group& g);
  std::vector<CheckItem> check_items(const Group& g, int32_t layer) const;
  void dispatch_check(CheckItem item);
  CheckOutcome run_check(const CheckItem& item) const;
  void fill_check_cache(const CheckItem& item, CheckCache& c) const;
  std::vector<float> attend(const CheckItem& item, CheckCache& c, DType out_dtype) const;
  std::vector<float> naive_attend(const CheckItem& item, const CheckCache& c) const;
  KvCacheView cache_view(int32_t layer, size_t table_offset, size_t lens_offset, int64_t rows);
  void finish(Running& r);

  const ReplayOptions& o_;
  Activations act_;
  std::vector<TraceRequest> trace_;
  AttentionSpec spec_;
  int32_t max_seq_ = 0;
  int32_t max_blocks_ = 0;
  int64_t row_elems_ = 0;  // Hq * D: one output row
  float scale_host_ = 1.0f;

  // Execution: the stream (declared before the manager, which synchronizes it when destroyed),
  // the device buffers shared by the batches of a step (stream order keeps them apart), one slot
  // of host staging per batch of a step.
  Stream stream_;
  Buffer qkv_;        // CUDA: [layers, tokens, width]; CPU: one layer
  Buffer out_last_;   // [tokens, Hq, D]: the last layer's output
  Buffer out_check_;  // the checked layer's, when that is not the last
  Buffer meta_;       // the upload: tokens, positions, block table, lengths, indirection (int32)
  Buffer scale_;      // fp8 / int8 cache scale
  Buffer forward_workspace_;
  std::unique_ptr<DecodeWorkspace> decode_workspace_;
  std::vector<std::unique_ptr<BatchSlot>> slots_;
  std::unique_ptr<KvCacheManager> cache_;

  std::deque<Running> waiting_;
  std::vector<std::unique_ptr<Running>> running_;
  int64_t reserved_blocks_ = 0;
  SeqId next_seq_ = 0;
  int64_t check_counter_ = 0;
  ReplayResult res_;

  // Checks: outcomes in submission order (a deque: the pool's jobs hold pointers to theirs), and
  // the pool, declared last so that its destructor finishes the jobs before anything they read
  // is destroyed.
  std::deque<CheckOutcome> outcomes_;
  std::unique_ptr<CheckPool> pool_;
};

// Blocks a request can hold at most: every beam's whole history plus a copied partial block.
int64_t blocks_needed(const TraceRequest& r, int32_t tokens_per_block) {
  const int64_t tokens = static_cast<int64_t>(r.prompt.size()) + r.output_len;
  return int64_t{r.beam_width} * ((tokens + tokens_per_block - 1) / tokens_per_block + 1);
}

// int32 offsets of the metadata upload, each part 256-byte aligned.
constexpr int64_t kMetaAlign = 64;
int64_t meta_align(int64_t n) { return (n + kMetaAlign - 1) / kMetaAlign * kMetaAlign; }

// Bytes of forward()'s workspace for up to `tokens` tokens and `requests` requests (the layout
// forward() documents: rotated Q, then int32 metadata, each part aligned to 256 bytes).
int64_t forward_workspace_bytes(int64_t tokens, int64_t requests, int64_t q_row_bytes) {
  auto align = [](int64_t b) { return (b + 255) / 256 * 256; };
  return align(tokens * q_row_bytes) + align((requests + 1) * 4) + align(requests * 4) +
         2 * align(tokens * 4);
}

Engine::Engine(const ReplayOptions& o)
    : o_(o), act_(o), trace_((validate_options(o), make_trace(o))), stream_(o.device) {
  spec_.num_q_heads = o.num_q_heads;
  spec_.num_kv_heads = o.num_kv_heads;
  spec_.head_dim = o.head_dim;
  spec_.mask.kind = MaskKind::kCausal;
  spec_.backend = o.device.is_cpu() ? Backend::kVanilla : o.backend;
  // Llama 3.1's RoPE: base 500000 with the llama3 frequency scaling.
  spec_.rope.style = RopeStyle::kGptNeox;
  spec_.rope.base = 500000.0;
  spec_.rope.scaling = RopeScaling::kLlama3;
  spec_.rope.factor = 8.0;
  spec_.validate();
  row_elems_ = int64_t{o.num_q_heads} * o.head_dim;

  max_seq_ = o.system_prompt_len + std::max(o.min_user_len, o.max_user_len) +
             std::max(o.min_output_len, o.max_output_len) + 1;
  max_blocks_ = (max_seq_ + o.tokens_per_block - 1) / o.tokens_per_block;

  // Per-tensor scales for quantized caches: |K|, |V| <= sqrt(2) after RoPE, so amax maps to
  // the top of the range.
  const float scale = o.kv_dtype == DType::kFp8E4M3 ? 1.5f / 448.0f
                      : o.kv_dtype == DType::kInt8  ? 1.5f / 127.0f
                                                    : 1.0f;
  scale_host_ = scale;
  const bool quantized = o.kv_dtype == DType::kFp8E4M3 || o.kv_dtype == DType::kInt8;

  if (o.device.is_cuda()) {
    // Everything a step needs on the device, sized for the largest batch before the pool takes
    // its fraction of the free memory: a batch has at most max_batch_requests requests of up to
    // beam_width rows, and its tokens are the chunk budget plus the generation rows.
    const int64_t rows = int64_t{o.max_batch_requests} * o.beam_width;
    const int64_t tokens = int64_t{o.max_batch_tokens} + rows;
    const int64_t indirection =
        o.beam_width > 1 ? int64_t{o.max_batch_requests} * o.beam_width * max_seq_ : 0;
    const int64_t row_bytes = row_elems_ * 2;
    qkv_ =
        Buffer(o.device, false, static_cast<size_t>(int64_t{o.layers} * tokens * act_.width() * 2));
    out_last_ = Buffer(o.device, false, static_cast<size_t>(tokens * row_bytes));
    out_check_ = Buffer(o.device, false, static_cast<size_t>(tokens * row_bytes));
    meta_ =
        Buffer(o.device, false,
               static_cast<size_t>(4 * (2 * meta_align(tokens) + meta_align(rows * max_blocks_) +
                                        meta_align(rows) + meta_align(indirection))));
    forward_workspace_ = Buffer(
        o.device, false,
        static_cast<size_t>(forward_workspace_bytes(tokens, o.max_batch_requests, row_bytes)));
    // Split-KV partials for up to 32 splits of every row: calls with few rows split more, but
    // then splits x rows stays far below this (docs/decode_design.md, the split heuristic).
    decode_workspace_ = std::make_unique<DecodeWorkspace>(spec_, rows, 32, o.device);
  }
  if (quantized) {
    scale_ = Buffer(o.device, false, sizeof(float));
    stream_.copy(scale_.data(), &scale, sizeof(float));
  }

  KvCacheManagerConfig c;
  c.num_layers = o.layers;
  c.num_kv_heads = o.num_kv_heads;
  c.head_dim = o.head_dim;
  c.tokens_per_block = o.tokens_per_block;
  c.dtype = o.kv_dtype;
  c.device = o.device;
  c.max_tokens = o.cache_tokens;
  c.max_seq_len = max_seq_;
  c.enable_prefix_reuse = o.prefix_reuse;
  c.stream = stream_.handle();
  const int64_t block_bytes = int64_t{o.layers} * 2 * o.num_kv_heads * o.tokens_per_block *
                              o.head_dim * static_cast<int64_t>(dtype_size(o.kv_dtype));
  c.host_cache_bytes =
      o.host_cache_mb > 0
          ? std::max<int64_t>(static_cast<int64_t>(o.host_cache_mb * 1048576.0), block_bytes)
          : 0;
  cache_ = std::make_unique<KvCacheManager>(c);
  ATTNKIT_CHECK(cache_->max_blocks_per_seq() == max_blocks_, "replay: block-table width ",
                cache_->max_blocks_per_seq(), " differs from the engine's ", max_blocks_);
  for (size_t i = 0; i < trace_.size(); ++i) check_fits(trace_[i], static_cast<int64_t>(i));
  stream_.synchronize();
#if defined(ATTNKIT_WITH_CUDA)
  // The workspace's and the pool's initialization ran outside the stream.
  if (o.device.is_cuda()) cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
#endif
  res_.check_threads = o.check_threads;
  if (o.check_threads > 0) pool_ = std::make_unique<CheckPool>(o.check_threads);
}

void Engine::check_fits(const TraceRequest& r, int64_t index) const {
  const int64_t need = blocks_needed(r, o_.tokens_per_block);
  ATTNKIT_CHECK(need <= cache_->num_blocks(),
                "replay: --cache-tokens must hold the largest request: request ", index,
                " needs up to ", need, " blocks (", r.prompt.size(), " prompt + ", r.output_len,
                " output tokens x ", r.beam_width, " beams), the pool has ", cache_->num_blocks(),
                " blocks of ", o_.tokens_per_block, " tokens");
}
bool Engine::admit(Running& r) {
  const int64_t need = blocks_needed(*r.request, o_.tokens_per_block);
  if (reserved_blocks_ + need > cache_->num_blocks()) return false;
  r.reserved_blocks = need;
  reserved_blocks_ += need;
  return true;
}

void Engine::finish(Running& r) {
  // Order-independent over requests, so that schedules that must give the same tokens (chunk
  // sizes, prefix reuse on or off, host tier) give the same digest.
  uint64_t h = mix64(uint64_t(r.index));
  for (const auto& beam : r.history) h = hash_bytes(beam.data(), beam.size() * sizeof(int32_t), h);
  res_.trace_digest += mix64(h);
  for (SeqId s : r.seqs) cache_->release(s);
  r.seqs.clear();
  r.done = true;
  reserved_blocks_ -= r.reserved_blocks;
  ++res_.requests;
}

// Generation requests first (each needs its beam_width tokens), then context chunks in arrival
// order from the remaining budget; every chunk but a prompt's last is a multiple of the page.
void Engine::schedule(std::vector<Group>& groups) {
  groups.clear();
  groups.emplace_back();  // context + greedy generation
  int64_t budget = o_.max_batch_tokens;
  for (auto& rp : running_) {
    Running& r = *rp;
    if (r.in_context) continue;
    const int32_t w = r.request->beam_width;
    if (w == 1) {
      groups[0].generation.push_back(&r);
    } else {
      auto it = std::find_if(groups.begin() + 1, groups.end(),
                             [&](const Group& g) { return g.beam_width == w; });
      if (it == groups.end()) {
        groups.emplace_back();
        groups.back().beam_width = w;
        it = groups.end() - 1;
      }
      it->generation.push_back(&r);
    }
    budget -= w;
  }
  const int64_t page = o_.tokens_per_block;
  for (auto& rp : running_) {
    Running& r = *rp;
    if (!r.in_context || budget <= 0) continue;
    const auto& prompt = r.request->prompt;
    int64_t start = r.computed;
    if (!r.added && o_.prefix_reuse) start = cache_->probe_prefix(prompt);
    const int64_t remaining = static_cast<int64_t>(prompt.size()) - start;
    const int64_t n = remaining <= budget ? remaining : budget / page * page;
    if (n <= 0) continue;
    const std::span<const int32_t> upto(prompt.data(), static_cast<size_t>(start + n));
    if (!r.added) {
      r.seqs = {next_seq_++};
      const int64_t cached = cache_->add(r.seqs[0], upto);
      r.added = true;
      r.computed = cached;
      res_.reused_tokens += cached;
    } else {
      cache_->append(r.seqs[0], upto.subspan(static_cast<size_t>(start)));
    }
    const int64_t chunk = start + n - r.computed;
    groups[0].context.push_back(&r);
    groups[0].chunk.push_back(chunk);
    budget -= chunk;
  }
  for (Group& g : groups) {
    for (Running* r : g.generation) {
      for (size_t b = 0; b < r->seqs.size(); ++b) {
        cache_->append(r->seqs[b], std::span<const int32_t>(&r->history[b].back(), 1));
      }
    }
  }
  std::erase_if(groups, [](const Group& g) { return g.context.empty() && g.generation.empty(); });
}

void Engine::build(Group& g) {
  g.cu_seqlens = {0};
  for (size_t i = 0; i < g.context.size(); ++i) {
    Running& r = *g.context[i];
    g.rows.push_back(r.seqs[0]);
    g.past_lens.push_back(static_cast<int32_t>(r.computed));
    for (int64_t t = 0; t < g.chunk[i]; ++t) {
      g.tokens.push_back(r.request->prompt[static_cast<size_t>(r.computed + t)]);
      g.positions.push_back(static_cast<int32_t>(r.computed + t));
    }
    g.cu_seqlens.push_back(static_cast<int32_t>(g.tokens.size()));
  }
  for (Running* r : g.generation) {
    const int64_t past = static_cast<int64_t>(r->history[0].size()) - 1;
    g.past_lens.push_back(static_cast<int32_t>(past));
    for (size_t b = 0; b < r->seqs.size(); ++b) {
      g.rows.push_back(r->seqs[b]);
      g.tokens.push_back(r->history[b].back());
      g.positions.push_back(static_cast<int32_t>(past));
    }
    g.cu_seqlens.push_back(static_cast<int32_t>(g.tokens.size()));
  }
}

KvCacheView Engine::cache_view(int32_t layer, size_t table_offset, size_t lens_offset,
                               int64_t rows) {
  const TensorView table_view =
      view_of(meta_, o_.device, DType::kInt32, {rows, max_blocks_}, table_offset);
  const TensorView lens_view = view_of(meta_, o_.device, DType::kInt32, {rows}, lens_offset);
  KvCacheView v = cache_->layer_view(layer, table_view, lens_view);
  if (scale_.data()) {
    v.k_scale = view_of(scale_, o_.device, DType::kF32, {1});
    v.v_scale = v.k_scale;
  }
  return v;
}

// Enqueues the copies of rows `tokens` (ascending) of a [tokens, row_elems] bf16 buffer into
// `dst`, one copy per run of consecutive rows.
void copy_rows(const Stream& stream, const Buffer& src, const std::vector<int64_t>& tokens,
               int64_t row_elems, uint16_t* dst) {
  for (size_t i = 0; i < tokens.size();) {
    size_t j = i + 1;
    while (j < tokens.size() && tokens[j] == tokens[j - 1] + 1) ++j;
    stream.copy(dst + static_cast<int64_t>(i) * row_elems,
                src.as<uint16_t>() + tokens[i] * row_elems,
                (j - i) * static_cast<size_t>(row_elems) * sizeof(uint16_t));
    i = j;
  }
}

void Engine::launch(Group& g, size_t slot_index, bool check) {
  build(g);
  const int64_t n = g.num_tokens();
  const int64_t rows = static_cast<int64_t>(g.rows.size());
  const int64_t width = act_.width();
  const int64_t num_generation = static_cast<int64_t>(g.generation.size());
  const Device dev = o_.device;
  const bool cuda = stream_.cuda();
  while (slots_.size() <= slot_index) {
    auto slot = std::make_unique<BatchSlot>();
    slot->upload = Buffer(dev, true);
    slot->download = Buffer(dev, true);
    if (cuda) slot->timer = std::make_unique<ForwardTimer>();
    slots_.push_back(std::move(slot));
  }
  BatchSlot& slot = *slots_[slot_index];
  g.slot = slot_index;

  // What the checks of this batch compare, taken before sampling changes the histories.
  const int32_t check_layer =
      check ? static_cast<int32_t>((o_.seed + 7 * check_counter_++) % o_.layers) : -1;
  if (check_layer >= 0) g.checks = check_items(g, check_layer);

  // Metadata, staged on the host and copied in one piece: tokens, positions, the block table and
  // lengths (from the manager), the beam indirection.
  const int64_t indirection = g.beam_width > 1 ? num_generation * g.beam_width * max_seq_ : 0;
  const int64_t positions_at = meta_align(n);
  const int64_t table_at = positions_at + meta_align(n);
  const int64_t lens_at = table_at + meta_align(rows * max_blocks_);
  const int64_t indirection_at = lens_at + meta_align(rows);
  const auto meta_bytes = static_cast<size_t>(4 * (indirection_at + meta_align(indirection)));
  slot.upload.ensure(meta_bytes);
  int32_t* up = slot.upload.as<int32_t>();
  std::copy(g.tokens.begin(), g.tokens.end(), up);
  std::copy(g.positions.begin(), g.positions.end(), up + positions_at);
  cache_->fill_block_tables(g.rows, up + table_at, max_blocks_, up + lens_at);
  if (indirection > 0) {
    const std::vector<SeqId> beams(g.rows.begin() + static_cast<int64_t>(g.context.size()),
                                   g.rows.end());
    const std::vector<int32_t> ind = cache_->cache_indirection(beams, g.beam_width, max_seq_);
    std::copy(ind.begin(), ind.end(), up + indirection_at);
  }
  meta_.ensure(meta_bytes);
  stream_.copy(meta_.data(), up, meta_bytes);

  // Outputs, poisoned with NaN so that elements forward() leaves unwritten fail.
  const auto out_bytes = static_cast<size_t>(n * row_elems_) * 2;
  const bool separate_check = check_layer >= 0 && check_layer != o_.layers - 1;
  out_last_.ensure(out_bytes);
  stream_.fill(out_last_.data(), 0xff, out_bytes);
  if (separate_check) {
    out_check_.ensure(out_bytes);
    stream_.fill(out_check_.data(), 0xff, out_bytes);
  }
  const Buffer& out_checked = separate_check ? out_check_ : out_last_;

  ForwardArgs a;
  a.num_context = static_cast<int32_t>(g.context.size());
  a.beam_width = g.beam_width;
  a.cu_seqlens_q =
      TensorView(g.cu_seqlens.data(), DType::kInt32, {static_cast<int64_t>(g.cu_seqlens.size())});
  a.past_lens =
      TensorView(g.past_lens.data(), DType::kInt32, {static_cast<int64_t>(g.past_lens.size())});
  if (indirection > 0) {
    a.cache_indirection =
        view_of(meta_, dev, DType::kInt32, {num_generation, g.beam_width, max_seq_},
                static_cast<size_t>(4 * indirection_at));
  }
  if (cuda) {
    a.workspace = TensorView(forward_workspace_.data(), DType::kInt8,
                             {static_cast<int64_t>(forward_workspace_.bytes())}, dev);
    a.decode_workspace = decode_workspace_.get();
  }
  const size_t layer_bytes = static_cast<size_t>(n * width) * 2;
  auto set_layer = [&](int32_t l, size_t qkv_offset) {
    a.qkv = view_of(qkv_, dev, DType::kBF16, {n, width}, qkv_offset);
    a.kv_cache =
        cache_view(l, static_cast<size_t>(4 * table_at), static_cast<size_t>(4 * lens_at), rows);
    const Buffer& out = l == check_layer ? out_checked : out_last_;
    a.out = view_of(out, dev, DType::kBF16, {n, o_.num_q_heads, o_.head_dim});
  };

  g.forward_seconds = 0;
  if (cuda) {
#if defined(ATTNKIT_WITH_CUDA)
    // Every layer's activations on the device, then the layers between the two events.
    qkv_.ensure(layer_bytes * static_cast<size_t>(o_.layers));
    generate_activations_cuda(meta_.as<int32_t>(), meta_.as<int32_t>() + positions_at, n, o_.layers,
                              width, act_.seed_key(), qkv_.as<uint16_t>(), stream_.handle());
    slot.timer->start(stream_);
    for (int32_t l = 0; l < o_.layers; ++l) {
      set_layer(l, layer_bytes * static_cast<size_t>(l));
      forward(spec_, a, stream_.handle());
    }
    slot.timer->stop(stream_);
#endif
  } else {
    // The host makes one layer at a time from the tokens' base rows, outside the timed calls.
    std::vector<uint16_t> base(static_cast<size_t>(n * width));
    for (int64_t t = 0; t < n; ++t) {
      act_.base_row(g.tokens[t], g.positions[t], base.data() + t * width);
    }
    qkv_.ensure(layer_bytes);
    for (int32_t l = 0; l < o_.layers; ++l) {
      for (int64_t t = 0; t < n; ++t) {
        act_.layer_row(base.data() + t * width, l, qkv_.as<uint16_t>() + t * width);
      }
      set_layer(l, 0);
      const auto t0 = Clock::now();
      forward(spec_, a, stream_.handle());
      g.forward_seconds += seconds_since(t0);
    }
  }

  // The rows the host reads: the last token of each prompt this chunk completes and every
  // generation row (sampling), and the checked queries' rows of the checked layer.
  g.sampled = HostRows{};
  g.checked = HostRows{};
  for (size_t i = 0; i < g.context.size(); ++i) {
    const Running& r = *g.context[i];
    if (r.computed + g.chunk[i] == static_cast<int64_t>(r.request->prompt.size())) {
      g.sampled.tokens.push_back(g.cu_seqlens[i + 1] - 1);
    }
  }
  for (int64_t t = g.num_context_tokens(); t < n; ++t) g.sampled.tokens.push_back(t);
  for (const CheckItem& item : g.checks) {
    g.checked.tokens.insert(g.checked.tokens.end(), item.tokens.begin(), item.tokens.end());
  }
  std::sort(g.checked.tokens.begin(), g.checked.tokens.end());
  g.checked.tokens.erase(std::unique(g.checked.tokens.begin(), g.checked.tokens.end()),
                         g.checked.tokens.end());
  const size_t sampled_rows = g.sampled.tokens.size();
  slot.download.ensure((sampled_rows + g.checked.tokens.size()) * static_cast<size_t>(row_elems_) *
                       2);
  uint16_t* down = slot.download.as<uint16_t>();
  copy_rows(stream_, out_last_, g.sampled.tokens, row_elems_, down);
  copy_rows(stream_, out_checked, g.checked.tokens, row_elems_,
            down + static_cast<int64_t>(sampled_rows) * row_elems_);
  g.sampled.data = down;
  g.checked.data = down + static_cast<int64_t>(sampled_rows) * row_elems_;
  g.sampled.row_elems = g.checked.row_elems = row_elems_;
}

// After the step's stream has been waited for: timings, checks, sampling.
void Engine::complete(Group& g) {
#if defined(ATTNKIT_WITH_CUDA)
  if (stream_.cuda()) g.forward_seconds = slots_[g.slot]->timer->seconds();
#endif
  ++res_.forward_calls;
  res_.forward_seconds += g.forward_seconds;

  // Split the time between prefill and decode by attention work (query x key pairs).
  double context_work = 0, generation_work = 0;
  for (size_t i = 0; i < g.context.size(); ++i) {
    const double past = static_cast<double>(g.context[i]->computed);
    const double c = static_cast<double>(g.chunk[i]);
    context_work += c * past + c * (c + 1) / 2;
  }
  for (Running* r : g.generation) {
    generation_work +=
        static_cast<double>(r->seqs.size()) * static_cast<double>(r->history[0].size());
  }
  const double total_work = context_work + generation_work;
  if (total_work > 0) {
    res_.prefill_seconds += g.forward_seconds * context_work / total_work;
    res_.decode_seconds += g.forward_seconds * generation_work / total_work;
  }

  const size_t row_bytes = static_cast<size_t>(row_elems_) * 2;
  for (size_t k = 0; k < g.checks.size(); ++k) {
    CheckItem& item = g.checks[k];
    item.got.resize(item.tokens.size() * static_cast<size_t>(row_elems_));
    for (size_t q = 0; q < item.tokens.size(); ++q) {
      std::memcpy(item.got.data() + q * static_cast<size_t>(row_elems_),
                  g.checked.row(item.tokens[q]), row_bytes);
    }
    // --inject-fault: the top exponent bit of one element, a change no tolerance absorbs.
    if (o_.inject_fault && k == 0 && !item.got.empty()) item.got[item.got.size() / 2] ^= 0x4000;
    dispatch_check(std::move(item));
  }
  g.checks.clear();
  sample(g);
}

void Engine::sample(Group& g) {
  auto out_row = [&](int64_t token) { return g.sampled.row(token); };
  auto record = [&](int32_t) { ++res_.generated_tokens; };
  for (size_t i = 0; i < g.context.size(); ++i) {
    Running& r = *g.context[i];
    r.computed += g.chunk[i];
    res_.computed_prompt_tokens += g.chunk[i];
    ++res_.context_chunks;
    if (r.computed < static_cast<int64_t>(r.request->prompt.size())) continue;
    // Prompt done: the last token's output gives each beam its first token.
    const int64_t last = g.cu_seqlens[i + 1] - 1;
    r.in_context = false;
    const int32_t w = r.request->beam_width;
    for (int32_t b = 0; b < w; ++b) {
      r.history.push_back(r.request->prompt);
      const int32_t token = sample_token(out_row(last), row_elems_, uint64_t(b), o_.vocab);
      r.history.back().push_back(token);
      record(token);
      if (b > 0) {
        r.seqs.push_back(next_seq_++);
        cache_->fork(r.seqs[0], r.seqs.back());
      }
    }
    r.generated = 1;
  }
  int64_t token = g.num_context_tokens();
  for (Running* r : g.generation) {
    const int32_t w = r->request->beam_width;
    if (w == 1) {
      const int32_t next = sample_token(out_row(token), row_elems_, 0, o_.vocab);
      r->history[0].push_back(next);
      record(next);
    } else {
      // Synthetic beam search: rank beams by a hash of their output; the better half each
      // continue into two beams, so histories get reordered through reorder_beams().
      std::vector<uint64_t> score(static_cast<size_t>(w));
      for (int32_t b = 0; b < w; ++b) {
        score[b] = hash_bytes(out_row(token + b), static_cast<size_t>(row_elems_) * 2, 0x5eed);
      }
      std::vector<int32_t> rank(static_cast<size_t>(w));
      for (int32_t b = 0; b < w; ++b) rank[b] = b;
      std::stable_sort(rank.begin(), rank.end(),
                       [&](int32_t x, int32_t y) { return score[x] > score[y]; });
      const int32_t keep = (w + 1) / 2;
      std::vector<int32_t> parents(static_cast<size_t>(w));
      std::vector<std::vector<int32_t>> history(static_cast<size_t>(w));
      for (int32_t b = 0; b < w; ++b) {
        parents[b] = rank[b % keep];
        history[b] = r->history[parents[b]];
        const int32_t next =
            sample_token(out_row(token + parents[b]), row_elems_, uint64_t(b) + 1, o_.vocab);
        history[b].push_back(next);
        record(next);
      }
      cache_->reorder_beams(r->seqs, parents);
      r->history = std::move(history);
    }
    token += w;
    res_.decode_tokens += w;
    ++r->generated;
  }
}

// ---- checks ------------------------------------------------------------------------------------

// The sequences of a checked batch: each context chunk (its queried rows: all, or --check-rows
// evenly spaced with the chunk's last) and each beam of each generation request; with
// --check-seqs, an evenly spaced subset of them.
std::vector<CheckItem> Engine::check_items(const Group& g, int32_t layer) const {
  const std::string at = "step " + std::to_string(res_.steps) + " layer " + std::to_string(layer);
  std::vector<CheckItem> items;
  for (size_t i = 0; i < g.context.size(); ++i) {
    const Running& r = *g.context[i];
    const auto& prompt = r.request->prompt;
    const int64_t begin = r.computed, chunk = g.chunk[i];
    CheckItem item;
    item.what = at + " request " + std::to_string(r.index) + " context chunk";
    item.layer = layer;
    item.history.assign(prompt.begin(), prompt.begin() + (begin + chunk));
    const int64_t checked = o_.check_rows > 0 ? std::min<int64_t>(o_.check_rows, chunk) : chunk;
    item.contiguous = checked == chunk;
    for (int64_t k = 0; k < checked; ++k) {
      const int64_t p = item.contiguous ? begin + k : begin + (k + 1) * chunk / checked - 1;
      item.queries.push_back(p);
      item.tokens.push_back(g.cu_seqlens[i] + (p - begin));
    }
    items.push_back(std::move(item));
  }
  for (size_t i = 0; i < g.generation.size(); ++i) {
    const Running& r = *g.generation[i];
    const int64_t first = g.cu_seqlens[g.context.size() + i];
    for (size_t b = 0; b < r.history.size(); ++b) {
      CheckItem item;
      item.what = at + " request " + std::to_string(r.index) + " beam " + std::to_string(b);
      item.layer = layer;
      item.history = r.history[b];
      item.queries = {static_cast<int64_t>(item.history.size()) - 1};
      item.generation = true;
      item.contiguous = true;
      item.tokens = {first + static_cast<int64_t>(b)};
      items.push_back(std::move(item));
    }
  }
  // With a limit, an evenly spaced subset (the host-side recomputation is the slow part on GPUs).
  const size_t count = o_.check_max_seqs > 0
                           ? std::min(static_cast<size_t>(o_.check_max_seqs), items.size())
                           : items.size();
  if (count == items.size()) return items;
  std::vector<CheckItem> subset;
  for (size_t k = 0; k < count; ++k) subset.push_back(std::move(items[k * items.size() / count]));
  return subset;
}

void Engine::dispatch_check(CheckItem item) {
  outcomes_.emplace_back();
  CheckOutcome* outcome = &outcomes_.back();
  if (!pool_) {
    const auto t0 = Clock::now();
    *outcome = run_check(item);
    res_.check_seconds += seconds_since(t0);
    return;
  }
  res_.check_seconds +=
      pool_->submit([this, outcome, item = std::move(item)] { *outcome = run_check(item); });
}

// The check's cache: append_kv of the whole history into a fresh contiguous cache, then the
// queried positions' rotated Q. Only the queries need this layer's Q heads: the K/V of every
// position go through append_kv under a spec with Hkv query heads (their rotated Q is dropped),
// which keeps the reference's RoPE work to the K heads on long histories; the queried positions
// then go through append_kv under the replay's spec, writing their K/V again with the same bits.
void Engine::fill_check_cache(const CheckItem& item, CheckCache& c) const {
  const auto& history = item.history;
  const int64_t len = static_cast<int64_t>(history.size());
  const int64_t width = act_.width();
  const int32_t hq = o_.num_q_heads, hkv = o_.num_kv_heads, d = o_.head_dim;
  const int64_t kv_width = int64_t{hkv} * d;
  const size_t elt = dtype_size(o_.kv_dtype);
  const int64_t half = kv_width * len;
  c.kv.assign(static_cast<size_t>(2 * half) * elt, 0);
  c.seq_len = {static_cast<int32_t>(len)};
  c.scale = {scale_host_};
  KvCacheView& cache = c.view;
  cache.k_base = c.kv.data();
  cache.v_base = c.kv.data() + half * elt;
  cache.block_stride_bytes = static_cast<int64_t>(2 * half * elt);
  cache.num_blocks = 1;
  cache.dtype = o_.kv_dtype;
  cache.num_kv_heads = hkv;
  cache.tokens_per_block = static_cast<int32_t>(len);
  cache.head_dim = d;
  cache.paged = false;
  cache.seq_lens = TensorView(c.seq_len.data(), DType::kInt32, {1});
  if (scale_.data()) {
    cache.k_scale = TensorView(c.scale.data(), DType::kF32, {1});
    cache.v_scale = cache.k_scale;
  }
  AttentionSpec ref_spec = spec_;
  ref_spec.backend = Backend::kVanilla;

  std::vector<uint16_t> k(static_cast<size_t>(half)), v(static_cast<size_t>(half));
  std::vector<uint16_t> q(static_cast<size_t>(half), 0), q_dropped(static_cast<size_t>(half));
  std::vector<int32_t> positions(static_cast<size_t>(len)), row_of(static_cast<size_t>(len), 0);
  for (int64_t t = 0; t < len; ++t) {
    const auto position = static_cast<int32_t>(t);
    positions[t] = position;
    act_.layer_elements(history[t], position, item.layer, int64_t{hq} * d, kv_width,
                        k.data() + t * kv_width);
    act_.layer_elements(history[t], position, item.layer, int64_t{hq} * d + kv_width, kv_width,
                        v.data() + t * kv_width);
  }
  AttentionSpec kv_spec = ref_spec;
  kv_spec.num_q_heads = hkv;
  AppendKvArgs kv_args;
  kv_args.q = TensorView(q.data(), DType::kBF16, {len, hkv, d});
  kv_args.k = TensorView(k.data(), DType::kBF16, {len, hkv, d});
  kv_args.v = TensorView(v.data(), DType::kBF16, {len, hkv, d});
  kv_args.positions = TensorView(positions.data(), DType::kInt32, {len});
  kv_args.row_of_token = TensorView(row_of.data(), DType::kInt32, {len});
  kv_args.kv_cache = cache;
  kv_args.q_out = TensorView(q_dropped.data(), DType::kBF16, {len, hkv, d});
  append_kv(kv_spec, kv_args);

  const auto nq = static_cast<int64_t>(item.queries.size());
  std::vector<uint16_t> qkv(static_cast<size_t>(nq * width));
  std::vector<int32_t> q_positions(static_cast<size_t>(nq)), q_rows(static_cast<size_t>(nq), 0);
  for (int64_t j = 0; j < nq; ++j) {
    const auto p = static_cast<int32_t>(item.queries[j]);
    q_positions[j] = p;
    act_.layer_elements(history[p], p, item.layer, 0, width, qkv.data() + j * width);
  }
  c.q_rot.assign(static_cast<size_t>(nq * hq * d), 0);
  AppendKvArgs q_args;
  q_args.qkv = TensorView(qkv.data(), DType::kBF16, {nq, width});
  q_args.positions = TensorView(q_positions.data(), DType::kInt32, {nq});
  q_args.row_of_token = TensorView(q_rows.data(), DType::kInt32, {nq});
  q_args.kv_cache = cache;
  q_args.q_out = TensorView(c.q_rot.data(), DType::kBF16, {nq, hq, d});
  append_kv(ref_spec, q_args);
}

// The reference's output for the item's queries in `out_dtype` (queries in out_dtype too: f32
// holds the bf16 values exactly): decode for a generation row, as forward() does; one prefill
// for contiguous queries; else one prefill per query over the keys up to it.
std::vector<float> Engine::attend(const CheckItem& item, CheckCache& c, DType out_dtype) const {
  const int32_t hq = o_.num_q_heads, d = o_.head_dim;
  const auto nq = static_cast<int64_t>(item.queries.size());
  const int64_t len = static_cast<int64_t>(item.history.size());
  const int64_t q_elems = nq * hq * d;
  const size_t row_bytes = static_cast<size_t>(hq * d) * dtype_size(out_dtype);
  std::vector<uint8_t> q(static_cast<size_t>(q_elems) * dtype_size(out_dtype));
  std::vector<uint8_t> out(q.size());
  for (int64_t i = 0; i < q_elems; ++i) {
    detail::store_from_float(q.data(), out_dtype, i,
                             detail::load_as_float(c.q_rot.data(), DType::kBF16, i));
  }
  std::memset(out.data(), 0xff, out.size());
  AttentionSpec ref_spec = spec_;
  ref_spec.backend = Backend::kVanilla;
  auto prefill_rows = [&](int64_t first, int64_t count, int64_t kv_len) {
    c.seq_len[0] = static_cast<int32_t>(kv_len);
    std::vector<int32_t> cu = {0, static_cast<int32_t>(count)};
    PrefillArgs pa;
    pa.q = TensorView(q.data() + first * row_bytes, out_dtype, {count, hq, d});
    pa.cu_seqlens_q = TensorView(cu.data(), DType::kInt32, {2});
    pa.kv_cache = &c.view;
    pa.out = TensorView(out.data() + first * row_bytes, out_dtype, {count, hq, d});
    prefill(ref_spec, pa);
  };
  if (item.generation) {
    c.seq_len[0] = static_cast<int32_t>(len);
    DecodeArgs da;
    da.q = TensorView(q.data(), out_dtype, {1, hq, d});
    da.kv_cache = c.view;
    da.out = TensorView(out.data(), out_dtype, {1, hq, d});
    decode(ref_spec, da);
  } else if (item.contiguous) {
    prefill_rows(0, nq, len);
  } else {
    for (int64_t j = 0; j < nq; ++j) prefill_rows(j, 1, item.queries[j] + 1);
  }
  std::vector<float> result(static_cast<size_t>(q_elems));
  for (int64_t i = 0; i < q_elems; ++i) result[i] = detail::load_as_float(out.data(), out_dtype, i);
  return result;
}

// A naive bf16 computation (f32 scores, P rounded to bf16, f32 accumulation, bf16 output) from
// the same rotated Q and cache: the yardstick of docs/testing.md.
std::vector<float> Engine::naive_attend(const CheckItem& item, const CheckCache& c) const {
  const int32_t hq = o_.num_q_heads, hkv = o_.num_kv_heads, d = o_.head_dim;
  const int64_t len = static_cast<int64_t>(item.history.size());
  const auto nq = static_cast<int64_t>(item.queries.size());
  const float softmax_scale = static_cast<float>(spec_.effective_scale());
  const float scale = scale_host_;
  const int32_t group = hq / hkv;
  std::vector<float> naive(static_cast<size_t>(nq * hq * d), 0.0f);
  std::vector<float> s(static_cast<size_t>(len));
  auto bf16 = [](float x) {
    uint16_t bits;
    detail::store_from_float(&bits, DType::kBF16, 0, x);
    return detail::load_as_float(&bits, DType::kBF16, 0);
  };
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t p = item.queries[i];
    for (int32_t h = 0; h < hq; ++h) {
      const int32_t kh = h / group;
      const uint16_t* qrow = c.q_rot.data() + (i * hq + h) * d;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j <= p; ++j) {
        float acc = 0;
        for (int32_t e = 0; e < d; ++e) {
          acc += detail::load_as_float(qrow, DType::kBF16, e) *
                 detail::load_as_float(c.view.k_base, o_.kv_dtype, (kh * len + j) * d + e) * scale;
        }
        s[j] = acc * softmax_scale;
        m = std::max(m, s[j]);
      }
      float l = 0;
      float* o = naive.data() + (i * hq + h) * d;
      for (int64_t j = 0; j <= p; ++j) {
        const float pj = std::exp(s[j] - m);
        l += pj;
        const float pj_bf16 = bf16(pj);
        for (int32_t e = 0; e < d; ++e) {
          o[e] += pj_bf16 *
                  detail::load_as_float(c.view.v_base, o_.kv_dtype, (kh * len + j) * d + e) * scale;
        }
      }
      for (int32_t e = 0; e < d; ++e) o[e] = bf16(o[e] / l);
    }
  }
  return naive;
}

// CPU (reference backend): forward()'s rows must equal the recomputation bit for bit. CUDA:
// max|out - ref64| <= 2 * max|naive_bf16 - ref64| + 1e-3 (docs/testing.md), ref64 the reference
// with f32 queries and output.
CheckOutcome Engine::run_check(const CheckItem& item) const {
  const auto t0 = Clock::now();
  CheckOutcome outcome;
  try {
    CheckCache c;
    fill_check_cache(item, c);
    const bool exact_bits = o_.device.is_cpu();
    const std::vector<float> ref = attend(item, c, exact_bits ? DType::kBF16 : DType::kF32);
    const std::vector<float> naive = exact_bits ? std::vector<float>{} : naive_attend(item, c);
    double error = 0, tolerance = 0;
    bool bit_exact = true;
    for (size_t i = 0; i < ref.size(); ++i) {
      const float g = detail::load_as_float(item.got.data(), DType::kBF16, static_cast<int64_t>(i));
      const double diff = std::isnan(g) ? std::numeric_limits<double>::infinity()
                                        : std::fabs(static_cast<double>(g) - ref[i]);
      error = std::max(error, diff);
      if (exact_bits) {
        uint16_t bits;
        detail::store_from_float(&bits, DType::kBF16, 0, ref[i]);
        if (bits != item.got[i]) bit_exact = false;
      } else {
        tolerance = std::max(tolerance, std::fabs(static_cast<double>(naive[i]) - ref[i]));
      }
    }
    outcome.error = error;
    outcome.passed = exact_bits ? bit_exact : error <= 2 * tolerance + 1e-3;
    if (!outcome.passed) {
      outcome.failure = item.what + ": max |out - ref| = " + std::to_string(error) +
                        (exact_bits ? " (expected bit-exact)"
                                    : " > tolerance " + std::to_string(2 * tolerance + 1e-3));
    }
  } catch (const std::exception& e) {
    outcome.passed = false;
    outcome.error = std::numeric_limits<double>::infinity();
    outcome.failure = item.what + ": the check could not run: " + e.what();
  }
  outcome.seconds = seconds_since(t0);
  return outcome;
}

ReplayResult Engine::run() {
  res_.device = o_.device.str();
  res_.backend = o_.device.is_cpu() ? "reference" : backend_name(spec_.backend);
  for (const TraceRequest& r : trace_) {
    res_.prompt_tokens += static_cast<int64_t>(r.prompt.size());
    if (r.beam_width > 1) ++res_.beam_requests;
  }
  const auto t0 = Clock::now();
  size_t next_arrival = 0;
  int64_t step = 0;
  std::vector<Group> groups;
  const int32_t total = static_cast<int32_t>(trace_.size());
  while (res_.requests < total) {
    while (next_arrival < trace_.size() && trace_[next_arrival].arrival_step <= step) {
      Running r;
      r.request = &trace_[next_arrival];
      r.index = static_cast<int64_t>(next_arrival);
      waiting_.push_back(std::move(r));
      ++next_arrival;
    }
    while (!waiting_.empty() && static_cast<int32_t>(running_.size()) < o_.max_batch_requests &&
           admit(waiting_.front())) {
      running_.push_back(std::make_unique<Running>(std::move(waiting_.front())));
      waiting_.pop_front();
    }
    if (running_.empty()) {
      // Idle: jump the clock to the next arrival.
      step = std::max<int64_t>(step + 1, trace_[next_arrival].arrival_step);
      continue;
    }
    res_.max_running = std::max(res_.max_running, static_cast<int32_t>(running_.size()));
    schedule(groups);
    const bool check = o_.check_every > 0 && res_.steps % o_.check_every == 0;
    for (size_t i = 0; i < groups.size(); ++i) launch(groups[i], i, check);
    stream_.synchronize();
    ReplayStep record;
    for (Group& g : groups) {
      record.context_tokens += static_cast<int32_t>(g.num_context_tokens());
      record.generation_tokens += static_cast<int32_t>(g.num_tokens() - g.num_context_tokens());
      complete(g);
      record.forward_seconds += g.forward_seconds;
    }
    res_.step_log.push_back(record);
    for (auto& rp : running_) {
      if (!rp->in_context && rp->generated >= rp->request->output_len) finish(*rp);
    }
    std::erase_if(running_, [](const std::unique_ptr<Running>& r) { return r->done; });
    ++res_.steps;
    ++step;
    if (o_.on_step) {
      ReplayProgress p;
      p.step = res_.steps;
      p.finished = res_.requests;
      p.total = total;
      p.running = static_cast<int32_t>(running_.size());
      p.waiting = static_cast<int32_t>(waiting_.size() + (trace_.size() - next_arrival));
      p.tokens = res_.computed_prompt_tokens + res_.generated_tokens;
      p.forward_tokens = res_.computed_prompt_tokens + res_.decode_tokens;
      p.seconds = seconds_since(t0);
      p.forward_seconds = res_.forward_seconds;
      o_.on_step(p);
    }
  }
  if (pool_) res_.check_seconds += pool_->drain();
  for (const CheckOutcome& c : outcomes_) {
    res_.check_cpu_seconds += c.seconds;
    res_.max_check_error = std::max(res_.max_check_error, c.error);
    if (c.passed) {
      ++res_.checks_passed;
    } else {
      ++res_.checks_failed;
      if (res_.failures.size() < 8) res_.failures.push_back(c.failure);
    }
  }
  res_.wall_seconds = seconds_since(t0);
  cache_->check_invariants();
  res_.cache = cache_->stats();
  return res_;
}

}  // namespace

ReplayResult run_replay(const ReplayOptions& options) {
  Engine engine(options);
  return engine.run();
}

}  // namespace attnkit::tools
