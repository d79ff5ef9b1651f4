// The replay engine: trace generation, the scheduler loop, forward() per layer, deterministic
// sampling, and the independent re-computation that checks sampled steps (docs/replay.md).
#include "replay_engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <limits>
#include <memory>
#include <random>
#include <span>

#include "attnkit/attention.h"
#include "attnkit/kv_cache_manager.h"
#include "core/check.h"
#include "core/element.h"

#if defined(ATTNKIT_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace attnkit::tools {
namespace {

using Clock = std::chrono::steady_clock;

uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

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

// QKV activations: a deterministic function of (token id, position, layer), so a reused prefix
// must hold exactly what recomputation writes. Layer l is the token's base row rotated by l * 97
// elements: one hash per element per token and step, not per layer.
class Activations {
 public:
  Activations(const ReplayOptions& o)
      : width_(int64_t{o.num_q_heads + 2 * o.num_kv_heads} * o.head_dim), seed_(mix64(o.seed)) {}
  int64_t width() const { return width_; }

  // base row (bf16 bits, uniform in [-1, 1)) of one token
  void base_row(int32_t token, int32_t position, uint16_t* row) const {
    const uint64_t h = mix64(seed_ ^ mix64((uint64_t(uint32_t(token)) << 32) | uint32_t(position)));
    for (int64_t i = 0; i < width_; ++i) {
      const double u = static_cast<double>(mix64(h + uint64_t(i)) >> 11) * 0x1.0p-53;
      detail::store_from_float(row, DType::kBF16, i, static_cast<float>(2.0 * u - 1.0));
    }
  }
  // Layer `layer`'s row from a base row.
  void layer_row(const uint16_t* base, int32_t layer, uint16_t* row) const {
    const int64_t shift = (int64_t{layer} * 97) % width_;
    std::memcpy(row, base + shift, static_cast<size_t>(width_ - shift) * 2);
    std::memcpy(row + (width_ - shift), base, static_cast<size_t>(shift) * 2);
  }

 private:
  int64_t width_;
  uint64_t seed_;
};

// The "sampled" token: a hash of the attention output row (bf16 bits, all heads).
int32_t sample_token(const uint16_t* out_row, int64_t elements, uint64_t salt, int32_t vocab) {
  return static_cast<int32_t>(hash_bytes(out_row, static_cast<size_t>(elements) * 2, salt) %
                              static_cast<uint64_t>(vocab));
}

// ---- memory ------------------------------------------------------------------------------------

// Device memory for CUDA runs (plain host memory otherwise).
class Buffer {
 public:
  Buffer() = default;
  Buffer(const Device& device, size_t bytes) : device_(device), bytes_(bytes) {
    if (device.is_cpu()) {
      host_.resize(bytes);
      data_ = host_.data();
      return;
    }
#if defined(ATTNKIT_WITH_CUDA)
    cuda_check(cudaSetDevice(device.index), "cudaSetDevice");
    cuda_check(cudaMalloc(&data_, std::max<size_t>(bytes, 1)), "cudaMalloc");
#else
    detail::fail("replay: --device ", device.str(), " needs a CUDA build of attnkit");
#endif
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    std::swap(device_, o.device_);
    std::swap(bytes_, o.bytes_);
    std::swap(host_, o.host_);
    std::swap(data_, o.data_);
    return *this;
  }
  ~Buffer() {
#if defined(ATTNKIT_WITH_CUDA)
    if (device_.is_cuda() && data_) cudaFree(data_);
#endif
  }
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  void upload(const void* src, size_t bytes, size_t offset = 0) {
    if (device_.is_cpu()) {
      std::memcpy(static_cast<uint8_t*>(data_) + offset, src, bytes);
      return;
    }
#if defined(ATTNKIT_WITH_CUDA)
    cuda_check(
        cudaMemcpy(static_cast<uint8_t*>(data_) + offset, src, bytes, cudaMemcpyHostToDevice),
        "cudaMemcpy");
#endif
  }
  void download(void* dst, size_t bytes) const {
    if (device_.is_cpu()) {
      std::memcpy(dst, data_, bytes);
      return;
    }
#if defined(ATTNKIT_WITH_CUDA)
    cuda_check(cudaMemcpy(dst, data_, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
#endif
  }
  // NaN poison (bf16/f16 0xffff is a NaN), so elements forward() leaves unwritten fail.
  void poison() {
    if (device_.is_cpu()) {
      std::memset(data_, 0xff, bytes_);
      return;
    }
#if defined(ATTNKIT_WITH_CUDA)
    cuda_check(cudaMemset(data_, 0xff, bytes_), "cudaMemset");
#endif
  }

#if defined(ATTNKIT_WITH_CUDA)
  static void cuda_check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) detail::fail("replay: ", what, " failed: ", cudaGetErrorString(e));
  }
#endif

 private:
  Device device_{};
  size_t bytes_ = 0;
  std::vector<uint8_t> host_;
  void* data_ = nullptr;
};

void device_synchronize(const Device& device) {
#if defined(ATTNKIT_WITH_CUDA)
  if (device.is_cuda()) Buffer::cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
#else
  (void)device;
#endif
}

// A tensor in `buffer` with a contiguous shape.
TensorView view_of(const Buffer& buffer, const Device& device, DType dtype,
                   std::initializer_list<int64_t> shape, size_t byte_offset = 0) {
  TensorView v(static_cast<uint8_t*>(buffer.data()) + byte_offset, dtype, shape);
  v.device = device;
  return v;
}

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
  int64_t num_tokens() const { return static_cast<int64_t>(tokens.size()); }
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
  need(o.host_cache_mb >= 0 && std::isfinite(o.host_cache_mb), "--host-cache-mb",
       "a finite number >= 0", o.host_cache_mb);
  need(o.cache_tokens >= 0, "--cache-tokens", ">= 0", o.cache_tokens);
  need(o.kv_dtype == DType::kBF16 || o.kv_dtype == DType::kF16 || o.kv_dtype == DType::kFp8E4M3 ||
           o.kv_dtype == DType::kInt8,
       "--kv-dtype", "bf16, f16, fp8_e4m3 or int8", dtype_name(o.kv_dtype));
  need(o.device.is_cuda() || o.cache_tokens > 0, "--cache-tokens",
       "> 0 on the CPU (the pool needs an explicit size)", o.cache_tokens);
}

class Engine {
 public:
  explicit Engine(const ReplayOptions& o)
      : o_(o), act_(o), trace_((validate_options(o), make_trace(o))) {
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

    max_seq_ = o.system_prompt_len + std::max(o.min_user_len, o.max_user_len) +
               std::max(o.min_output_len, o.max_output_len) + 1;
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
    const int64_t block_bytes = int64_t{o.layers} * 2 * o.num_kv_heads * o.tokens_per_block *
                                o.head_dim * static_cast<int64_t>(dtype_size(o.kv_dtype));
    c.host_cache_bytes =
        o.host_cache_mb > 0
            ? std::max<int64_t>(static_cast<int64_t>(o.host_cache_mb * 1048576.0), block_bytes)
            : 0;
    cache_ = std::make_unique<KvCacheManager>(c);

    // Per-tensor scales for quantized caches: |K|, |V| <= sqrt(2) after RoPE, so amax maps to
    // the top of the range.
    const float scale = o.kv_dtype == DType::kFp8E4M3 ? 1.5f / 448.0f
                        : o.kv_dtype == DType::kInt8  ? 1.5f / 127.0f
                                                      : 1.0f;
    scale_host_ = scale;
    for (size_t i = 0; i < trace_.size(); ++i) check_fits(trace_[i], static_cast<int64_t>(i));
    if (o.kv_dtype == DType::kFp8E4M3 || o.kv_dtype == DType::kInt8) {
      scale_ = Buffer(o.device, sizeof(float));
      scale_.upload(&scale, sizeof(float));
    }
  }

  ReplayResult run();

 private:
  void check_fits(const TraceRequest& r, int64_t index) const;
  bool admit(Running& r);
  void schedule(std::vector<Group>& groups);
  void build(Group& g);
  void execute(Group& g, bool check);
  void sample(Group& g, const std::vector<uint16_t>& out);
  void check_group(Group& g, int32_t layer, const std::vector<uint16_t>& out);
  void compare(const std::string& what, const uint16_t* got, const std::vector<float>& ref,
               const std::vector<float>& naive, const std::vector<float>& exact);
  std::vector<float> recompute(const std::vector<int32_t>& history, int64_t num_queries,
                               bool generation, int32_t layer, DType out_dtype,
                               std::vector<float>* naive);
  KvCacheView cache_view(int32_t layer, const Buffer& table, const Buffer& lens, int64_t rows);
  void finish(Running& r);

  const ReplayOptions& o_;
  Activations act_;
  std::vector<TraceRequest> trace_;
  AttentionSpec spec_;
  int32_t max_seq_ = 0;
  std::unique_ptr<KvCacheManager> cache_;
  Buffer scale_;
  float scale_host_ = 1.0f;

  std::deque<Running> waiting_;
  std::vector<std::unique_ptr<Running>> running_;
  int64_t reserved_blocks_ = 0;
  SeqId next_seq_ = 0;
  int64_t check_counter_ = 0;
  ReplayResult res_;
};

// Blocks a request can hold at most: every beam's whole history plus a copied partial block.
int64_t blocks_needed(const TraceRequest& r, int32_t tokens_per_block) {
  const int64_t tokens = static_cast<int64_t>(r.prompt.size()) + r.output_len;
  return int64_t{r.beam_width} * ((tokens + tokens_per_block - 1) / tokens_per_block + 1);
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

KvCacheView Engine::cache_view(int32_t layer, const Buffer& table, const Buffer& lens,
                               int64_t rows) {
  const TensorView table_view =
      view_of(table, o_.device, DType::kInt32, {rows, cache_->max_blocks_per_seq()});
  const TensorView lens_view = view_of(lens, o_.device, DType::kInt32, {rows});
  KvCacheView v = cache_->layer_view(layer, table_view, lens_view);
  if (scale_.data()) {
    v.k_scale = view_of(scale_, o_.device, DType::kF32, {1});
    v.v_scale = v.k_scale;
  }
  return v;
}

void Engine::execute(Group& g, bool check) {
  build(g);
  const int64_t n = g.num_tokens();
  const int64_t rows = static_cast<int64_t>(g.rows.size());
  const int64_t width = act_.width();
  const int64_t out_elems = n * o_.num_q_heads * o_.head_dim;
  const Device dev = o_.device;

  // Tables, lengths, indirection: host values from the manager, uploaded for CUDA.
  const KvBlockTables tables = cache_->block_tables(g.rows);
  Buffer table(dev, tables.table.size() * sizeof(int32_t));
  table.upload(tables.table.data(), table.bytes());
  Buffer lens(dev, tables.seq_lens.size() * sizeof(int32_t));
  lens.upload(tables.seq_lens.data(), lens.bytes());
  Buffer indirection;
  const int32_t num_generation = static_cast<int32_t>(g.generation.size());
  if (g.beam_width > 1) {
    std::vector<SeqId> beams(g.rows.begin() + static_cast<int64_t>(g.context.size()), g.rows.end());
    const std::vector<int32_t> ind = cache_->cache_indirection(beams, g.beam_width, max_seq_);
    indirection = Buffer(dev, ind.size() * sizeof(int32_t));
    indirection.upload(ind.data(), indirection.bytes());
  }

  // Activations of every layer (generated on the host, not timed).
  std::vector<uint16_t> base(static_cast<size_t>(n * width));
  for (int64_t t = 0; t < n; ++t) {
    act_.base_row(g.tokens[t], g.positions[t], base.data() + t * width);
  }
  const size_t layer_bytes = static_cast<size_t>(n * width) * 2;
  const bool all_layers_resident = dev.is_cuda();
  Buffer qkv(dev, layer_bytes * (all_layers_resident ? o_.layers : 1));
  std::vector<uint16_t> layer_rows(static_cast<size_t>(n * width));
  auto make_layer = [&](int32_t l) {
    for (int64_t t = 0; t < n; ++t) {
      act_.layer_row(base.data() + t * width, l, layer_rows.data() + t * width);
    }
  };
  const int32_t check_layer =
      check ? static_cast<int32_t>((o_.seed + 7 * check_counter_++) % o_.layers) : -1;
  Buffer out_last(dev, static_cast<size_t>(out_elems) * 2);
  Buffer out_check(dev, check_layer >= 0 ? static_cast<size_t>(out_elems) * 2 : 0);
  out_last.poison();
  if (check_layer >= 0) out_check.poison();

  ForwardArgs a;
  a.num_context = static_cast<int32_t>(g.context.size());
  a.beam_width = g.beam_width;
  a.cu_seqlens_q =
      TensorView(g.cu_seqlens.data(), DType::kInt32, {static_cast<int64_t>(g.cu_seqlens.size())});
  a.past_lens =
      TensorView(g.past_lens.data(), DType::kInt32, {static_cast<int64_t>(g.past_lens.size())});
  if (indirection.data()) {
    a.cache_indirection =
        view_of(indirection, dev, DType::kInt32, {num_generation, g.beam_width, max_seq_});
  }
  auto out_of = [&](int32_t l) -> Buffer& {
    return l == check_layer && l != o_.layers - 1 ? out_check : out_last;
  };

  double seconds = 0;
  if (all_layers_resident) {
    for (int32_t l = 0; l < o_.layers; ++l) {
      make_layer(l);
      qkv.upload(layer_rows.data(), layer_bytes, layer_bytes * l);
    }
    device_synchronize(dev);
    const auto t0 = Clock::now();
    for (int32_t l = 0; l < o_.layers; ++l) {
      a.qkv = view_of(qkv, dev, DType::kBF16, {n, width}, layer_bytes * l);
      a.kv_cache = cache_view(l, table, lens, rows);
      a.out = view_of(out_of(l), dev, DType::kBF16, {n, o_.num_q_heads, o_.head_dim});
      forward(spec_, a);
    }
    device_synchronize(dev);
    seconds = seconds_since(t0);
  } else {
    for (int32_t l = 0; l < o_.layers; ++l) {
      make_layer(l);
      qkv.upload(layer_rows.data(), layer_bytes);
      a.qkv = view_of(qkv, dev, DType::kBF16, {n, width});
      a.kv_cache = cache_view(l, table, lens, rows);
      a.out = view_of(out_of(l), dev, DType::kBF16, {n, o_.num_q_heads, o_.head_dim});
      const auto t0 = Clock::now();
      forward(spec_, a);
      seconds += seconds_since(t0);
    }
  }
  ++res_.forward_calls;

  // Split the time between prefill and decode by attention work (query x key pairs).
  double context_work = 0, generation_work = 0;
  for (size_t i = 0; i < g.context.size(); ++i) {
    const double past = g.context[i]->computed, c = static_cast<double>(g.chunk[i]);
    context_work += c * past + c * (c + 1) / 2;
  }
  for (Running* r : g.generation) {
    generation_work +=
        static_cast<double>(r->seqs.size()) * static_cast<double>(r->history[0].size());
  }
  const double total_work = context_work + generation_work;
  if (total_work > 0) {
    res_.prefill_seconds += seconds * context_work / total_work;
    res_.decode_seconds += seconds * generation_work / total_work;
  }

  std::vector<uint16_t> out(static_cast<size_t>(out_elems));
  if (check_layer >= 0) {
    std::vector<uint16_t> checked(static_cast<size_t>(out_elems));
    out_of(check_layer).download(checked.data(), checked.size() * 2);
    if (o_.inject_fault && out_elems > 0) checked[checked.size() / 2] ^= 0x0040;
    check_group(g, check_layer, checked);
  }
  out_last.download(out.data(), out.size() * 2);
  sample(g, out);
}

void Engine::sample(Group& g, const std::vector<uint16_t>& out) {
  const int64_t row_elems = int64_t{o_.num_q_heads} * o_.head_dim;
  auto out_row = [&](int64_t token) { return out.data() + token * row_elems; };
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
      const int32_t token = sample_token(out_row(last), row_elems, uint64_t(b), o_.vocab);
      r.history.back().push_back(token);
      record(token);
      if (b > 0) {
        r.seqs.push_back(next_seq_++);
        cache_->fork(r.seqs[0], r.seqs.back());
      }
    }
    r.generated = 1;
  }
  const int64_t first_generation_token = g.cu_seqlens[g.context.size()];
  int64_t token = first_generation_token;
  for (Running* r : g.generation) {
    const int32_t w = r->request->beam_width;
    if (w == 1) {
      const int32_t next = sample_token(out_row(token), row_elems, 0, o_.vocab);
      r->history[0].push_back(next);
      record(next);
    } else {
      // Synthetic beam search: rank beams by a hash of their output; the better half each
      // continue into two beams, so histories get reordered through reorder_beams().
      std::vector<uint64_t> score(static_cast<size_t>(w));
      for (int32_t b = 0; b < w; ++b) {
        score[b] = hash_bytes(out_row(token + b), static_cast<size_t>(row_elems) * 2, 0x5eed);
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
            sample_token(out_row(token + parents[b]), row_elems, uint64_t(b) + 1, o_.vocab);
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

// The output of the `num_queries` last tokens of `history` at layer `layer`, recomputed from
// scratch: append_kv of the whole history into a fresh contiguous cache, then prefill (decode for
// a generation row, as forward() does) through the reference on CPU tensors, in `out_dtype`.
// `naive`, if given, gets a naive bf16 computation (f32 scores, bf16 P) from the same rotated Q and
// cache: the yardstick of docs/testing.md.
std::vector<float> Engine::recompute(const std::vector<int32_t>& history, int64_t num_queries,
                                     bool generation, int32_t layer, DType out_dtype,
                                     std::vector<float>* naive) {
  const int64_t len = static_cast<int64_t>(history.size());
  const int64_t width = act_.width();
  const int32_t hq = o_.num_q_heads, hkv = o_.num_kv_heads, d = o_.head_dim;
  std::vector<uint16_t> qkv(static_cast<size_t>(len * width)), base(static_cast<size_t>(width));
  std::vector<int32_t> positions(static_cast<size_t>(len)), row_of(static_cast<size_t>(len), 0);
  for (int64_t t = 0; t < len; ++t) {
    positions[t] = static_cast<int32_t>(t);
    act_.base_row(history[t], static_cast<int32_t>(t), base.data());
    act_.layer_row(base.data(), layer, qkv.data() + t * width);
  }
  const size_t elt = dtype_size(o_.kv_dtype);
  const int64_t half = int64_t{hkv} * len * d;
  std::vector<uint8_t> kv(static_cast<size_t>(2 * half) * elt);
  std::vector<int32_t> seq_len = {static_cast<int32_t>(len)};
  KvCacheView cache;
  cache.k_base = kv.data();
  cache.v_base = kv.data() + half * elt;
  cache.block_stride_bytes = static_cast<int64_t>(2 * half * elt);
  cache.num_blocks = 1;
  cache.dtype = o_.kv_dtype;
  cache.num_kv_heads = hkv;
  cache.tokens_per_block = static_cast<int32_t>(len);
  cache.head_dim = d;
  cache.paged = false;
  cache.seq_lens = TensorView(seq_len.data(), DType::kInt32, {1});
  float scale = scale_host_;
  if (scale_.data()) {
    cache.k_scale = TensorView(&scale, DType::kF32, {1});
    cache.v_scale = cache.k_scale;
  }

  std::vector<uint16_t> q_rot(static_cast<size_t>(len * hq * d));
  AppendKvArgs ap;
  ap.qkv = TensorView(qkv.data(), DType::kBF16, {len, width});
  ap.positions = TensorView(positions.data(), DType::kInt32, {len});
  ap.row_of_token = TensorView(row_of.data(), DType::kInt32, {len});
  ap.kv_cache = cache;
  ap.q_out = TensorView(q_rot.data(), DType::kBF16, {len, hq, d});
  append_kv(spec_, ap);

  // Queries in out_dtype (f32 holds the bf16 values exactly).
  const int64_t q_elems = num_queries * hq * d;
  const uint16_t* q_last = q_rot.data() + (len - num_queries) * hq * d;
  std::vector<uint8_t> q(static_cast<size_t>(q_elems) * dtype_size(out_dtype));
  std::vector<uint8_t> out(static_cast<size_t>(q_elems) * dtype_size(out_dtype));
  for (int64_t i = 0; i < q_elems; ++i) {
    detail::store_from_float(q.data(), out_dtype, i,
                             detail::load_as_float(q_last, DType::kBF16, i));
  }
  std::memset(out.data(), 0xff, out.size());
  AttentionSpec ref_spec = spec_;
  ref_spec.backend = Backend::kVanilla;
  if (generation) {
    DecodeArgs da;
    da.q = TensorView(q.data(), out_dtype, {1, hq, d});
    da.kv_cache = cache;
    da.out = TensorView(out.data(), out_dtype, {1, hq, d});
    decode(ref_spec, da);
  } else {
    std::vector<int32_t> cu = {0, static_cast<int32_t>(num_queries)};
    PrefillArgs pa;
    pa.q = TensorView(q.data(), out_dtype, {num_queries, hq, d});
    pa.cu_seqlens_q = TensorView(cu.data(), DType::kInt32, {2});
    pa.kv_cache = &cache;
    pa.out = TensorView(out.data(), out_dtype, {num_queries, hq, d});
    prefill(ref_spec, pa);
  }
  std::vector<float> result(static_cast<size_t>(q_elems));
  for (int64_t i = 0; i < q_elems; ++i) result[i] = detail::load_as_float(out.data(), out_dtype, i);

  if (naive) {
    naive->assign(static_cast<size_t>(q_elems), 0.0f);
    const float softmax_scale = static_cast<float>(spec_.effective_scale());
    const int32_t group = hq / hkv;
    std::vector<float> s(static_cast<size_t>(len));
    for (int64_t i = 0; i < num_queries; ++i) {
      const int64_t p = len - num_queries + i;
      for (int32_t h = 0; h < hq; ++h) {
        const int32_t kh = h / group;
        const uint16_t* qrow = q_last + (i * hq + h) * d;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j <= p; ++j) {
          float acc = 0;
          for (int32_t e = 0; e < d; ++e) {
            acc += detail::load_as_float(qrow, DType::kBF16, e) *
                   detail::load_as_float(cache.k_base, o_.kv_dtype, (kh * len + j) * d + e) * scale;
          }
          s[j] = acc * softmax_scale;
          m = std::max(m, s[j]);
        }
        float l = 0;
        float* o = naive->data() + (i * hq + h) * d;
        for (int64_t j = 0; j <= p; ++j) {
          float pj = std::exp(s[j] - m);
          l += pj;
          uint16_t bits;
          detail::store_from_float(&bits, DType::kBF16, 0, pj);
          pj = detail::load_as_float(&bits, DType::kBF16, 0);
          for (int32_t e = 0; e < d; ++e) {
            o[e] += pj * detail::load_as_float(cache.v_base, o_.kv_dtype, (kh * len + j) * d + e) *
                    scale;
          }
        }
        for (int32_t e = 0; e < d; ++e) {
          uint16_t bits;
          detail::store_from_float(&bits, DType::kBF16, 0, o[e] / l);
          o[e] = detail::load_as_float(&bits, DType::kBF16, 0);
        }
      }
    }
  }
  return result;
}

void Engine::compare(const std::string& what, const uint16_t* got, const std::vector<float>& ref,
                     const std::vector<float>& naive, const std::vector<float>& exact) {
  double error = 0, tolerance = 0;
  bool bit_exact = true;
  for (size_t i = 0; i < ref.size(); ++i) {
    const float g = detail::load_as_float(got, DType::kBF16, static_cast<int64_t>(i));
    if (exact.empty()) {
      // CPU: the same reference code on the same data must agree bit for bit.
      uint16_t bits;
      detail::store_from_float(&bits, DType::kBF16, 0, ref[i]);
      if (bits != got[i]) bit_exact = false;
      error = std::max(error, std::fabs(static_cast<double>(g) - ref[i]));
      if (std::isnan(g)) error = std::numeric_limits<double>::infinity();
    } else {
      error = std::max(error, std::isnan(g) ? std::numeric_limits<double>::infinity()
                                            : std::fabs(static_cast<double>(g) - exact[i]));
      tolerance = std::max(tolerance, std::fabs(static_cast<double>(naive[i]) - exact[i]));
    }
  }
  res_.max_check_error = std::max(res_.max_check_error, error);
  const bool pass = exact.empty() ? bit_exact : error <= 2 * tolerance + 1e-3;
  if (pass) {
    ++res_.checks_passed;
    return;
  }
  ++res_.checks_failed;
  if (res_.failures.size() < 8) {
    res_.failures.push_back(what + ": max |out - ref| = " + std::to_string(error) +
                            (exact.empty()
                                 ? " (expected bit-exact)"
                                 : " > tolerance " + std::to_string(2 * tolerance + 1e-3)));
  }
}

void Engine::check_group(Group& g, int32_t layer, const std::vector<uint16_t>& out) {
  struct Item {
    std::string what;
    std::vector<int32_t> history;
    int64_t num_queries;
    bool generation;
    int64_t first_token;
  };
  const std::string at = "step " + std::to_string(res_.steps) + " layer " + std::to_string(layer);
  std::vector<Item> items;
  for (size_t i = 0; i < g.context.size(); ++i) {
    const Running& r = *g.context[i];
    const auto& prompt = r.request->prompt;
    items.push_back(
        {at + " request " + std::to_string(r.index) + " context chunk",
         std::vector<int32_t>(prompt.begin(), prompt.begin() + (r.computed + g.chunk[i])),
         g.chunk[i], false, g.cu_seqlens[i]});
  }
  for (size_t i = 0; i < g.generation.size(); ++i) {
    const Running& r = *g.generation[i];
    const int64_t first = g.cu_seqlens[g.context.size() + i];
    for (size_t b = 0; b < r.history.size(); ++b) {
      items.push_back({at + " request " + std::to_string(r.index) + " beam " + std::to_string(b),
                       r.history[b], 1, true, first + static_cast<int64_t>(b)});
    }
  }
  // With a limit, an evenly spaced subset (the host-side recomputation is the slow part on GPUs).
  const size_t limit =
      o_.check_max_seqs > 0 ? static_cast<size_t>(o_.check_max_seqs) : items.size();
  const size_t count = std::min(limit, items.size());
  const int64_t row_elems = int64_t{o_.num_q_heads} * o_.head_dim;
  const bool gpu = o_.device.is_cuda();
  for (size_t k = 0; k < count; ++k) {
    const Item& item = items[k * items.size() / count];
    std::vector<float> naive, exact;
    const std::vector<float> ref = recompute(item.history, item.num_queries, item.generation, layer,
                                             DType::kBF16, gpu ? &naive : nullptr);
    if (gpu) {
      exact =
          recompute(item.history, item.num_queries, item.generation, layer, DType::kF32, nullptr);
    }
    compare(item.what, out.data() + item.first_token * row_elems, ref, naive, exact);
  }
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
    for (Group& g : groups) execute(g, check);
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
      p.seconds = seconds_since(t0);
      o_.on_step(p);
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
