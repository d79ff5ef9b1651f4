// Reference prefill / decode / merge_states against brute-force fp64 attention, and the
// equivalences of docs/testing.md (paged == contiguous, GQA == MHA with repeated KV heads,
// beam indirection == gathered caches, merge of two halves == whole).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "common/reference_oracle.h"
#include "common/test_util.h"

namespace attnkit::test {
namespace {

AttentionSpec make_spec(int32_t hq, int32_t hkv, int32_t d, MaskSpec mask) {
  AttentionSpec spec;
  spec.num_q_heads = hq;
  spec.num_kv_heads = hkv;
  spec.head_dim = d;
  spec.mask = mask;
  return spec;
}

MaskSpec causal() { return {MaskKind::kCausal, 0, 0}; }
MaskSpec no_mask() { return {MaskKind::kNone, 0, 0}; }
MaskSpec window(int32_t w, int32_t sinks) { return {MaskKind::kSlidingWindow, w, sinks}; }

struct SeqLen {
  int64_t q;
  int64_t kv;
};

// Packed prefill on fresh random data against the oracle, sequence by sequence. `slopes` are the
// ALiBi slopes the oracle uses (the test's own expectation), empty without ALiBi.
void check_packed_prefill(const AttentionSpec& spec, const std::vector<SeqLen>& seqs, DType dtype,
                          const std::vector<double>& slopes, double value_range = 1.0) {
  SCOPED_TRACE(::testing::Message()
               << "dtype " << dtype_name(dtype) << " mask " << mask_name(spec.mask.kind)
               << " W=" << spec.mask.window << " S=" << spec.mask.sink_tokens);
  std::mt19937_64 rng(test_seed());
  const int32_t hq = spec.num_q_heads, hkv = spec.num_kv_heads, d = spec.head_dim;
  std::vector<int32_t> cu_q{0}, cu_kv{0};
  for (const SeqLen& s : seqs) {
    cu_q.push_back(cu_q.back() + static_cast<int32_t>(s.q));
    cu_kv.push_back(cu_kv.back() + static_cast<int32_t>(s.kv));
  }
  const int64_t total_q = cu_q.back(), total_kv = cu_kv.back();
  const std::vector<double> q =
      rounded_to(dtype, random_values(rng, total_q * hq * d, -value_range, value_range));
  const std::vector<double> k =
      rounded_to(dtype, random_values(rng, total_kv * hkv * d, -value_range, value_range));
  const std::vector<double> v = rounded_to(dtype, random_values(rng, total_kv * hkv * d, -1, 1));
  HostTensor tq = tensor_from(dtype, {total_q, hq, d}, q);
  HostTensor tk = tensor_from(dtype, {total_kv, hkv, d}, k);
  HostTensor tv = tensor_from(dtype, {total_kv, hkv, d}, v);
  HostTensor out(dtype, {total_q, hq, d}), lse(DType::kF32, {total_q, hq});
  out.fill(NAN);
  lse.fill(NAN);
  HostTensor tcu_q = int32_tensor(cu_q), tcu_kv = int32_tensor(cu_kv);
  PrefillArgs args;
  args.q = tq;
  args.k = tk;
  args.v = tv;
  args.cu_seqlens_q = tcu_q;
  args.cu_seqlens_kv = tcu_kv;
  args.out = out;
  args.lse = lse;
  call::prefill(spec, args);

  const std::vector<double> got = out.to_double(), got_lse = lse.to_double();
  for (size_t i = 0; i < seqs.size(); ++i) {
    OracleProblem pr;
    pr.num_q_heads = hq;
    pr.num_kv_heads = hkv;
    pr.head_dim = d;
    pr.q.assign(q.begin() + cu_q[i] * hq * d, q.begin() + cu_q[i + 1] * hq * d);
    pr.k.assign(k.begin() + cu_kv[i] * hkv * d, k.begin() + cu_kv[i + 1] * hkv * d);
    pr.v.assign(v.begin() + cu_kv[i] * hkv * d, v.begin() + cu_kv[i + 1] * hkv * d);
    for (int64_t t = 0; t < seqs[i].q; ++t) pr.q_positions.push_back(seqs[i].kv - seqs[i].q + t);
    pr.mask = spec.mask;
    pr.scale = spec.softmax_scale;
    pr.softcap = spec.logit_softcap;
    pr.alibi_slopes = slopes;
    const OracleResult ref = brute_force_attention(pr);
    const std::vector<double> naive =
        dtype == DType::kF32 ? ref.out : naive_same_precision(pr, dtype);
    const double naive_err = max_abs_diff(naive, ref.out);
    double max_err = 0.0;
    for (size_t e = 0; e < ref.out.size(); ++e) {
      const double g = got[cu_q[i] * hq * d + e];
      ASSERT_FALSE(std::isnan(g)) << "sequence " << i << " element " << e << " not written";
      const double err = std::fabs(g - ref.out[e]);
      max_err = std::max(max_err, err);
      ASSERT_LE(err, rounding_bound(dtype, ref.out[e]))
          << "sequence " << i << " element " << e << " got " << g << " want " << ref.out[e];
    }
    if (dtype != DType::kF32) EXPECT_LE(max_err, 2 * naive_err + 1e-3) << "docs/testing.md rule";
    const std::vector<double> seq_lse(got_lse.begin() + cu_q[i] * hq,
                                      got_lse.begin() + cu_q[i + 1] * hq);
    bool inf_ok = false;
    EXPECT_LE(max_abs_diff_lse(seq_lse, ref.lse, &inf_ok), 1e-5) << "sequence " << i;
    EXPECT_TRUE(inf_ok) << "sequence " << i << ": -inf LSE rows differ";
  }
}

const std::vector<SeqLen> kSelfAndChunks = {{1, 1}, {7, 7}, {16, 16}, {4, 21}, {1, 9}, {0, 3}};

TEST(ReferencePrefill, CausalMatchesOracle) {
  check_packed_prefill(make_spec(4, 4, 32, causal()), kSelfAndChunks, DType::kF32, {});
}

TEST(ReferencePrefill, SlidingWindowMatchesOracle) {
  check_packed_prefill(make_spec(4, 2, 32, window(5, 0)), kSelfAndChunks, DType::kF32, {});
  check_packed_prefill(make_spec(4, 2, 32, window(1, 0)), kSelfAndChunks, DType::kF32, {});
}

TEST(ReferencePrefill, SlidingWindowWithSinksMatchesOracle) {
  check_packed_prefill(make_spec(4, 2, 32, window(5, 2)), kSelfAndChunks, DType::kF32, {});
  check_packed_prefill(make_spec(2, 1, 16, window(3, 7)), kSelfAndChunks, DType::kF32, {});
}

TEST(ReferencePrefill, NoMaskAndCrossAttentionMatchOracle) {
  check_packed_prefill(make_spec(4, 4, 32, no_mask()), {{5, 5}, {3, 11}, {12, 5}, {1, 1}, {9, 2}},
                       DType::kF32, {});
}

TEST(ReferencePrefill, GqaAndMqaMatchOracle) {
  check_packed_prefill(make_spec(8, 2, 16, causal()), kSelfAndChunks, DType::kF32, {});
  check_packed_prefill(make_spec(6, 1, 16, causal()), kSelfAndChunks, DType::kF32, {});
}

TEST(ReferencePrefill, Bf16AndF16WithinRoundingAndDesignRule) {
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    check_packed_prefill(make_spec(4, 2, 64, causal()), {{9, 9}, {5, 17}, {1, 1}}, dtype, {});
    check_packed_prefill(make_spec(4, 2, 64, window(4, 1)), {{13, 13}}, dtype, {});
  }
}

TEST(ReferencePrefill, StridedViewsIntoFusedQkvEqualContiguousCopies) {
  std::mt19937_64 rng(test_seed());
  const int32_t hq = 4, hkv = 2, d = 16, n = 11, width = (hq + 2 * hkv) * d;
  const AttentionSpec spec = make_spec(hq, hkv, d, causal());
  HostTensor qkv(DType::kBF16, {n, width});
  qkv.fill_uniform(rng, -1, 1);
  // q / k / v as views into the fused rows (row stride = width), and contiguous copies.
  auto strided = [&](int32_t first_head, int32_t heads) {
    return TensorView(qkv.data<uint16_t>() + first_head * d, DType::kBF16, {n, heads, d},
                      {width, d, 1});
  };
  HostTensor q(DType::kBF16, {n, hq, d}), k(DType::kBF16, {n, hkv, d}),
      v(DType::kBF16, {n, hkv, d});
  for (int32_t t = 0; t < n; ++t) {
    for (int32_t c = 0; c < width; ++c) {
      const float x = qkv.get(t * width + c);
      if (c < hq * d) {
        q.set(t * hq * d + c, x);
      } else if (c < (hq + hkv) * d) {
        k.set(t * hkv * d + c - hq * d, x);
      } else {
        v.set(t * hkv * d + c - (hq + hkv) * d, x);
      }
    }
  }
  HostTensor cu = int32_tensor({0, n});
  // Output into a wider buffer (row stride 2 * Hq * D) to exercise strided writes too.
  HostTensor wide(DType::kBF16, {n, 2 * hq * d}), out(DType::kBF16, {n, hq, d});
  wide.fill(NAN);
  out.fill(NAN);
  PrefillArgs args;
  args.q = strided(0, hq);
  args.k = strided(hq, hkv);
  args.v = strided(hq + hkv, hkv);
  args.cu_seqlens_q = cu;
  args.cu_seqlens_kv = cu;
  args.out = TensorView(wide.data<uint16_t>(), DType::kBF16, {n, hq, d}, {2 * hq * d, d, 1});
  call::prefill(spec, args);
  args.q = q;
  args.k = k;
  args.v = v;
  args.out = out;
  call::prefill(spec, args);
  for (int32_t t = 0; t < n; ++t) {
    for (int32_t e = 0; e < hq * d; ++e) {
      ASSERT_EQ(wide.get(t * 2 * hq * d + e), out.get(t * hq * d + e)) << t << " " << e;
      ASSERT_TRUE(std::isnan(wide.get(t * 2 * hq * d + hq * d + e))) << "wrote past the view";
    }
  }
}

// Expected default slopes written out: m = 8 heads -> 2^-1 .. 2^-8; 12 heads -> those 8 and
// then the odd powers 2^(-4(2k+1)/8) = 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5.
std::vector<double> expected_slopes(int heads) {
  std::vector<double> s;
  for (int h = 1; h <= 8; ++h) s.push_back(std::ldexp(1.0, -h));
  if (heads == 12) {
    for (double e : {-0.5, -1.5, -2.5, -3.5}) s.push_back(std::exp2(e));
  }
  return s;
}

TEST(ReferencePrefill, DefaultAlibiSlopesAreTheDesignFormula) {
  for (int heads : {8, 12}) {
    const std::vector<float> got = default_alibi_slopes(heads);
    const std::vector<double> want = expected_slopes(heads);
    ASSERT_EQ(got.size(), want.size());
    for (size_t h = 0; h < want.size(); ++h) {
      EXPECT_EQ(got[h], static_cast<float>(want[h])) << heads << " heads, head " << h;
    }
  }
}

TEST(ReferencePrefill, AlibiMatchesOracle) {
  for (int heads : {8, 12}) {
    AttentionSpec spec = make_spec(heads, heads / 4, 16, causal());
    spec.alibi = true;
    std::vector<double> slopes;
    for (float s : default_alibi_slopes(heads)) slopes.push_back(s);
    ASSERT_EQ(slopes.size(), expected_slopes(heads).size());
    check_packed_prefill(spec, {{6, 6}, {3, 12}, {1, 5}}, DType::kF32, slopes, 2.0);
  }
  // User slopes, with a window and no mask (ALiBi with j > p gives positive bias).
  AttentionSpec spec = make_spec(4, 4, 16, window(4, 1));
  spec.alibi = true;
  spec.alibi_slopes = {0.9f, -0.25f, 0.0f, 1.5f};
  check_packed_prefill(spec, {{8, 8}, {3, 10}}, DType::kF32, {0.9, -0.25, 0.0, 1.5}, 2.0);
  spec.mask = no_mask();
  check_packed_prefill(spec, {{5, 9}, {7, 3}}, DType::kF32, {0.9, -0.25, 0.0, 1.5}, 2.0);
}

TEST(ReferencePrefill, SoftcapMatchesOracle) {
  AttentionSpec spec = make_spec(4, 2, 32, causal());
  spec.logit_softcap = 0.7;
  check_packed_prefill(spec, {{7, 7}, {4, 11}}, DType::kF32, {}, 3.0);
  // Soft-cap before ALiBi: with both, the order of operations matters.
  spec.alibi = true;
  spec.alibi_slopes = {0.5f, 0.25f, 2.0f, 1.0f};
  spec.softmax_scale = 0.3;
  check_packed_prefill(spec, {{7, 7}, {4, 11}}, DType::kF32, {0.5, 0.25, 2.0, 1.0}, 3.0);
}

TEST(ReferencePrefill, FullyMaskedRowsGiveZerosAndNegInfLse) {
  // A sequence without keys (mask none, so more queries than keys is accepted): every row of it
  // attends nothing.
  const AttentionSpec spec = make_spec(2, 2, 16, no_mask());
  check_packed_prefill(spec, {{3, 0}, {2, 4}}, DType::kF32, {});
  std::mt19937_64 rng(test_seed());
  HostTensor q(DType::kF32, {2, 2, 16}), k(DType::kF32, {1, 2, 16}), v(DType::kF32, {1, 2, 16});
  q.fill_uniform(rng, -1, 1);
  k.fill_uniform(rng, -1, 1);
  v.fill_uniform(rng, -1, 1);
  HostTensor out(DType::kF32, {2, 2, 16}), lse(DType::kF32, {2, 2});
  out.fill(NAN);
  lse.fill(NAN);
  HostTensor cu_q = int32_tensor({0, 1, 2}), cu_kv = int32_tensor({0, 0, 1});
  PrefillArgs args;
  args.q = q;
  args.k = k;
  args.v = v;
  args.cu_seqlens_q = cu_q;
  args.cu_seqlens_kv = cu_kv;
  args.out = out;
  args.lse = lse;
  call::prefill(spec, args);
  for (int64_t e = 0; e < 2 * 16; ++e) EXPECT_EQ(out.get(e), 0.0f) << e;  // query 0: no keys
  EXPECT_EQ(lse.get(0), -INFINITY);
  EXPECT_EQ(lse.get(1), -INFINITY);
  EXPECT_TRUE(std::isfinite(lse.get(2)));
  EXPECT_FALSE(any_nan(out.to_double()));
}

// ---- paged cache: decode and prefill ----------------------------------------------------------

// Fills rows of `cache` with random K/V for positions 0 .. lens[r]-1 and returns them, as the
// cache reads them back (dequantized), per row: [len, Hkv, D].
struct RowKv {
  std::vector<double> k, v;
};
std::vector<RowKv> fill_cache(OracleKvCache& cache, const std::vector<int32_t>& lens, int32_t hkv,
                              int32_t d, std::mt19937_64& rng) {
  std::vector<RowKv> rows;
  for (size_t r = 0; r < lens.size(); ++r) {
    cache.set_seq_len(static_cast<int64_t>(r), lens[r]);
    for (int32_t p = 0; p < lens[r]; ++p) {
      for (int32_t h = 0; h < hkv; ++h) {
        const std::vector<double> k = random_values(rng, d, -1, 1);
        const std::vector<double> v = random_values(rng, d, -1, 1);
        cache.write(static_cast<int64_t>(r), p, h, 0, k.data());
        cache.write(static_cast<int64_t>(r), p, h, 1, v.data());
      }
    }
    rows.push_back({cache.dense(static_cast<int64_t>(r), lens[r], 0),
                    cache.dense(static_cast<int64_t>(r), lens[r], 1)});
  }
  return rows;
}

struct DecodeRun {
  std::vector<double> out, lse;
};
DecodeRun run_decode(const AttentionSpec& spec, const KvCacheView& cache, const HostTensor& q,
                     int32_t beam_width = 1, const TensorView& indirection = {},
                     int32_t num_splits = 0) {
  const int64_t rows = q.view().shape[0];
  HostTensor out(q.dtype(), {rows, spec.num_q_heads, spec.head_dim});
  HostTensor lse(DType::kF32, {rows, spec.num_q_heads});
  out.fill(NAN);
  lse.fill(NAN);
  DecodeArgs args;
  args.q = q;
  args.kv_cache = cache;
  args.beam_width = beam_width;
  args.cache_indirection = indirection;
  args.num_splits = num_splits;
  args.out = out;
  args.lse = lse;
  call::decode(spec, args);
  return {out.to_double(), lse.to_double()};
}

TEST(ReferenceDecode, PagedMatchesOracleForEveryMaskAndKvDtype) {
  std::mt19937_64 rng(test_seed());
  const int32_t hq = 8, hkv = 2, d = 32, tpb = 8;
  const std::vector<int32_t> lens = {1, 8, 9, 23, 32};
  for (KvCacheLayout layout : kBothLayouts)
    for (DType kv_dtype : {DType::kBF16, DType::kF16, DType::kFp8E4M3, DType::kInt8}) {
      for (MaskSpec mask : {causal(), window(6, 0), window(6, 3), no_mask()}) {
        SCOPED_TRACE(::testing::Message()
                     << kv_layout_name(layout) << " " << dtype_name(kv_dtype) << " "
                     << mask_name(mask.kind) << " S=" << mask.sink_tokens);
        AttentionSpec spec = make_spec(hq, hkv, d, mask);
        spec.alibi = mask.kind == MaskKind::kNone;  // ALiBi in decode too
        OracleKvCache cache = OracleKvCache::paged(kv_dtype, hkv, d, tpb, 5, 4, rng, layout);
        if (kv_dtype == DType::kFp8E4M3) cache.set_scales({0.01f}, {0.004f});
        if (kv_dtype == DType::kInt8) cache.set_scales({0.01f, 0.02f}, {0.008f, 0.009f});
        const std::vector<RowKv> kv = fill_cache(cache, lens, hkv, d, rng);
        // Unquantized caches take queries of their own dtype; quantized ones bf16 here (bf16 query
        // + fp8 KV with a window is a combination other engines got wrong).
        const DType q_dtype =
            kv_dtype == DType::kBF16 || kv_dtype == DType::kF16 ? kv_dtype : DType::kBF16;
        const std::vector<double> qv = rounded_to(q_dtype, random_values(rng, 5 * hq * d, -1, 1));
        HostTensor q = tensor_from(q_dtype, {5, hq, d}, qv);
        const DecodeRun got = run_decode(spec, cache.view(), q);
        for (int64_t r = 0; r < 5; ++r) {
          OracleProblem pr;
          pr.num_q_heads = hq;
          pr.num_kv_heads = hkv;
          pr.head_dim = d;
          pr.q.assign(qv.begin() + r * hq * d, qv.begin() + (r + 1) * hq * d);
          pr.k = kv[r].k;
          pr.v = kv[r].v;
          pr.q_positions = {lens[r] - 1};
          pr.mask = mask;
          if (spec.alibi) {
            for (float s : default_alibi_slopes(hq)) pr.alibi_slopes.push_back(s);
          }
          const OracleResult ref = brute_force_attention(pr);
          const std::vector<double> row(got.out.begin() + r * hq * d,
                                        got.out.begin() + (r + 1) * hq * d);
          for (size_t e = 0; e < row.size(); ++e) {
            ASSERT_LE(std::fabs(row[e] - ref.out[e]), rounding_bound(q_dtype, ref.out[e]))
                << "row " << r << " element " << e;
          }
          const std::vector<double> row_lse(got.lse.begin() + r * hq,
                                            got.lse.begin() + (r + 1) * hq);
          EXPECT_LE(max_abs_diff(row_lse, ref.lse), 1e-5) << "row " << r;
        }
      }
    }
}

TEST(ReferenceDecode, PagedEqualsContiguous) {
  std::mt19937_64 rng(test_seed());
  const int32_t hq = 4, hkv = 2, d = 16, tpb = 8;
  const std::vector<int32_t> lens = {3, 16, 17, 30};
  // The paged cache in one layout, the contiguous one in the other as well.
  for (KvCacheLayout paged_layout : kBothLayouts)
    for (KvCacheLayout contiguous_layout : kBothLayouts)
      for (MaskSpec mask : {causal(), window(5, 2)}) {
        SCOPED_TRACE(::testing::Message() << "paged " << kv_layout_name(paged_layout)
                                          << ", contiguous " << kv_layout_name(contiguous_layout));
        const AttentionSpec spec = make_spec(hq, hkv, d, mask);
        OracleKvCache paged =
            OracleKvCache::paged(DType::kBF16, hkv, d, tpb, 4, 4, rng, paged_layout);
        OracleKvCache contiguous =
            OracleKvCache::contiguous(DType::kBF16, hkv, d, 4, 32, contiguous_layout);
        const std::vector<RowKv> kv = fill_cache(paged, lens, hkv, d, rng);
        for (size_t r = 0; r < lens.size(); ++r) {
          contiguous.set_seq_len(static_cast<int64_t>(r), lens[r]);
          for (int32_t p = 0; p < lens[r]; ++p) {
            for (int32_t h = 0; h < hkv; ++h) {
              contiguous.write(static_cast<int64_t>(r), p, h, 0, &kv[r].k[(p * hkv + h) * d]);
              contiguous.write(static_cast<int64_t>(r), p, h, 1, &kv[r].v[(p * hkv + h) * d]);
            }
          }
        }
        HostTensor q(DType::kBF16, {4, hq, d});
        q.fill_uniform(rng, -1, 1);
        const DecodeRun a = run_decode(spec, paged.view(), q);
        const DecodeRun b = run_decode(spec, contiguous.view(), q);
        EXPECT_FALSE(any_nan(a.out));
        EXPECT_EQ(max_abs_diff(a.out, b.out), 0.0);
        EXPECT_EQ(max_abs_diff(a.lse, b.lse), 0.0);

        // Prefill over the caches (the last 5 tokens of rows 1..3 as queries; row 0 has 3).
        HostTensor pq(DType::kBF16, {3 + 5 * 3, hq, d});
        pq.fill_uniform(rng, -1, 1);
        HostTensor cu = int32_tensor({0, 3, 8, 13, 18});
        std::vector<std::vector<double>> outs;
        for (const OracleKvCache* c : {&paged, &contiguous}) {
          const KvCacheView view = c->view();
          HostTensor out(DType::kBF16, {18, hq, d});
          out.fill(NAN);
          PrefillArgs args;
          args.q = pq;
          args.cu_seqlens_q = cu;
          args.kv_cache = &view;
          args.out = out;
          call::prefill(spec, args);
          outs.push_back(out.to_double());
        }
        EXPECT_FALSE(any_nan(outs[0]));
        EXPECT_EQ(max_abs_diff(outs[0], outs[1]), 0.0);
      }
}

TEST(ReferenceDecode, SplitCountDoesNotChangeTheResult) {
  std::mt19937_64 rng(test_seed());
  const AttentionSpec spec = make_spec(4, 1, 16, window(9, 1));
  OracleKvCache cache = OracleKvCache::paged(DType::kF16, 1, 16, 8, 3, 5, rng);
  fill_cache(cache, {1, 17, 40}, 1, 16, rng);
  HostTensor q(DType::kF16, {3, 4, 16});
  q.fill_uniform(rng, -1, 1);
  const DecodeRun base = run_decode(spec, cache.view(), q);
  EXPECT_FALSE(any_nan(base.out));
  for (int32_t splits : {1, 2, 5}) {
    const DecodeRun split = run_decode(spec, cache.view(), q, 1, {}, splits);
    EXPECT_EQ(max_abs_diff(base.out, split.out), 0.0) << splits << " splits";
    EXPECT_EQ(max_abs_diff(base.lse, split.lse), 0.0) << splits << " splits";
  }
}

// The reference computes each row on its own: batch_invariant is accepted and changes no bit, and
// a row computed alone (a batch of one: its q row, its seq_lens and block-table row) equals the
// same row inside the batch.
TEST(ReferenceDecode, BatchInvariantChangesNothingAndRowsEqualAlone) {
  std::mt19937_64 rng(test_seed());
  const AttentionSpec spec = make_spec(4, 2, 16, causal());
  OracleKvCache cache = OracleKvCache::paged(DType::kBF16, 2, 16, 8, 4, 6, rng);
  const std::vector<int32_t> lens = {1, 30, 17, 8};
  fill_cache(cache, lens, 2, 16, rng);
  HostTensor q(DType::kBF16, {4, 4, 16});
  q.fill_uniform(rng, -1, 1);
  const DecodeRun base = run_decode(spec, cache.view(), q);
  auto run = [&](const KvCacheView& view, const TensorView& q_rows, int64_t rows) {
    HostTensor out(DType::kBF16, {rows, 4, 16});
    HostTensor lse(DType::kF32, {rows, 4});
    out.fill(NAN);
    lse.fill(NAN);
    DecodeArgs args;
    args.q = q_rows;
    args.kv_cache = view;
    args.out = out;
    args.lse = lse;
    args.batch_invariant = true;
    call::decode(spec, args);
    return DecodeRun{out.to_double(), lse.to_double()};
  };
  const DecodeRun invariant = run(cache.view(), q, 4);
  EXPECT_FALSE(any_nan(invariant.out));
  EXPECT_EQ(max_abs_diff(base.out, invariant.out), 0.0);
  EXPECT_EQ(max_abs_diff(base.lse, invariant.lse), 0.0);
  for (int64_t r = 0; r < 4; ++r) {
    KvCacheView one = cache.view();
    one.seq_lens.data = static_cast<int32_t*>(one.seq_lens.data) + r * one.seq_lens.strides[0];
    one.seq_lens.shape[0] = 1;
    one.block_table.data =
        static_cast<int32_t*>(one.block_table.data) + r * one.block_table.strides[0];
    one.block_table.shape[0] = 1;
    TensorView q_row = q;
    q_row.data = static_cast<uint8_t*>(q_row.data) + r * q_row.strides[0] * 2;
    q_row.shape[0] = 1;
    const DecodeRun alone = run(one, q_row, 1);
    const std::vector<double> row(base.out.begin() + r * 64, base.out.begin() + (r + 1) * 64);
    const std::vector<double> row_lse(base.lse.begin() + r * 4, base.lse.begin() + (r + 1) * 4);
    EXPECT_EQ(max_abs_diff(alone.out, row), 0.0) << "row " << r;
    EXPECT_EQ(max_abs_diff(alone.lse, row_lse), 0.0) << "row " << r;
  }
}

TEST(ReferenceDecode, GqaEqualsMhaWithRepeatedKvHeads) {
  std::mt19937_64 rng(test_seed());
  const int32_t hq = 8, d = 16, tpb = 8;
  const std::vector<int32_t> lens = {5, 19};
  for (KvCacheLayout layout : kBothLayouts)
    for (int32_t hkv : {1, 2, 4}) {
      SCOPED_TRACE(kv_layout_name(layout));
      const AttentionSpec gqa = make_spec(hq, hkv, d, causal());
      const AttentionSpec mha = make_spec(hq, hq, d, causal());
      OracleKvCache small = OracleKvCache::paged(DType::kBF16, hkv, d, tpb, 2, 3, rng, layout);
      OracleKvCache big = OracleKvCache::paged(DType::kBF16, hq, d, tpb, 2, 3, rng, layout);
      const std::vector<RowKv> kv = fill_cache(small, lens, hkv, d, rng);
      for (size_t r = 0; r < lens.size(); ++r) {
        big.set_seq_len(static_cast<int64_t>(r), lens[r]);
        for (int32_t p = 0; p < lens[r]; ++p) {
          for (int32_t h = 0; h < hq; ++h) {
            const int32_t src = h / (hq / hkv);
            big.write(static_cast<int64_t>(r), p, h, 0, &kv[r].k[(p * hkv + src) * d]);
            big.write(static_cast<int64_t>(r), p, h, 1, &kv[r].v[(p * hkv + src) * d]);
          }
        }
      }
      HostTensor q(DType::kBF16, {2, hq, d});
      q.fill_uniform(rng, -1, 1);
      const DecodeRun a = run_decode(gqa, small.view(), q);
      const DecodeRun b = run_decode(mha, big.view(), q);
      EXPECT_FALSE(any_nan(a.out));
      EXPECT_EQ(max_abs_diff(a.out, b.out), 0.0) << "Hkv=" << hkv;
      EXPECT_EQ(max_abs_diff(a.lse, b.lse), 0.0) << "Hkv=" << hkv;
    }
}

TEST(ReferenceDecode, BeamIndirectionEqualsGatheredCaches) {
  std::mt19937_64 rng(test_seed());
  const int32_t hq = 4, hkv = 2, d = 16, tpb = 8, beams = 3, seqs = 2, max_seq = 24;
  const std::vector<int32_t> lens = {11, 11, 11, 20, 20, 20};
  const AttentionSpec spec = make_spec(hq, hkv, d, causal());
  // The beams' cache in each layout; the gathered one in the other.
  for (KvCacheLayout layout : kBothLayouts) {
    SCOPED_TRACE(kv_layout_name(layout));
    const KvCacheLayout other = other_layout(layout);
    OracleKvCache cache = OracleKvCache::paged(DType::kFp8E4M3, hkv, d, tpb, 6, 3, rng, layout);
    cache.set_scales({0.005f}, {0.006f});
    const std::vector<RowKv> kv = fill_cache(cache, lens, hkv, d, rng);
    HostTensor ind(DType::kInt32, {seqs, beams, max_seq});
    std::uniform_int_distribution<int32_t> pick(0, beams - 1);
    for (int64_t i = 0; i < ind.numel(); ++i) ind.data<int32_t>()[i] = pick(rng);
    // The gathered caches: row (s, b) holds at position t the K/V of beam ind[s][b][t].
    OracleKvCache gathered = OracleKvCache::contiguous(DType::kFp8E4M3, hkv, d, 6, max_seq, other);
    gathered.set_scales({0.005f}, {0.006f});
    for (int32_t s = 0; s < seqs; ++s) {
      for (int32_t b = 0; b < beams; ++b) {
        const int32_t row = s * beams + b;
        gathered.set_seq_len(row, lens[row]);
        for (int32_t t = 0; t < lens[row]; ++t) {
          const int32_t src = s * beams + ind.data<int32_t>()[(s * beams + b) * max_seq + t];
          for (int32_t h = 0; h < hkv; ++h) {
            gathered.write(row, t, h, 0, &kv[src].k[(t * hkv + h) * d]);
            gathered.write(row, t, h, 1, &kv[src].v[(t * hkv + h) * d]);
          }
        }
      }
    }
    HostTensor q(DType::kF32, {6, hq, d});
    q.fill_uniform(rng, -1, 1);
    const DecodeRun a = run_decode(spec, cache.view(), q, beams, ind);
    const DecodeRun b = run_decode(spec, gathered.view(), q);
    const DecodeRun plain = run_decode(spec, cache.view(), q, beams);  // no indirection
    EXPECT_FALSE(any_nan(a.out));
    EXPECT_EQ(max_abs_diff(a.out, b.out), 0.0);
    EXPECT_EQ(max_abs_diff(a.lse, b.lse), 0.0);
    EXPECT_GT(max_abs_diff(a.out, plain.out), 0.0) << "the indirection must change the result";
  }
}

// ---- merge_states -----------------------------------------------------------------------------

struct Partial {
  HostTensor out, lse;
};
Partial packed_prefill(const AttentionSpec& spec, const HostTensor& q, const HostTensor& k,
                       const HostTensor& v) {
  const int64_t nq = q.view().shape[0], nk = k.view().shape[0];
  Partial p{HostTensor(DType::kF32, {nq, spec.num_q_heads, spec.head_dim}),
            HostTensor(DType::kF32, {nq, spec.num_q_heads})};
  p.out.fill(NAN);
  p.lse.fill(NAN);
  HostTensor cu_q = int32_tensor({0, static_cast<int32_t>(nq)});
  HostTensor cu_kv = int32_tensor({0, static_cast<int32_t>(nk)});
  PrefillArgs args;
  args.q = q;
  args.k = k;
  args.v = v;
  args.cu_seqlens_q = cu_q;
  args.cu_seqlens_kv = cu_kv;
  args.out = p.out;
  args.lse = p.lse;
  call::prefill(spec, args);
  return p;
}

HostTensor rows_of(const HostTensor& t, int64_t begin, int64_t count) {
  const TensorView view = t.view();
  std::vector<int64_t> shape(view.shape.begin(), view.shape.begin() + view.ndim);
  const int64_t row = t.numel() / shape[0];
  shape[0] = count;
  HostTensor s(t.dtype(), shape);
  for (int64_t i = 0; i < count * row; ++i) s.set(i, t.get(begin * row + i));
  return s;
}

TEST(ReferenceMergeStates, TwoHalvesEqualTheWhole) {
  std::mt19937_64 rng(test_seed());
  const AttentionSpec spec = make_spec(4, 2, 32, no_mask());
  HostTensor q(DType::kF32, {6, 4, 32}), k(DType::kF32, {23, 2, 32}), v(DType::kF32, {23, 2, 32});
  q.fill_uniform(rng, -2, 2);
  k.fill_uniform(rng, -2, 2);
  v.fill_uniform(rng, -1, 1);
  const Partial whole = packed_prefill(spec, q, k, v);
  const Partial a = packed_prefill(spec, q, rows_of(k, 0, 9), rows_of(v, 0, 9));
  const Partial b = packed_prefill(spec, q, rows_of(k, 9, 14), rows_of(v, 9, 14));
  HostTensor out(DType::kF32, {6, 4, 32}), lse(DType::kF32, {6, 4});
  out.fill(NAN);
  lse.fill(NAN);
  MergeStatesArgs args{a.out, a.lse, b.out, b.lse, out, lse};
  call::merge_states(args);
  EXPECT_LE(max_abs_diff(out.to_double(), whole.out.to_double()), 1e-5);
  EXPECT_LE(max_abs_diff(lse.to_double(), whole.lse.to_double()), 1e-5);
  // The merge must actually combine: either half alone differs from the whole.
  EXPECT_GT(max_abs_diff(a.out.to_double(), whole.out.to_double()), 1e-3);
}

TEST(ReferenceMergeStates, EmptySidesGiveTheOtherSideOrZerosAndNegInf) {
  std::mt19937_64 rng(test_seed());
  HostTensor oa(DType::kBF16, {3, 2, 16}), ob(DType::kBF16, {3, 2, 16});
  HostTensor la(DType::kF32, {3, 2}), lb(DType::kF32, {3, 2});
  oa.fill_uniform(rng, -1, 1);
  ob.fill(NAN);  // an empty partial's output must not be read
  la.fill_uniform(rng, -3, 3);
  lb.fill(-INFINITY);
  la.set(5, -INFINITY);  // token 2, head 1: both sides empty
  HostTensor out(DType::kBF16, {3, 2, 16}), lse(DType::kF32, {3, 2});
  out.fill(NAN);
  lse.fill(NAN);
  call::merge_states(MergeStatesArgs{oa, la, ob, lb, out, lse});
  for (int64_t row = 0; row < 6; ++row) {
    for (int64_t dd = 0; dd < 16; ++dd) {
      const float want = row == 5 ? 0.0f : oa.get(row * 16 + dd);
      EXPECT_EQ(out.get(row * 16 + dd), want) << "row " << row << " d " << dd;
    }
    EXPECT_EQ(lse.get(row), row == 5 ? -INFINITY : la.get(row)) << "row " << row;
  }
}

}  // namespace
}  // namespace attnkit::test
