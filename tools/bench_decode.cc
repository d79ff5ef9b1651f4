// `attnkit bench decode`: paged decode bandwidth (DESIGN.md section 7). Effective TB/s = KV bytes
// that must be read (the cache at its stored dtype) / kernel time, and that as a fraction of the
// device's measured copy bandwidth. CUDA events around a CUDA graph of 16 calls (per-call time =
// sample / 16), warm-up, median of >= 20 samples, KV pools rotated across enough buffers that the
// 60 MB L2 cannot serve them, random (never zero) data.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "commands.h"
#include "core/numerics.h"

#if defined(ATTNKIT_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace attnkit::tools {
namespace {

struct DecodeBenchConfig {
  int batch = 64;
  int context = 4096;
  int q_heads = 32;
  int kv_heads = 8;
  int head_dim = 128;
  int page = 32;
  std::string kv_dtype = "bf16";
  int splits = 0;  // 0: heuristic
};

struct DecodeBenchOptions {
  std::vector<int> batch;
  int context = 0;
  int q_heads = 32;
  int kv_heads = 8;
  int head_dim = 128;
  int page = 32;
  std::string kv_dtype = "bf16";
  int splits = 0;
  int iters = 30;
  bool json = false;
};

// The grid: Hq=32, Hkv=8, D=128, page 32, bf16 unless the row says otherwise.
std::vector<DecodeBenchConfig> default_grid() {
  std::vector<DecodeBenchConfig> grid;
  for (auto [batch, context] : {std::pair{64, 4096}, std::pair{128, 2048}, std::pair{256, 1024},
                                std::pair{32, 32768}, std::pair{1, 32768}}) {
    DecodeBenchConfig c;
    c.batch = batch;
    c.context = context;
    grid.push_back(c);
  }
  for (const char* kv : {"fp8_e4m3", "int8"}) {
    for (auto [batch, context] : {std::pair{64, 4096}, std::pair{1, 32768}}) {
      DecodeBenchConfig c;
      c.batch = batch;
      c.context = context;
      c.kv_dtype = kv;
      grid.push_back(c);
    }
  }
  for (int page : {16, 64}) {
    DecodeBenchConfig c;
    c.page = page;
    grid.push_back(c);
  }
  for (int kv_heads : {32, 1}) {  // MHA, MQA
    DecodeBenchConfig c;
    c.kv_heads = kv_heads;
    grid.push_back(c);
  }
  return grid;
}

DType parse_kv_dtype(const std::string& name) {
  if (name == "bf16") return DType::kBF16;
  if (name == "fp8_e4m3" || name == "fp8") return DType::kFp8E4M3;
  if (name == "int8") return DType::kInt8;
  throw Error("--kv-dtype: accepted bf16, fp8_e4m3, int8; got '" + name + "'");
}

#if defined(ATTNKIT_WITH_CUDA)
void cuda_ok(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw Error(std::string("bench decode: ") + what + ": " + cudaGetErrorString(status));
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Read + write bytes per second of a device-to-device copy of 1 GiB (median of 20).
double measure_copy_bandwidth() {
  const size_t bytes = size_t{1} << 30;
  void *src = nullptr, *dst = nullptr;
  cuda_ok(cudaMalloc(&src, bytes), "cudaMalloc");
  cuda_ok(cudaMalloc(&dst, bytes), "cudaMalloc");
  cuda_ok(cudaMemset(src, 0x3c, bytes), "cudaMemset");
  cudaEvent_t start, stop;
  cuda_ok(cudaEventCreate(&start), "cudaEventCreate");
  cuda_ok(cudaEventCreate(&stop), "cudaEventCreate");
  std::vector<double> times;
  for (int i = 0; i < 23; ++i) {
    cuda_ok(cudaEventRecord(start), "cudaEventRecord");
    cuda_ok(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice), "cudaMemcpyAsync");
    cuda_ok(cudaEventRecord(stop), "cudaEventRecord");
    cuda_ok(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    cuda_ok(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    if (i >= 3) times.push_back(ms * 1e-3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaFree(src);
  cudaFree(dst);
  return 2.0 * static_cast<double>(bytes) / median(times);
}

// Fills device memory with random values valid for `dtype` (no NaN, never all zero).
void fill_random(void* device, size_t bytes, DType dtype, std::mt19937_64& rng) {
  std::vector<uint8_t> host(std::min<size_t>(bytes, size_t{32} << 20));
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  if (dtype == DType::kBF16) {
    auto* h = reinterpret_cast<uint16_t*>(host.data());
    for (size_t i = 0; i < host.size() / 2; ++i) h[i] = numerics::float_to_bf16_bits(value(rng));
  } else if (dtype == DType::kFp8E4M3) {
    for (auto& b : host) b = numerics::float_to_fp8_e4m3_bits(value(rng) * 200.0f);
  } else {
    for (auto& b : host) b = static_cast<uint8_t>(numerics::float_to_int8_sat(value(rng) * 120));
  }
  for (size_t offset = 0; offset < bytes; offset += host.size()) {
    cuda_ok(cudaMemcpy(static_cast<uint8_t*>(device) + offset, host.data(),
                       std::min(host.size(), bytes - offset), cudaMemcpyHostToDevice),
            "cudaMemcpy");
  }
}

struct DecodeBenchResult {
  DecodeBenchConfig config;
  double seconds = 0;
  double kv_bytes = 0;
  double tb_per_s = 0;
  double copy_fraction = 0;
};

DecodeBenchResult run_one(const DecodeBenchConfig& c, int iters, double copy_bw,
                          std::mt19937_64& rng) {
  const DType kv_dtype = parse_kv_dtype(c.kv_dtype);
  const DType dtype = DType::kBF16;
  const int64_t elt = static_cast<int64_t>(dtype_size(kv_dtype));
  const int64_t blocks_per_seq = (c.context + c.page - 1) / c.page;
  const int64_t num_blocks = c.batch * blocks_per_seq;
  const int64_t half = static_cast<int64_t>(c.kv_heads) * c.page * c.head_dim * elt;
  const size_t pool_bytes = static_cast<size_t>(num_blocks * 2 * half);
  // Enough pools that one call's KV is never still in the 60 MB L2 from the previous call.
  const int pools =
      static_cast<int>(std::clamp<size_t>((size_t{240} << 20) / pool_bytes + 1, 1, 8));

  std::vector<void*> pool(pools, nullptr);
  for (auto& p : pool) {
    cuda_ok(cudaMalloc(&p, pool_bytes), "cudaMalloc(pool)");
    fill_random(p, pool_bytes, kv_dtype, rng);
  }
  std::vector<int32_t> table(num_blocks);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);  // scattered pages, as in a serving pool
  std::vector<int32_t> lens(c.batch, c.context);
  const size_t q_elems = static_cast<size_t>(c.batch) * c.q_heads * c.head_dim;
  void *d_table, *d_lens, *d_q, *d_out, *d_lse, *d_scale;
  cuda_ok(cudaMalloc(&d_table, table.size() * 4), "cudaMalloc");
  cuda_ok(cudaMalloc(&d_lens, lens.size() * 4), "cudaMalloc");
  cuda_ok(cudaMalloc(&d_q, q_elems * 2), "cudaMalloc");
  cuda_ok(cudaMalloc(&d_out, q_elems * 2), "cudaMalloc");
  cuda_ok(cudaMalloc(&d_lse, static_cast<size_t>(c.batch) * c.q_heads * 4), "cudaMalloc");
  cuda_ok(cudaMalloc(&d_scale, 4), "cudaMalloc");
  cuda_ok(cudaMemcpy(d_table, table.data(), table.size() * 4, cudaMemcpyHostToDevice), "copy");
  cuda_ok(cudaMemcpy(d_lens, lens.data(), lens.size() * 4, cudaMemcpyHostToDevice), "copy");
  fill_random(d_q, q_elems * 2, DType::kBF16, rng);
  const float scale = kv_dtype == DType::kBF16 ? 1.0f : 1.0f / 128;
  cuda_ok(cudaMemcpy(d_scale, &scale, 4, cudaMemcpyHostToDevice), "copy");

  AttentionSpec spec;
  spec.num_q_heads = c.q_heads;
  spec.num_kv_heads = c.kv_heads;
  spec.head_dim = c.head_dim;
  spec.backend = Backend::kFused;
  const Device gpu = Device::cuda(0);
  DecodeArgs args;
  args.q = TensorView(d_q, dtype, {c.batch, c.q_heads, c.head_dim}, gpu);
  args.out = TensorView(d_out, dtype, {c.batch, c.q_heads, c.head_dim}, gpu);
  args.lse = TensorView(d_lse, DType::kF32, {c.batch, c.q_heads}, gpu);
  args.num_splits = c.splits;
  args.max_seq_len = c.context;
  KvCacheView& cache = args.kv_cache;
  cache.block_stride_bytes = 2 * half;
  cache.num_blocks = static_cast<int32_t>(num_blocks);
  cache.dtype = kv_dtype;
  cache.device = gpu;
  cache.num_kv_heads = c.kv_heads;
  cache.tokens_per_block = c.page;
  cache.head_dim = c.head_dim;
  cache.block_table = TensorView(d_table, DType::kInt32, {c.batch, blocks_per_seq}, gpu);
  cache.seq_lens = TensorView(d_lens, DType::kInt32, {c.batch}, gpu);
  if (kv_dtype != DType::kBF16) {
    cache.k_scale = TensorView(d_scale, DType::kF32, {1}, gpu);
    cache.v_scale = TensorView(d_scale, DType::kF32, {1}, gpu);
  }
  auto use_pool = [&](int i) {
    cache.k_base = pool[i % pools];
    cache.v_base = static_cast<uint8_t*>(pool[i % pools]) + half;
  };

  cudaStream_t stream;
  cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  for (int i = 0; i < 3; ++i) {
    use_pool(i);
    decode(spec, args, stream);
  }
  cuda_ok(cudaStreamSynchronize(stream), "warm-up");
  // One CUDA graph of kCallsPerSample calls over the rotated pools: the host's launch cost
  // stays out of the kernel time (and capture proves the op is graph friendly).
  constexpr int kCallsPerSample = 16;
  cudaGraph_t graph;
  cudaGraphExec_t graph_exec;
  cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
  for (int i = 0; i < kCallsPerSample; ++i) {
    use_pool(i);
    decode(spec, args, stream);
  }
  cuda_ok(cudaStreamEndCapture(stream, &graph), "end capture");
  cuda_ok(cudaGraphInstantiate(&graph_exec, graph, 0), "cudaGraphInstantiate");
  cuda_ok(cudaGraphLaunch(graph_exec, stream), "cudaGraphLaunch");
  cuda_ok(cudaStreamSynchronize(stream), "graph warm-up");
  cudaEvent_t start, stop;
  cuda_ok(cudaEventCreate(&start), "cudaEventCreate");
  cuda_ok(cudaEventCreate(&stop), "cudaEventCreate");
  std::vector<double> times;
  for (int i = 0; i < iters; ++i) {
    cuda_ok(cudaEventRecord(start, stream), "cudaEventRecord");
    cuda_ok(cudaGraphLaunch(graph_exec, stream), "cudaGraphLaunch");
    cuda_ok(cudaEventRecord(stop, stream), "cudaEventRecord");
    cuda_ok(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    cuda_ok(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    times.push_back(ms * 1e-3 / kCallsPerSample);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaGraphExecDestroy(graph_exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  for (void* p : pool) cudaFree(p);
  for (void* p : {d_table, d_lens, d_q, d_out, d_lse, d_scale}) cudaFree(p);

  DecodeBenchResult r;
  r.config = c;
  r.seconds = median(times);
  r.kv_bytes = static_cast<double>(c.batch) * c.context * c.kv_heads * c.head_dim * elt * 2.0;
  r.tb_per_s = r.kv_bytes / r.seconds * 1e-12;
  r.copy_fraction = r.kv_bytes / r.seconds / copy_bw;
  return r;
}

void run_bench(const DecodeBenchOptions& o) {
  std::vector<DecodeBenchConfig> configs;
  if (o.batch.empty() && o.context == 0) {
    configs = default_grid();
    for (auto& c : configs) c.splits = o.splits;
  } else {
    for (int batch : o.batch.empty() ? std::vector<int>{64} : o.batch) {
      DecodeBenchConfig c;
      c.batch = batch;
      c.context = o.context ? o.context : 4096;
      c.q_heads = o.q_heads;
      c.kv_heads = o.kv_heads;
      c.head_dim = o.head_dim;
      c.page = o.page;
      c.kv_dtype = o.kv_dtype;
      c.splits = o.splits;
      configs.push_back(c);
    }
  }
  cudaDeviceProp prop{};
  cuda_ok(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  const double copy_bw = measure_copy_bandwidth();
  std::mt19937_64 rng(12345);
  nlohmann::json rows = nlohmann::json::array();
  if (!o.json) {
    std::printf("device: %s (%d SMs), measured copy bandwidth (read+write) %.2f TB/s\n", prop.name,
                prop.multiProcessorCount, copy_bw * 1e-12);
    std::printf("%-22s %6s %6s %4s %4s %4s %5s %-9s %6s %10s %8s %7s\n", "impl", "batch", "ctx",
                "Hq", "Hkv", "D", "page", "kv", "splits", "time_us", "TB/s", "%copy");
  }
  for (const auto& c : configs) {
    const DecodeBenchResult r = run_one(c, o.iters, copy_bw, rng);
    if (o.json) {
      rows.push_back({{"impl", "attnkit"},
                      {"batch", c.batch},
                      {"context", c.context},
                      {"q_heads", c.q_heads},
                      {"kv_heads", c.kv_heads},
                      {"head_dim", c.head_dim},
                      {"page", c.page},
                      {"kv_dtype", c.kv_dtype},
                      {"splits", c.splits},
                      {"time_us", r.seconds * 1e6},
                      {"tb_per_s", r.tb_per_s},
                      {"copy_fraction", r.copy_fraction},
                      {"copy_tb_per_s", copy_bw * 1e-12}});
    } else {
      std::printf("%-22s %6d %6d %4d %4d %4d %5d %-9s %6s %10.1f %8.3f %6.1f%%\n", "attnkit paged",
                  c.batch, c.context, c.q_heads, c.kv_heads, c.head_dim, c.page, c.kv_dtype.c_str(),
                  c.splits ? std::to_string(c.splits).c_str() : "auto", r.seconds * 1e6, r.tb_per_s,
                  100.0 * r.copy_fraction);
      std::fflush(stdout);
    }
  }
  if (o.json) std::printf("%s\n", rows.dump(2).c_str());
}
#endif

}  // namespace

void register_bench_decode(CLI::App& bench) {
  auto options = std::make_shared<DecodeBenchOptions>();
  CLI::App* cmd = bench.add_subcommand(
      "decode",
      "paged GQA decode bandwidth (KV bytes / kernel time); with no --batch/--context, runs the "
      "issue's grid");
  cmd->add_option("--batch", options->batch, "sequences (several values: one run each)");
  cmd->add_option("--context", options->context, "tokens per sequence (default 4096)");
  cmd->add_option("--q-heads", options->q_heads, "query heads (default 32)");
  cmd->add_option("--kv-heads", options->kv_heads, "KV heads (default 8)");
  cmd->add_option("--head-dim", options->head_dim, "head_dim (default 128)");
  cmd->add_option("--page", options->page, "tokens per block (default 32)");
  cmd->add_option("--kv-dtype", options->kv_dtype, "bf16, fp8_e4m3 or int8 (default bf16)");
  cmd->add_option("--splits", options->splits, "split-KV count (0 = heuristic)");
  cmd->add_option("--iters", options->iters, "timed runs (median; default 30)")
      ->check(CLI::Range(20, 100000));
  cmd->add_flag("--json", options->json, "print JSON instead of the table");
  cmd->callback([options] {
#if defined(ATTNKIT_WITH_CUDA)
    run_bench(*options);
#else
    throw Error("bench decode: this build has no CUDA backend (configure with ATTNKIT_WITH_CUDA)");
#endif
  });
}

}  // namespace attnkit::tools
