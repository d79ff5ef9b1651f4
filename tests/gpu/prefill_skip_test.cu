// Skip-softmax in the fused prefill (docs/diffusion.md): the portable kernel (every compiled tile,
// causal and unmasked, threshold and target_sparsity) and the sm90 kernel (unmasked) against the
// tile-faithful reference, which is the CPU prefill() itself told the kernel's tiles (SkipStats
// block_m x block_n) and walking, as the kernels do, from a query tile's diagonal back: the same
// decisions (skipped counts equal up to the float32 slack at the boundary, totals exact), the same
// outputs to rounding. Threshold 0 and a closed gate are the plain call bit for bit, and so is a
// skipping kernel that skips nothing; a large threshold changes the output; skip_stats without
// skipping counts the visited tiles; the calls the fused kernels cannot serve raise; and the
// AttentionConfig role of each call of a model step reaches its kernel.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "attnkit/config.h"
#include "common/diffusion_like_data.h"
#include "common/test_util.h"
#include "core/numerics.h"
#include "core/problem.h"
#include "cuda/prefill/prefill_api.h"
#include "cuda/prefill/prefill_launch.h"
#include "gpu/gpu_util.h"

namespace attnkit::test {
namespace {

using cuda::prefill::PrefillTile;

using Seq = PackedSeq;

// Packed bf16 inputs of diffusion-like structure, and exact f32 copies for the reference.
struct Inputs : PackedDiffusionLike {
  HostTensor q32, k32, v32;
};

Inputs make_inputs(const std::vector<Seq>& seqs, int32_t hq, int32_t hkv, int32_t dim,
                   uint64_t salt) {
  std::mt19937_64 rng(test_seed() + salt);
  Inputs in{make_packed_diffusion_like(seqs, hq, hkv, dim, DType::kBF16, rng)};
  // f32 tensors of the same [tokens, heads, D] shapes (one view each: two view() calls would
  // give iterators into two different temporaries).
  auto f32_like = [](const HostTensor& t) {
    const TensorView v = t.view();
    return HostTensor(DType::kF32, std::vector<int64_t>(v.shape.begin(), v.shape.begin() + v.ndim));
  };
  in.q32 = f32_like(in.q);
  in.k32 = f32_like(in.k);
  in.v32 = f32_like(in.v);
  for (int64_t e = 0; e < in.q.numel(); ++e) in.q32.set(e, in.q.get(e));
  for (int64_t e = 0; e < in.k.numel(); ++e) {
    in.k32.set(e, in.k.get(e));
    in.v32.set(e, in.v.get(e));
  }
  return in;
}

// Device copies of the packed inputs.
struct DeviceInputs {
  DeviceTensor q, k, v, cu_q, cu_kv;
  int32_t max_q, max_kv;
  explicit DeviceInputs(const Inputs& in)
      : q(in.q),
        k(in.k),
        v(in.v),
        cu_q(in.cu_q),
        cu_kv(in.cu_kv),
        max_q(in.max_q),
        max_kv(in.max_kv) {}
  // The packed-mode PrefillArgs on the device, writing `out`.
  PrefillArgs args(const TensorView& out) const {
    return packed_prefill_args(q, k, v, cu_q, cu_kv, max_q, max_kv, out);
  }
};

SkipSoftmaxSpec threshold_skip(double lambda, double disabled_until = 0.0) {
  SkipSoftmaxSpec s;
  s.threshold = lambda;
  s.disabled_until_timestep = disabled_until;
  return s;
}

AttentionSpec spec_of(const Inputs& in, MaskKind mask, std::optional<SkipSoftmaxSpec> skip,
                      FusedKernel kernel = FusedKernel::kAuto) {
  AttentionSpec spec;
  spec.num_q_heads = in.hq;
  spec.num_kv_heads = in.hkv;
  spec.head_dim = in.dim;
  spec.mask.kind = mask;
  spec.backend = Backend::kFused;
  spec.fused_kernel = kernel;
  spec.skip_softmax = skip;
  return spec;
}

struct Result {
  HostTensor out, lse;
  SkipStats stats;
};

// The fused call on the GPU; `tile` forces a kernel (run_prefill), else the public prefill().
Result run_gpu(const AttentionSpec& spec, const Inputs& in, std::optional<PrefillTile> tile = {},
               double timestep = 0.0) {
  const int64_t total_q = in.q.view().shape[0];
  Result r{HostTensor(DType::kBF16, {total_q, in.hq, in.dim}),
           HostTensor(DType::kF32, {total_q, in.hq}),
           {}};
  r.out.fill(NAN);
  r.lse.fill(NAN);
  HostTensor stats(DType::kInt64, {4});
  stats.fill(-1.f);
  const DeviceInputs d_in(in);
  DeviceTensor d_out(r.out), d_lse(r.lse), d_stats(stats);
  PrefillArgs args = d_in.args(d_out);
  args.lse = d_lse;
  args.timestep = timestep;
  args.skip_stats = d_stats;
  if (tile) {
    const detail::PrefillProblem p = detail::validate_prefill(spec, args);
    cuda::prefill::run_prefill(spec, args, p, nullptr, tile);
  } else {
    prefill(spec, args);
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  d_out.download(r.out);
  d_lse.download(r.lse);
  d_stats.download(stats);
  std::memcpy(&r.stats, stats.data<int64_t>(), sizeof(SkipStats));
  return r;
}

// The CPU reference prefill() on the f32 copies with the kernel's tiles.
Result run_reference(AttentionSpec spec, const Inputs& in, const SkipStats& tiles,
                     double timestep = 0.0) {
  spec.backend = Backend::kAuto;
  const int64_t total_q = in.q.view().shape[0];
  Result r{HostTensor(DType::kF32, {total_q, in.hq, in.dim}),
           HostTensor(DType::kF32, {total_q, in.hq}),
           {}};
  HostTensor stats(DType::kInt64, {4});
  PrefillArgs args;
  args.q = in.q32;
  args.k = in.k32;
  args.v = in.v32;
  args.cu_seqlens_q = in.cu_q;
  args.cu_seqlens_kv = in.cu_kv;
  args.out = r.out;
  args.lse = r.lse;
  args.timestep = timestep;
  args.block_m = static_cast<int32_t>(tiles.block_m);
  args.block_n = static_cast<int32_t>(tiles.block_n);
  args.skip_stats = stats;
  prefill(spec, args);
  std::memcpy(&r.stats, stats.data<int64_t>(), sizeof(SkipStats));
  return r;
}

double round_bf16(double x) {
  return numerics::bf16_bits_to_float(numerics::float_to_bf16_bits(static_cast<float>(x)));
}

bool same_bytes(const HostTensor& a, const HostTensor& b) { return a.bytes() == b.bytes(); }

// Kernel against reference: totals exact, skipped counts within the float32 slack, between 10%
// and 90% of the tiles skipped (`min_fraction` to 90%), outputs by docs/testing.md's rule, LSE.
void expect_matches_reference(const Result& got, const Result& want, double min_fraction = 0.1) {
  EXPECT_EQ(got.stats.tiles_total, want.stats.tiles_total);
  const int64_t slack = std::max<int64_t>(2, want.stats.tiles_total / 500);
  EXPECT_NEAR(static_cast<double>(got.stats.tiles_skipped),
              static_cast<double>(want.stats.tiles_skipped), static_cast<double>(slack));
  EXPECT_GT(got.stats.tiles_skipped, got.stats.tiles_total * min_fraction)
      << "too little skipped: the test would be void";
  EXPECT_LT(got.stats.tiles_skipped, got.stats.tiles_total * 9 / 10);
  const std::vector<double> out = got.out.to_double(), ref = want.out.to_double();
  ASSERT_FALSE(any_nan(out));
  double naive = 0.0, err = 0.0;
  for (size_t i = 0; i < out.size(); ++i) {
    naive = std::max(naive, std::fabs(round_bf16(ref[i]) - ref[i]));
    err = std::max(err, std::fabs(out[i] - ref[i]));
  }
  EXPECT_LE(err, 2 * naive + 1e-3) << "naive bf16 error " << naive;
  const std::vector<double> lse = got.lse.to_double(), ref_lse = want.lse.to_double();
  for (size_t i = 0; i < lse.size(); ++i) ASSERT_NEAR(lse[i], ref_lse[i], 2e-3) << i;
}

// The portable tiles this build and GPU run for head_dim (bf16).
std::vector<PrefillTile> portable_tiles(int dim) {
  std::vector<PrefillTile> tiles;
  for (PrefillTile t : cuda::prefill::runnable_tiles(dim, DType::kBF16, 0)) {
    if (t != PrefillTile::kSm90) tiles.push_back(t);
  }
  return tiles;
}

bool has_sm90(int dim) {
  for (PrefillTile t : cuda::prefill::runnable_tiles(dim, DType::kBF16, 0)) {
    if (t == PrefillTile::kSm90) return true;
  }
  return false;
}

// Long, chunked (queries over a longer prefix) and single-query sequences.
const std::vector<Seq> kCausalSeqs = {{1000, 1000}, {300, 1500}, {1, 700}};

// ATTNKIT_TEST_SCALE=small: two thresholds on the first tile of each head_dim only.
TEST(PrefillSkipGpu, PortableCausalMatchesTheTileFaithfulReference) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  for (int dim : {128, 64, 256}) {
    const std::vector<PrefillTile> tiles = portable_tiles(dim);
    if (tiles.empty()) {
      std::printf("[ SKIPPED  ] no portable kernel for head_dim %d in this build\n", dim);
      continue;
    }
    const Inputs in = make_inputs(kCausalSeqs, 4, 2, dim, 11 + dim);
    for (size_t t = 0; t < (small_test_scale() ? 1 : tiles.size()); ++t) {
      for (double threshold : {1e-3, 3e-2}) {
        SCOPED_TRACE(testing::Message()
                     << "dim=" << dim << " tile=" << cuda::prefill::prefill_tile_name(tiles[t])
                     << " threshold=" << threshold);
        const AttentionSpec spec =
            spec_of(in, MaskKind::kCausal, threshold_skip(threshold), FusedKernel::kPortable);
        const Result got = run_gpu(spec, in, tiles[t]);
        EXPECT_EQ(got.stats.block_m, cuda::prefill::prefill_block_m(tiles[t], dim));
        EXPECT_EQ(got.stats.block_n, cuda::prefill::prefill_block_n(tiles[t], dim, true));
        expect_matches_reference(got, run_reference(spec, in, got.stats));
      }
    }
  }
}

// target_sparsity: lambda = a exp(b s) / kv_len of each sequence, derived in the kernel.
TEST(PrefillSkipGpu, PortableTargetSparsityTakesEachSequencesKvLen) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  if (portable_tiles(128).empty()) GTEST_SKIP() << "no portable kernel for head_dim 128";
  const Inputs in = make_inputs(kCausalSeqs, 4, 4, 128, 21);
  SkipSoftmaxSpec s;
  s.target_sparsity = 0.5;
  s.calibration_a = 2.0;
  s.calibration_b = 3.0;  // lambda = 2 e^1.5 / kv_len: 9e-3 .. 1.3e-2 here
  const AttentionSpec spec = spec_of(in, MaskKind::kCausal, s);
  const Result got = run_gpu(spec, in);
  expect_matches_reference(got, run_reference(spec, in, got.stats));
}

// Mask none (an encoder through prefill()): every key tile, walked from the last.
TEST(PrefillSkipGpu, PortableUnmaskedMatchesTheReference) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  if (portable_tiles(128).empty()) GTEST_SKIP() << "no portable kernel for head_dim 128";
  const Inputs in = make_inputs({{900, 900}, {200, 1200}}, 4, 2, 128, 31);
  const AttentionSpec spec =
      spec_of(in, MaskKind::kNone, threshold_skip(1e-2), FusedKernel::kPortable);
  const Result got = run_gpu(spec, in);
  expect_matches_reference(got, run_reference(spec, in, got.stats));
}

// The sm90 kernel skips unmasked calls (its dense skip kernels over packed sequences).
TEST(PrefillSkipGpu, HopperUnmaskedMatchesTheReference) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  for (int dim : {128, 64}) {
    if (!has_sm90(dim)) {
      std::printf("[ SKIPPED  ] no sm90 kernel for head_dim %d on this GPU / build\n", dim);
      continue;
    }
    SCOPED_TRACE(testing::Message() << "dim=" << dim);
    const Inputs in = make_inputs({{900, 900}, {200, 1200}}, 4, 2, dim, 41 + dim);
    const AttentionSpec spec =
        spec_of(in, MaskKind::kNone, threshold_skip(1e-2), FusedKernel::kHopper);
    const Result got = run_gpu(spec, in);
    EXPECT_EQ(got.stats.block_m, 64);
    EXPECT_EQ(got.stats.block_n, cuda::prefill::prefill_block_n(PrefillTile::kSm90, dim, true));
    expect_matches_reference(got, run_reference(spec, in, got.stats));
  }
}

TEST(PrefillSkipGpu, ThresholdZeroAClosedGateAndNothingSkippedAreThePlainCallBitForBit) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  const std::vector<PrefillTile> tiles = portable_tiles(128);
  if (tiles.empty()) GTEST_SKIP() << "no portable kernel for head_dim 128";
  const Inputs in = make_inputs(kCausalSeqs, 4, 2, 128, 51);
  for (PrefillTile tile : tiles) {
    SCOPED_TRACE(cuda::prefill::prefill_tile_name(tile));
    const Result plain = run_gpu(spec_of(in, MaskKind::kCausal, std::nullopt), in, tile);
    EXPECT_EQ(plain.stats.tiles_skipped, 0);
    const Result zero = run_gpu(spec_of(in, MaskKind::kCausal, threshold_skip(0.0)), in, tile);
    EXPECT_TRUE(same_bytes(zero.out, plain.out));
    EXPECT_TRUE(same_bytes(zero.lse, plain.lse));
    EXPECT_EQ(zero.stats.tiles_total, plain.stats.tiles_total);
    EXPECT_EQ(zero.stats.tiles_skipped, 0);
    // lambda = 1e-30: the skipping kernel runs, and no tile is 69 nats below its running maximum:
    // its arithmetic is the plain kernel's.
    const Result none = run_gpu(spec_of(in, MaskKind::kCausal, threshold_skip(1e-30)), in, tile);
    EXPECT_EQ(none.stats.tiles_skipped, 0);
    EXPECT_EQ(none.stats.tiles_total, plain.stats.tiles_total);
    EXPECT_TRUE(same_bytes(none.out, plain.out));
    EXPECT_TRUE(same_bytes(none.lse, plain.lse));
    // The gate: active for timestep <= 0.5 only.
    const AttentionSpec gated = spec_of(in, MaskKind::kCausal, threshold_skip(3e-2, 0.5));
    const Result closed = run_gpu(gated, in, tile, 0.8);
    EXPECT_TRUE(same_bytes(closed.out, plain.out));
    EXPECT_EQ(closed.stats.tiles_skipped, 0);
    const Result open = run_gpu(gated, in, tile, 0.5);
    EXPECT_GT(open.stats.tiles_skipped, 0);
    EXPECT_FALSE(same_bytes(open.out, plain.out));
  }
}

TEST(PrefillSkipGpu, ALargeThresholdChangesTheOutput) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  if (portable_tiles(128).empty()) GTEST_SKIP() << "no portable kernel for head_dim 128";
  const Inputs in = make_inputs(kCausalSeqs, 4, 2, 128, 61);
  const Result plain = run_gpu(spec_of(in, MaskKind::kCausal, std::nullopt), in);
  const Result skipped = run_gpu(spec_of(in, MaskKind::kCausal, threshold_skip(0.9)), in);
  EXPECT_GT(skipped.stats.tiles_skipped, skipped.stats.tiles_total / 4);
  EXPECT_GT(max_abs_diff(plain.out.to_double(), skipped.out.to_double()), 0.05);
}

// Without skipping, skip_stats still counts the tiles the call's kernel visits: every query tile
// of block_m tokens a head, its key tiles up to the diagonal.
TEST(PrefillSkipGpu, SkipStatsWithoutSkipCountTheVisitedTiles) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  if (portable_tiles(128).empty() && !has_sm90(128)) GTEST_SKIP() << "no kernel for head_dim 128";
  const Inputs in = make_inputs(kCausalSeqs, 4, 2, 128, 71);
  for (MaskKind mask : {MaskKind::kCausal, MaskKind::kNone}) {
    const Result plain = run_gpu(spec_of(in, mask, std::nullopt), in);
    ASSERT_GT(plain.stats.block_m, 0);
    ASSERT_GT(plain.stats.block_n, 0);
    int64_t want = 0;
    for (const Seq& s : in.seqs) {
      for (int64_t m0 = 0; m0 < s.q_len; m0 += plain.stats.block_m) {
        const int64_t last =
            s.kv_len - s.q_len + std::min<int64_t>(s.q_len, m0 + plain.stats.block_m);
        const int64_t keys =
            mask == MaskKind::kCausal ? std::min<int64_t>(s.kv_len, last) : s.kv_len;
        want += (keys + plain.stats.block_n - 1) / plain.stats.block_n;
      }
    }
    EXPECT_EQ(plain.stats.tiles_total, want * in.hq) << mask_name(mask);
    EXPECT_EQ(plain.stats.tiles_skipped, 0);
  }
}

TEST(PrefillSkipGpu, UnservableAndInvalidCallsRaiseAndWriteNothing) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  const Inputs in = make_inputs({{256, 256}}, 4, 2, 128, 81);
  HostTensor out(DType::kBF16, {256, 4, 128});
  out.fill(7.f);
  const DeviceInputs d_in(in);
  DeviceTensor d_out(out);
  const PrefillArgs args = d_in.args(d_out);
  auto expect_raise = [&](const AttentionSpec& spec, const PrefillArgs& a,
                          const std::string& what) {
    try {
      prefill(spec, a);
      ADD_FAILURE() << "accepted: " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  // A forced sm90 kernel does not skip causal calls, and says so (no silent fallback).
  expect_raise(spec_of(in, MaskKind::kCausal, threshold_skip(1e-2), FusedKernel::kHopper), args,
               "skip_softmax with fused_kernel 'hopper'");
  // The vanilla kernels do not skip; auto never takes a skip call there.
  AttentionSpec vanilla = spec_of(in, MaskKind::kCausal, threshold_skip(1e-2));
  vanilla.backend = Backend::kVanilla;
  expect_raise(vanilla, args, "backend 'vanilla' on CUDA does not skip tiles");
  // A paged cache: the skipping kernels read packed K / V.
  HostTensor pool(DType::kBF16, {16, 2, 2, 16, 128}), table(DType::kInt32, {1, 16}),
      lens(DType::kInt32, {1});
  pool.fill(0.5f);
  for (int i = 0; i < 16; ++i) table.data<int32_t>()[i] = i;
  lens.data<int32_t>()[0] = 256;
  DeviceTensor d_pool(pool), d_table(table), d_lens(lens);
  KvCacheView cache = paged_cache_view(d_pool.data(), DType::kBF16, 16, 2, 16, 128);
  cache.block_table = d_table;
  cache.seq_lens = d_lens;
  PrefillArgs paged = args;
  paged.k = paged.v = paged.cu_seqlens_kv = TensorView();
  paged.kv_cache = &cache;
  expect_raise(spec_of(in, MaskKind::kCausal, threshold_skip(1e-2)), paged,
               "skip_softmax over a KV cache");
  AttentionSpec auto_paged = spec_of(in, MaskKind::kCausal, threshold_skip(1e-2));
  auto_paged.backend = Backend::kAuto;
  expect_raise(auto_paged, paged, "skip_softmax runs on the fused kernels");
  // skip_stats must be int64 [4] on q's device.
  HostTensor bad(DType::kInt64, {2});
  DeviceTensor d_bad(bad);
  PrefillArgs bad_stats = args;
  bad_stats.skip_stats = d_bad;
  expect_raise(spec_of(in, MaskKind::kCausal, threshold_skip(1e-2)), bad_stats, "skip_stats");
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  HostTensor after(DType::kBF16, {256, 4, 128});
  d_out.download(after);
  EXPECT_TRUE(same_bytes(after, out));
}

// One step of a diffusion transformer through an AttentionConfig: per block a causal
// self-attention (prefill) and an unmasked cross attention (dense), each with its role's spec.
// The roles' thresholds differ (and self.video's gate is closed at this timestep), and so do the
// skip rates the kernels report; every call equals the call with its role's settings written
// into the spec by hand, bit for bit.
TEST(SkipRolesGpu, EachRolesSpecReachesItsKernel) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  if (portable_tiles(128).empty() && !has_sm90(128)) GTEST_SKIP() << "no kernel for head_dim 128";
  const AttentionConfig config = AttentionConfig::from_json(R"({
    "default": {"backend": "fused"},
    "per_role": {
      "self": {"skip_softmax": {"threshold": 0.5}},
      "self.video": {"skip_softmax": {"threshold": 0.5, "disabled_until_timestep": 0.3}},
      "cross": {"skip_softmax": {"threshold": 1e-4}}
    }})");
  const double timestep = 0.6;
  const Inputs in = make_inputs({{1024, 1024}}, 4, 2, 128, 91);
  std::vector<double> self_rate;
  for (const std::string role : {"self", "self.video"}) {
    const AttentionSpec spec = config.apply(role, spec_of(in, MaskKind::kCausal, std::nullopt));
    const Result got = run_gpu(spec, in, std::nullopt, timestep);
    AttentionSpec by_hand = spec_of(in, MaskKind::kCausal, std::nullopt);
    if (role == "self") by_hand.skip_softmax = threshold_skip(0.5);
    const Result want = run_gpu(by_hand, in);
    EXPECT_TRUE(same_bytes(got.out, want.out)) << role;
    EXPECT_EQ(got.stats.tiles_skipped, want.stats.tiles_skipped) << role;
    self_rate.push_back(got.stats.skipped_fraction());
  }
  EXPECT_GT(self_rate[0], 0.1);
  EXPECT_EQ(self_rate[1], 0.0);

  // Cross attention: dense() on [1, S, H, D] diffusion-like data.
  HostTensor q(DType::kBF16, {1, 1024, 4, 128}), k(DType::kBF16, {1, 1024, 2, 128}),
      v(DType::kBF16, {1, 1024, 2, 128});
  std::mt19937_64 rng(test_seed() + 92);
  fill_diffusion_like(q, k, v, rng);
  DeviceTensor d_q(q), d_k(k), d_v(v), d_out(q);
  auto dense_rate = [&](const AttentionSpec& spec) {
    DenseStats stats;
    DenseArgs args;
    args.q = d_q;
    args.k = d_k;
    args.v = d_v;
    args.out = d_out;
    args.timestep = timestep;
    args.stats = &stats;
    dense(spec, args);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return stats.skipped_fraction();
  };
  AttentionSpec cross = spec_of(in, MaskKind::kNone, std::nullopt);
  const double cross_rate = dense_rate(config.apply("cross", cross));
  const double self_dense_rate = dense_rate(config.apply("self", cross));
  EXPECT_GT(cross_rate, 0.0);
  EXPECT_GT(self_dense_rate, cross_rate);  // the larger lambda skips more tiles
}

}  // namespace
}  // namespace attnkit::test
