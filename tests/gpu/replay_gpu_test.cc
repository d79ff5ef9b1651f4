// The replay engine (tools/replay_engine.cc) on the GPU: the activations the device generates are
// bit-identical to the host's function, and a short replay through the CUDA backend passes its
// checks (which can fail), is deterministic, and reports the time inside forward().
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "gpu/gpu_util.h"
#include "replay_activations.h"
#include "replay_device.h"
#include "replay_engine.h"

namespace attnkit::tools {
namespace {

using attnkit::test::test_seed;

// `layers` layers of `n` tokens generated on the device, compared with replay_act on the host.
void expect_device_matches_host(uint64_t seed, int64_t n, int32_t layers, int64_t width,
                                std::mt19937_64& rng) {
  SCOPED_TRACE("seed " + std::to_string(seed) + ", " + std::to_string(n) + " tokens, " +
               std::to_string(layers) + " layers, width " + std::to_string(width));
  std::vector<int32_t> tokens(static_cast<size_t>(n)), positions(static_cast<size_t>(n));
  std::uniform_int_distribution<int32_t> any_token(0, std::numeric_limits<int32_t>::max());
  std::uniform_int_distribution<int32_t> any_position(0, 1 << 20);
  for (int64_t t = 0; t < n; ++t) {
    tokens[t] = any_token(rng);
    positions[t] = any_position(rng);
  }
  tokens[0] = 0;  // the extremes of both
  positions[0] = 0;
  tokens[n - 1] = std::numeric_limits<int32_t>::max();
  const size_t out_elems = static_cast<size_t>(layers * n * width);
  int32_t *tokens_dev = nullptr, *positions_dev = nullptr;
  uint16_t* out_dev = nullptr;
  ATTNKIT_CUDA_OK(cudaMalloc(&tokens_dev, tokens.size() * 4));
  ATTNKIT_CUDA_OK(cudaMalloc(&positions_dev, positions.size() * 4));
  ATTNKIT_CUDA_OK(cudaMalloc(&out_dev, out_elems * 2));
  ATTNKIT_CUDA_OK(cudaMemcpy(tokens_dev, tokens.data(), tokens.size() * 4, cudaMemcpyHostToDevice));
  ATTNKIT_CUDA_OK(
      cudaMemcpy(positions_dev, positions.data(), positions.size() * 4, cudaMemcpyHostToDevice));
  ATTNKIT_CUDA_OK(cudaMemset(out_dev, 0xff, out_elems * 2));  // unwritten elements mismatch
  const uint64_t key = replay_act::seed_key(seed);
  generate_activations_cuda(tokens_dev, positions_dev, n, layers, width, key, out_dev, nullptr);
  std::vector<uint16_t> out(out_elems);
  ATTNKIT_CUDA_OK(cudaMemcpy(out.data(), out_dev, out_elems * 2, cudaMemcpyDeviceToHost));
  cudaFree(tokens_dev);
  cudaFree(positions_dev);
  cudaFree(out_dev);

  int64_t mismatches = 0;
  std::string first;
  std::set<uint16_t> distinct;
  for (int32_t l = 0; l < layers; ++l) {
    for (int64_t t = 0; t < n; ++t) {
      const uint64_t row = replay_act::row_key(key, tokens[t], positions[t]);
      for (int64_t i = 0; i < width; ++i) {
        const uint16_t want = replay_act::layer_element(row, l, width, i);
        const uint16_t got = out[static_cast<size_t>((l * n + t) * width + i)];
        if (distinct.size() < 4096) distinct.insert(want);
        if (got != want && mismatches++ == 0) {
          first = "layer " + std::to_string(l) + " token " + std::to_string(t) + " element " +
                  std::to_string(i) + ": device " + std::to_string(got) + ", host " +
                  std::to_string(want);
        }
      }
    }
  }
  EXPECT_EQ(mismatches, 0) << first;
  // Uniform in [-1, 1) as bf16: many distinct values, not a constant that would match trivially.
  EXPECT_GT(distinct.size(), std::min<size_t>(1000, static_cast<size_t>(layers * n * width) / 4));
}

TEST(ReplayGpu, DeviceActivationsMatchHostBits) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed());
  // Llama-3-8B's row ((32 + 2 * 8) * 128) and a small GQA one over several layers; a width that
  // is no multiple of the kernel's 256 threads nor of the layer shift 97; more tokens than the
  // kernel has CTAs (its grid-stride loop); a row past 48 KB of shared memory (its opt-in).
  expect_device_matches_host(rng(), 257, 6, 6144, rng);
  expect_device_matches_host(rng(), 300, 5, (4 + 2 * 2) * 64, rng);
  expect_device_matches_host(rng(), 1000, 4, 63, rng);
  expect_device_matches_host(rng(), 17000, 2, 40, rng);
  expect_device_matches_host(rng(), 3, 3, 30000, rng);
}

TEST(ReplayGpu, DeviceActivationsRejectAnUnsupportedWidth) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  EXPECT_THROW(generate_activations_cuda(nullptr, nullptr, 1, 1, kMaxDeviceActivationWidth + 1, 1,
                                         nullptr, nullptr),
               Error);
}

// Llama-3-8B's heads (the fused kernels of every build serve D = 128 bf16), few layers and short
// prompts; a pool small enough for evictions and host-tier traffic whatever the seed: 20 requests
// of at least 160 + 100 prompt tokens fill more than 128 distinct full blocks of 16 tokens (the
// 3 system prompts' 30 shared, at least 6 of each request's own), the pool holds 128.
ReplayOptions gpu_options() {
  ReplayOptions o;
  o.layers = 3;
  o.num_q_heads = 32;
  o.num_kv_heads = 8;
  o.head_dim = 128;
  o.seed = test_seed();
  o.requests = 20;
  o.arrival_rate = 2.0;
  o.system_prompts = 3;
  o.system_prompt_len = 160;
  o.min_user_len = 100;
  o.max_user_len = 300;
  o.min_output_len = 1;
  o.max_output_len = 20;
  o.beam_fraction = 0.3;
  o.beam_width = 3;
  o.max_batch_tokens = 384;
  o.max_batch_requests = 10;
  o.tokens_per_block = 16;
  o.cache_tokens = 2048;
  o.host_cache_mb = 8;
  o.device = Device::cuda(0);
  o.check_every = 1;
  o.check_rows = 3;
  o.check_threads = 4;
  return o;
}

TEST(ReplayGpu, ShortReplayPassesChecksAndReportsForwardTime) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  const ReplayOptions o = gpu_options();
  const ReplayResult r = run_replay(o);
  EXPECT_EQ(r.requests, o.requests);
  EXPECT_EQ(r.checks_failed, 0) << (r.failures.empty() ? "" : r.failures.front());
  EXPECT_GT(r.checks_passed, r.steps);  // every step, at least one sequence per batch
  EXPECT_EQ(r.cache.used_blocks, 0);
  EXPECT_GT(r.cache.hits, 0);
  EXPECT_GT(r.cache.evictions, 0);
  EXPECT_GT(r.forward_seconds, 0.0);
  EXPECT_LT(r.forward_seconds, r.wall_seconds);
  ASSERT_EQ(static_cast<int64_t>(r.step_log.size()), r.steps);
  int64_t context = 0, generation = 0;
  double forward = 0;
  for (const ReplayStep& step : r.step_log) {
    context += step.context_tokens;
    generation += step.generation_tokens;
    forward += step.forward_seconds;
    EXPECT_GT(step.forward_seconds, 0.0);
  }
  EXPECT_EQ(context, r.computed_prompt_tokens);
  EXPECT_EQ(generation, r.decode_tokens);
  EXPECT_NEAR(forward, r.forward_seconds, 1e-9 * static_cast<double>(r.steps) + 1e-12);
  const double fraction = r.forward_seconds / r.wall_seconds;
  std::printf(
      "[ ReplayGpu ] %lld steps, %lld checks: forward %.3f s of %.3f s wall (%.1f%%), "
      "checks %.3f s waited (%.2f s computed), %.0f tokens/s in forward\n",
      static_cast<long long>(r.steps), static_cast<long long>(r.checks_passed), r.forward_seconds,
      r.wall_seconds, 100.0 * fraction, r.check_seconds, r.check_cpu_seconds,
      static_cast<double>(r.computed_prompt_tokens + r.decode_tokens) / r.forward_seconds);
  ::testing::Test::RecordProperty("forward_fraction", std::to_string(fraction));
}

TEST(ReplayGpu, RunsAreDeterministicWithInlineOrPooledChecks) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  ReplayOptions o = gpu_options();
  o.requests = 10;
  o.check_every = 2;
  const ReplayResult pooled = run_replay(o);
  o.check_threads = 0;
  const ReplayResult inline_checks = run_replay(o);
  EXPECT_EQ(pooled.trace_digest, inline_checks.trace_digest);
  EXPECT_EQ(pooled.checks_passed, inline_checks.checks_passed);
  EXPECT_EQ(pooled.checks_failed, 0);
  EXPECT_EQ(inline_checks.checks_failed, 0);
  EXPECT_EQ(pooled.max_check_error, inline_checks.max_check_error);
  EXPECT_EQ(pooled.steps, inline_checks.steps);
}

TEST(ReplayGpu, QuantizedCachePassesChecks) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  for (DType dtype : {DType::kFp8E4M3, DType::kInt8}) {
    ReplayOptions o = gpu_options();
    o.requests = 6;
    o.kv_dtype = dtype;
    const ReplayResult r = run_replay(o);
    EXPECT_EQ(r.checks_failed, 0) << dtype_name(dtype) << ": "
                                  << (r.failures.empty() ? "" : r.failures.front());
    EXPECT_GT(r.checks_passed, 0) << dtype_name(dtype);
  }
}

TEST(ReplayGpu, CorruptedOutputFailsTheCheck) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  ReplayOptions o = gpu_options();
  o.requests = 4;
  o.inject_fault = true;
  const ReplayResult r = run_replay(o);
  EXPECT_GT(r.checks_failed, 0);
  ASSERT_FALSE(r.failures.empty());
  EXPECT_NE(r.failures.front().find("tolerance"), std::string::npos) << r.failures.front();
}

}  // namespace
}  // namespace attnkit::tools
