// `attnkit bench decode`: paged decode bandwidth (docs/bench.md). TB/s = KV bytes that must
// be read (the cache at its stored dtype) / kernel time; % of ceiling against the measured D2D
// copy bandwidth. CUDA graphs of 16 calls (the host's launch cost stays out), KV pools rotated
// past the L2, scattered pages, random data (bench_session.h). Split calls go through one
// DecodeWorkspace, as a serving engine keeps one per stream (--split-workspace per-call: the
// per-call allocation and counter memset instead). --merge forces where split calls merge (the
// library's test seam, cuda::set_decode_merge_mode): a measurement knob, not a DecodeArgs field.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "bench_session.h"
#include "commands.h"
#include "core/check.h"
#if defined(ATTNKIT_WITH_CUDA)
#include "cuda/decode/decode_launch.h"
#endif

namespace attnkit::tools {
namespace {

constexpr const char* kCommand = "decode";

struct DecodeShape {
  std::string label;
  int batch = 64;
  int context = 4096;
  int q_heads = 32;
  int kv_heads = 8;
  int head_dim = 128;
  int page = 32;
  std::string kv_dtype = "bf16";
  int splits = 0;                // 0: heuristic
  bool caller_workspace = true;  // DecodeArgs::workspace (false: the per-call workspace)
  std::string merge =
      "auto";  // where split calls merge: auto (the rule), in-kernel, accumulate, separate
  bool batch_invariant = false;   // DecodeArgs::batch_invariant
  std::string kv_layout = "HND";  // KvCacheView::layout: HND or NHD
};

struct DecodeBenchOptions {
  CommonBenchOptions common;
  std::vector<int> batch;
  int context = 4096;
  int q_heads = 32;
  int kv_heads = 8;
  int head_dim = 128;
  int page = 32;
  std::string kv_dtype = "bf16";
  int splits = 0;
  std::string split_workspace = "caller";
  std::string merge = "auto";
  bool batch_invariant = false;
  std::string kv_layout = "HND";
  bool custom = false;  // a shape option was given: run that shape instead of the grid
};

std::string short_tokens(int n) {
  return n % 1024 == 0 ? std::to_string(n / 1024) + "k" : std::to_string(n);
}

// The default grid: Hq=32, Hkv=8, D=128, page 32, bf16 unless the label says otherwise.
std::vector<DecodeShape> default_grid(bool quick) {
  std::vector<DecodeShape> grid;
  auto add = [&](DecodeShape s) {
    const std::string size = std::to_string(s.batch) + "x" + short_tokens(s.context);
    if (s.label.empty()) s.label = s.kv_dtype + " " + size;
    grid.push_back(s);
  };
  using Pairs = std::vector<std::pair<int, int>>;
  const Pairs sizes = quick ? Pairs{{64, 4096}, {1, 32768}}
                            : Pairs{{64, 4096}, {128, 2048}, {256, 1024}, {32, 32768}, {1, 32768}};
  for (auto [batch, context] : sizes) add({.label = "", .batch = batch, .context = context});
  for (const char* kv : {"fp8_e4m3", "int8"}) {
    for (auto [batch, context] : quick ? Pairs{{64, 4096}} : Pairs{{64, 4096}, {1, 32768}}) {
      add({.label = "", .batch = batch, .context = context, .kv_dtype = kv});
    }
  }
  if (quick) return grid;
  for (int page : {16, 64}) add({.label = "page " + std::to_string(page), .page = page});
  add({.label = "MHA 32/32", .kv_heads = 32});
  add({.label = "MQA 32/1", .kv_heads = 1});
  return grid;
}

std::vector<DecodeShape> plan(const DecodeBenchOptions& o) {
  for (int b : o.batch) check_at_least(kCommand, "--batch", b, 1);
  check_at_least(kCommand, "--context", o.context, 1);
  check_heads(kCommand, o.q_heads, o.kv_heads, "--q-heads", "--kv-heads");
  check_head_dim(kCommand, o.head_dim);
  check_page(kCommand, "--page", o.page);
  parse_kv_dtype(kCommand, "--kv-dtype", o.kv_dtype);
  check_at_least(kCommand, "--splits", o.splits, 0);
  check_iters(kCommand, o.common.iters);
  check_names(kCommand, "--split-workspace", {o.split_workspace}, {"caller", "per-call"});
  check_names(kCommand, "--merge", {o.merge}, {"auto", "in-kernel", "separate", "accumulate"});
  check_names(kCommand, "--kv-layout", {o.kv_layout}, {"HND", "NHD"});
  ATTNKIT_CHECK(!o.batch_invariant || (o.splits == 0 && o.merge == "auto"), "bench ", kCommand,
                ": --batch-invariant fixes the splits and the merge; it takes neither --splits "
                "nor --merge");
  const bool caller_workspace = o.split_workspace == "caller";
  if (!o.custom) {
    std::vector<DecodeShape> grid = default_grid(o.common.quick);
    for (DecodeShape& s : grid) {
      s.splits = o.splits;
      s.caller_workspace = caller_workspace;
      s.merge = o.merge;
      s.batch_invariant = o.batch_invariant;
      s.kv_layout = o.kv_layout;
      if (o.kv_layout != "HND") s.label += " " + o.kv_layout;
    }
    return grid;
  }
  std::vector<DecodeShape> shapes;
  for (int batch : o.batch.empty() ? std::vector<int>{64} : o.batch) {
    shapes.push_back({.label = "custom",
                      .batch = batch,
                      .context = o.context,
                      .q_heads = o.q_heads,
                      .kv_heads = o.kv_heads,
                      .head_dim = o.head_dim,
                      .page = o.page,
                      .kv_dtype = o.kv_dtype,
                      .splits = o.splits,
                      .caller_workspace = caller_workspace,
                      .merge = o.merge,
                      .batch_invariant = o.batch_invariant,
                      .kv_layout = o.kv_layout});
  }
  return shapes;
}

BenchRow row_of(const DecodeShape& s) {
  BenchRow row;
  row.label = s.label;
  row.shape = {{"batch", s.batch},
               {"context", s.context},
               {"q_heads", s.q_heads},
               {"kv_heads", s.kv_heads},
               {"head_dim", s.head_dim},
               {"page", s.page},
               {"kv_dtype", s.kv_dtype},
               {"splits", s.splits},
               {"split_workspace", s.caller_workspace ? "caller" : "per-call"},
               {"merge", s.merge},
               {"batch_invariant", s.batch_invariant},
               {"kv_layout", s.kv_layout}};
  return row;
}

BenchSession::Measurement measure(BenchSession& session, const DecodeShape& s, BenchRow& row) {
  const DType kv_dtype = parse_kv_dtype(kCommand, "--kv-dtype", s.kv_dtype);
  const int64_t elt = static_cast<int64_t>(dtype_size(kv_dtype));
  const int64_t blocks_per_seq = (s.context + s.page - 1) / s.page;
  const int64_t num_blocks = s.batch * blocks_per_seq;
  const int64_t half_block = int64_t{s.kv_heads} * s.page * s.head_dim * elt;
  const size_t pool_bytes = static_cast<size_t>(num_blocks * 2 * half_block);
  const int pools = rotation_sets(pool_bytes, session.l2_bytes());
  std::vector<DeviceBuffer> pool;
  for (int i = 0; i < pools; ++i) {
    pool.emplace_back(pool_bytes);
    fill_random(pool.back(), kv_dtype, 100 + i);
  }
  std::mt19937_64 rng(12345);
  std::vector<int32_t> table(num_blocks);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);  // scattered pages, as in a serving pool
  const std::vector<int32_t> lens(s.batch, s.context);
  // 8-bit caches: values up to ~1.5 after the scale, like bf16's [-1, 1].
  const float scale = kv_dtype == DType::kBF16 ? 1.0f : 1.0f / 128;
  const DeviceBuffer d_table = upload(table.data(), table.size() * 4);
  const DeviceBuffer d_lens = upload(lens.data(), lens.size() * 4);
  const DeviceBuffer d_scale = upload(&scale, 4);
  const int64_t q_elems = int64_t{s.batch} * s.q_heads * s.head_dim;
  DeviceBuffer d_q(q_elems * 2), d_out(q_elems * 2), d_lse(int64_t{s.batch} * s.q_heads * 4);
  fill_random(d_q, DType::kBF16, 1);

  AttentionSpec spec;
  spec.num_q_heads = s.q_heads;
  spec.num_kv_heads = s.kv_heads;
  spec.head_dim = s.head_dim;
  spec.backend = session.backend(Backend::kFused);
  const Device gpu = session.device();
  DecodeArgs args;
  args.q = TensorView(d_q.get(), DType::kBF16, {s.batch, s.q_heads, s.head_dim}, gpu);
  args.out = TensorView(d_out.get(), DType::kBF16, {s.batch, s.q_heads, s.head_dim}, gpu);
  args.lse = TensorView(d_lse.get(), DType::kF32, {s.batch, s.q_heads}, gpu);
  args.num_splits = s.splits;
  args.batch_invariant = s.batch_invariant;
  args.max_seq_len = s.context;
  KvCacheView& cache = args.kv_cache;
  cache.block_stride_bytes = 2 * half_block;
  cache.num_blocks = static_cast<int32_t>(num_blocks);
  cache.dtype = kv_dtype;
  cache.device = gpu;
  cache.num_kv_heads = s.kv_heads;
  cache.tokens_per_block = s.page;
  cache.head_dim = s.head_dim;
  // The pool's random bytes read as [T, Hkv, D] blocks instead of [Hkv, T, D]: the same bytes.
  cache.layout = s.kv_layout == "NHD" ? KvCacheLayout::kNHD : KvCacheLayout::kHND;
  cache.block_table = TensorView(d_table.get(), DType::kInt32, {s.batch, blocks_per_seq}, gpu);
  cache.seq_lens = TensorView(d_lens.get(), DType::kInt32, {s.batch}, gpu);
  if (kv_dtype != DType::kBF16) {
    cache.k_scale = TensorView(d_scale.get(), DType::kF32, {1}, gpu);
    cache.v_scale = cache.k_scale;
  }
  // The forced merge holds for this row's calls only.
  struct MergeOverride {
    explicit MergeOverride(const std::string& merge, Backend backend) {
      if (merge == "auto") return;
      ATTNKIT_CHECK(backend == Backend::kFused, "bench decode: --merge ", merge,
                    " needs the fused backend (this row runs ", backend_name(backend), ")");
#if defined(ATTNKIT_WITH_CUDA)
      cuda::set_decode_merge_mode(merge == "separate"     ? cuda::DecodeMergeMode::kSeparate
                                  : merge == "accumulate" ? cuda::DecodeMergeMode::kAccumulate
                                                          : cuda::DecodeMergeMode::kInKernel);
      forced = true;
#endif
    }
    ~MergeOverride() {
#if defined(ATTNKIT_WITH_CUDA)
      if (forced) cuda::set_decode_merge_mode(cuda::DecodeMergeMode::kAuto);
#endif
    }
    bool forced = false;
  } merge_override(s.merge, spec.backend);
  // Sized for this batch at any split count (calls that do not split never touch it). The
  // self-test (reference backend on the CPU) has no use for one.
  std::unique_ptr<DecodeWorkspace> workspace;
  if (s.caller_workspace && gpu.is_cuda()) {
    workspace = std::make_unique<DecodeWorkspace>(spec, s.batch, DecodeWorkspace::kMaxSplits, gpu);
    args.workspace = workspace.get();
  }
  const double ms = session.time_ms(
      [&](int call, Stream stream) {
        DecodeArgs a = args;
        a.kv_cache.k_base = pool[call % pools].get();
        a.kv_cache.v_base = pool[call % pools].as<uint8_t>() + half_block;
        decode(spec, a, stream);
      },
      {.calls_per_sample = 16, .cuda_graph = true});
  const double kv_bytes = 2.0 * s.batch * s.context * s.kv_heads * s.head_dim * elt;
  const double tbps = kv_bytes / (ms * 1e-3) * 1e-12;
  row.extra["kv_mb"] = kv_bytes * 1e-6;
  // A kernel that only reads the same bytes, timed the same way: the rate this row's size allows
  // (per-call gaps and the ramp weigh more in short calls), next to the 1 GiB ceiling.
  std::vector<const void*> sets;
  for (const DeviceBuffer& b : pool) sets.push_back(b.get());
  if (const std::optional<double> read_ms = session.time_read_ms(sets, pool_bytes)) {
    const double read_tbps = static_cast<double>(pool_bytes) / (*read_ms * 1e-3) * 1e-12;
    row.extra["read_same_bytes_tbps"] = read_tbps;
    row.extra["pct_of_same_bytes_read"] = 100.0 * tbps / read_tbps;
  }
  return {ms, tbps};
}

}  // namespace

void register_bench_decode(CLI::App& bench) {
  auto o = std::make_shared<DecodeBenchOptions>();
  CLI::App* cmd = bench.add_subcommand(
      "decode",
      "paged GQA decode bandwidth (KV bytes / kernel time, TB/s); without shape options runs the "
      "default grid");
  cmd->add_option("--batch", o->batch, "sequences (several values: one row each; default 64)");
  cmd->add_option("--context", o->context, "tokens per sequence (default 4096)");
  cmd->add_option("--q-heads", o->q_heads, "query heads (default 32)");
  cmd->add_option("--kv-heads", o->kv_heads, "KV heads, a divisor of --q-heads (default 8)");
  cmd->add_option("--head-dim", o->head_dim, "64, 80, 96, 128 or 256 (default 128)");
  cmd->add_option("--page", o->page, "tokens per block: 8, 16, 32, 64, 128 (default 32)");
  cmd->add_option("--kv-dtype", o->kv_dtype, "bf16, fp8_e4m3 or int8 (default bf16)");
  cmd->add_option("--splits", o->splits,
                  "split-KV count (0 = heuristic; also applies to the grid)");
  cmd->add_option("--merge", o->merge,
                  "where split calls merge their partials: 'auto' (the library's rule, the "
                  "default), 'in-kernel' (the last CTA of each KV head), 'accumulate' (the "
                  "last CTA over sums the splits add in L2) or 'separate' (a merge kernel after "
                  "the decode grid); a measurement knob");
  cmd->add_flag("--batch-invariant", o->batch_invariant,
                "DecodeArgs::batch_invariant: splits of a fixed 1024 keys and one kernel whatever "
                "the batch (also applies to the grid; takes neither --splits nor --merge)");
  cmd->add_option("--kv-layout", o->kv_layout,
                  "the cache's block layout: 'HND' ([Hkv, T, D], the default) or 'NHD' ([T, Hkv, "
                  "D]); also applies to the grid");
  cmd->add_option("--split-workspace", o->split_workspace,
                  "split calls through one caller-owned DecodeWorkspace ('caller', the default, "
                  "as a serving engine) or a per-call allocation + counter memset ('per-call')");
  add_common_options(*cmd, o->common, 30);
  cmd->callback([o, cmd] {
    for (const char* name : {"--batch", "--context", "--q-heads", "--kv-heads", "--head-dim",
                             "--page", "--kv-dtype"}) {
      if (cmd->count(name) > 0) o->custom = true;
    }
    const std::vector<DecodeShape> shapes = plan(*o);
    BenchSession session(kCommand, RateUnit::kTbps, Ceiling::kReadBandwidth, o->common,
                         static_cast<int>(shapes.size()));
    for (const DecodeShape& s : shapes) {
      session.run_row(row_of(s), [&](BenchRow& row) { return measure(session, s, row); });
    }
    session.finish();
  });
}

}  // namespace attnkit::tools
