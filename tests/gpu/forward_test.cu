// forward() on CUDA against the CPU reference and an fp64 oracle: a packed mixed batch (context
// chunks after cached tokens, a fresh prompt, generation requests with beams and cache
// indirection), a sequence built by chunked prefill then decode steps, a cyclic window cache,
// fp8 caches, the fused and vanilla paths, a caller workspace, and the rejections.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "gpu/forward_case_util.h"
#include "gpu/gpu_case_util.h"

namespace attnkit::test {
namespace {

AttentionSpec llama_like(int32_t hq, int32_t hkv, int32_t d) {
  AttentionSpec spec;
  spec.num_q_heads = hq;
  spec.num_kv_heads = hkv;
  spec.head_dim = d;
  spec.rope.style = RopeStyle::kGptNeox;
  return spec;
}

void fill_finite(OracleKvCache& cache, DType dtype, int32_t hkv, std::mt19937_64& rng) {
  fill_cache_random(cache, dtype, hkv, true, rng);
}

TEST(Forward, MixedBatchWithBeamsMatchesReference) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed());
  const AttentionSpec spec = llama_like(8, 2, 64);
  for (DType kv_dtype : {DType::kBF16, DType::kFp8E4M3}) {
    for (Backend backend : {Backend::kFused, Backend::kVanilla, Backend::kAuto}) {
      // Two context requests (a chunk after 32 cached tokens, a fresh prompt) and two generation
      // requests of beam width 2: rows 0, 1 and 2..5.
      const int32_t tpb = 16, rows = 6, blocks_per_row = 5;
      OracleKvCache cpu_cache =
          OracleKvCache::paged(kv_dtype, 2, 64, tpb, rows, blocks_per_row, rng);
      fill_finite(cpu_cache, kv_dtype, 2, rng);
      DeviceKvCache gpu_cache(cpu_cache);
      Step step;
      step.context_past = {32, 0};
      step.context_len = {20, 7};
      step.generation_past = {40, 9};
      step.beam = 2;
      step.indirection = true;
      step.bias = true;
      step.caller_workspace = backend == Backend::kAuto;
      // The decode rows split (forced 3) through a caller DecodeWorkspace on the auto backend.
      DecodeWorkspace decode_ws(spec, rows, 8, Device::cuda(0));
      if (backend == Backend::kAuto) {
        step.decode_workspace = &decode_ws;
        step.num_splits = 3;
      }
      run_forward_step(
          spec, backend, step, cpu_cache, gpu_cache, rng,
          std::string("mixed batch ") + dtype_name(kv_dtype) + " " + backend_name(backend));
    }
  }
}

TEST(Forward, ChunkedPrefillThenDecodeEqualsReference) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() + 1);
  AttentionSpec spec = llama_like(4, 1, 128);
  spec.rope.style = RopeStyle::kGptJ;
  spec.alibi = true;
  for (Backend backend : {Backend::kFused, Backend::kVanilla}) {
    // The fused steps share one DecodeWorkspace (the heuristic splits the lone decode row).
    DecodeWorkspace decode_ws(spec, 1, DecodeWorkspace::kMaxSplits, Device::cuda(0));
    const int32_t tpb = 16;
    OracleKvCache cpu_cache = OracleKvCache::paged(DType::kBF16, 1, 128, tpb, 1, 4, rng);
    fill_finite(cpu_cache, DType::kBF16, 1, rng);
    DeviceKvCache gpu_cache(cpu_cache);
    int32_t past = 0;
    for (int32_t chunk : {16, 16, 5}) {
      Step step;
      step.context_past = {past};
      step.context_len = {chunk};
      run_forward_step(
          spec, backend, step, cpu_cache, gpu_cache, rng,
          std::string("chunk at ") + std::to_string(past) + " " + backend_name(backend));
      past += chunk;
    }
    for (int i = 0; i < 3; ++i) {
      Step step;
      step.generation_past = {past};
      if (backend == Backend::kFused) step.decode_workspace = &decode_ws;
      run_forward_step(
          spec, backend, step, cpu_cache, gpu_cache, rng,
          std::string("decode at ") + std::to_string(past) + " " + backend_name(backend));
      ++past;
    }
  }
}

TEST(Forward, CyclicWindowCache) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() + 2);
  AttentionSpec spec = llama_like(4, 2, 64);
  spec.mask.kind = MaskKind::kSlidingWindow;
  spec.mask.window = 12;
  spec.mask.sink_tokens = 2;
  const int32_t tpb = 8;
  OracleKvCache cpu_cache = OracleKvCache::paged(DType::kBF16, 2, 64, tpb, 2, 5, rng);
  fill_finite(cpu_cache, DType::kBF16, 2, rng);
  cpu_cache.make_cyclic(cyclic_window_slots(spec.mask.window, tpb), spec.mask.sink_tokens);
  DeviceKvCache gpu_cache(cpu_cache);
  // Row 0: a chunk of 8 far past the window capacity; row 1: a generation step.
  Step step;
  step.context_past = {96};
  step.context_len = {8};
  step.generation_past = {77};
  run_forward_step(spec, Backend::kFused, step, cpu_cache, gpu_cache, rng, "cyclic fused");
}

TEST(Forward, RejectsBadInputWithoutWriting) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() + 3);
  const AttentionSpec spec = llama_like(4, 2, 64);
  OracleKvCache cache = OracleKvCache::paged(DType::kBF16, 2, 64, 16, 1, 2, rng);
  fill_finite(cache, DType::kBF16, 2, rng);
  cache.set_seq_len(0, 5);
  DeviceKvCache dcache(cache);
  const int64_t width = int64_t{4 + 4} * 64;
  HostTensor qkv(DType::kBF16, {5, width});
  qkv.fill_uniform(rng, -1.0f, 1.0f);
  const HostTensor poison = poisoned(DType::kBF16, {5, 4, 64});
  HostTensor hcu = int32_tensor({0, 5}), hpast = int32_tensor({0});
  DeviceTensor dqkv(qkv), dout(poison), dcu(hcu), small(HostTensor(DType::kInt8, {64}));
  ForwardArgs args;
  args.qkv = dqkv;
  args.num_context = 1;
  args.cu_seqlens_q = hcu;
  args.past_lens = hpast;
  args.kv_cache = dcache.view();
  args.out = dout;
  // A workspace that is too small.
  ForwardArgs bad = args;
  bad.workspace = small;
  EXPECT_THROW(forward(spec, bad), Error);
  // cu_seqlens_q on the device (it must be in host memory).
  bad = args;
  bad.cu_seqlens_q = dcu;
  EXPECT_THROW(forward(spec, bad), Error);
  // A generation step (row 0: 4 cached tokens + 1) forced to 4 splits through a decode workspace
  // sized for 2: rejected before append_kv writes the new token.
  bad = args;
  bad.num_context = 0;
  HostTensor hcu1 = int32_tensor({0, 1}), hpast4 = int32_tensor({4});
  bad.cu_seqlens_q = hcu1;
  bad.past_lens = hpast4;
  bad.qkv = TensorView(dqkv.data(), DType::kBF16, {1, width}, Device::cuda(0));
  bad.out = TensorView(dout.data(), DType::kBF16, {1, 4, 64}, Device::cuda(0));
  bad.num_splits = 4;
  DecodeWorkspace two_splits(spec, 1, 2, Device::cuda(0));
  bad.decode_workspace = &two_splits;
  try {
    forward(spec, bad);
    ADD_FAILURE() << "a too small decode_workspace was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("forward: decode_workspace: too small"), std::string::npos)
        << e.what();
  }
  ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
  for (double x : downloaded(dout, poison).to_double()) {
    ASSERT_TRUE(std::isnan(x)) << "output written by a rejected call";
  }
  OracleKvCache after = cache;
  dcache.download_pool(after);
  EXPECT_EQ(after.pool().bytes(), cache.pool().bytes()) << "cache written by a rejected call";
}

// No silent fallback: a part of the step that the fused kernels cannot serve (here head_dim 32:
// the fused append_kv serves it, the fused prefill does not) raises under an explicit backend
// 'fused', before anything is written, and runs on the naive kernels under 'auto'.
TEST(Forward, ExplicitFusedRaisesForAPartItCannotServe) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() + 4);
  AttentionSpec spec = llama_like(4, 2, 32);
  spec.backend = Backend::kFused;
  OracleKvCache cache = OracleKvCache::paged(DType::kBF16, 2, 32, 16, 1, 2, rng);
  fill_finite(cache, DType::kBF16, 2, rng);
  cache.set_seq_len(0, 5);
  DeviceKvCache dcache(cache);
  const int64_t width = int64_t{4 + 4} * 32;
  HostTensor qkv(DType::kBF16, {5, width});
  qkv.fill_uniform(rng, -1.0f, 1.0f);
  const HostTensor poison = poisoned(DType::kBF16, {5, 4, 32});
  HostTensor hcu = int32_tensor({0, 5}), hpast = int32_tensor({0});
  DeviceTensor dqkv(qkv), dout(poison);
  ForwardArgs args;
  args.qkv = dqkv;
  args.num_context = 1;
  args.cu_seqlens_q = hcu;
  args.past_lens = hpast;
  args.kv_cache = dcache.view();
  args.out = dout;
  try {
    forward(spec, args);
    ADD_FAILURE() << "backend 'fused' ran a context part it cannot serve";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot serve the context requests"), std::string::npos)
        << e.what();
  }
  ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
  for (double x : downloaded(dout, poison).to_double()) {
    ASSERT_TRUE(std::isnan(x)) << "output written by a rejected call";
  }
  OracleKvCache after = cache;
  dcache.download_pool(after);
  EXPECT_EQ(after.pool().bytes(), cache.pool().bytes()) << "cache written by a rejected call";
  spec.backend = Backend::kAuto;
  forward(spec, args);
  ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
  for (double x : downloaded(dout, poison).to_double()) {
    ASSERT_TRUE(std::isfinite(x)) << "backend 'auto' left an output row unwritten";
  }
}

}  // namespace
}  // namespace attnkit::test
