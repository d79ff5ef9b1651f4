// Context parallelism on the reference backend, ranks simulated by threads over the in-process
// transport: ring_prefill and sharded_decode equal the single-rank result (to float32 rounding)
// for R = 1, 2, 4, 8, causal and not, uneven lengths, GQA; bad input is rejected on a rank
// before it communicates, naming the argument, with the outputs untouched.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attnkit/context_parallel.h"
#include "common/cp_test_util.h"
#include "common/reference_oracle.h"
#include "common/test_util.h"

namespace attnkit::test {
namespace {

AttentionSpec make_spec(int32_t hq, int32_t hkv, int32_t d, MaskKind mask) {
  AttentionSpec spec;
  spec.num_q_heads = hq;
  spec.num_kv_heads = hkv;
  spec.head_dim = d;
  spec.mask = MaskSpec{mask, 0, 0};
  return spec;
}

// Largest |a - b|, both read as doubles; -inf == -inf counts as equal, a NaN as infinitely far.
double max_diff(const HostTensor& a, const HostTensor& b) {
  double m = 0.0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double x = a.get(i), y = b.get(i);
    if (std::isnan(x) || std::isnan(y)) return INFINITY;
    if (x == y) continue;
    m = std::max(m, std::fabs(x - y));
  }
  return m;
}

struct PrefillRun {
  HostTensor out, lse;
};

// Global packed q, k, v of a batch (random, rounded to dtype).
struct Batch {
  std::vector<int32_t> cu;
  HostTensor q, k, v;
};

Batch random_batch(const AttentionSpec& spec, const std::vector<int32_t>& lengths, DType dtype,
                   std::mt19937_64& rng) {
  Batch b;
  b.cu = cu_seqlens_of(lengths);
  const int64_t total = b.cu.back();
  b.q = HostTensor(dtype, {total, spec.num_q_heads, spec.head_dim});
  b.k = HostTensor(dtype, {total, spec.num_kv_heads, spec.head_dim});
  b.v = HostTensor(dtype, {total, spec.num_kv_heads, spec.head_dim});
  // Wide q / k make some rows peaked, so a lost or doubled block shows.
  b.q.fill_uniform(rng, -2.0f, 2.0f);
  b.k.fill_uniform(rng, -2.0f, 2.0f);
  b.v.fill_uniform(rng, -1.0f, 1.0f);
  return b;
}

PrefillRun single_rank_prefill(const AttentionSpec& spec, const Batch& b) {
  const int64_t total = b.cu.back();
  PrefillRun run{HostTensor(b.q.dtype(), {total, spec.num_q_heads, spec.head_dim}),
                 HostTensor(DType::kF32, {total, spec.num_q_heads})};
  HostTensor cu = int32_tensor(b.cu);
  PrefillArgs args;
  args.q = b.q;
  args.k = b.k;
  args.v = b.v;
  args.cu_seqlens_q = cu;
  args.cu_seqlens_kv = cu;
  args.out = run.out;
  args.lse = run.lse;
  prefill(spec, args);
  return run;
}

// ring_prefill over `world` threads; the outputs scattered back to the global order.
PrefillRun ring_prefill_ranks(const AttentionSpec& spec, const Batch& b, int32_t world,
                              bool with_lse) {
  const cp::ZigzagPlan plan(b.cu, world);
  const int64_t total = b.cu.back();
  const std::vector<Device> devices(static_cast<size_t>(world), Device::cpu());
  const auto group = cp::make_in_process_group(devices, 60.0);
  std::vector<HostTensor> q, k, v, out, lse;
  for (int32_t r = 0; r < world; ++r) {
    const std::vector<int32_t> rows = plan.global_rows(r);
    q.push_back(gather_rows(b.q, rows));
    k.push_back(gather_rows(b.k, rows));
    v.push_back(gather_rows(b.v, rows));
    const int64_t n = plan.local_tokens(r);
    out.emplace_back(b.q.dtype(), std::vector<int64_t>{n, spec.num_q_heads, spec.head_dim});
    lse.emplace_back(DType::kF32, std::vector<int64_t>{n, spec.num_q_heads});
    out.back().fill(NAN);
    lse.back().fill(NAN);
  }
  run_ranks(world, [&](int32_t r) {
    cp::RingPrefillArgs args;
    args.q = q[r];
    args.k = k[r];
    args.v = v[r];
    args.out = out[r];
    if (with_lse) args.lse = lse[r];
    cp::ring_prefill(spec, plan, args, {group[r].get()});
  });
  PrefillRun run{HostTensor(b.q.dtype(), {total, spec.num_q_heads, spec.head_dim}),
                 HostTensor(DType::kF32, {total, spec.num_q_heads})};
  run.out.fill(NAN);
  run.lse.fill(NAN);
  for (int32_t r = 0; r < world; ++r) {
    scatter_rows(out[r], plan.global_rows(r), run.out);
    scatter_rows(lse[r], plan.global_rows(r), run.lse);
  }
  return run;
}

struct RingCase {
  int32_t hq, hkv, d;
  std::vector<int32_t> lengths;
  double softcap;
};

const std::vector<RingCase>& ring_cases() {
  static const std::vector<RingCase> cases = {
      {4, 2, 16, {37, 0, 1, 64, 9, 100}, 0.0},  // GQA, uneven, empty and one-token sequences
      {4, 1, 8, {3, 2, 1, 5}, 0.0},             // MQA, sequences shorter than 2R
      {2, 2, 16, {129}, 30.0},                  // one long sequence, soft-cap
  };
  return cases;
}

TEST(CpRingPrefill, EqualsSingleRankPrefill) {
  std::mt19937_64 rng(test_seed());
  for (const RingCase& c : ring_cases()) {
    for (const MaskKind mask : {MaskKind::kCausal, MaskKind::kNone}) {
      AttentionSpec spec = make_spec(c.hq, c.hkv, c.d, mask);
      spec.logit_softcap = c.softcap;
      const Batch batch = random_batch(spec, c.lengths, DType::kF32, rng);
      const PrefillRun want = single_rank_prefill(spec, batch);
      for (const int32_t world : {1, 2, 4, 8}) {
        SCOPED_TRACE(::testing::Message()
                     << "world " << world << " mask " << mask_name(mask) << " Hq/Hkv " << c.hq
                     << "/" << c.hkv << " B " << c.lengths.size());
        const PrefillRun got = ring_prefill_ranks(spec, batch, world, /*with_lse=*/true);
        // Each merge rounds once to float32 (the reference accumulates in fp64).
        EXPECT_LE(max_diff(got.out, want.out), 2e-6);
        EXPECT_LE(max_diff(got.lse, want.lse), 2e-5);
        for (int64_t i = 0; i < got.lse.numel(); ++i) {
          ASSERT_EQ(std::isinf(got.lse.get(i)), std::isinf(want.lse.get(i))) << "lse row " << i;
        }
      }
    }
  }
}

// Without an lse the result is the same; without a communicator ring_prefill is prefill().
TEST(CpRingPrefill, NoLseAndNoCommunicator) {
  std::mt19937_64 rng(test_seed());
  const AttentionSpec spec = make_spec(4, 2, 16, MaskKind::kCausal);
  const Batch batch = random_batch(spec, {20, 3, 33}, DType::kF32, rng);
  const PrefillRun want = single_rank_prefill(spec, batch);
  const PrefillRun with = ring_prefill_ranks(spec, batch, 4, true);
  const PrefillRun without = ring_prefill_ranks(spec, batch, 4, false);
  EXPECT_EQ(with.out.bytes(), without.out.bytes());

  const cp::ZigzagPlan plan(batch.cu, 1);
  HostTensor out(DType::kF32, {batch.cu.back(), 4, 16}), lse(DType::kF32, {batch.cu.back(), 4});
  cp::RingPrefillArgs args;
  args.q = batch.q;
  args.k = batch.k;
  args.v = batch.v;
  args.out = out;
  args.lse = lse;
  cp::ring_prefill(spec, plan, args, {});
  EXPECT_EQ(out.bytes(), want.out.bytes());
  EXPECT_EQ(lse.bytes(), want.lse.bytes());
}

// bf16 partials are rounded once per block and once per merge: each rounding moves an element by
// at most half a bf16 ulp of a value bounded by max |v| = 1, so a row with n blocks is within
// (2n - 1) * 2^-9 of the exact result, and of the single-rank result (one rounding) within 2n.
TEST(CpRingPrefill, Bf16WithinOneRoundingPerBlockAndMerge) {
  std::mt19937_64 rng(test_seed());
  const AttentionSpec spec = make_spec(4, 2, 16, MaskKind::kCausal);
  const Batch batch = random_batch(spec, {50, 7, 91}, DType::kBF16, rng);
  const PrefillRun want = single_rank_prefill(spec, batch);
  for (const int32_t world : {2, 4}) {
    const PrefillRun got = ring_prefill_ranks(spec, batch, world, true);
    const double blocks = 2.0 * world;  // the most blocks a causal slot merges
    EXPECT_LE(max_diff(got.out, want.out), 2 * blocks * std::ldexp(1.0, -9)) << "world " << world;
    EXPECT_LE(max_diff(got.lse, want.lse), 1e-4);
  }
}

// ---- bad input ------------------------------------------------------------------------------

struct RejectCase {
  const char* what;
  const char* needle;
};

TEST(CpRingPrefill, RejectsBadInputBeforeCommunicating) {
  std::mt19937_64 rng(test_seed());
  const AttentionSpec good_spec = make_spec(4, 2, 16, MaskKind::kCausal);
  const Batch batch = random_batch(good_spec, {12, 5}, DType::kF32, rng);
  const cp::ZigzagPlan plan(batch.cu, 2);
  const std::vector<int32_t> rows = plan.global_rows(0);
  const int64_t n = plan.local_tokens(0);
  HostTensor q = gather_rows(batch.q, rows), k = gather_rows(batch.k, rows),
             v = gather_rows(batch.v, rows);
  HostTensor out(DType::kF32, {n, 4, 16}), lse(DType::kF32, {n, 4});
  out.fill(NAN);
  lse.fill(NAN);
  const std::vector<uint8_t> out_before = out.bytes(), lse_before = lse.bytes();
  HostTensor wide_k(DType::kF32, {n, 2, 32}), bf16_out(DType::kBF16, {n, 4, 16}),
      short_lse(DType::kF32, {n - 1, 4});
  const std::vector<Device> devices(2, Device::cpu());
  // Rank 1 never calls: a check that lets a call through would wait, and time out.
  const auto group = cp::make_in_process_group(devices, 5.0);

  const auto expect_rejected = [&](const char* needle, AttentionSpec spec, const cp::ZigzagPlan& p,
                                   cp::RingPrefillArgs args) {
    SCOPED_TRACE(needle);
    try {
      cp::ring_prefill(spec, p, args, {group[0].get()});
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).find("waited"), std::string::npos) << e.what();
    }
    EXPECT_EQ(out.bytes(), out_before);
    EXPECT_EQ(lse.bytes(), lse_before);
  };
  cp::RingPrefillArgs good;
  good.q = q;
  good.k = k;
  good.v = v;
  good.out = out;
  good.lse = lse;

  expect_rejected("plan", good_spec, cp::ZigzagPlan(batch.cu, 4), good);
  AttentionSpec window = good_spec;
  window.mask = MaskSpec{MaskKind::kSlidingWindow, 4, 0};
  expect_rejected("spec.mask", window, plan, good);
  AttentionSpec alibi = good_spec;
  alibi.alibi = true;
  expect_rejected("spec.alibi", alibi, plan, good);
  AttentionSpec skip = good_spec;
  skip.skip_softmax = SkipSoftmaxSpec{};
  skip.skip_softmax->threshold = 0.5;
  expect_rejected("spec.skip_softmax", skip, plan, good);
  AttentionSpec fused = good_spec;
  fused.backend = Backend::kFused;
  expect_rejected("spec.backend", fused, plan, good);
  AttentionSpec bad_heads = good_spec;
  bad_heads.num_kv_heads = 3;
  expect_rejected("num_kv_heads", bad_heads, plan, good);

  HostTensor short_q(DType::kF32, {n - 1, 4, 16});
  cp::RingPrefillArgs a = good;
  a.q = short_q;
  expect_rejected("q", good_spec, plan, a);
  a = good;
  a.k = TensorView(wide_k.view().data, DType::kF32, {n, 2, 16}, {64, 32, 1});  // strided rows
  expect_rejected("k", good_spec, plan, a);
  a = good;
  a.v = TensorView();
  expect_rejected("v", good_spec, plan, a);
  a = good;
  a.out = bf16_out;
  expect_rejected("out", good_spec, plan, a);
  a = good;
  a.lse = short_lse;
  expect_rejected("lse", good_spec, plan, a);
}

// ---- sharded decode -------------------------------------------------------------------------

constexpr int32_t kHq = 8, kHkv = 2, kD = 16, kT = 8;

KvCacheManagerConfig decode_config(int32_t max_seq_len) {
  KvCacheManagerConfig c;
  c.num_layers = 1;
  c.num_kv_heads = kHkv;
  c.head_dim = kD;
  c.tokens_per_block = kT;
  c.dtype = DType::kBF16;
  c.max_tokens = 4096;
  c.max_seq_len = max_seq_len;
  c.enable_prefix_reuse = false;
  return c;
}

struct DecodeOut {
  HostTensor out, lse;
};

DecodeOut run_decode(const AttentionSpec& spec, const KvBlockTables& tables,
                     const KvCacheManager& manager, const HostTensor& q, cp::Communicator* comm,
                     int32_t num_splits) {
  const int64_t rows = tables.num_rows;
  DecodeOut r{HostTensor(DType::kF32, {rows, kHq, kD}), HostTensor(DType::kF32, {rows, kHq})};
  r.out.fill(NAN);
  r.lse.fill(NAN);
  DecodeArgs args;
  args.q = q;
  args.kv_cache = manager.layer_view(0, tables.table_view(), tables.seq_lens_view());
  args.out = r.out;
  args.lse = r.lse;
  args.num_splits = num_splits;
  cp::sharded_decode(spec, args, {comm});
  return r;
}

// Sequences grow through ShardedKvCache on every rank (prompts, then decode steps, short ones
// leaving some ranks without a token), K/V written at each rank's local positions, against one
// manager that holds the whole sequences. Every rank returns the same bits.
TEST(CpShardedDecode, EqualsSingleRankDecode) {
  std::mt19937_64 rng(test_seed());
  const AttentionSpec spec = make_spec(kHq, kHkv, kD, MaskKind::kCausal);
  std::uniform_int_distribution<int32_t> token(0, 30000);
  std::uniform_real_distribution<float> value(-2.0f, 2.0f);
  for (const int32_t world : {1, 2, 4, 8}) {
    SCOPED_TRACE("world " + std::to_string(world));
    const cp::DecodeShardLayout layout{world, kT};
    KvCacheManager global(decode_config(512));
    std::vector<std::unique_ptr<KvCacheManager>> managers;
    std::vector<cp::ShardedKvCache> shards;
    for (int32_t r = 0; r < world; ++r) {
      managers.push_back(std::make_unique<KvCacheManager>(
          decode_config(static_cast<int32_t>(layout.local_length(0, 512)))));
    }
    for (int32_t r = 0; r < world; ++r) shards.emplace_back(*managers[r], layout, r);

    const std::vector<SeqId> seqs{11, 12, 13, 14};
    const std::vector<int32_t> prompt_lengths{3, 70, 17, 200};
    const auto extend = [&](SeqId seq, const std::vector<int32_t>& tokens) {
      const int64_t begin = shards[0].length(seq);
      if (begin == 0) {
        global.add(seq, tokens);
      } else {
        global.append(seq, tokens);
      }
      for (auto& shard : shards) shard.extend(seq, tokens);
      for (size_t i = 0; i < tokens.size(); ++i) {
        const int64_t p = begin + static_cast<int64_t>(i);
        std::vector<float> k(kHkv * kD), v(kHkv * kD);
        for (float& x : k) x = value(rng);
        for (float& x : v) x = value(rng) / 2;
        write_kv_bf16(global, seq, p, kHkv, kT, kD, k.data(), v.data());
        const int32_t owner = layout.rank_of_position(p);
        write_kv_bf16(*managers[owner], seq, layout.local_position(p), kHkv, kT, kD, k.data(),
                      v.data());
      }
    };
    for (size_t s = 0; s < seqs.size(); ++s) {
      std::vector<int32_t> prompt(static_cast<size_t>(prompt_lengths[s]));
      for (int32_t& t : prompt) t = token(rng);
      extend(seqs[s], prompt);
    }
    const std::vector<Device> devices(static_cast<size_t>(world), Device::cpu());
    const auto group = cp::make_in_process_group(devices, 60.0);
    for (int step = 0; step < 3; ++step) {
      for (const SeqId seq : seqs) extend(seq, {token(rng)});
      for (int32_t r = 0; r < world; ++r) {
        for (const SeqId seq : seqs) {
          ASSERT_EQ(managers[r]->contains(seq) ? managers[r]->length(seq) : 0,
                    layout.local_length(r, global.length(seq)));
          EXPECT_EQ(shards[r].local_length(seq), layout.local_length(r, global.length(seq)));
        }
      }
      HostTensor q(DType::kF32, {static_cast<int64_t>(seqs.size()), kHq, kD});
      q.fill_uniform(rng, -2.0f, 2.0f);
      const KvBlockTables global_tables = global.block_tables(seqs);
      const DecodeOut want = run_decode(spec, global_tables, global, q, nullptr, 0);
      std::vector<DecodeOut> got(static_cast<size_t>(world));
      run_ranks(world, [&](int32_t r) {
        const KvBlockTables tables = shards[r].block_tables(seqs);
        got[r] = run_decode(spec, tables, *managers[r], q, group[r].get(), step == 1 ? 2 : 0);
      });
      EXPECT_LE(max_diff(got[0].out, want.out), 2e-6) << "step " << step;
      EXPECT_LE(max_diff(got[0].lse, want.lse), 2e-5) << "step " << step;
      for (int32_t r = 1; r < world; ++r) {
        EXPECT_EQ(got[r].out.bytes(), got[0].out.bytes()) << "rank " << r;
        EXPECT_EQ(got[r].lse.bytes(), got[0].lse.bytes()) << "rank " << r;
      }
    }
    for (auto& shard : shards) shard.release(seqs[0]);
    for (int32_t r = 0; r < world; ++r) {
      EXPECT_FALSE(managers[r]->contains(seqs[0]));
      EXPECT_EQ(shards[r].length(seqs[0]), 0);
      managers[r]->check_invariants();
    }
  }
}

TEST(CpShardedDecode, RejectsWhatNeedsAbsolutePositions) {
  std::mt19937_64 rng(test_seed());
  KvCacheManager manager(decode_config(64));
  cp::ShardedKvCache shard(manager, {2, kT}, 0);
  EXPECT_THROW(cp::ShardedKvCache(manager, {2, kT}, 2), Error);
  const std::vector<SeqId> seqs{1};
  shard.extend(1, std::vector<int32_t>(20, 5));
  const KvBlockTables tables = shard.block_tables(seqs);
  HostTensor q(DType::kF32, {1, kHq, kD}), out(DType::kF32, {1, kHq, kD});
  q.fill_uniform(rng, -1.0f, 1.0f);
  out.fill(NAN);
  const std::vector<uint8_t> before = out.bytes();
  const std::vector<Device> devices(2, Device::cpu());
  const auto group = cp::make_in_process_group(devices, 5.0);
  const auto expect_rejected = [&](const char* needle, const AttentionSpec& spec,
                                   const DecodeArgs& args) {
    try {
      cp::sharded_decode(spec, args, {group[0].get()});
      ADD_FAILURE() << needle << ": accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_EQ(out.bytes(), before);
  };
  DecodeArgs args;
  args.q = q;
  args.kv_cache = manager.layer_view(0, tables.table_view(), tables.seq_lens_view());
  args.out = out;
  AttentionSpec spec = make_spec(kHq, kHkv, kD, MaskKind::kSlidingWindow);
  spec.mask.window = 4;
  expect_rejected("spec.mask", spec, args);
  spec = make_spec(kHq, kHkv, kD, MaskKind::kCausal);
  spec.alibi = true;
  expect_rejected("spec.alibi", spec, args);
  spec.alibi = false;
  DecodeArgs beams = args;
  beams.beam_width = 2;
  expect_rejected("beam_width", spec, beams);
  DecodeArgs wrong = args;
  HostTensor short_out(DType::kF32, {1, kHq, kD / 2});
  wrong.out = short_out;
  expect_rejected("out", spec, wrong);
}

}  // namespace
}  // namespace attnkit::test
