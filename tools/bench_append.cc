// `attnkit bench append`: fused append_kv bandwidth (docs/bench.md). TB/s = bytes that must
// move (fused QKV read, rotated Q written, K and V written at the cache dtype) / kernel time;
// % of ceiling against the measured copy bandwidth, and next to it a device-to-device copy of the
// same bytes measured in the same run. One row per cache dtype (bf16, fp8_e4m3, int8).
#include <algorithm>
#include <cstdint>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "bench_session.h"
#include "commands.h"

namespace attnkit::tools {
namespace {

constexpr const char* kCommand = "append";

struct AppendShape {
  int64_t tokens = 16384;
  int q_heads = 32;
  int kv_heads = 8;
  int head_dim = 128;
  int page = 64;
  std::string kv_dtype = "bf16";
  std::string kv_layout = "HND";  // KvCacheView::layout: HND or NHD
};

struct AppendBenchOptions {
  CommonBenchOptions common;
  int64_t tokens = 16384;
  int q_heads = 32;
  int kv_heads = 8;
  int head_dim = 128;
  int page = 64;
  std::vector<std::string> kv_dtypes;  // empty: bf16, fp8_e4m3, int8
  std::string kv_layout = "HND";
};

std::vector<AppendShape> plan(const AppendBenchOptions& o) {
  check_at_least(kCommand, "--tokens", o.tokens, 1);
  check_heads(kCommand, o.q_heads, o.kv_heads, "--q-heads", "--kv-heads");
  check_head_dim(kCommand, o.head_dim);
  check_page(kCommand, "--page", o.page);
  check_iters(kCommand, o.common.iters);
  check_names(kCommand, "--kv-layout", {o.kv_layout}, {"HND", "NHD"});
  std::vector<AppendShape> shapes;
  for (const std::string& kv :
       o.kv_dtypes.empty() ? std::vector<std::string>{"bf16", "fp8_e4m3", "int8"} : o.kv_dtypes) {
    shapes.push_back({.tokens = o.tokens,
                      .q_heads = o.q_heads,
                      .kv_heads = o.kv_heads,
                      .head_dim = o.head_dim,
                      .page = o.page,
                      .kv_dtype = dtype_name(parse_kv_dtype(kCommand, "--kv-dtype", kv)),
                      .kv_layout = o.kv_layout});
  }
  return shapes;
}

BenchRow row_of(const AppendShape& s) {
  BenchRow row;
  row.label = s.kv_dtype + " cache" + (s.kv_layout != "HND" ? " " + s.kv_layout : "");
  row.shape = {{"tokens", s.tokens},      {"q_heads", s.q_heads}, {"kv_heads", s.kv_heads},
               {"head_dim", s.head_dim},  {"page", s.page},       {"kv_dtype", s.kv_dtype},
               {"kv_layout", s.kv_layout}};
  return row;
}

struct AppendSet {
  DeviceBuffer qkv, q_out, pool;
  AppendKvArgs args;
};

BenchSession::Measurement measure(BenchSession& session, const AppendShape& s, BenchRow& row) {
  const DType kv_dtype = parse_kv_dtype(kCommand, "--kv-dtype", s.kv_dtype);
  AttentionSpec spec;
  spec.num_q_heads = s.q_heads;
  spec.num_kv_heads = s.kv_heads;
  spec.head_dim = s.head_dim;
  spec.rope.style = RopeStyle::kGptNeox;
  spec.backend = session.backend(Backend::kFused);
  const int64_t d = s.head_dim;
  const int64_t width = int64_t{s.q_heads + 2 * s.kv_heads} * d;
  // Sequences of 1024 tokens, each with its own block-table row.
  const int64_t rows = std::max<int64_t>(1, s.tokens / 1024);
  const int64_t tokens_per_row = (s.tokens + rows - 1) / rows;
  const int64_t blocks_per_row = (tokens_per_row + s.page - 1) / s.page;
  const int64_t blocks = rows * blocks_per_row;
  std::vector<int32_t> positions(s.tokens), row_of_token(s.tokens), table(blocks);
  for (int64_t t = 0; t < s.tokens; ++t) {
    positions[t] = static_cast<int32_t>(t % tokens_per_row);
    row_of_token[t] = static_cast<int32_t>(t / tokens_per_row);
  }
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), std::mt19937_64(12345));
  const float scale = 0.05f;
  const DeviceBuffer d_positions = upload(positions.data(), positions.size() * 4);
  const DeviceBuffer d_rows = upload(row_of_token.data(), row_of_token.size() * 4);
  const DeviceBuffer d_table = upload(table.data(), table.size() * 4);
  const DeviceBuffer d_scale = upload(&scale, 4);
  const Device gpu = session.device();
  const int64_t kv_elt = static_cast<int64_t>(dtype_size(kv_dtype));
  const int64_t block_bytes = 2 * int64_t{s.kv_heads} * s.page * d * kv_elt;
  const size_t qkv_bytes = static_cast<size_t>(s.tokens * width * 2);
  const size_t q_bytes = static_cast<size_t>(s.tokens * s.q_heads * d * 2);
  const int sets = rotation_sets(qkv_bytes + q_bytes + blocks * block_bytes, session.l2_bytes());
  std::vector<std::unique_ptr<AppendSet>> set(sets);
  for (int i = 0; i < sets; ++i) {
    set[i] = std::make_unique<AppendSet>();
    AppendSet& x = *set[i];
    x.qkv = DeviceBuffer(qkv_bytes);
    x.q_out = DeviceBuffer(q_bytes);
    x.pool = DeviceBuffer(blocks * block_bytes);
    fill_random(x.qkv, DType::kBF16, 7 * i + 1);
    AppendKvArgs& a = x.args;
    a.qkv = TensorView(x.qkv.get(), DType::kBF16, {s.tokens, width}, gpu);
    a.positions = TensorView(d_positions.get(), DType::kInt32, {s.tokens}, gpu);
    a.row_of_token = TensorView(d_rows.get(), DType::kInt32, {s.tokens}, gpu);
    a.q_out = TensorView(x.q_out.get(), DType::kBF16, {s.tokens, s.q_heads, d}, gpu);
    KvCacheView& v = a.kv_cache;
    v.k_base = x.pool.get();
    v.v_base = x.pool.as<uint8_t>() + block_bytes / 2;
    v.block_stride_bytes = block_bytes;
    v.num_blocks = static_cast<int32_t>(blocks);
    v.dtype = kv_dtype;
    v.device = gpu;
    v.num_kv_heads = s.kv_heads;
    v.tokens_per_block = s.page;
    v.head_dim = s.head_dim;
    v.layout = s.kv_layout == "NHD" ? KvCacheLayout::kNHD : KvCacheLayout::kHND;
    v.block_table = TensorView(d_table.get(), DType::kInt32, {rows, blocks_per_row}, gpu);
    if (kv_dtype != DType::kBF16) {
      v.k_scale = TensorView(d_scale.get(), DType::kF32, {1}, gpu);
      v.v_scale = v.k_scale;
    }
  }
  const double ms = session.time_ms(
      [&](int call, Stream stream) { append_kv(spec, set[call % sets]->args, stream); }, {});
  const double bytes = static_cast<double>(s.tokens) * (width * 2 + int64_t{s.q_heads} * d * 2 +
                                                        2 * int64_t{s.kv_heads} * d * kv_elt);
  // The copy reads bytes / 2 and writes bytes / 2: the same traffic.
  const double copy_ms = session.time_copy_ms(static_cast<size_t>(bytes / 2));
  const double tbps = bytes / (ms * 1e-3) * 1e-12;
  const double copy_tbps = bytes / (copy_ms * 1e-3) * 1e-12;
  row.extra["mb_moved"] = bytes * 1e-6;
  row.extra["copy_same_bytes_tbps"] = copy_tbps;
  row.extra["fraction_of_copy"] = tbps / copy_tbps;
  return {ms, tbps};
}

}  // namespace

void register_bench_append(CLI::App& bench) {
  auto o = std::make_shared<AppendBenchOptions>();
  CLI::App* cmd = bench.add_subcommand(
      "append",
      "fused append_kv bandwidth (fused QKV bf16 + GPT-NeoX RoPE into a paged cache), one row per "
      "cache dtype, next to a D2D copy of the same bytes");
  cmd->add_option("--tokens", o->tokens, "tokens per call (default 16384)");
  cmd->add_option("--q-heads", o->q_heads, "query heads (default 32)");
  cmd->add_option("--kv-heads", o->kv_heads, "KV heads, a divisor of --q-heads (default 8)");
  cmd->add_option("--head-dim", o->head_dim, "64, 80, 96, 128 or 256 (default 128)");
  cmd->add_option("--page", o->page, "tokens per block: 8, 16, 32, 64, 128 (default 64)");
  cmd->add_option("--kv-dtype", o->kv_dtypes,
                  "cache dtypes to run: bf16, fp8_e4m3, int8 (default all three)");
  cmd->add_option("--kv-layout", o->kv_layout,
                  "the cache's block layout: 'HND' ([Hkv, T, D], the default) or 'NHD'");
  add_common_options(*cmd, o->common, 21);
  cmd->callback([o] {
    const std::vector<AppendShape> shapes = plan(*o);
    BenchSession session(kCommand, RateUnit::kTbps, Ceiling::kCopyBandwidth, o->common,
                         static_cast<int>(shapes.size()));
    for (const AppendShape& s : shapes) {
      session.run_row(row_of(s), [&](BenchRow& row) { return measure(session, s, row); });
    }
    session.finish();
  });
}

}  // namespace attnkit::tools
