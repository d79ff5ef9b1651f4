// `attnkit bench prefill`: context FMHA throughput (DESIGN.md section 7). TFLOP/s counts
// 4 * Sq * Skv * D * Hq per sequence (halved for causal) over the kernel time; the cuBLAS bf16
// GEMM rate measured in the same run (cuBLAS loaded at run time; the column is left out when it
// is absent) gives "% GEMM". CUDA events, 3 warm-up calls, median of >= 20 timed calls, inputs
// rotated across 3 sets (each larger than the 60 MB L2), random (never zero) data.
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
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#endif

namespace attnkit::tools {
namespace {

struct PrefillBenchConfig {
  int batch = 1;
  int seqlen = 4096;
  int heads = 16;
  int kv_heads = 16;
  int head_dim = 128;
  bool causal = false;
  int page = 0;                   // 0: packed K/V; else a paged cache with this page size
  std::string kv_dtype = "bf16";  // paged only: bf16, fp8_e4m3, int8
};

struct PrefillBenchOptions {
  int batch = 0;
  int seqlen = 0;
  int heads = 0;
  int kv_heads = 0;
  int head_dim = 128;
  bool causal = false;
  int page = 0;
  std::string kv_dtype = "bf16";
  int iters = 20;
  bool json = false;
};

constexpr int kTokens = 16384;  // batch x S of the grid
constexpr int kHidden = 2048;   // heads x D

#if defined(ATTNKIT_WITH_CUDA)
// The grid: D in {64, 128, 256}, S in {512 .. 16k}, causal and not, batch x S = 16k
// tokens, heads = 2048 / D; then paged rows at equal FLOPs for the >= 90% of dense check.
std::vector<PrefillBenchConfig> default_grid() {
  std::vector<PrefillBenchConfig> grid;
  for (int d : {64, 128, 256}) {
    for (bool causal : {false, true}) {
      for (int s : {512, 1024, 2048, 4096, 8192, 16384}) {
        PrefillBenchConfig c;
        c.head_dim = d;
        c.seqlen = s;
        c.batch = kTokens / s;
        c.heads = c.kv_heads = kHidden / d;
        c.causal = causal;
        grid.push_back(c);
      }
    }
  }
  for (const char* kv : {"bf16", "fp8_e4m3"}) {
    for (int s : {2048, 8192}) {
      PrefillBenchConfig c;
      c.seqlen = s;
      c.batch = kTokens / s;
      c.causal = true;
      c.page = 64;
      c.kv_dtype = kv;
      grid.push_back(c);
    }
  }
  return grid;
}

double flops_of(const PrefillBenchConfig& c) {
  const double f = 4.0 * c.seqlen * static_cast<double>(c.seqlen) * c.head_dim * c.heads * c.batch;
  return c.causal ? f / 2 : f;
}

void cuda_ok(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw Error(std::string("bench prefill: ") + what + ": " + cudaGetErrorString(status));
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// A device buffer of random bf16 values in [-1, 1] (or random 8-bit codes that are never NaN).
// The host pattern is generated once and uploaded at a seed-dependent offset.
void* random_device_buffer(size_t bytes, uint64_t seed, bool eight_bit) {
  static std::vector<uint16_t> pattern[2];
  std::vector<uint16_t>& host = pattern[eight_bit ? 1 : 0];
  const size_t need = bytes / 2 + 4096;
  if (host.size() < need) {
    host.resize(need);
    uint64_t state = 0x9E3779B97F4A7C15ull + (eight_bit ? 1 : 0);
    for (auto& h : host) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      const float u = static_cast<float>((state >> 40) & 0xFFFFFF) / 16777216.0f * 2.f - 1.f;
      // 8-bit: two bytes with the exponent's top bit clear (never NaN, never all zero).
      h = eight_bit ? static_cast<uint16_t>(((state >> 24) & 0xbf) | (((state >> 32) & 0xbf) << 8))
                    : numerics::float_to_bf16_bits(u);
    }
  }
  void* dev = nullptr;
  cuda_ok(cudaMalloc(&dev, bytes + 16), "cudaMalloc");
  cuda_ok(cudaMemcpy(dev, host.data() + (seed * 577) % 4096, bytes, cudaMemcpyHostToDevice),
          "cudaMemcpy");
  return dev;
}

// cuBLAS through dlopen, so that the program does not need the library to exist.
double measure_gemm_tflops() {
  void* lib = nullptr;
  for (const char* name : {"libcublas.so.13", "libcublas.so.12", "libcublas.so"}) {
    lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (lib) break;
  }
  if (!lib) return 0.0;
  using CreateFn = cublasStatus_t (*)(cublasHandle_t*);
  using GemmFn = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int,
                                    int, const void*, const void*, cudaDataType, int, const void*,
                                    cudaDataType, int, const void*, void*, cudaDataType, int,
                                    cublasComputeType_t, cublasGemmAlgo_t);
  auto create = reinterpret_cast<CreateFn>(dlsym(lib, "cublasCreate_v2"));
  auto gemm = reinterpret_cast<GemmFn>(dlsym(lib, "cublasGemmEx"));
  if (!create || !gemm) return 0.0;
  cublasHandle_t handle;
  if (create(&handle) != CUBLAS_STATUS_SUCCESS) return 0.0;
  const int n = 8192;
  const size_t bytes = size_t{2} * n * n;
  void* a = random_device_buffer(bytes, 11, false);
  void* b = random_device_buffer(bytes, 12, false);
  void* c = random_device_buffer(bytes, 13, false);
  const float alpha = 1.f, beta = 0.f;
  cudaEvent_t start, stop;
  cuda_ok(cudaEventCreate(&start), "cudaEventCreate");
  cuda_ok(cudaEventCreate(&stop), "cudaEventCreate");
  std::vector<double> times;
  for (int i = 0; i < 23; ++i) {
    cuda_ok(cudaEventRecord(start), "cudaEventRecord");
    gemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a, CUDA_R_16BF, n, b, CUDA_R_16BF, n,
         &beta, c, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    cuda_ok(cudaEventRecord(stop), "cudaEventRecord");
    cuda_ok(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    cuda_ok(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    if (i >= 3) times.push_back(ms * 1e-3);
  }
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  return 2.0 * n * n * static_cast<double>(n) / median(times) / 1e12;
}

struct BenchResult {
  double ms = 0;
  double tflops = 0;
};

DType kv_dtype_of(const std::string& name) {
  if (name == "bf16") return DType::kBF16;
  if (name == "fp8_e4m3" || name == "fp8") return DType::kFp8E4M3;
  if (name == "int8") return DType::kInt8;
  throw Error("--kv-dtype: accepted bf16, fp8_e4m3, int8; got '" + name + "'");
}

BenchResult run_config(const PrefillBenchConfig& c, int iters) {
  constexpr int kSets = 3;
  const int64_t tokens = static_cast<int64_t>(c.batch) * c.seqlen;
  const int d = c.head_dim;
  const DType kv_dtype = c.page ? kv_dtype_of(c.kv_dtype) : DType::kBF16;
  const bool eight_bit = kv_dtype != DType::kBF16;
  const size_t q_bytes = static_cast<size_t>(tokens) * c.heads * d * 2;
  const size_t kv_elt = eight_bit ? 1 : 2;
  const size_t kv_bytes = static_cast<size_t>(tokens) * c.kv_heads * d * kv_elt;

  AttentionSpec spec;
  spec.num_q_heads = c.heads;
  spec.num_kv_heads = c.kv_heads;
  spec.head_dim = d;
  spec.mask.kind = c.causal ? MaskKind::kCausal : MaskKind::kNone;
  spec.backend = Backend::kFused;

  std::vector<int32_t> cu(c.batch + 1);
  for (int b = 0; b <= c.batch; ++b) cu[b] = b * c.seqlen;
  int32_t* d_cu = nullptr;
  cuda_ok(cudaMalloc(&d_cu, cu.size() * 4), "cudaMalloc");
  cuda_ok(cudaMemcpy(d_cu, cu.data(), cu.size() * 4, cudaMemcpyHostToDevice), "cudaMemcpy");

  // Paged: every sequence's blocks in a shuffled order over one pool per set.
  const int blocks_per_seq = c.page ? (c.seqlen + c.page - 1) / c.page : 0;
  const int num_blocks = blocks_per_seq * c.batch;
  int32_t *d_table = nullptr, *d_lens = nullptr;
  float* d_scale = nullptr;
  if (c.page) {
    std::vector<int32_t> ids(num_blocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), std::mt19937(7));
    std::vector<int32_t> lens(c.batch, c.seqlen);
    cuda_ok(cudaMalloc(&d_table, ids.size() * 4), "cudaMalloc");
    cuda_ok(cudaMalloc(&d_lens, lens.size() * 4), "cudaMalloc");
    cuda_ok(cudaMemcpy(d_table, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
    cuda_ok(cudaMemcpy(d_lens, lens.data(), lens.size() * 4, cudaMemcpyHostToDevice), "cudaMemcpy");
    const float scale = eight_bit ? 0.05f : 1.f;
    cuda_ok(cudaMalloc(&d_scale, 4), "cudaMalloc");
    cuda_ok(cudaMemcpy(d_scale, &scale, 4, cudaMemcpyHostToDevice), "cudaMemcpy");
  }

  std::vector<void*> buffers;
  std::vector<PrefillArgs> args(kSets);
  std::vector<KvCacheView> views(kSets);
  for (int s = 0; s < kSets; ++s) {
    void* q = random_device_buffer(q_bytes, 100 + s, false);
    void* out = random_device_buffer(q_bytes, 200 + s, false);
    buffers.insert(buffers.end(), {q, out});
    PrefillArgs& a = args[s];
    a.q = TensorView(q, DType::kBF16, {tokens, c.heads, d}, Device::cuda(0));
    a.out = TensorView(out, DType::kBF16, {tokens, c.heads, d}, Device::cuda(0));
    a.cu_seqlens_q = TensorView(d_cu, DType::kInt32, {c.batch + 1}, Device::cuda(0));
    a.max_seqlen_q = a.max_seqlen_kv = c.seqlen;
    if (c.page) {
      void* pool = random_device_buffer(2 * kv_bytes, 300 + s, eight_bit);
      buffers.push_back(pool);
      KvCacheView& v = views[s];
      const int64_t block_bytes = static_cast<int64_t>(c.kv_heads) * c.page * d * kv_elt;
      v.k_base = pool;
      v.v_base = static_cast<uint8_t*>(pool) + block_bytes;
      v.block_stride_bytes = 2 * block_bytes;
      v.num_blocks = num_blocks;
      v.dtype = kv_dtype;
      v.device = Device::cuda(0);
      v.num_kv_heads = c.kv_heads;
      v.tokens_per_block = c.page;
      v.head_dim = d;
      v.block_table =
          TensorView(d_table, DType::kInt32, {c.batch, blocks_per_seq}, Device::cuda(0));
      v.seq_lens = TensorView(d_lens, DType::kInt32, {c.batch}, Device::cuda(0));
      if (eight_bit) {
        v.k_scale = TensorView(d_scale, DType::kF32, {1}, Device::cuda(0));
        v.v_scale = TensorView(d_scale, DType::kF32, {1}, Device::cuda(0));
      }
      a.kv_cache = &views[s];
    } else {
      void* k = random_device_buffer(kv_bytes, 300 + s, false);
      void* v = random_device_buffer(kv_bytes, 400 + s, false);
      buffers.insert(buffers.end(), {k, v});
      a.k = TensorView(k, DType::kBF16, {tokens, c.kv_heads, d}, Device::cuda(0));
      a.v = TensorView(v, DType::kBF16, {tokens, c.kv_heads, d}, Device::cuda(0));
      a.cu_seqlens_kv = TensorView(d_cu, DType::kInt32, {c.batch + 1}, Device::cuda(0));
    }
  }

  cudaEvent_t start, stop;
  cuda_ok(cudaEventCreate(&start), "cudaEventCreate");
  cuda_ok(cudaEventCreate(&stop), "cudaEventCreate");
  for (int i = 0; i < 3; ++i) prefill(spec, args[i % kSets]);
  cuda_ok(cudaDeviceSynchronize(), "warm-up");
  std::vector<double> times;
  for (int i = 0; i < std::max(iters, 20); ++i) {
    cuda_ok(cudaEventRecord(start), "cudaEventRecord");
    prefill(spec, args[i % kSets]);
    cuda_ok(cudaEventRecord(stop), "cudaEventRecord");
    cuda_ok(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    cuda_ok(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    times.push_back(ms);
  }
  cuda_ok(cudaGetLastError(), "prefill");
  for (void* b : buffers) cudaFree(b);
  cudaFree(d_cu);
  cudaFree(d_table);
  cudaFree(d_lens);
  cudaFree(d_scale);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  BenchResult r;
  r.ms = median(times);
  r.tflops = flops_of(c) / (r.ms * 1e-3) / 1e12;
  return r;
}

void run_bench(const PrefillBenchOptions& o) {
  std::vector<PrefillBenchConfig> grid;
  if (o.seqlen > 0) {
    PrefillBenchConfig c;
    c.head_dim = o.head_dim;
    c.seqlen = o.seqlen;
    c.batch = o.batch > 0 ? o.batch : std::max(1, kTokens / o.seqlen);
    c.heads = o.heads > 0 ? o.heads : kHidden / o.head_dim;
    c.kv_heads = o.kv_heads > 0 ? o.kv_heads : c.heads;
    c.causal = o.causal;
    c.page = o.page;
    c.kv_dtype = o.kv_dtype;
    grid.push_back(c);
  } else {
    grid = default_grid();
  }
  const double gemm = measure_gemm_tflops();
  nlohmann::json rows = nlohmann::json::array();
  if (!o.json) {
    std::printf("cuBLAS bf16 GEMM 8192^3: %s\n",
                gemm > 0 ? (std::to_string(gemm) + " TFLOP/s").c_str() : "not available");
    std::printf("| impl | D | S | batch | heads | kv_heads | causal | kv | ms | TFLOP/s |%s\n",
                gemm > 0 ? " % GEMM |" : "");
    std::printf("|---|---|---|---|---|---|---|---|---|---|%s\n", gemm > 0 ? "---|" : "");
  }
  for (const PrefillBenchConfig& c : grid) {
    const BenchResult r = run_config(c, o.iters);
    const std::string kv = c.page ? "paged" + std::to_string(c.page) + "-" + c.kv_dtype : "packed";
    if (o.json) {
      rows.push_back({{"impl", "attnkit"},
                      {"head_dim", c.head_dim},
                      {"seqlen", c.seqlen},
                      {"batch", c.batch},
                      {"heads", c.heads},
                      {"kv_heads", c.kv_heads},
                      {"causal", c.causal},
                      {"kv", kv},
                      {"ms", r.ms},
                      {"tflops", r.tflops},
                      {"gemm_tflops", gemm}});
    } else {
      std::printf("| attnkit | %d | %d | %d | %d | %d | %d | %s | %.3f | %.1f |", c.head_dim,
                  c.seqlen, c.batch, c.heads, c.kv_heads, c.causal ? 1 : 0, kv.c_str(), r.ms,
                  r.tflops);
      if (gemm > 0) std::printf(" %.1f%% |", 100.0 * r.tflops / gemm);
      std::printf("\n");
      std::fflush(stdout);
    }
  }
  if (o.json) std::printf("%s\n", rows.dump(1).c_str());
}
#endif

}  // namespace

void register_bench_prefill(CLI::App& bench) {
  auto options = std::make_shared<PrefillBenchOptions>();
  CLI::App* cmd = bench.add_subcommand(
      "prefill",
      "context FMHA TFLOP/s (bf16); without --seqlen runs the default grid (D 64/128/256, "
      "S 512..16k, causal and not, 16k tokens, hidden 2048, plus paged rows)");
  cmd->add_option("--batch", options->batch, "sequences (default 16384 / seqlen)");
  cmd->add_option("--seqlen", options->seqlen, "tokens per sequence (queries = keys)");
  cmd->add_option("--heads", options->heads, "query heads (default 2048 / head_dim)");
  cmd->add_option("--kv-heads", options->kv_heads, "KV heads (default = heads)");
  cmd->add_option("--head-dim", options->head_dim, "64, 80, 96, 128 or 256");
  cmd->add_flag("--causal", options->causal, "causal mask (else none)");
  cmd->add_option("--page", options->page, "paged cache with this page size (0 = packed K/V)");
  cmd->add_option("--kv-dtype", options->kv_dtype, "paged cache dtype: bf16, fp8_e4m3, int8");
  cmd->add_option("--iters", options->iters, "timed calls per row (>= 20)");
  cmd->add_flag("--json", options->json, "print JSON instead of the table");
  cmd->callback([options] {
#if defined(ATTNKIT_WITH_CUDA)
    run_bench(*options);
#else
    (void)options;
    throw Error("bench prefill: this attnkit was built without CUDA");
#endif
  });
}

}  // namespace attnkit::tools
