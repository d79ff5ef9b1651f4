// `attnkit bench prefill`: context FMHA throughput (docs/bench.md). TFLOP/s counts
// 4 * Sq * Skv * D * Hq per sequence (halved for causal) over the kernel time; % of ceiling
// against the cuBLAS bf16 GEMM rate measured in the same run. Input sets rotated past the L2,
// random data, median of >= 20 samples (bench_session.h).
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

constexpr const char* kCommand = "prefill";
constexpr int kTokens = 16384;  // batch x S of the default grid
constexpr int kHidden = 2048;   // heads x D

struct PrefillShape {
  std::string label;
  int batch = 1;
  int seqlen = 4096;
  int heads = 16;
  int kv_heads = 16;
  int head_dim = 128;
  bool causal = false;
  int page = 0;                   // 0: packed K/V; else a paged cache with this page size
  std::string kv_dtype = "bf16";  // paged only: bf16, fp8_e4m3, int8
  std::string dtype = "bf16";     // Q, O and packed K/V: bf16 or f16
  FusedKernel kernel = FusedKernel::kAuto;
  std::string kv_layout = "HND";  // paged only: KvCacheView::layout, HND or NHD
};

struct PrefillBenchOptions {
  CommonBenchOptions common;
  int batch = 0;  // 0: 16384 / seqlen
  int seqlen = 0;
  int heads = 0;     // 0: 2048 / head_dim
  int kv_heads = 0;  // 0: = heads
  int head_dim = 128;
  bool causal = false;
  int page = 0;
  std::string kv_dtype = "bf16";
  std::string dtype = "bf16";
  std::string kernel = "auto";  // auto, portable, hopper (AttentionSpec::fused_kernel)
  std::string kv_layout = "HND";
};

FusedKernel parse_kernel(const std::string& name) {
  for (FusedKernel k : {FusedKernel::kAuto, FusedKernel::kPortable, FusedKernel::kHopper}) {
    if (name == fused_kernel_name(k)) return k;
  }
  throw Error("bench prefill: --kernel: accepted auto, portable, hopper; got '" + name + "'");
}

std::string short_tokens(int n) {
  return n % 1024 == 0 ? std::to_string(n / 1024) + "k" : std::to_string(n);
}

std::string label_of(const PrefillShape& s) {
  std::string label = "D" + std::to_string(s.head_dim) + " S" + short_tokens(s.seqlen);
  if (s.page) label += " paged" + std::to_string(s.page) + " " + s.kv_dtype;
  if (s.page && s.kv_layout != "HND") label += " " + s.kv_layout;
  if (s.dtype != "bf16") label += " " + s.dtype;
  return label + (s.causal ? " causal" : "");
}

PrefillShape grid_shape(int d, int s, bool causal, int page = 0, const char* kv = "bf16") {
  PrefillShape shape{.label = "",
                     .batch = std::max(1, kTokens / s),
                     .seqlen = s,
                     .heads = kHidden / d,
                     .kv_heads = kHidden / d,
                     .head_dim = d,
                     .causal = causal,
                     .page = page,
                     .kv_dtype = kv};
  shape.label = label_of(shape);
  return shape;
}

// The default grid: D in {64, 128, 256} x S in {512 .. 16k} x causal and not, batch x S = 16k
// tokens, heads = 2048 / D; then paged rows (page 64, bf16 / fp8) at equal FLOPs.
std::vector<PrefillShape> default_grid(bool quick) {
  if (quick) {
    return {grid_shape(128, 4096, false), grid_shape(128, 4096, true), grid_shape(64, 2048, true),
            grid_shape(256, 8192, false), grid_shape(128, 2048, true, 64, "bf16")};
  }
  std::vector<PrefillShape> grid;
  for (int d : {64, 128, 256}) {
    for (bool causal : {false, true}) {
      for (int s : {512, 1024, 2048, 4096, 8192, 16384}) grid.push_back(grid_shape(d, s, causal));
    }
  }
  for (const char* kv : {"bf16", "fp8_e4m3"}) {
    for (int s : {2048, 8192}) grid.push_back(grid_shape(128, s, true, 64, kv));
  }
  return grid;
}

std::vector<PrefillShape> plan(const PrefillBenchOptions& o) {
  check_at_least(kCommand, "--batch", o.batch, 0);
  check_at_least(kCommand, "--seqlen", o.seqlen, 0);
  check_head_dim(kCommand, o.head_dim);
  check_at_least(kCommand, "--heads", o.heads, 0);
  check_at_least(kCommand, "--kv-heads", o.kv_heads, 0);
  if (o.page != 0) check_one_of(kCommand, "--page", o.page, {0, 8, 16, 32, 64, 128});
  const DType kv = parse_kv_dtype(kCommand, "--kv-dtype", o.kv_dtype);
  if (kv != DType::kBF16 && o.page == 0 && o.dtype != "fp8_e4m3") {
    throw Error("bench prefill: --kv-dtype " + o.kv_dtype +
                ": accepted only with --page (a paged cache; packed K/V are bf16); got --page 0");
  }
  if (o.dtype != "bf16" && o.dtype != "f16" && o.dtype != "fp8_e4m3") {
    throw Error("bench prefill: --dtype: accepted bf16, f16, fp8_e4m3; got '" + o.dtype + "'");
  }
  // fp8_e4m3: the FP8 kernel (fp8 q, k, v; bf16 out), packed or over an fp8_e4m3 cache.
  if (o.dtype == "fp8_e4m3" && o.page != 0 && kv != DType::kFp8E4M3) {
    throw Error(
        "bench prefill: --dtype fp8_e4m3 with --page: accepted only with --kv-dtype "
        "fp8_e4m3 (the FP8 kernel reads an fp8 cache); got --kv-dtype " +
        o.kv_dtype);
  }
  if (o.dtype == "f16" && o.page != 0) {
    throw Error("bench prefill: --dtype " + o.dtype +
                ": accepted only with --page 0 (the paged rows use bf16 queries); got --page " +
                std::to_string(o.page));
  }
  check_names(kCommand, "--kv-layout", {o.kv_layout}, {"HND", "NHD"});
  check_iters(kCommand, o.common.iters);
  const FusedKernel kernel = parse_kernel(o.kernel);
  if (o.seqlen == 0) {
    if (o.dtype != "bf16") {
      throw Error("bench prefill: --dtype " + o.dtype + ": accepted only with --seqlen (one row)");
    }
    std::vector<PrefillShape> grid = default_grid(o.common.quick);
    for (PrefillShape& s : grid) {
      s.kernel = kernel;
      s.kv_layout = o.kv_layout;
      s.label = label_of(s);
    }
    return grid;
  }
  PrefillShape s;
  s.head_dim = o.head_dim;
  s.seqlen = o.seqlen;
  s.batch = o.batch > 0 ? o.batch : std::max(1, kTokens / o.seqlen);
  s.heads = o.heads > 0 ? o.heads : std::max(1, kHidden / o.head_dim);
  s.kv_heads = o.kv_heads > 0 ? o.kv_heads : s.heads;
  check_heads(kCommand, s.heads, s.kv_heads, "--heads", "--kv-heads");
  s.causal = o.causal;
  s.page = o.page;
  s.kv_dtype = o.kv_dtype;
  s.dtype = o.dtype;
  s.kernel = kernel;
  s.kv_layout = o.kv_layout;
  s.label = label_of(s);
  return {s};
}

BenchRow row_of(const PrefillShape& s) {
  BenchRow row;
  row.label = s.label;
  row.shape = {{"batch", s.batch},
               {"seqlen", s.seqlen},
               {"q_heads", s.heads},
               {"kv_heads", s.kv_heads},
               {"head_dim", s.head_dim},
               {"causal", s.causal},
               {"page", s.page},
               {"kv_dtype", s.kv_dtype},
               {"dtype", s.dtype},
               {"kernel", fused_kernel_name(s.kernel)},
               {"kv_layout", s.page ? s.kv_layout : "-"}};
  return row;
}

double flops_of(const PrefillShape& s) {
  const double f = 4.0 * s.seqlen * static_cast<double>(s.seqlen) * s.head_dim * s.heads * s.batch;
  return s.causal ? f / 2 : f;
}

// One set of inputs (and its paged cache) per rotation slot.
struct PrefillSet {
  DeviceBuffer q, out, k, v, pool;
  KvCacheView view;
  PrefillArgs args;
};

BenchSession::Measurement measure(BenchSession& session, const PrefillShape& s) {
  const int64_t tokens = int64_t{s.batch} * s.seqlen;
  const int d = s.head_dim;
  const bool fp8 = s.dtype == "fp8_e4m3";
  const DType dtype = fp8 ? DType::kFp8E4M3 : s.dtype == "f16" ? DType::kF16 : DType::kBF16;
  const DType out_dtype = fp8 ? DType::kBF16 : dtype;
  const DType kv_dtype = s.page ? parse_kv_dtype(kCommand, "--kv-dtype", s.kv_dtype) : dtype;
  const size_t kv_elt = dtype_size(kv_dtype);
  const size_t q_bytes = static_cast<size_t>(tokens) * s.heads * d * dtype_size(dtype);
  const size_t out_bytes = static_cast<size_t>(tokens) * s.heads * d * 2;
  const size_t kv_bytes = static_cast<size_t>(tokens) * s.kv_heads * d * kv_elt;
  const int sets = rotation_sets(q_bytes + out_bytes + 2 * kv_bytes, session.l2_bytes());
  const Device gpu = session.device();

  AttentionSpec spec;
  spec.num_q_heads = s.heads;
  spec.num_kv_heads = s.kv_heads;
  spec.head_dim = d;
  spec.mask.kind = s.causal ? MaskKind::kCausal : MaskKind::kNone;
  spec.backend = session.backend(Backend::kFused);
  spec.fused_kernel = s.kernel;

  std::vector<int32_t> cu(s.batch + 1);
  for (int b = 0; b <= s.batch; ++b) cu[b] = b * s.seqlen;
  const DeviceBuffer d_cu = upload(cu.data(), cu.size() * 4);
  // Paged: every sequence's blocks in a shuffled order, one pool per set.
  const int blocks_per_seq = s.page ? (s.seqlen + s.page - 1) / s.page : 0;
  const int num_blocks = blocks_per_seq * s.batch;
  std::vector<int32_t> ids(num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(7));
  const std::vector<int32_t> lens(s.batch, s.seqlen);
  const float scale = kv_dtype == DType::kBF16 ? 1.f : 0.05f;
  DeviceBuffer d_table, d_lens, d_scale;
  if (s.page) {
    d_table = upload(ids.data(), ids.size() * 4);
    d_lens = upload(lens.data(), lens.size() * 4);
  }
  if (s.page || fp8) d_scale = upload(&scale, 4);

  std::vector<std::unique_ptr<PrefillSet>> set(sets);
  for (int i = 0; i < sets; ++i) {
    set[i] = std::make_unique<PrefillSet>();
    PrefillSet& x = *set[i];
    x.q = DeviceBuffer(q_bytes);
    x.out = DeviceBuffer(out_bytes);
    fill_random(x.q, dtype, 10 * i + 1);
    PrefillArgs& a = x.args;
    a.q = TensorView(x.q.get(), dtype, {tokens, s.heads, d}, gpu);
    a.out = TensorView(x.out.get(), out_dtype, {tokens, s.heads, d}, gpu);
    if (fp8) a.q_descale = TensorView(d_scale.get(), DType::kF32, {1}, gpu);
    a.cu_seqlens_q = TensorView(d_cu.get(), DType::kInt32, {s.batch + 1}, gpu);
    a.max_seqlen_q = a.max_seqlen_kv = s.seqlen;
    if (s.page) {
      // Whole pages: a seqlen that is not a multiple of the page still fills its last block.
      const int64_t block_bytes = int64_t{s.kv_heads} * s.page * d * kv_elt;
      x.pool = DeviceBuffer(static_cast<size_t>(2 * block_bytes * num_blocks));
      fill_random(x.pool, kv_dtype, 10 * i + 2);
      KvCacheView& v = x.view;
      v.k_base = x.pool.get();
      v.v_base = x.pool.as<uint8_t>() + block_bytes;
      v.block_stride_bytes = 2 * block_bytes;
      v.num_blocks = num_blocks;
      v.dtype = kv_dtype;
      v.device = gpu;
      v.num_kv_heads = s.kv_heads;
      v.tokens_per_block = s.page;
      v.head_dim = d;
      // The pool's random bytes read as [T, Hkv, D] blocks instead of [Hkv, T, D].
      v.layout = s.kv_layout == "NHD" ? KvCacheLayout::kNHD : KvCacheLayout::kHND;
      v.block_table = TensorView(d_table.get(), DType::kInt32, {s.batch, blocks_per_seq}, gpu);
      v.seq_lens = TensorView(d_lens.get(), DType::kInt32, {s.batch}, gpu);
      if (kv_dtype != DType::kBF16) {
        v.k_scale = TensorView(d_scale.get(), DType::kF32, {1}, gpu);
        v.v_scale = v.k_scale;
      }
      a.kv_cache = &x.view;
    } else {
      x.k = DeviceBuffer(kv_bytes);
      x.v = DeviceBuffer(kv_bytes);
      fill_random(x.k, dtype, 10 * i + 3);
      fill_random(x.v, dtype, 10 * i + 4);
      a.k = TensorView(x.k.get(), dtype, {tokens, s.kv_heads, d}, gpu);
      a.v = TensorView(x.v.get(), dtype, {tokens, s.kv_heads, d}, gpu);
      a.cu_seqlens_kv = a.cu_seqlens_q;
      if (fp8) a.k_descale = a.v_descale = a.q_descale;
    }
  }
  const double ms = session.time_ms(
      [&](int call, Stream stream) { prefill(spec, set[call % sets]->args, stream); }, {});
  return {ms, flops_of(s) / (ms * 1e-3) * 1e-12};
}

}  // namespace

void register_bench_prefill(CLI::App& bench) {
  auto o = std::make_shared<PrefillBenchOptions>();
  CLI::App* cmd = bench.add_subcommand(
      "prefill",
      "context FMHA TFLOP/s (bf16); without --seqlen runs the default grid (D 64/128/256, "
      "S 512..16k, causal and not, 16k tokens, hidden 2048, plus paged rows)");
  cmd->add_option("--batch", o->batch, "sequences (default 16384 / seqlen)");
  cmd->add_option("--seqlen", o->seqlen, "tokens per sequence (queries = keys); selects one row");
  cmd->add_option("--heads", o->heads, "query heads (default 2048 / head_dim)");
  cmd->add_option("--kv-heads", o->kv_heads, "KV heads, a divisor of --heads (default = heads)");
  cmd->add_option("--head-dim", o->head_dim, "64, 80, 96, 128 or 256 (default 128)");
  cmd->add_flag("--causal", o->causal, "causal mask (else none)");
  cmd->add_option("--page", o->page, "paged cache with this page size (0 = packed K/V)");
  cmd->add_option("--kv-dtype", o->kv_dtype, "paged cache dtype: bf16, fp8_e4m3, int8");
  cmd->add_option("--dtype", o->dtype,
                  "q, out and packed K/V dtype: bf16, f16 or fp8_e4m3 (the FP8 kernel: fp8 q / K / "
                  "V, bf16 out; default bf16)");
  cmd->add_option("--kv-layout", o->kv_layout,
                  "paged cache block layout: 'HND' ([Hkv, T, D], the default) or 'NHD' ([T, Hkv, "
                  "D]); also applies to the grid's paged rows");
  cmd->add_option("--kernel", o->kernel,
                  "fused kernel: auto, portable (mma.sync, sm80+) or hopper (sm90 warpgroup)");
  add_common_options(*cmd, o->common, 20);
  cmd->callback([o] {
    const std::vector<PrefillShape> shapes = plan(*o);
    BenchSession session(kCommand, RateUnit::kTflops, Ceiling::kGemm, o->common,
                         static_cast<int>(shapes.size()));
    for (const PrefillShape& s : shapes) {
      session.run_row(row_of(s), [&](BenchRow&) { return measure(session, s); });
    }
    session.finish();
  });
}

}  // namespace attnkit::tools
