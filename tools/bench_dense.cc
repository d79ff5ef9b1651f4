// `attnkit bench dense`: diffusion-shaped dense attention ([B, S, H, D] bf16, no mask) through
// attnkit::dense(), TFLOP/s = 4 * S^2 * D * H * B over the kernel time, % of ceiling against the
// cuBLAS bf16 GEMM rate. Each shape runs several AttentionConfig variants (plain, skip-softmax,
// SAGE int8 / fp8); a variant the selected backend cannot serve is printed with its reason, never
// run on another backend under its name.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "attnkit/config.h"
#include "bench_session.h"

namespace attnkit::tools {
namespace {

constexpr const char* kCommand = "dense";
const std::vector<std::string> kVariants = {"default", "skip_softmax", "sage_int8", "sage_fp8",
                                            "vanilla"};

struct DenseShape {
  int batch = 1;
  int seqlen = 4096;
  int heads = 24;
  int head_dim = 128;
  std::string variant = "default";
  std::string config_json;  // the AttentionConfig the variant runs with
  double hot_keys = 0.0;    // fraction of keys, at the start of each sequence, every query prefers
};

struct DenseBenchOptions {
  CommonBenchOptions common;
  int batch = 0;  // 0: the grid's batch (custom shapes: 1)
  std::vector<int> seqlens;
  int heads = 24;
  int head_dim = 128;
  std::vector<std::string> variants;
  double skip_threshold = 0.01;
  double hot_keys = 0.3;
  double timestep = 0.0;
  std::string config;  // JSON text or @file: one more variant, resolved for --role
  std::string role = "self";
};

std::string short_tokens(int n) {
  return n % 1024 == 0 ? std::to_string(n / 1024) + "k" : std::to_string(n);
}

std::string variant_config(const std::string& variant, double threshold) {
  if (variant == "skip_softmax") {
    std::ostringstream text;
    text.precision(17);
    text << R"({"default": {"backend": "fused", "skip_softmax": {"threshold": )" << threshold
         << "}}}";
    return text.str();
  }
  if (variant == "sage_int8" || variant == "sage_fp8") {
    return std::string(R"({"default": {"backend": "fused", "quant": {"dtype_qk": ")") +
           (variant == "sage_int8" ? "int8" : "fp8_e4m3") +
           R"(", "q_block_size": 1, "k_block_size": 16}}})";
  }
  if (variant == "vanilla") return R"({"default": {"backend": "vanilla"}})";
  return R"({"default": {"backend": "fused"}})";
}

std::vector<DenseShape> plan(const DenseBenchOptions& o) {
  check_at_least(kCommand, "--batch", o.batch, 0);
  for (int s : o.seqlens) check_at_least(kCommand, "--seqlen", s, 1);
  check_at_least(kCommand, "--heads", o.heads, 1);
  check_head_dim(kCommand, o.head_dim);
  check_names(kCommand, "--variants", o.variants, kVariants);
  check_finite_at_least(kCommand, "--skip-threshold", o.skip_threshold, 0.0);
  check_finite_at_least(kCommand, "--timestep", o.timestep, 0.0);
  check_finite_at_least(kCommand, "--hot-keys", o.hot_keys, 0.0);
  if (o.hot_keys >= 1.0) {
    throw Error("bench dense: --hot-keys: accepted a fraction in [0, 1); got " +
                std::to_string(o.hot_keys));
  }
  if (o.timestep > 1.0) {
    throw Error("bench dense: --timestep: accepted a number in [0, 1]; got " +
                std::to_string(o.timestep));
  }
  check_iters(kCommand, o.common.iters);
  std::string user_config;
  if (!o.config.empty()) {
    try {
      // Parsed now so that a bad config fails before any measuring.
      const AttentionConfig config = o.config[0] == '@'
                                         ? AttentionConfig::from_file(o.config.substr(1))
                                         : AttentionConfig::from_json(o.config);
      (void)config;
      user_config = o.config;
    } catch (const Error& e) {
      throw Error(std::string("bench dense: --config: ") + e.what());
    }
  }
  std::vector<std::pair<int, int>> sizes;  // (batch, seqlen)
  if (!o.seqlens.empty()) {
    for (int s : o.seqlens) sizes.push_back({o.batch > 0 ? o.batch : 1, s});
  } else if (o.common.quick) {
    sizes = {{2, 4096}, {1, 32760}};
  } else {
    sizes = {{2, 4096}, {2, 16384}, {1, 32760}};  // 32760: not a multiple of any tile
  }
  if (o.batch > 0) {
    for (auto& size : sizes) size.first = o.batch;
  }
  std::vector<std::string> variants = o.variants;
  if (variants.empty()) variants = user_config.empty() ? kVariants : std::vector<std::string>{};
  std::vector<DenseShape> shapes;
  for (auto [batch, seqlen] : sizes) {
    for (const std::string& v : variants) {
      if (v == "vanilla") continue;
      shapes.push_back(
          {batch, seqlen, o.heads, o.head_dim, v, variant_config(v, o.skip_threshold), o.hot_keys});
    }
    if (!user_config.empty()) {
      shapes.push_back(
          {batch, seqlen, o.heads, o.head_dim, "config:" + o.role, user_config, o.hot_keys});
    }
  }
  // The naive GPU kernels materialize the scores: one small sanity row.
  if (std::find(variants.begin(), variants.end(), "vanilla") != variants.end()) {
    int seqlen = 1024;
    for (const auto& size : sizes) seqlen = std::min(seqlen, size.second);
    shapes.push_back(
        {1, seqlen, o.heads, o.head_dim, "vanilla", variant_config("vanilla", 0), o.hot_keys});
  }
  return shapes;
}

AttentionSpec spec_of(const DenseShape& s, const std::string& role) {
  AttentionSpec spec;
  spec.num_q_heads = s.heads;
  spec.num_kv_heads = s.heads;
  spec.head_dim = s.head_dim;
  spec.mask.kind = MaskKind::kNone;
  const AttentionConfig config = s.config_json[0] == '@'
                                     ? AttentionConfig::from_file(s.config_json.substr(1))
                                     : AttentionConfig::from_json(s.config_json);
  return config.apply(role, spec);
}

BenchRow row_of(const DenseShape& s, const std::string& role) {
  BenchRow row;
  row.label = s.variant + " " + std::to_string(s.batch) + "x" + short_tokens(s.seqlen);
  row.backend = backend_name(spec_of(s, role).backend);
  row.shape = {{"batch", s.batch},      {"seqlen", s.seqlen},     {"q_heads", s.heads},
               {"kv_heads", s.heads},   {"head_dim", s.head_dim}, {"variant", s.variant},
               {"hot_keys", s.hot_keys}};
  return row;
}

struct DenseSet {
  DeviceBuffer q, k, v, out;
  DenseArgs args;
};

BenchSession::Measurement measure(BenchSession& session, const DenseShape& s,
                                  const DenseBenchOptions& o, BenchRow& row) {
  AttentionSpec spec = spec_of(s, o.role);
  spec.backend = session.backend(spec.backend);
  const Device gpu = session.device();
  const int64_t elems = int64_t{s.batch} * s.seqlen * s.heads * s.head_dim;
  const size_t bytes = static_cast<size_t>(elems) * 2;
  const int sets = rotation_sets(4 * bytes, session.l2_bytes());
  std::vector<std::unique_ptr<DenseSet>> set(sets);
  for (int i = 0; i < sets; ++i) {
    set[i] = std::make_unique<DenseSet>();
    DenseSet& x = *set[i];
    x.q = DeviceBuffer(bytes);
    x.k = DeviceBuffer(bytes);
    x.v = DeviceBuffer(bytes);
    x.out = DeviceBuffer(bytes);
    // Hot keys: K = 1 on hot_tokens of every sequence (the first half of them at its start, the
    // rest at its end) and Q in [0, 2], so that those keys lead every query by about sqrt(D)
    // logits and the other tiles can be skipped. At both ends, because the running maximum is
    // built along the walk and walks differ (the reference goes first to last, the fused kernel
    // last to first): either way the first tile visited is hot and about 1 - hot_keys skip.
    const int64_t hot_tokens = static_cast<int64_t>(s.hot_keys * s.seqlen);
    const int64_t hot_front = (hot_tokens + 1) / 2, hot_back = hot_tokens - hot_front;
    fill_random(x.q, DType::kBF16, 5 * i + 1, hot_tokens > 0 ? 1.0f : 0.0f);
    fill_random(x.k, DType::kBF16, 5 * i + 2);
    const size_t token_bytes = size_t{2} * s.heads * s.head_dim;
    for (int b = 0; b < s.batch && hot_tokens > 0; ++b) {
      const size_t first = static_cast<size_t>(b) * s.seqlen;
      fill_constant(x.k, first * token_bytes, hot_front * token_bytes, DType::kBF16, 1.0f);
      fill_constant(x.k, (first + s.seqlen - hot_back) * token_bytes, hot_back * token_bytes,
                    DType::kBF16, 1.0f);
    }
    fill_random(x.v, DType::kBF16, 5 * i + 3);
    DenseArgs& a = x.args;
    const std::initializer_list<int64_t> shape = {s.batch, s.seqlen, s.heads, s.head_dim};
    a.q = TensorView(x.q.get(), DType::kBF16, shape, gpu);
    a.k = TensorView(x.k.get(), DType::kBF16, shape, gpu);
    a.v = TensorView(x.v.get(), DType::kBF16, shape, gpu);
    a.out = TensorView(x.out.get(), DType::kBF16, shape, gpu);
    a.timestep = o.timestep;
  }
  const double ms = session.time_ms(
      [&](int call, Stream stream) { dense(spec, set[call % sets]->args, stream); }, {});
  if (spec.skip_softmax) {
    // One more (untimed) call for the fraction of tiles the kernel skipped on this data.
    DenseStats stats;
    DenseArgs a = set[0]->args;
    a.stats = &stats;
    dense(spec, a, session.stream());
    row.extra["tiles_skipped_fraction"] = stats.skipped_fraction();
  }
  const double flops =
      4.0 * s.seqlen * static_cast<double>(s.seqlen) * s.head_dim * s.heads * s.batch;
  return {ms, flops / (ms * 1e-3) * 1e-12};
}

}  // namespace

void register_bench_dense(CLI::App& bench) {
  auto o = std::make_shared<DenseBenchOptions>();
  CLI::App* cmd = bench.add_subcommand(
      "dense",
      "diffusion dense attention TFLOP/s (bf16, no mask) with AttentionConfig variants: plain, "
      "skip-softmax, SAGE int8/fp8, and a small naive-GPU sanity row");
  cmd->add_option("--batch", o->batch, "batch (default: the grid's 2 / 2 / 1; custom: 1)");
  cmd->add_option("--seqlen", o->seqlens,
                  "tokens (several values: one shape each; default grid "
                  "4096, 16384, 32760)");
  cmd->add_option("--heads", o->heads, "heads (default 24)");
  cmd->add_option("--head-dim", o->head_dim, "64, 80, 96, 128 or 256 (default 128)");
  cmd->add_option("--variants", o->variants,
                  "any of default, skip_softmax, sage_int8, sage_fp8, vanilla (default all)")
      ->delimiter(',');
  cmd->add_option("--skip-threshold", o->skip_threshold,
                  "lambda of the skip_softmax variant (>= 0; default 0.01)");
  cmd->add_option("--timestep", o->timestep, "normalized timestep passed to dense() (default 0)");
  cmd->add_option("--hot-keys", o->hot_keys,
                  "fraction of keys (half at each end of a sequence) that every query prefers, in "
                  "[0, 1); gives skip-softmax something to skip (default 0.3; 0 = random data)");
  cmd->add_option("--config", o->config,
                  "an AttentionConfig (JSON text or @file) to run as one more variant");
  cmd->add_option("--role", o->role, "the role --config is resolved for (default self)");
  add_common_options(*cmd, o->common, 20);
  cmd->callback([o] {
    const std::vector<DenseShape> shapes = plan(*o);
    BenchSession session(kCommand, RateUnit::kTflops, Ceiling::kGemm, o->common,
                         static_cast<int>(shapes.size()));
    for (const DenseShape& s : shapes) {
      session.run_row(row_of(s, o->role),
                      [&](BenchRow& row) { return measure(session, s, *o, row); });
    }
    session.finish();
  });
}

}  // namespace attnkit::tools
