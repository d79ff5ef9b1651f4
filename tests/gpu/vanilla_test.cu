// The naive GPU kernels (backend=vanilla on CUDA tensors) against an fp64 oracle and the CPU
// reference: decode (paged / contiguous, GQA, every cache dtype with per-tensor and per-head
// scales, masks, sinks, cyclic cache, ALiBi, soft-cap, beams), prefill over the cache (chunked)
// and packed, dense, and the rejections.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "gpu/gpu_case_util.h"

namespace attnkit::test {
namespace {

struct Features {
  const char* name;
  MaskKind mask = MaskKind::kCausal;
  int32_t window = 0;
  int32_t sinks = 0;
  bool alibi = false;
  double softcap = 0.0;
};

AttentionSpec make_spec(int32_t hq, int32_t hkv, int32_t d, const Features& f) {
  AttentionSpec spec;
  spec.num_q_heads = hq;
  spec.num_kv_heads = hkv;
  spec.head_dim = d;
  spec.mask.kind = f.mask;
  spec.mask.window = f.window;
  spec.mask.sink_tokens = f.sinks;
  spec.alibi = f.alibi;
  spec.logit_softcap = f.softcap;
  return spec;
}

const Features kFeatures[] = {
    {"causal"},
    {"window+sinks", MaskKind::kSlidingWindow, 24, 3},
    {"alibi+softcap", MaskKind::kCausal, 0, 0, true, 8.0},
};

struct DecodeCase {
  DType kv_dtype;
  bool per_head_scales;
  int32_t hq, hkv, d, tpb;
  bool paged;
  bool cyclic;  // with the sliding-window features only
  int32_t beam;
};

// Decode of `rows` rows over a random cache: GPU vanilla vs oracle and CPU reference.
void run_decode_case(const DecodeCase& c, const Features& f, std::mt19937_64& rng) {
  const std::string what = std::string("decode ") + dtype_name(c.kv_dtype) + " " + f.name +
                           " hq=" + std::to_string(c.hq) + " hkv=" + std::to_string(c.hkv) +
                           " d=" + std::to_string(c.d) + (c.paged ? " paged" : " contiguous") +
                           (c.cyclic ? " cyclic" : "") + " beam=" + std::to_string(c.beam);
  SCOPED_TRACE(what);
  AttentionSpec spec = make_spec(c.hq, c.hkv, c.d, f);
  const int32_t seqs = 3;
  const int32_t rows = seqs * c.beam;
  const int32_t blocks_per_row = 6;
  const int32_t capacity = blocks_per_row * c.tpb;
  OracleKvCache cache =
      c.paged ? OracleKvCache::paged(c.kv_dtype, c.hkv, c.d, c.tpb, rows, blocks_per_row, rng)
              : OracleKvCache::contiguous(c.kv_dtype, c.hkv, c.d, rows, capacity);
  fill_cache_random(cache, c.kv_dtype, c.hkv, c.per_head_scales, rng);
  // Lengths: 1, a block boundary, and a non-multiple (longer than the window when cyclic).
  std::vector<int32_t> seq_len = {1, c.tpb, capacity - 5};
  if (c.cyclic) {
    const int32_t slots = cyclic_window_slots(f.window, c.tpb);
    cache.make_cyclic(slots, f.sinks);
    seq_len = {1, f.window + 2, 3 * capacity};  // positions far past the capacity wrap around
  }
  for (int32_t r = 0; r < rows; ++r) cache.set_seq_len(r, seq_len[r / c.beam]);
  const int32_t max_seq = c.cyclic ? 3 * capacity : capacity;
  HostTensor indirection;
  if (c.beam > 1) {
    indirection = HostTensor(DType::kInt32, {seqs, c.beam, max_seq});
    std::uniform_int_distribution<int32_t> beam_of(0, c.beam - 1);
    for (int64_t i = 0; i < indirection.numel(); ++i) indirection.data<int32_t>()[i] = beam_of(rng);
  }
  HostTensor q(DType::kBF16, {rows, c.hq, c.d});
  q.fill_uniform(rng, -1.0f, 1.0f);

  // CPU reference.
  HostTensor cpu_out = poisoned(DType::kBF16, {rows, c.hq, c.d});
  HostTensor cpu_lse = poisoned(DType::kF32, {rows, c.hq});
  DecodeArgs args;
  args.q = q;
  args.kv_cache = cache.view();
  args.beam_width = c.beam;
  if (c.beam > 1) args.cache_indirection = indirection;
  args.out = cpu_out;
  args.lse = cpu_lse;
  decode(spec, args);

  // GPU vanilla.
  DeviceKvCache dcache(cache);
  DeviceTensor dq(q), dind, dout(poisoned(DType::kBF16, {rows, c.hq, c.d})),
      dlse(poisoned(DType::kF32, {rows, c.hq}));
  if (c.beam > 1) dind = DeviceTensor(indirection);
  DecodeArgs gargs = args;
  gargs.q = dq;
  gargs.kv_cache = dcache.view();
  if (c.beam > 1) gargs.cache_indirection = dind;
  gargs.out = dout;
  gargs.lse = dlse;
  spec.backend = Backend::kVanilla;
  ASSERT_NO_THROW(decode(spec, gargs));
  ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
  const HostTensor gpu_out = downloaded(dout, cpu_out);
  const HostTensor gpu_lse = downloaded(dlse, cpu_lse);

  // fp64 oracle, row by row (beams gather their keys through the indirection).
  OracleAccumulator oracle;
  for (int32_t r = 0; r < rows; ++r) {
    const int32_t len = seq_len[r / c.beam];
    OracleProblem pr = oracle_problem_of(spec);
    pr.q = head_values(q, int64_t{r} * c.hq * c.d, int64_t{c.hq} * c.d);
    pr.q_positions = {len - 1};
    pr.k.resize(size_t(len) * c.hkv * c.d);
    pr.v.resize(pr.k.size());
    for (int32_t j = 0; j < len; ++j) {
      int32_t src = r;
      if (c.beam > 1) {
        const int32_t s = r / c.beam, b = r % c.beam;
        src = s * c.beam + indirection.data<int32_t>()[(int64_t{s} * c.beam + b) * max_seq + j];
      }
      for (int32_t h = 0; h < c.hkv; ++h) {
        for (int32_t d = 0; d < c.d; ++d) {
          pr.k[(size_t(j) * c.hkv + h) * c.d + d] = cache.read(src, j, h, d, 0);
          pr.v[(size_t(j) * c.hkv + h) * c.d + d] = cache.read(src, j, h, d, 1);
        }
      }
    }
    oracle.add(pr, DType::kBF16);
  }
  expect_attention_matches(what, oracle, gpu_out, &gpu_lse, cpu_out, &cpu_lse);
}

TEST(VanillaDecode, MatchesReferenceOverCacheDtypesAndFeatures) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed());
  const DecodeCase cases[] = {
      {DType::kBF16, false, 8, 2, 64, 16, true, false, 1},
      {DType::kBF16, false, 4, 4, 128, 8, false, false, 1},
      {DType::kFp8E4M3, true, 8, 2, 128, 16, true, false, 1},
      {DType::kInt8, false, 6, 3, 64, 32, true, false, 1},
  };
  for (const DecodeCase& c : cases) {
    for (const Features& f : kFeatures) run_decode_case(c, f, rng);
  }
}

TEST(VanillaDecode, CyclicWindowCache) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() + 1);
  const Features window{"window+sinks", MaskKind::kSlidingWindow, 20, 2};
  run_decode_case({DType::kBF16, false, 4, 2, 64, 8, true, true, 1}, window, rng);
  run_decode_case({DType::kFp8E4M3, true, 4, 1, 128, 16, true, true, 1}, window, rng);
}

TEST(VanillaDecode, BeamsThroughCacheIndirection) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() + 2);
  run_decode_case({DType::kBF16, false, 8, 2, 64, 16, true, false, 2}, kFeatures[0], rng);
  run_decode_case({DType::kInt8, true, 4, 2, 128, 8, true, false, 3}, kFeatures[2], rng);
}

// Prefill over the cache: each sequence's last n_i tokens are queries (chunked context).
void run_paged_prefill_case(DType kv_dtype, const Features& f, std::mt19937_64& rng) {
  const int32_t hq = 8, hkv = 2, d = 64, tpb = 16, blocks_per_row = 5;
  const std::string what = std::string("paged prefill ") + dtype_name(kv_dtype) + " " + f.name;
  SCOPED_TRACE(what);
  AttentionSpec spec = make_spec(hq, hkv, d, f);
  const std::vector<int32_t> kv_len = {1, 33, 80, 17};
  const std::vector<int32_t> q_len = {1, 33, 16, 5};  // whole prompt, chunk after 64, tail
  const int32_t batch = static_cast<int32_t>(kv_len.size());
  OracleKvCache cache = OracleKvCache::paged(kv_dtype, hkv, d, tpb, batch, blocks_per_row, rng);
  fill_cache_random(cache, kv_dtype, hkv, true, rng);
  std::vector<int32_t> cu = {0};
  for (int32_t i = 0; i < batch; ++i) {
    cache.set_seq_len(i, kv_len[i]);
    cu.push_back(cu.back() + q_len[i]);
  }
  const int64_t total_q = cu.back();
  HostTensor q(DType::kBF16, {total_q, hq, d});
  q.fill_uniform(rng, -1.0f, 1.0f);
  HostTensor cu_q = int32_tensor(cu);
  HostTensor cpu_out = poisoned(DType::kBF16, {total_q, hq, d});
  HostTensor cpu_lse = poisoned(DType::kF32, {total_q, hq});
  const KvCacheView host_view = cache.view();
  PrefillArgs args;
  args.q = q;
  args.cu_seqlens_q = cu_q;
  args.kv_cache = &host_view;
  args.out = cpu_out;
  args.lse = cpu_lse;
  prefill(spec, args);

  DeviceKvCache dcache(cache);
  DeviceTensor dq(q), dcu(cu_q), dout(poisoned(DType::kBF16, {total_q, hq, d})),
      dlse(poisoned(DType::kF32, {total_q, hq}));
  PrefillArgs gargs;
  gargs.q = dq;
  gargs.cu_seqlens_q = dcu;
  gargs.kv_cache = &dcache.view();
  gargs.out = dout;
  gargs.lse = dlse;
  gargs.max_seqlen_q = 33;
  gargs.max_seqlen_kv = 80;
  spec.backend = Backend::kVanilla;
  ASSERT_NO_THROW(prefill(spec, gargs));
  ATTNKIT_CUDA_OK(cudaDeviceSynchronize());

  OracleAccumulator oracle;
  for (int32_t i = 0; i < batch; ++i) {
    OracleProblem pr = oracle_problem_of(spec);
    pr.q = head_values(q, int64_t{cu[i]} * hq * d, int64_t{q_len[i]} * hq * d);
    for (int32_t t = 0; t < q_len[i]; ++t) pr.q_positions.push_back(kv_len[i] - q_len[i] + t);
    pr.k = cache.dense(i, kv_len[i], 0);
    pr.v = cache.dense(i, kv_len[i], 1);
    oracle.add(pr, DType::kBF16);
  }
  const HostTensor gpu_lse = downloaded(dlse, cpu_lse);
  expect_attention_matches(what, oracle, downloaded(dout, cpu_out), &gpu_lse, cpu_out, &cpu_lse);
}

TEST(VanillaPrefill, PagedChunkedMatchesReference) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() + 3);
  for (const Features& f : kFeatures) {
    run_paged_prefill_case(DType::kBF16, f, rng);
    run_paged_prefill_case(DType::kFp8E4M3, f, rng);
  }
  run_paged_prefill_case(DType::kInt8, kFeatures[1], rng);
}

TEST(VanillaPrefill, PackedMatchesReference) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() + 4);
  const int32_t hq = 6, hkv = 2, d = 80;
  const Features none{"none", MaskKind::kNone};
  for (const Features& f : {kFeatures[0], kFeatures[1], kFeatures[2], none}) {
    for (DType dtype : {DType::kBF16, DType::kF16}) {
      const std::string what = std::string("packed prefill ") + dtype_name(dtype) + " " + f.name;
      SCOPED_TRACE(what);
      AttentionSpec spec = make_spec(hq, hkv, d, f);
      const std::vector<int32_t> q_len = {1, 40, 7};
      const std::vector<int32_t> kv_len = {1, 40, 29};
      std::vector<int32_t> cu_q = {0}, cu_kv = {0};
      for (size_t i = 0; i < q_len.size(); ++i) {
        cu_q.push_back(cu_q.back() + q_len[i]);
        cu_kv.push_back(cu_kv.back() + kv_len[i]);
      }
      const int64_t tq = cu_q.back(), tkv = cu_kv.back();
      HostTensor q(dtype, {tq, hq, d}), k(dtype, {tkv, hkv, d}), v(dtype, {tkv, hkv, d});
      q.fill_uniform(rng, -1.0f, 1.0f);
      k.fill_uniform(rng, -1.0f, 1.0f);
      v.fill_uniform(rng, -1.0f, 1.0f);
      HostTensor hcu_q = int32_tensor(cu_q), hcu_kv = int32_tensor(cu_kv);
      HostTensor cpu_out = poisoned(dtype, {tq, hq, d});
      HostTensor cpu_lse = poisoned(DType::kF32, {tq, hq});
      PrefillArgs args;
      args.q = q;
      args.k = k;
      args.v = v;
      args.cu_seqlens_q = hcu_q;
      args.cu_seqlens_kv = hcu_kv;
      args.out = cpu_out;
      args.lse = cpu_lse;
      prefill(spec, args);

      DeviceTensor dq(q), dk(k), dv(v), dcq(hcu_q), dckv(hcu_kv),
          dout(poisoned(dtype, {tq, hq, d})), dlse(poisoned(DType::kF32, {tq, hq}));
      PrefillArgs gargs;
      gargs.q = dq;
      gargs.k = dk;
      gargs.v = dv;
      gargs.cu_seqlens_q = dcq;
      gargs.cu_seqlens_kv = dckv;
      gargs.out = dout;
      gargs.lse = dlse;
      gargs.max_seqlen_q = 40;
      gargs.max_seqlen_kv = 40;
      spec.backend = Backend::kVanilla;
      ASSERT_NO_THROW(prefill(spec, gargs));
      ATTNKIT_CUDA_OK(cudaDeviceSynchronize());

      OracleAccumulator oracle;
      for (size_t i = 0; i < q_len.size(); ++i) {
        OracleProblem pr = oracle_problem_of(spec);
        pr.q = head_values(q, int64_t{cu_q[i]} * hq * d, int64_t{q_len[i]} * hq * d);
        for (int32_t t = 0; t < q_len[i]; ++t) pr.q_positions.push_back(kv_len[i] - q_len[i] + t);
        pr.k = head_values(k, int64_t{cu_kv[i]} * hkv * d, int64_t{kv_len[i]} * hkv * d);
        pr.v = head_values(v, int64_t{cu_kv[i]} * hkv * d, int64_t{kv_len[i]} * hkv * d);
        oracle.add(pr, dtype);
      }
      const HostTensor gpu_lse = downloaded(dlse, cpu_lse);
      expect_attention_matches(what, oracle, downloaded(dout, cpu_out), &gpu_lse, cpu_out,
                               &cpu_lse);
    }
  }
}

TEST(VanillaDense, MatchesReference) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() + 5);
  const int32_t b = 2, sq = 37, skv = 50, hq = 4, hkv = 2, d = 128;
  AttentionSpec spec = make_spec(hq, hkv, d, {"none", MaskKind::kNone});
  HostTensor q(DType::kBF16, {b, sq, hq, d}), k(DType::kBF16, {b, skv, hkv, d}),
      v(DType::kBF16, {b, skv, hkv, d});
  q.fill_uniform(rng, -1.0f, 1.0f);
  k.fill_uniform(rng, -1.0f, 1.0f);
  v.fill_uniform(rng, -1.0f, 1.0f);
  HostTensor cpu_out = poisoned(DType::kBF16, {b, sq, hq, d});
  HostTensor cpu_lse = poisoned(DType::kF32, {b, sq, hq});
  DenseArgs args;
  args.q = q;
  args.k = k;
  args.v = v;
  args.out = cpu_out;
  args.lse = cpu_lse;
  dense(spec, args);

  DeviceTensor dq(q), dk(k), dv(v), dout(poisoned(DType::kBF16, {b, sq, hq, d})),
      dlse(poisoned(DType::kF32, {b, sq, hq}));
  DenseArgs gargs;
  gargs.q = dq;
  gargs.k = dk;
  gargs.v = dv;
  gargs.out = dout;
  gargs.lse = dlse;
  spec.backend = Backend::kVanilla;
  ASSERT_NO_THROW(dense(spec, gargs));
  ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
  OracleAccumulator oracle;
  for (int32_t i = 0; i < b; ++i) {
    OracleProblem pr = oracle_problem_of(spec);
    pr.q = head_values(q, int64_t{i} * sq * hq * d, int64_t{sq} * hq * d);
    for (int32_t t = 0; t < sq; ++t) pr.q_positions.push_back(skv - sq + t);
    pr.k = head_values(k, int64_t{i} * skv * hkv * d, int64_t{skv} * hkv * d);
    pr.v = head_values(v, int64_t{i} * skv * hkv * d, int64_t{skv} * hkv * d);
    oracle.add(pr, DType::kBF16);
  }
  const HostTensor gpu_lse = downloaded(dlse, cpu_lse);
  expect_attention_matches("dense", oracle, downloaded(dout, cpu_out), &gpu_lse, cpu_out, &cpu_lse);
}

TEST(VanillaDense, RejectsSkipSoftmaxAndSageWithoutWriting) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() + 6);
  AttentionSpec spec = make_spec(2, 2, 64, {"none", MaskKind::kNone});
  spec.backend = Backend::kVanilla;
  HostTensor q(DType::kBF16, {1, 16, 2, 64});
  q.fill_uniform(rng, -1.0f, 1.0f);
  const HostTensor poison = poisoned(DType::kBF16, {1, 16, 2, 64});
  DeviceTensor dq(q), dk(q), dv(q), dout(poison);
  DenseArgs args;
  args.q = dq;
  args.k = dk;
  args.v = dv;
  args.out = dout;
  for (int variant = 0; variant < 2; ++variant) {
    AttentionSpec s = spec;
    if (variant == 0) {
      s.skip_softmax = SkipSoftmaxSpec{};
      s.skip_softmax->threshold = 0.01;
    } else {
      s.quant = SageQuantSpec{};
    }
    try {
      dense(s, args);
      ADD_FAILURE() << "vanilla dense on CUDA accepted " << (variant ? "SAGE" : "skip_softmax");
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("not implemented"), std::string::npos) << e.what();
    }
  }
  ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
  for (double x : downloaded(dout, poison).to_double()) {
    ASSERT_TRUE(std::isnan(x)) << "output written by a rejected call";
  }
}

TEST(VanillaDecode, RejectsBadInputBeforeLaunch) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() + 7);
  AttentionSpec spec = make_spec(4, 2, 64, kFeatures[0]);
  spec.backend = Backend::kVanilla;
  OracleKvCache cache = OracleKvCache::paged(DType::kBF16, 2, 64, 16, 2, 2, rng);
  fill_cache_random(cache, DType::kBF16, 2, false, rng);
  cache.set_seq_len(0, 5);
  cache.set_seq_len(1, 9);
  DeviceKvCache dcache(cache);
  HostTensor q(DType::kBF16, {2, 4, 64});
  q.fill_uniform(rng, -1.0f, 1.0f);
  const HostTensor poison = poisoned(DType::kBF16, {2, 4, 64});
  DeviceTensor dq(q), dout(poison);
  HostTensor wrong_shape(DType::kBF16, {2, 4, 32});
  DeviceTensor dwrong(wrong_shape);
  DecodeArgs args;
  args.q = dq;
  args.kv_cache = dcache.view();
  args.out = dout;
  // q on the device, out with the wrong head_dim: rejected by validation.
  DecodeArgs bad = args;
  bad.q = dwrong;
  EXPECT_THROW(decode(spec, bad), Error);
  // Cache on the host while q is on the device.
  bad = args;
  bad.kv_cache = cache.view();
  EXPECT_THROW(decode(spec, bad), Error);
  ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
  for (double x : downloaded(dout, poison).to_double()) {
    ASSERT_TRUE(std::isnan(x)) << "output written by a rejected call";
  }
}

}  // namespace
}  // namespace attnkit::test
