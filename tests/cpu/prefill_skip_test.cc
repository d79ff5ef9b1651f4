// Skip-softmax in prefill() on the reference backend (docs/diffusion.md): decisions, counts and
// outputs against the test's own tile walk over materialized causal scores (the walk from each
// query tile's diagonal back to the first key tile, rows without a key in a tile not voting);
// threshold 0 and a closed gate are the plain call bit for bit; target_sparsity takes each
// sequence's own kv_len; skip_stats; invalid calls; and AttentionConfig roles reaching their calls.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "attnkit/config.h"
#include "common/diffusion_like_data.h"
#include "common/test_util.h"
#include "validate_fixtures.h"

namespace attnkit::test {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

using Seq = PackedSeq;
using PackedInputs = PackedDiffusionLike;

// Packed causal f32 inputs: a shared low-rank positional part makes attention local, so that tiles
// far from the diagonal skip.
PackedInputs make_inputs(const std::vector<Seq>& seqs, int32_t hq, int32_t hkv, int32_t dim,
                         uint64_t salt) {
  std::mt19937_64 rng(test_seed() + salt);
  return make_packed_diffusion_like(seqs, hq, hkv, dim, DType::kF32, rng);
}

AttentionSpec causal_spec(const PackedInputs& in, std::optional<double> threshold,
                          double disabled_until = 0.0) {
  AttentionSpec spec;
  spec.num_q_heads = in.hq;
  spec.num_kv_heads = in.hkv;
  spec.head_dim = in.dim;
  spec.mask.kind = MaskKind::kCausal;
  if (threshold) {
    SkipSoftmaxSpec s;
    s.threshold = *threshold;
    s.disabled_until_timestep = disabled_until;
    spec.skip_softmax = s;
  }
  return spec;
}

struct Result {
  HostTensor out, lse;
  SkipStats stats;
};

Result run_prefill(const AttentionSpec& spec, const PackedInputs& in, int32_t block_m,
                   int32_t block_n, double timestep = 0.0) {
  const int64_t total_q = in.q.view().shape[0];
  Result r{HostTensor(DType::kF32, {total_q, in.hq, in.dim}),
           HostTensor(DType::kF32, {total_q, in.hq}),
           {}};
  r.out.fill(NAN);
  r.lse.fill(NAN);
  HostTensor stats(DType::kInt64, {4});
  stats.fill(-1.f);
  PrefillArgs args = in.args(r.out);
  args.lse = r.lse;
  args.timestep = timestep;
  args.block_m = block_m;
  args.block_n = block_n;
  args.skip_stats = stats;
  prefill(spec, args);
  std::memcpy(&r.stats, stats.data<int64_t>(), sizeof(SkipStats));
  return r;
}

bool same_bytes(const HostTensor& a, const HostTensor& b) { return a.bytes() == b.bytes(); }

// ---- the test's own walk ------------------------------------------------------------------------
struct Walk {
  std::vector<double> out;  // [total_q, Hq, D]
  int64_t total = 0, skipped = 0;
};

// Per (sequence, head, query tile): the whole masked score rows, the key tiles from the one holding
// the tile's last query position back to tile 0, each kept unless every row with an attended key
// in it has its tile maximum below its running maximum by more than ln(lambda); the output is
// exact softmax attention over the kept tiles' keys. `logit` gives the modified logit.
template <typename Logit>
Walk independent_walk(const PackedInputs& in, int32_t bm, int32_t bn, double lambda,
                      const Logit& logit) {
  Walk w;
  const int64_t total_q = in.q.view().shape[0];
  w.out.assign(static_cast<size_t>(total_q * in.hq * in.dim), 0.0);
  const int32_t group = in.hq / in.hkv;
  int64_t q0 = 0, k0 = 0;
  for (const Seq& s : in.seqs) {
    const int64_t pos0 = s.kv_len - s.q_len;
    for (int32_t h = 0; h < in.hq; ++h) {
      const int32_t hk = h / group;
      // scores[r][j]: -inf where masked.
      std::vector<std::vector<double>> scores(s.q_len, std::vector<double>(s.kv_len, kNegInf));
      for (int64_t r = 0; r < s.q_len; ++r) {
        for (int64_t j = 0; j <= pos0 + r && j < s.kv_len; ++j) {
          double dot = 0.0;
          for (int32_t d = 0; d < in.dim; ++d) {
            dot += static_cast<double>(in.q.get(((q0 + r) * in.hq + h) * in.dim + d)) *
                   in.k.get(((k0 + j) * in.hkv + hk) * in.dim + d);
          }
          scores[r][j] = logit(dot, h, pos0 + r, j);
        }
      }
      for (int64_t m0 = 0; m0 < s.q_len; m0 += bm) {
        const int64_t rows = std::min<int64_t>(bm, s.q_len - m0);
        const int64_t key_end = std::min<int64_t>(s.kv_len, pos0 + m0 + rows);
        const int64_t tiles = (key_end + bn - 1) / bn;
        std::vector<double> running(rows, kNegInf);
        std::vector<bool> kept(tiles, false);
        for (int64_t t = tiles - 1; t >= 0; --t) {
          ++w.total;
          std::vector<double> tmax(rows, kNegInf);
          for (int64_t r = 0; r < rows; ++r) {
            for (int64_t j = t * bn; j < std::min<int64_t>(s.kv_len, (t + 1) * bn); ++j)
              tmax[r] = std::max(tmax[r], scores[m0 + r][j]);
          }
          bool skip = lambda > 0.0;
          for (int64_t r = 0; r < rows; ++r) {
            if (tmax[r] != kNegInf && !(tmax[r] - running[r] < std::log(lambda))) skip = false;
          }
          if (skip) {
            ++w.skipped;
            continue;
          }
          kept[t] = true;
          for (int64_t r = 0; r < rows; ++r) running[r] = std::max(running[r], tmax[r]);
        }
        for (int64_t r = 0; r < rows; ++r) {
          double mx = kNegInf;
          for (int64_t t = 0; t < tiles; ++t) {
            if (!kept[t]) continue;
            for (int64_t j = t * bn; j < std::min<int64_t>(s.kv_len, (t + 1) * bn); ++j)
              mx = std::max(mx, scores[m0 + r][j]);
          }
          if (mx == kNegInf) continue;
          double sum = 0.0;
          std::vector<double> acc(in.dim, 0.0);
          for (int64_t t = 0; t < tiles; ++t) {
            if (!kept[t]) continue;
            for (int64_t j = t * bn; j < std::min<int64_t>(s.kv_len, (t + 1) * bn); ++j) {
              const double p = std::exp(scores[m0 + r][j] - mx);
              sum += p;
              for (int32_t d = 0; d < in.dim; ++d)
                acc[d] += p * in.v.get(((k0 + j) * in.hkv + hk) * in.dim + d);
            }
          }
          for (int32_t d = 0; d < in.dim; ++d)
            w.out[((q0 + m0 + r) * in.hq + h) * in.dim + d] = acc[d] / sum;
        }
      }
    }
    q0 += s.q_len;
    k0 += s.kv_len;
  }
  return w;
}

void expect_close(const HostTensor& got, const std::vector<double>& want, double tol) {
  const std::vector<double> g = got.to_double();
  ASSERT_EQ(g.size(), want.size());
  ASSERT_FALSE(any_nan(g));
  double worst = 0.0;
  for (size_t i = 0; i < g.size(); ++i) worst = std::max(worst, std::fabs(g[i] - want[i]));
  EXPECT_LE(worst, tol);
}

const std::vector<Seq> kSeqs = {{300, 300}, {77, 400}, {1, 130}};

TEST(PrefillSkip, DecisionsAndOutputsMatchAnIndependentTileWalk) {
  const PackedInputs in = make_inputs(kSeqs, 4, 2, 64, 1);
  struct Case {
    int32_t bm, bn;
    double lambda;
    bool mods;  // soft-cap and ALiBi
  };
  for (const Case& c : {Case{64, 64, 1e-2, false}, Case{32, 128, 3e-2, false},
                        Case{128, 32, 1e-2, true}, Case{16, 16, 1e-3, false}}) {
    SCOPED_TRACE(testing::Message() << c.bm << "x" << c.bn << " lambda " << c.lambda
                                    << (c.mods ? " softcap + alibi" : ""));
    AttentionSpec spec = causal_spec(in, c.lambda);
    const double scale = 1.0 / std::sqrt(64.0);
    std::vector<float> slopes;
    if (c.mods) {
      spec.logit_softcap = 30.0;
      spec.alibi = true;
      slopes = default_alibi_slopes(in.hq);
    }
    const Result got = run_prefill(spec, in, c.bm, c.bn);
    const Walk want =
        independent_walk(in, c.bm, c.bn, c.lambda, [&](double dot, int h, int64_t p, int64_t j) {
          double x = dot * scale;
          if (c.mods) x = 30.0 * std::tanh(x / 30.0) + slopes[h] * static_cast<double>(j - p);
          return x;
        });
    EXPECT_EQ(got.stats.tiles_total, want.total);
    EXPECT_EQ(got.stats.tiles_skipped, want.skipped);
    EXPECT_EQ(got.stats.block_m, c.bm);
    EXPECT_EQ(got.stats.block_n, c.bn);
    // The structured data skips, and not everything: the test cannot pass vacuously.
    EXPECT_GT(want.skipped, want.total / 20);
    EXPECT_LT(want.skipped, want.total * 9 / 10);
    expect_close(got.out, want.out, 2e-6);
  }
}

TEST(PrefillSkip, MaskNoneWalksEveryKeyTileFromTheLast) {
  PackedInputs in = make_inputs({{200, 200}, {64, 300}}, 2, 2, 64, 2);
  AttentionSpec spec = causal_spec(in, 1e-2);
  spec.mask.kind = MaskKind::kNone;
  const Result got = run_prefill(spec, in, 64, 32);
  // Every query tile visits ceil(kv_len / 32) key tiles.
  EXPECT_EQ(got.stats.tiles_total, 2 * (4 * 7 + 1 * 10));
  EXPECT_GT(got.stats.tiles_skipped, 0);
  const Result plain = run_prefill(causal_spec(in, std::nullopt), in, 64, 32);
  EXPECT_FALSE(same_bytes(got.out, plain.out));
}

TEST(PrefillSkip, ThresholdZeroAndAClosedGateAreThePlainCallBitForBit) {
  const PackedInputs in = make_inputs(kSeqs, 4, 2, 64, 3);
  const Result plain = run_prefill(causal_spec(in, std::nullopt), in, 64, 64);
  // Without skip_softmax, skip_stats still counts the visited tiles.
  EXPECT_GT(plain.stats.tiles_total, 0);
  EXPECT_EQ(plain.stats.tiles_skipped, 0);
  const Result zero = run_prefill(causal_spec(in, 0.0), in, 64, 64);
  EXPECT_TRUE(same_bytes(zero.out, plain.out));
  EXPECT_TRUE(same_bytes(zero.lse, plain.lse));
  EXPECT_EQ(zero.stats.tiles_total, plain.stats.tiles_total);
  EXPECT_EQ(zero.stats.tiles_skipped, 0);
  // Gate at 0.5: closed at 0.8, open at 0.5.
  const AttentionSpec gated = causal_spec(in, 1e-2, 0.5);
  const Result closed = run_prefill(gated, in, 64, 64, 0.8);
  EXPECT_TRUE(same_bytes(closed.out, plain.out));
  EXPECT_EQ(closed.stats.tiles_skipped, 0);
  const Result open = run_prefill(gated, in, 64, 64, 0.5);
  EXPECT_GT(open.stats.tiles_skipped, 0);
  EXPECT_FALSE(same_bytes(open.out, plain.out));
  EXPECT_EQ(open.stats.tiles_total, plain.stats.tiles_total);
}

TEST(PrefillSkip, ALargeThresholdChangesTheOutputMeasurably) {
  const PackedInputs in = make_inputs(kSeqs, 4, 2, 64, 4);
  const Result plain = run_prefill(causal_spec(in, std::nullopt), in, 64, 64);
  const Result skipped = run_prefill(causal_spec(in, 0.9), in, 64, 64);
  EXPECT_GT(skipped.stats.tiles_skipped, skipped.stats.tiles_total / 4);
  EXPECT_GT(max_abs_diff(plain.out.to_double(), skipped.out.to_double()), 0.05);
}

TEST(PrefillSkip, TargetSparsityTakesEachSequencesKvLen) {
  const PackedInputs in = make_inputs(kSeqs, 2, 1, 64, 5);
  AttentionSpec target = causal_spec(in, std::nullopt);
  SkipSoftmaxSpec s;
  s.target_sparsity = 0.6;
  s.calibration_a = 0.5;
  s.calibration_b = 4.0;
  target.skip_softmax = s;
  const Result all = run_prefill(target, in, 32, 32);
  int64_t total = 0, skipped = 0;
  int64_t q0 = 0;
  for (size_t i = 0; i < kSeqs.size(); ++i) {
    // Sequence i alone, with its own lambda as a threshold.
    PackedInputs single;
    single.seqs = {kSeqs[i]};
    single.hq = 2;
    single.hkv = 1;
    single.dim = 64;
    single.q = HostTensor(DType::kF32, {kSeqs[i].q_len, 2, 64});
    single.k = HostTensor(DType::kF32, {kSeqs[i].kv_len, 1, 64});
    single.v = HostTensor(DType::kF32, {kSeqs[i].kv_len, 1, 64});
    single.cu_q = HostTensor(DType::kInt32, {2});
    single.cu_kv = HostTensor(DType::kInt32, {2});
    const int64_t k0 = in.cu_kv.data<int32_t>()[i];
    for (int64_t e = 0; e < single.q.numel(); ++e) single.q.set(e, in.q.get(q0 * 2 * 64 + e));
    for (int64_t e = 0; e < single.k.numel(); ++e) {
      single.k.set(e, in.k.get(k0 * 64 + e));
      single.v.set(e, in.v.get(k0 * 64 + e));
    }
    single.cu_q.data<int32_t>()[0] = single.cu_kv.data<int32_t>()[0] = 0;
    single.cu_q.data<int32_t>()[1] = kSeqs[i].q_len;
    single.cu_kv.data<int32_t>()[1] = kSeqs[i].kv_len;
    const double lambda = 0.5 * std::exp(4.0 * 0.6) / kSeqs[i].kv_len;
    const Result alone = run_prefill(causal_spec(single, lambda), single, 32, 32);
    total += alone.stats.tiles_total;
    skipped += alone.stats.tiles_skipped;
    const int64_t elems = single.q.numel();
    EXPECT_EQ(std::memcmp(all.out.data<float>() + q0 * 2 * 64, alone.out.data<float>(),
                          static_cast<size_t>(elems) * sizeof(float)),
              0)
        << "sequence " << i;
    q0 += kSeqs[i].q_len;
  }
  EXPECT_EQ(all.stats.tiles_total, total);
  EXPECT_EQ(all.stats.tiles_skipped, skipped);
  EXPECT_GT(skipped, 0);
}

TEST(PrefillSkip, InvalidCallsRaiseAndWriteNothing) {
  const PackedInputs in = make_inputs({{40, 50}}, 4, 2, 64, 6);
  HostTensor out(DType::kF32, {40, 4, 64}), stats(DType::kInt64, {4});
  out.fill(7.f);
  stats.fill(3.f);
  auto call = [&](AttentionSpec spec, auto&& edit) {
    PrefillArgs args = in.args(out);
    args.skip_stats = stats;
    edit(spec, args);
    return [spec, args] { prefill(spec, args); };
  };
  const AttentionSpec skip = causal_spec(in, 1e-2);
  const std::vector<const HostTensor*> outputs = {&out, &stats};
  expect_rejected(call(skip,
                       [](AttentionSpec& s, PrefillArgs&) {
                         s.mask.kind = MaskKind::kSlidingWindow;
                         s.mask.window = 16;
                       }),
                  "prefill: spec.skip_softmax:", outputs);
  HostTensor stats2(DType::kInt64, {2}), stats_i32(DType::kInt32, {4});
  expect_rejected(call(skip, [&](AttentionSpec&, PrefillArgs& a) { a.skip_stats = stats2; }),
                  "prefill: skip_stats:", outputs);
  expect_rejected(call(skip, [&](AttentionSpec&, PrefillArgs& a) { a.skip_stats = stats_i32; }),
                  "prefill: skip_stats:", outputs);
  expect_rejected(call(skip, [](AttentionSpec&, PrefillArgs& a) { a.timestep = 1.5; }),
                  "prefill: timestep:", outputs);
  expect_rejected(call(skip, [](AttentionSpec&, PrefillArgs& a) { a.block_m = 48; }),
                  "prefill: block_m:", outputs);
  expect_rejected(call(skip, [](AttentionSpec&, PrefillArgs& a) { a.block_n = 0; }),
                  "prefill: block_n:", outputs);
  // skip + SAGE combine (the skip test takes the SAGE scores); SAGE under a window does not.
  expect_rejected(call(skip,
                       [](AttentionSpec& s, PrefillArgs&) {
                         s.quant = SageQuantSpec{};
                         s.mask.kind = MaskKind::kSlidingWindow;
                         s.mask.window = 16;
                       }),
                  "prefill: spec.quant:", outputs);
  expect_rejected(call(skip,
                       [](AttentionSpec& s, PrefillArgs&) {
                         s.skip_softmax->threshold.reset();
                         s.skip_softmax->target_sparsity = 0.5;  // without a calibration curve
                       }),
                  "spec.skip_softmax", outputs);
  // skip_stats alone (no skip_softmax) under a sliding window: no tile walk to count.
  expect_rejected(call(causal_spec(in, std::nullopt),
                       [](AttentionSpec& s, PrefillArgs&) {
                         s.mask.kind = MaskKind::kSlidingWindow;
                         s.mask.window = 16;
                       }),
                  "prefill: skip_stats:", outputs);
}

TEST(PrefillSkip, DecodeAndForwardStillRejectSkipSoftmax) {
  const AttentionSpec base = small_spec();
  AttentionSpec spec = base;
  SkipSoftmaxSpec s;
  s.threshold = 0.1;
  spec.skip_softmax = s;
  CacheFixture cache({5, 9});
  auto q = make_input(DType::kBF16, {2, 4, 16});
  auto out = make_output(DType::kBF16, {2, 4, 16});
  DecodeArgs args;
  args.q = *q;
  args.kv_cache = cache.view;
  args.out = *out;
  expect_rejected([&] { decode(spec, args); }, "decode: spec.skip_softmax:", {out.get()});
}

// ---- AttentionConfig roles reach their calls ----------------------------------------------------
// One model step of a diffusion transformer on the reference backend: a causal self-attention
// (prefill) and an unmasked cross-attention (dense) per block, each through its role's spec. The
// roles skip at different thresholds, and self.video is gated off at this timestep: the skip
// rates differ as the roles say, and every call equals the same call with the role's settings
// written into the spec by hand.
TEST(SkipRoles, EachRolesSpecReachesItsCall) {
  const AttentionConfig config = AttentionConfig::from_json(R"({
    "per_role": {
      "self": {"skip_softmax": {"threshold": 0.05}},
      "self.video": {"skip_softmax": {"threshold": 0.05, "disabled_until_timestep": 0.3}},
      "cross": {"skip_softmax": {"threshold": 1e-4}}
    }})");
  const double timestep = 0.6;
  const PackedInputs in = make_inputs({{256, 256}}, 2, 2, 64, 7);
  std::vector<std::pair<std::string, double>> self_rates;
  for (const std::string role : {"self", "self.video", "self.audio"}) {
    const AttentionSpec spec = config.apply(role, causal_spec(in, std::nullopt));
    const Result got = run_prefill(spec, in, 32, 32, timestep);
    const double expected_threshold = role == "self.video" ? 0.0 : 0.05;  // gated off at 0.6
    const Result by_hand = run_prefill(causal_spec(in, expected_threshold), in, 32, 32);
    EXPECT_TRUE(same_bytes(got.out, by_hand.out)) << role;
    EXPECT_EQ(got.stats.tiles_skipped, by_hand.stats.tiles_skipped) << role;
    self_rates.emplace_back(role, got.stats.skipped_fraction());
  }
  EXPECT_GT(self_rates[0].second, 0.05);
  EXPECT_EQ(self_rates[1].second, 0.0);
  EXPECT_EQ(self_rates[2].second, self_rates[0].second);  // self.audio resolves through self

  // Cross attention: dense() over [1, S, H, D] views of the same data.
  HostTensor q(DType::kF32, {1, 256, 2, 64}), k(DType::kF32, {1, 256, 2, 64}),
      v(DType::kF32, {1, 256, 2, 64});
  std::mt19937_64 rng(test_seed() + 8);
  fill_diffusion_like(q, k, v, rng);
  auto dense_rate = [&](const AttentionSpec& spec) {
    HostTensor out(DType::kF32, {1, 256, 2, 64});
    DenseStats stats;
    DenseArgs args;
    args.q = q;
    args.k = k;
    args.v = v;
    args.out = out;
    args.timestep = timestep;
    args.block_m = 32;
    args.block_n = 32;
    args.stats = &stats;
    dense(spec, args);
    return stats.skipped_fraction();
  };
  AttentionSpec cross = causal_spec(in, std::nullopt);
  cross.mask.kind = MaskKind::kNone;
  const double cross_rate = dense_rate(config.apply("cross", cross));
  const double self_rate_dense = dense_rate(config.apply("self", cross));
  EXPECT_GT(cross_rate, 0.0);
  EXPECT_GT(self_rate_dense, cross_rate);  // the larger lambda skips more
}

}  // namespace
}  // namespace attnkit::test
