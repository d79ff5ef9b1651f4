// `attnkit bench append`: fused append_kv bandwidth (DESIGN.md section 7). Bytes that must move
// (fused QKV read, rotated Q written, K and V written at the cache dtype) / kernel time, next to
// a device-to-device copy of the same bytes measured in the same run. CUDA events, warm-up,
// median of 21 samples of 4 back-to-back calls, two input sets of ~200 MB (past the 60 MB L2),
// non-zero data.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "check_support.h"
#include "commands.h"

#if defined(ATTNKIT_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace attnkit::tools {
namespace {

#if defined(ATTNKIT_WITH_CUDA)
void cuda_ok(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw Error(std::string("bench append: ") + what + ": " + cudaGetErrorString(status));
}

struct AppendBenchResult {
  double ms = 0, tbs = 0, copy_tbs = 0;
};

AppendBenchResult bench_one(DType kv_dtype, int64_t tokens, int32_t hq, int32_t hkv, int32_t d,
                            int32_t page) {
  constexpr int kSets = 2, kWarmup = 3, kRuns = 21, kBatch = 4;
  AttentionSpec spec;
  spec.num_q_heads = hq;
  spec.num_kv_heads = hkv;
  spec.head_dim = d;
  spec.rope.style = RopeStyle::kGptNeox;
  spec.backend = Backend::kFused;
  const int64_t width = int64_t{hq + 2 * hkv} * d;
  const int32_t rows = static_cast<int32_t>(std::max<int64_t>(1, tokens / 1024));
  const int64_t tokens_per_row = tokens / rows;
  const int32_t blocks_per_row = static_cast<int32_t>((tokens_per_row + page - 1) / page);
  const int64_t blocks = int64_t{rows} * blocks_per_row;
  std::mt19937_64 rng(12345);
  std::vector<Tensor> qkv;
  for (int s = 0; s < kSets; ++s) {
    qkv.emplace_back(DType::kBF16, std::vector<int64_t>{tokens, width});
    qkv.back().fill_uniform(rng, -1.f, 1.f);
  }
  Tensor positions(DType::kInt32, {tokens}), row_of(DType::kInt32, {tokens});
  for (int64_t t = 0; t < tokens; ++t) {
    positions.ints()[t] = static_cast<int32_t>(t % tokens_per_row);
    row_of.ints()[t] = static_cast<int32_t>(t / tokens_per_row);
  }
  Tensor table(DType::kInt32, {rows, blocks_per_row});
  std::iota(table.ints(), table.ints() + blocks, 0);
  std::shuffle(table.ints(), table.ints() + blocks, rng);
  Tensor scale(DType::kF32, {1});
  scale.set(0, 0.05f);
  const Device gpu = Device::cuda(0);
  const int64_t block_bytes = 2 * int64_t{hkv} * page * d * int64_t(dtype_size(kv_dtype));
  std::vector<void*> q_out(kSets), pools(kSets);
  for (int s = 0; s < kSets; ++s) {
    cuda_ok(cudaMalloc(&q_out[s], tokens * hq * d * 2), "cudaMalloc");
    cuda_ok(cudaMalloc(&pools[s], blocks * block_bytes), "cudaMalloc");
  }
  std::vector<AppendKvArgs> args(kSets);
  for (int s = 0; s < kSets; ++s) {
    AppendKvArgs& a = args[s];
    a.qkv = qkv[s].on(gpu);
    a.positions = positions.on(gpu);
    a.row_of_token = row_of.on(gpu);
    a.q_out = TensorView(q_out[s], DType::kBF16, {tokens, hq, d}, gpu);
    KvCacheView& v = a.kv_cache;
    v.k_base = pools[s];
    v.v_base = static_cast<uint8_t*>(pools[s]) + block_bytes / 2;
    v.block_stride_bytes = block_bytes;
    v.num_blocks = static_cast<int32_t>(blocks);
    v.dtype = kv_dtype;
    v.device = gpu;
    v.num_kv_heads = hkv;
    v.tokens_per_block = page;
    v.head_dim = d;
    v.block_table = table.on(gpu);
    if (kv_dtype == DType::kFp8E4M3 || kv_dtype == DType::kInt8) {
      v.k_scale = scale.on(gpu);
      v.v_scale = v.k_scale;
    }
  }
  const double bytes =
      static_cast<double>(tokens) *
      (width * 2 + int64_t{hq} * d * 2 + 2 * int64_t{hkv} * d * int64_t(dtype_size(kv_dtype)));
  cudaEvent_t start, stop;
  cuda_ok(cudaEventCreate(&start), "cudaEventCreate");
  cuda_ok(cudaEventCreate(&stop), "cudaEventCreate");
  auto median_ms = [&](auto&& launch) {
    std::vector<float> times;
    for (int i = 0; i < kWarmup + kRuns; ++i) {
      cudaEventRecord(start);
      for (int b = 0; b < kBatch; ++b) launch((i * kBatch + b) % kSets);
      cudaEventRecord(stop);
      cuda_ok(cudaEventSynchronize(stop), "kernel");
      float ms = 0;
      cudaEventElapsedTime(&ms, start, stop);
      if (i >= kWarmup) times.push_back(ms / kBatch);
    }
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
  };
  AppendBenchResult result;
  result.ms = median_ms([&](int s) { append_kv(spec, args[s]); });
  // The copy reads bytes/2 and writes bytes/2: the same traffic.
  const size_t copy_bytes = static_cast<size_t>(bytes / 2);
  void *src = nullptr, *dst = nullptr;
  cuda_ok(cudaMalloc(&src, copy_bytes * kSets), "cudaMalloc");
  cuda_ok(cudaMalloc(&dst, copy_bytes * kSets), "cudaMalloc");
  cuda_ok(cudaMemset(src, 0x3c, copy_bytes * kSets), "cudaMemset");
  const double copy_ms = median_ms([&](int s) {
    cudaMemcpyAsync(static_cast<uint8_t*>(dst) + s * copy_bytes,
                    static_cast<uint8_t*>(src) + s * copy_bytes, copy_bytes,
                    cudaMemcpyDeviceToDevice);
  });
  for (void* p : {src, dst}) cudaFree(p);
  for (int s = 0; s < kSets; ++s) {
    cudaFree(q_out[s]);
    cudaFree(pools[s]);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  result.tbs = bytes / (result.ms * 1e-3) / 1e12;
  result.copy_tbs = bytes / (copy_ms * 1e-3) / 1e12;
  return result;
}
#endif

}  // namespace

void register_bench_append(CLI::App& bench) {
  CLI::App* cmd = bench.add_subcommand("append", "fused append_kv bandwidth vs a D2D copy");
  static int64_t tokens = 16384;
  static int32_t hq = 32, hkv = 8, d = 128, page = 64;
  cmd->add_option("--tokens", tokens, "tokens per call");
  cmd->add_option("--q-heads", hq);
  cmd->add_option("--kv-heads", hkv);
  cmd->add_option("--head-dim", d);
  cmd->add_option("--page", page);
  cmd->callback([] {
#if defined(ATTNKIT_WITH_CUDA)
    if (cuda_devices().empty()) throw Error("bench append: no CUDA device visible");
    std::printf(
        "append_kv (fused QKV bf16 + GPT-NeoX RoPE), tokens=%lld Hq=%d Hkv=%d D=%d page=%d\n",
        static_cast<long long>(tokens), hq, hkv, d, page);
    std::printf("%-9s %-10s %-12s %-14s %s\n", "kv", "ms", "TB/s", "copy TB/s", "fraction");
    for (DType kv : {DType::kBF16, DType::kFp8E4M3, DType::kInt8}) {
      const auto r = bench_one(kv, tokens, hq, hkv, d, page);
      std::printf("%-9s %-10.3f %-12.2f %-14.2f %.2f\n", dtype_name(kv), r.ms, r.tbs, r.copy_tbs,
                  r.tbs / r.copy_tbs);
    }
#else
    throw Error("bench append: attnkit was built without the CUDA backend");
#endif
  });
}

}  // namespace attnkit::tools
