// Reference attention over a KV cache filled by append_kv: chunked context == unchunked, cyclic
// sliding-window cache == dense masked window, and forward() of a mixed in-flight batch ==
// separate append_kv / prefill / decode calls.
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
  spec.rope.style = RopeStyle::kGptNeox;
  return spec;
}

// Copy of rows [begin, begin + count) of a contiguous tensor.
HostTensor copy_rows(const HostTensor& t, int64_t begin, int64_t count) {
  const TensorView view = t.view();
  std::vector<int64_t> shape(view.shape.begin(), view.shape.begin() + view.ndim);
  const int64_t row = t.numel() / shape[0];
  shape[0] = count;
  HostTensor s(t.dtype(), shape);
  for (int64_t i = 0; i < count * row; ++i) s.set(i, t.get(begin * row + i));
  return s;
}

// A view of rows [begin, begin + count) (no copy).
TensorView view_rows(const TensorView& t, int64_t begin, int64_t count) {
  TensorView s = t;
  s.data = static_cast<uint8_t*>(t.data) +
           begin * t.strides[0] * static_cast<int64_t>(dtype_size(t.dtype));
  s.shape[0] = count;
  return s;
}

std::vector<int32_t> iota_positions(int32_t begin, int32_t count) {
  std::vector<int32_t> p(count);
  for (int32_t i = 0; i < count; ++i) p[i] = begin + i;
  return p;
}

struct Result {
  HostTensor out, lse;
};
Result prefill_over_cache(const AttentionSpec& spec, const HostTensor& q,
                          const std::vector<int32_t>& cu_q, const KvCacheView& cache) {
  const int64_t n = q.view().shape[0];
  Result r{HostTensor(q.dtype(), {n, spec.num_q_heads, spec.head_dim}),
           HostTensor(DType::kF32, {n, spec.num_q_heads})};
  r.out.fill(NAN);
  r.lse.fill(NAN);
  HostTensor cu = int32_tensor(cu_q);
  PrefillArgs args;
  args.q = q;
  args.cu_seqlens_q = cu;
  args.kv_cache = &cache;
  args.out = r.out;
  args.lse = r.lse;
  call::prefill(spec, args);
  return r;
}

Result decode_over_cache(const AttentionSpec& spec, const HostTensor& q, const KvCacheView& cache,
                         int32_t beam_width = 1, const TensorView& indirection = {}) {
  const int64_t n = q.view().shape[0];
  Result r{HostTensor(q.dtype(), {n, spec.num_q_heads, spec.head_dim}),
           HostTensor(DType::kF32, {n, spec.num_q_heads})};
  r.out.fill(NAN);
  r.lse.fill(NAN);
  DecodeArgs args;
  args.q = q;
  args.kv_cache = cache;
  args.beam_width = beam_width;
  args.cache_indirection = indirection;
  args.out = r.out;
  args.lse = r.lse;
  call::decode(spec, args);
  return r;
}

TEST(ReferenceChunkedContext, ChunksEqualTheWholePromptAndTheOracle) {
  std::mt19937_64 rng(test_seed());
  const int32_t hq = 4, hkv = 2, d = 16, tpb = 8, len = 37, width = (hq + 2 * hkv) * d;
  AttentionSpec sliding = make_spec(hq, hkv, d, {MaskKind::kSlidingWindow, 7, 2});
  sliding.alibi = true;
  // The whole prompt's cache in each layout, the chunked one in the other.
  for (KvCacheLayout layout : kBothLayouts) {
    for (const AttentionSpec& spec : {make_spec(hq, hkv, d, {MaskKind::kCausal, 0, 0}), sliding}) {
      SCOPED_TRACE(::testing::Message()
                   << mask_name(spec.mask.kind) << " whole " << kv_layout_name(layout));
      HostTensor qkv(DType::kBF16, {len, width});
      qkv.fill_uniform(rng, -1, 1);
      // Unchunked: the whole prompt at once.
      OracleKvCache whole = OracleKvCache::paged(DType::kBF16, hkv, d, tpb, 1, 5, rng, layout);
      const HostTensor q_all = run_append_kv(spec, qkv, iota_positions(0, len),
                                             std::vector<int32_t>(len, 0), whole.view());
      whole.set_seq_len(0, len);
      const Result expected = prefill_over_cache(spec, q_all, {0, len}, whole.view());
      // Chunked: 16 + 16 + 5 tokens (all but the last a multiple of tokens_per_block).
      OracleKvCache chunked =
          OracleKvCache::paged(DType::kBF16, hkv, d, tpb, 1, 5, rng, other_layout(layout));
      std::vector<double> out, lse;
      int32_t begin = 0;
      for (int32_t n : {16, 16, 5}) {
        const HostTensor q = run_append_kv(spec, copy_rows(qkv, begin, n), iota_positions(begin, n),
                                           std::vector<int32_t>(n, 0), chunked.view());
        chunked.set_seq_len(0, begin + n);
        const Result r = prefill_over_cache(spec, q, {0, n}, chunked.view());
        const std::vector<double> o = r.out.to_double(), l = r.lse.to_double();
        out.insert(out.end(), o.begin(), o.end());
        lse.insert(lse.end(), l.begin(), l.end());
        begin += n;
      }
      EXPECT_FALSE(any_nan(out));
      EXPECT_EQ(max_abs_diff(out, expected.out.to_double()), 0.0);
      EXPECT_EQ(max_abs_diff(lse, expected.lse.to_double()), 0.0);

      OracleProblem pr;
      pr.num_q_heads = hq;
      pr.num_kv_heads = hkv;
      pr.head_dim = d;
      pr.q = q_all.to_double();
      pr.k = whole.dense(0, len, 0);
      pr.v = whole.dense(0, len, 1);
      for (int32_t t = 0; t < len; ++t) pr.q_positions.push_back(t);
      pr.mask = spec.mask;
      if (spec.alibi) {
        for (float s : default_alibi_slopes(hq)) pr.alibi_slopes.push_back(s);
      }
      const OracleResult ref = brute_force_attention(pr);
      const std::vector<double> got = expected.out.to_double();
      for (size_t e = 0; e < got.size(); ++e) {
        ASSERT_NEAR(got[e], ref.out[e], std::fabs(ref.out[e]) * std::ldexp(1.0, -8) + 1e-6) << e;
      }
    }
  }
}

// A long sequence through a cyclic cache (sinks + W' slots), chunk and token-by-token, against
// dense masked-window attention over every token (kept in a linear cache).
TEST(ReferenceCyclicCache, MatchesDenseMaskedWindow) {
  std::mt19937_64 rng(test_seed());
  const int32_t hq = 2, hkv = 1, d = 16, tpb = 8, len = 50, width = (hq + 2 * hkv) * d;
  struct Case {
    int32_t sinks;
    DType input, cache;
  };
  // The cyclic cache in each layout, the linear one in the other.
  for (KvCacheLayout layout : kBothLayouts)
    for (const Case& c : {Case{0, DType::kBF16, DType::kBF16}, Case{2, DType::kBF16, DType::kBF16},
                          Case{2, DType::kF32, DType::kFp8E4M3}}) {
      const int32_t sinks = c.sinks;
      SCOPED_TRACE(::testing::Message() << "sinks " << sinks << " cache " << dtype_name(c.cache)
                                        << " cyclic " << kv_layout_name(layout));
      const AttentionSpec spec = make_spec(hq, hkv, d, {MaskKind::kSlidingWindow, 6, sinks});
      const int32_t slots = cyclic_window_slots(6, tpb);
      ASSERT_EQ(slots, 16);
      const int32_t blocks = (sinks + slots + tpb - 1) / tpb;
      OracleKvCache cyclic = OracleKvCache::paged(c.cache, hkv, d, tpb, 1, blocks, rng, layout);
      cyclic.make_cyclic(slots, sinks);
      OracleKvCache linear =
          OracleKvCache::contiguous(c.cache, hkv, d, 1, len, other_layout(layout));
      if (c.cache == DType::kFp8E4M3) {
        cyclic.set_scales({0.004f}, {0.003f});
        linear.set_scales({0.004f}, {0.003f});
      }
      HostTensor qkv(c.input, {len, width});
      qkv.fill_uniform(rng, -1, 1);

      auto check = [&](const HostTensor& out, const HostTensor& q, int32_t first, int32_t n) {
        OracleProblem pr;
        pr.num_q_heads = hq;
        pr.num_kv_heads = hkv;
        pr.head_dim = d;
        pr.q = q.to_double();
        pr.k = linear.dense(0, first + n, 0);
        pr.v = linear.dense(0, first + n, 1);
        for (int32_t t = 0; t < n; ++t) pr.q_positions.push_back(first + t);
        pr.mask = spec.mask;
        const OracleResult ref = brute_force_attention(pr);
        const std::vector<double> got = out.to_double();
        for (size_t e = 0; e < got.size(); ++e) {
          ASSERT_LE(std::fabs(got[e] - ref.out[e]), rounding_bound(c.input, ref.out[e]))
              << "tokens " << first << "+" << n << " element " << e;
        }
      };
      int32_t p = 0;
      while (p < len) {
        // Chunks of 8 tokens at 0 and 24 (prefill over the cyclic cache), otherwise decode.
        const int32_t n = (p == 0 || p == 24) ? 8 : 1;
        const HostTensor chunk = copy_rows(qkv, p, n);
        const HostTensor q = run_append_kv(spec, chunk, iota_positions(p, n),
                                           std::vector<int32_t>(n, 0), cyclic.view());
        run_append_kv(spec, chunk, iota_positions(p, n), std::vector<int32_t>(n, 0), linear.view());
        cyclic.set_seq_len(0, p + n);
        const Result r = n > 1 ? prefill_over_cache(spec, q, {0, n}, cyclic.view())
                               : decode_over_cache(spec, q, cyclic.view());
        check(r.out, q, p, n);
        p += n;
      }
    }
}

// Rows of 2^24 and INT32_MAX tokens in a cyclic cache: the reference reads the sinks and the
// window only (it once allocated and scanned the whole row: 2 GB at 16.7M tokens, std::bad_alloc
// at INT32_MAX). The result equals the oracle over the same keys at small positions (no RoPE or
// ALiBi: attention depends on positions only through the mask).
TEST(ReferenceCyclicCache, RowsOfBillionsOfTokensReadOnlyTheWindow) {
  std::mt19937_64 rng(test_seed());
  const int32_t hq = 2, hkv = 1, d = 16, tpb = 8, window = 6, sinks = 2, written = 8;
  AttentionSpec spec = make_spec(hq, hkv, d, {MaskKind::kSlidingWindow, window, sinks});
  spec.rope.style = RopeStyle::kNone;
  const int32_t slots = cyclic_window_slots(window, tpb);
  for (const int64_t len : {int64_t{1} << 24, int64_t{std::numeric_limits<int32_t>::max()}}) {
    SCOPED_TRACE(::testing::Message() << "row of " << len << " tokens");
    OracleKvCache cache =
        OracleKvCache::paged(DType::kBF16, hkv, d, tpb, 1, (sinks + slots + tpb - 1) / tpb, rng);
    cache.make_cyclic(slots, sinks);
    // The sinks and the last `written` tokens; the oracle sees them at positions 0 .. 9.
    std::vector<int64_t> positions = {0, 1};
    for (int64_t p = len - written; p < len; ++p) positions.push_back(p);
    OracleProblem pr;
    pr.num_q_heads = hq;
    pr.num_kv_heads = hkv;
    pr.head_dim = d;
    pr.mask = spec.mask;
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    for (int64_t p : positions) {
      for (int kv = 0; kv < 2; ++kv) {
        std::vector<double> x(d);
        for (double& e : x) e = u(rng);
        cache.write(0, p, 0, kv, x.data());
        for (int32_t e = 0; e < d; ++e) (kv ? pr.v : pr.k).push_back(cache.read(0, p, 0, e, kv));
      }
    }
    cache.set_seq_len(0, static_cast<int32_t>(len));
    const int32_t n = 3;  // queries at len - 3 .. len - 1 (oracle positions 7 .. 9)
    HostTensor q(DType::kF32, {n, hq, d});
    q.fill_uniform(rng, -1, 1);
    pr.q = q.to_double();
    for (int32_t t = 0; t < n; ++t) pr.q_positions.push_back(sinks + written - n + t);
    const OracleResult ref = brute_force_attention(pr);

    const Result chunk = prefill_over_cache(spec, q, {0, n}, cache.view());
    HostTensor last = copy_rows(q, n - 1, 1);
    const Result step = decode_over_cache(spec, last, cache.view());
    const std::vector<double> got = chunk.out.to_double(), got_step = step.out.to_double();
    for (size_t e = 0; e < got.size(); ++e) {
      ASSERT_LE(std::fabs(got[e] - ref.out[e]), rounding_bound(DType::kF32, ref.out[e])) << e;
    }
    for (size_t e = 0; e < got_step.size(); ++e) {
      const double expected = ref.out[(n - 1) * hq * d + e];
      ASSERT_LE(std::fabs(got_step[e] - expected), rounding_bound(DType::kF32, expected)) << e;
    }
  }
}

// forward() over a batch of 2 context chunks (one after 8 cached tokens, one fresh) and 2
// generation requests with 2 beams each, against separate append_kv / prefill / decode calls.
TEST(ReferenceForward, MixedBatchEqualsSeparateCalls) {
  std::mt19937_64 rng(test_seed());
  const int32_t hq = 4, hkv = 2, d = 16, tpb = 8, beams = 2, max_seq = 24;
  const int32_t width = (hq + 2 * hkv) * d;
  AttentionSpec spec = make_spec(hq, hkv, d, {MaskKind::kCausal, 0, 0});
  spec.rope.style = RopeStyle::kGptJ;
  // The paged cache in each layout, the contiguous one in the other.
  for (KvCacheLayout layout : kBothLayouts) {
    SCOPED_TRACE(kv_layout_name(layout));
    OracleKvCache cache = OracleKvCache::paged(DType::kFp8E4M3, hkv, d, tpb, 6, 3, rng, layout);
    cache.set_scales({0.004f, 0.006f}, {0.005f, 0.003f});

    // Earlier steps: row 0 holds 8 tokens, rows 2-3 hold 11 and rows 4-5 hold 6.
    const std::vector<int32_t> past_rows = {8, 0, 11, 11, 6, 6};
    std::vector<int32_t> pre_positions, pre_rows;
    for (int32_t r = 0; r < 6; ++r) {
      for (int32_t p = 0; p < past_rows[r]; ++p) {
        pre_positions.push_back(p);
        pre_rows.push_back(r);
      }
    }
    HostTensor pre(DType::kBF16, {static_cast<int64_t>(pre_positions.size()), width});
    pre.fill_uniform(rng, -1, 1);
    run_append_kv(spec, pre, pre_positions, pre_rows, cache.view());
    // The same state in a contiguous cache (row r = block r).
    OracleKvCache contiguous =
        OracleKvCache::contiguous(DType::kFp8E4M3, hkv, d, 6, max_seq, other_layout(layout));
    contiguous.set_scales({0.004f, 0.006f}, {0.005f, 0.003f});
    run_append_kv(spec, pre, pre_positions, pre_rows, contiguous.view());

    const std::vector<int32_t> cu = {0, 5, 14, 16, 18}, past = {8, 0, 11, 6};
    const std::vector<int32_t> after = {13, 9, 12, 12, 7, 7};
    for (int32_t r = 0; r < 6; ++r) cache.set_seq_len(r, after[r]);
    for (int32_t r = 0; r < 6; ++r) contiguous.set_seq_len(r, after[r]);
    HostTensor qkv(DType::kBF16, {18, width}), bias(DType::kBF16, {width});
    qkv.fill_uniform(rng, -1, 1);
    bias.fill_uniform(rng, -0.5, 0.5);
    HostTensor ind(DType::kInt32, {2, beams, max_seq});
    std::uniform_int_distribution<int32_t> pick(0, beams - 1);
    for (int32_t g = 0; g < 2; ++g) {
      for (int32_t b = 0; b < beams; ++b) {
        for (int32_t t = 0; t < max_seq; ++t) {
          // The new token of a beam is its own; older positions come from any beam.
          ind.data<int32_t>()[(g * beams + b) * max_seq + t] = t == past[2 + g] ? b : pick(rng);
        }
      }
    }
    OracleKvCache separate = cache;

    HostTensor out(DType::kBF16, {18, hq, d}), lse(DType::kF32, {18, hq});
    out.fill(NAN);
    lse.fill(NAN);
    HostTensor cu_t = int32_tensor(cu), past_t = int32_tensor(past);
    ForwardArgs args;
    args.qkv = qkv;
    args.qkv_bias = bias;
    args.num_context = 2;
    args.beam_width = beams;
    args.cu_seqlens_q = cu_t;
    args.past_lens = past_t;
    args.kv_cache = cache.view();
    args.cache_indirection = ind;
    args.out = out;
    args.lse = lse;
    call::forward(spec, args);

    // forward() over the contiguous cache gives the same result.
    HostTensor out_contiguous(DType::kBF16, {18, hq, d});
    out_contiguous.fill(NAN);
    ForwardArgs contiguous_args = args;
    contiguous_args.kv_cache = contiguous.view();
    contiguous_args.out = out_contiguous;
    contiguous_args.lse = TensorView();
    call::forward(spec, contiguous_args);
    EXPECT_EQ(max_abs_diff(out.to_double(), out_contiguous.to_double()), 0.0);

    // Separate calls: append_kv for every token, prefill for rows 0-1, decode for rows 2-5.
    std::vector<int32_t> positions, rows;
    for (int32_t t = 0; t < 5; ++t) positions.push_back(8 + t), rows.push_back(0);
    for (int32_t t = 0; t < 9; ++t) positions.push_back(t), rows.push_back(1);
    for (int32_t r = 2; r < 6; ++r) positions.push_back(past_rows[r]), rows.push_back(r);
    const KvCacheView all = separate.view();
    const HostTensor q = run_append_kv(spec, qkv, positions, rows, all, &bias);
    KvCacheView context = all;
    context.seq_lens = view_rows(all.seq_lens, 0, 2);
    context.block_table = view_rows(all.block_table, 0, 2);
    const Result pre_out = prefill_over_cache(spec, copy_rows(q, 0, 14), {0, 5, 14}, context);
    KvCacheView generation = all;
    generation.seq_lens = view_rows(all.seq_lens, 2, 4);
    generation.block_table = view_rows(all.block_table, 2, 4);
    const Result dec_out = decode_over_cache(spec, copy_rows(q, 14, 4), generation, beams, ind);

    std::vector<double> want = pre_out.out.to_double(), want_lse = pre_out.lse.to_double();
    const std::vector<double> dec = dec_out.out.to_double(), dec_lse = dec_out.lse.to_double();
    want.insert(want.end(), dec.begin(), dec.end());
    want_lse.insert(want_lse.end(), dec_lse.begin(), dec_lse.end());
    EXPECT_FALSE(any_nan(out.to_double()));
    EXPECT_FALSE(any_nan(lse.to_double()));
    EXPECT_EQ(max_abs_diff(out.to_double(), want), 0.0);
    EXPECT_EQ(max_abs_diff(lse.to_double(), want_lse), 0.0);
    EXPECT_EQ(cache.pool().bytes(), separate.pool().bytes());

    // The first context request attends its 8 cached tokens: against the oracle.
    OracleProblem pr;
    pr.num_q_heads = hq;
    pr.num_kv_heads = hkv;
    pr.head_dim = d;
    pr.q = copy_rows(q, 0, 5).to_double();
    pr.k = cache.dense(0, 13, 0);
    pr.v = cache.dense(0, 13, 1);
    pr.q_positions = {8, 9, 10, 11, 12};
    pr.mask = spec.mask;
    const OracleResult ref = brute_force_attention(pr);
    const std::vector<double> got = copy_rows(out, 0, 5).to_double();
    for (size_t e = 0; e < got.size(); ++e) {
      ASSERT_NEAR(got[e], ref.out[e], std::fabs(ref.out[e]) * std::ldexp(1.0, -8) + 1e-6) << e;
    }
  }
}

}  // namespace
}  // namespace attnkit::test
