// The two KV-cache layouts through the reference backend: a cache of NHD blocks ([T, Hkv, D])
// gives bit for bit the results of the HND cache ([Hkv, T, D]) of the same logical contents
// (OracleKvCache::relaid moves every stored element), for decode (paged, contiguous, cyclic,
// beams, quantized, every logit option), paged prefill and forward; append_kv writes a token's
// heads next to each other in an NHD block.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
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

// Random K/V at positions 0 .. lens[r] - 1 of every row (values rounded by the cache's dtype and
// scales when written).
void fill_rows(OracleKvCache& cache, const std::vector<int32_t>& lens, int32_t hkv, int32_t d,
               std::mt19937_64& rng) {
  for (size_t r = 0; r < lens.size(); ++r) {
    cache.set_seq_len(static_cast<int64_t>(r), lens[r]);
    for (int32_t p = 0; p < lens[r]; ++p) {
      for (int32_t h = 0; h < hkv; ++h) {
        for (int kv = 0; kv < 2; ++kv) {
          const std::vector<double> x = random_values(rng, d, -1, 1);
          cache.write(static_cast<int64_t>(r), p, h, kv, x.data());
        }
      }
    }
  }
}

struct Outputs {
  HostTensor out, lse;
};

Outputs run_decode(const AttentionSpec& spec, const KvCacheView& cache, const HostTensor& q,
                   int32_t beam_width = 1, const TensorView& indirection = {},
                   int32_t num_splits = 0) {
  const int64_t rows = q.view().shape[0];
  Outputs o{HostTensor(q.dtype(), {rows, spec.num_q_heads, spec.head_dim}),
            HostTensor(DType::kF32, {rows, spec.num_q_heads})};
  o.out.fill(NAN);
  o.lse.fill(NAN);
  DecodeArgs args;
  args.q = q;
  args.kv_cache = cache;
  args.beam_width = beam_width;
  args.cache_indirection = indirection;
  args.num_splits = num_splits;
  args.out = o.out;
  args.lse = o.lse;
  call::decode(spec, args);
  return o;
}

Outputs run_prefill(const AttentionSpec& spec, const KvCacheView& cache, const HostTensor& q,
                    const std::vector<int32_t>& cu_q) {
  const int64_t n = q.view().shape[0];
  Outputs o{HostTensor(q.dtype(), {n, spec.num_q_heads, spec.head_dim}),
            HostTensor(DType::kF32, {n, spec.num_q_heads})};
  o.out.fill(NAN);
  o.lse.fill(NAN);
  HostTensor cu = int32_tensor(cu_q);
  PrefillArgs args;
  args.q = q;
  args.cu_seqlens_q = cu;
  args.kv_cache = &cache;
  args.out = o.out;
  args.lse = o.lse;
  call::prefill(spec, args);
  return o;
}

// The NHD run equals the HND run bit for bit, and wrote every output element.
void expect_same(const Outputs& hnd, const Outputs& nhd) {
  EXPECT_FALSE(any_nan(hnd.out.to_double())) << "unwritten output elements";
  EXPECT_FALSE(any_nan(hnd.lse.to_double())) << "unwritten lse elements";
  EXPECT_TRUE(hnd.out.bytes() == nhd.out.bytes()) << "out differs between the layouts";
  EXPECT_TRUE(hnd.lse.bytes() == nhd.lse.bytes()) << "lse differs between the layouts";
}

TEST(ReferenceLayout, RelaidCacheHoldsTheSameElementsInTheOtherOrder) {
  std::mt19937_64 rng(test_seed());
  const int32_t hkv = 3, d = 8, tpb = 8;
  OracleKvCache hnd = OracleKvCache::paged(DType::kBF16, hkv, d, tpb, 2, 2, rng);
  fill_rows(hnd, {13, 16}, hkv, d, rng);
  const OracleKvCache nhd = hnd.relaid(KvCacheLayout::kNHD);
  EXPECT_EQ(nhd.view().layout, KvCacheLayout::kNHD);
  EXPECT_EQ(nhd.view().token_stride(), hkv * d);
  EXPECT_EQ(nhd.view().head_stride(), d);
  EXPECT_EQ(hnd.view().token_stride(), d);
  EXPECT_EQ(hnd.view().head_stride(), tpb * d);
  const size_t elt = dtype_size(DType::kBF16);
  for (int64_t r = 0; r < 2; ++r) {
    for (int32_t p = 0; p < 13; ++p) {
      for (int32_t h = 0; h < hkv; ++h) {
        for (int32_t e = 0; e < d; ++e) {
          for (int kv = 0; kv < 2; ++kv) {
            ASSERT_EQ(hnd.read(r, p, h, e, kv), nhd.read(r, p, h, e, kv));
            // NHD: element e of head h at slot t of block b is element ((b * 2 + kv) * T + t) *
            // Hkv * D + h * D + e of the pool: the token's heads side by side.
            const int64_t block =
                hnd.view().block_table.defined() ? hnd.block_table_entry(r, p / tpb) : r;
            const int64_t nhd_index = (((block * 2 + kv) * tpb + p % tpb) * hkv + h) * d + e;
            const int64_t hnd_index = (((block * 2 + kv) * hkv + h) * tpb + p % tpb) * d + e;
            ASSERT_EQ(std::memcmp(nhd.pool().bytes().data() + nhd_index * elt,
                                  hnd.pool().bytes().data() + hnd_index * elt, elt),
                      0);
          }
        }
      }
    }
  }
  EXPECT_TRUE(nhd.relaid(KvCacheLayout::kHND).pool().bytes() == hnd.pool().bytes());
}

TEST(ReferenceLayout, DecodeOverAnNhdCacheEqualsTheHndCache) {
  std::mt19937_64 rng(test_seed());
  const int32_t hq = 8, hkv = 2, d = 32, tpb = 8;
  const std::vector<int32_t> lens = {1, 8, 9, 23, 32};
  struct Case {
    DType kv;
    MaskSpec mask;
    bool alibi;
    double softcap;
    int32_t splits;
  };
  const MaskSpec causal{MaskKind::kCausal, 0, 0}, window{MaskKind::kSlidingWindow, 6, 2};
  for (const Case& c :
       {Case{DType::kBF16, causal, false, 0.0, 0}, Case{DType::kF16, window, true, 0.0, 3},
        Case{DType::kBF16, causal, true, 5.0, 2}, Case{DType::kFp8E4M3, window, false, 0.0, 0},
        Case{DType::kInt8, causal, false, 30.0, 4}}) {
    SCOPED_TRACE(::testing::Message() << dtype_name(c.kv) << " " << mask_name(c.mask.kind)
                                      << " alibi " << c.alibi << " softcap " << c.softcap);
    AttentionSpec spec = make_spec(hq, hkv, d, c.mask);
    spec.alibi = c.alibi;
    spec.logit_softcap = c.softcap;
    OracleKvCache hnd = OracleKvCache::paged(c.kv, hkv, d, tpb, 5, 4, rng);
    if (c.kv == DType::kFp8E4M3) hnd.set_scales({0.01f}, {0.004f});
    if (c.kv == DType::kInt8) hnd.set_scales({0.01f, 0.02f}, {0.008f, 0.009f});
    fill_rows(hnd, lens, hkv, d, rng);
    const OracleKvCache nhd = hnd.relaid(KvCacheLayout::kNHD);
    const DType q_dtype = c.kv == DType::kF16 ? DType::kF16 : DType::kBF16;
    HostTensor q(q_dtype, {5, hq, d});
    q.fill_uniform(rng, -1, 1);
    expect_same(run_decode(spec, hnd.view(), q, 1, {}, c.splits),
                run_decode(spec, nhd.view(), q, 1, {}, c.splits));
  }
}

TEST(ReferenceLayout, ContiguousCyclicAndBeamCachesEqualTheirHndCaches) {
  std::mt19937_64 rng(test_seed());
  const int32_t hq = 4, hkv = 2, d = 16, tpb = 8;
  {
    SCOPED_TRACE("contiguous");
    const AttentionSpec spec = make_spec(hq, hkv, d, {MaskKind::kCausal, 0, 0});
    OracleKvCache hnd = OracleKvCache::contiguous(DType::kBF16, hkv, d, 3, 40);
    fill_rows(hnd, {1, 33, 40}, hkv, d, rng);
    HostTensor q(DType::kBF16, {3, hq, d});
    q.fill_uniform(rng, -1, 1);
    expect_same(run_decode(spec, hnd.view(), q),
                run_decode(spec, hnd.relaid(KvCacheLayout::kNHD).view(), q));
    HostTensor pq(DType::kBF16, {9, hq, d});
    pq.fill_uniform(rng, -1, 1);
    expect_same(run_prefill(spec, hnd.view(), pq, {0, 1, 5, 9}),
                run_prefill(spec, hnd.relaid(KvCacheLayout::kNHD).view(), pq, {0, 1, 5, 9}));
  }
  {
    SCOPED_TRACE("cyclic");
    const AttentionSpec spec = make_spec(hq, hkv, d, {MaskKind::kSlidingWindow, 6, 2});
    const int32_t slots = cyclic_window_slots(6, tpb);
    OracleKvCache hnd = OracleKvCache::paged(DType::kBF16, hkv, d, tpb, 2, 3, rng);
    hnd.make_cyclic(slots, 2);
    // Rows of 41 and 7 tokens: the first wrapped around its 16 window slots.
    fill_rows(hnd, {41, 7}, hkv, d, rng);
    HostTensor q(DType::kBF16, {2, hq, d});
    q.fill_uniform(rng, -1, 1);
    expect_same(run_decode(spec, hnd.view(), q),
                run_decode(spec, hnd.relaid(KvCacheLayout::kNHD).view(), q));
  }
  {
    SCOPED_TRACE("beams");
    const int32_t beams = 2, max_seq = 20;
    const AttentionSpec spec = make_spec(hq, hkv, d, {MaskKind::kCausal, 0, 0});
    OracleKvCache hnd = OracleKvCache::paged(DType::kFp8E4M3, hkv, d, tpb, 4, 3, rng);
    hnd.set_scales({0.005f, 0.007f}, {0.006f, 0.004f});
    fill_rows(hnd, {11, 11, 20, 20}, hkv, d, rng);
    HostTensor ind(DType::kInt32, {2, beams, max_seq});
    std::uniform_int_distribution<int32_t> pick(0, beams - 1);
    for (int64_t i = 0; i < ind.numel(); ++i) ind.data<int32_t>()[i] = pick(rng);
    HostTensor q(DType::kBF16, {4, hq, d});
    q.fill_uniform(rng, -1, 1);
    expect_same(run_decode(spec, hnd.view(), q, beams, ind),
                run_decode(spec, hnd.relaid(KvCacheLayout::kNHD).view(), q, beams, ind));
  }
}

TEST(ReferenceLayout, PagedPrefillOverAnNhdCacheEqualsTheHndCache) {
  std::mt19937_64 rng(test_seed());
  const int32_t hq = 6, hkv = 3, d = 16, tpb = 16;
  for (MaskSpec mask : {MaskSpec{MaskKind::kCausal, 0, 0}, MaskSpec{MaskKind::kSlidingWindow, 9, 1},
                        MaskSpec{MaskKind::kNone, 0, 0}}) {
    SCOPED_TRACE(mask_name(mask.kind));
    AttentionSpec spec = make_spec(hq, hkv, d, mask);
    spec.alibi = mask.kind == MaskKind::kCausal;
    OracleKvCache hnd = OracleKvCache::paged(DType::kBF16, hkv, d, tpb, 3, 3, rng);
    // Chunks after 0, 16 and 31 cached tokens: queries are each row's last tokens.
    fill_rows(hnd, {12, 35, 47}, hkv, d, rng);
    HostTensor q(DType::kBF16, {12 + 19 + 16, hq, d});
    q.fill_uniform(rng, -1, 1);
    const std::vector<int32_t> cu = {0, 12, 31, 47};
    expect_same(run_prefill(spec, hnd.view(), q, cu),
                run_prefill(spec, hnd.relaid(KvCacheLayout::kNHD).view(), q, cu));
  }
}

// append_kv into an NHD cache writes the rotated K and the V of a token where the HND append
// writes them in its own order (the relaid HND cache), and nothing else; forward() over the two
// caches gives the same output.
TEST(ReferenceLayout, AppendKvAndForwardWriteTheSameLogicalCache) {
  std::mt19937_64 rng(test_seed());
  const int32_t hq = 4, hkv = 2, d = 16, tpb = 8, width = (hq + 2 * hkv) * d;
  AttentionSpec spec = make_spec(hq, hkv, d, {MaskKind::kCausal, 0, 0});
  spec.rope.style = RopeStyle::kGptNeox;
  for (DType kv_dtype : {DType::kBF16, DType::kInt8}) {
    SCOPED_TRACE(dtype_name(kv_dtype));
    OracleKvCache hnd = OracleKvCache::paged(kv_dtype, hkv, d, tpb, 3, 3, rng);
    if (kv_dtype == DType::kInt8) hnd.set_scales({0.02f, 0.01f}, {0.015f, 0.02f});
    OracleKvCache nhd = hnd.relaid(KvCacheLayout::kNHD);
    // Earlier tokens: rows of 5, 0 and 9.
    const int32_t earlier[3] = {5, 0, 9};
    std::vector<int32_t> positions, rows;
    for (int32_t r = 0; r < 3; ++r) {
      for (int32_t p = 0; p < earlier[r]; ++p) {
        positions.push_back(p);
        rows.push_back(r);
      }
    }
    HostTensor pre(DType::kBF16, {static_cast<int64_t>(positions.size()), width});
    pre.fill_uniform(rng, -1, 1);
    HostTensor pos = int32_tensor(positions), row = int32_tensor(rows);
    for (OracleKvCache* cache : {&hnd, &nhd}) {
      HostTensor q_out(DType::kBF16, {static_cast<int64_t>(positions.size()), hq, d});
      AppendKvArgs args;
      args.qkv = pre;
      args.positions = pos;
      args.row_of_token = row;
      args.kv_cache = cache->view();
      args.q_out = q_out;
      call::append_kv(spec, args);
    }
    EXPECT_TRUE(nhd.pool().bytes() == hnd.relaid(KvCacheLayout::kNHD).pool().bytes());

    // One step: a context chunk of 4 tokens on row 1, decode on rows 0 and 2.
    const std::vector<int32_t> after = {6, 4, 10};
    for (int32_t r = 0; r < 3; ++r) hnd.set_seq_len(r, after[r]), nhd.set_seq_len(r, after[r]);
    HostTensor qkv(DType::kBF16, {6, width});
    qkv.fill_uniform(rng, -1, 1);
    HostTensor cu = int32_tensor({0, 4, 5, 6}), past = int32_tensor({0, 5, 9});
    std::vector<Outputs> results;
    for (OracleKvCache* cache : {&hnd, &nhd}) {
      Outputs o{HostTensor(DType::kBF16, {6, hq, d}), HostTensor(DType::kF32, {6, hq})};
      o.out.fill(NAN);
      o.lse.fill(NAN);
      // forward's rows: the context chunk's (row 1) first, then the generation rows 0 and 2.
      KvCacheView view = cache->view();
      HostTensor table(DType::kInt32, {3, 3}), lens = int32_tensor({after[1], after[0], after[2]});
      for (int32_t j = 0; j < 3; ++j) {
        table.data<int32_t>()[j] = cache->block_table_entry(1, j);
        table.data<int32_t>()[3 + j] = cache->block_table_entry(0, j);
        table.data<int32_t>()[6 + j] = cache->block_table_entry(2, j);
      }
      view.block_table = table;
      view.seq_lens = lens;
      ForwardArgs args;
      args.qkv = qkv;
      args.num_context = 1;
      args.cu_seqlens_q = cu;
      args.past_lens = past;
      args.kv_cache = view;
      args.out = o.out;
      args.lse = o.lse;
      call::forward(spec, args);
      results.push_back(std::move(o));
    }
    expect_same(results[0], results[1]);
    EXPECT_TRUE(nhd.pool().bytes() == hnd.relaid(KvCacheLayout::kNHD).pool().bytes());
  }
}

}  // namespace
}  // namespace attnkit::test
