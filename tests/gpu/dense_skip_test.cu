// Skip-softmax in the fused dense kernels (sm90 and portable) against the tile-faithful reference
// walked with the kernel's own tiles and order (docs/diffusion.md): the same skip decisions (tile
// counts equal up to the float32 slack at the boundary), the same outputs to rounding; threshold 0
// and a closed timestep gate are the plain call bit for bit; a large threshold changes the output;
// skip_stats matches the host statistics; the calls they cannot run raise.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "common/diffusion_like_data.h"
#include "common/test_util.h"
#include "core/numerics.h"
#include "cuda/prefill/prefill_api.h"
#include "cuda/prefill/prefill_launch.h"
#include "gpu/gpu_util.h"
#include "reference/dense_ref.h"

namespace attnkit::test {
namespace {

using cuda::prefill::PrefillTile;

double round_bf16(double x) {
  return numerics::bf16_bits_to_float(numerics::float_to_bf16_bits(static_cast<float>(x)));
}

bool has_sm90(int head_dim) {
  for (PrefillTile t : cuda::prefill::runnable_tiles(head_dim, DType::kBF16, 0)) {
    if (t == PrefillTile::kSm90) return true;
  }
  return false;
}

bool has_portable(int head_dim) {
  for (PrefillTile t : cuda::prefill::runnable_tiles(head_dim, DType::kBF16, 0)) {
    if (t != PrefillTile::kSm90) return true;
  }
  return false;
}

bool has_kernel(int head_dim, FusedKernel kernel) {
  return kernel == FusedKernel::kHopper ? has_sm90(head_dim) : has_portable(head_dim);
}

struct DenseCase {
  int batch = 2, sq = 1000, skv = 1000, hq = 4, hkv = 2, dim = 128;
  double threshold = 0.0;
  double disabled_until = 0.0;
  double timestep = 0.0;
  FusedKernel kernel = FusedKernel::kHopper;
};

struct DenseRun {
  HostTensor out, lse;
  DenseStats stats;
  int64_t device_stats[2] = {-1, -1};
};

class DenseData {
 public:
  explicit DenseData(const DenseCase& c, uint64_t salt)
      : q(DType::kBF16, {c.batch, c.sq, c.hq, c.dim}),
        k(DType::kBF16, {c.batch, c.skv, c.hkv, c.dim}),
        v(DType::kBF16, {c.batch, c.skv, c.hkv, c.dim}) {
    std::mt19937_64 rng(test_seed() + salt);
    fill_diffusion_like(q, k, v, rng);
  }
  HostTensor q, k, v;
};

AttentionSpec spec_of(const DenseCase& c, bool skip) {
  AttentionSpec spec;
  spec.num_q_heads = c.hq;
  spec.num_kv_heads = c.hkv;
  spec.head_dim = c.dim;
  spec.mask.kind = MaskKind::kNone;
  spec.backend = Backend::kFused;
  spec.fused_kernel = c.kernel;
  if (skip) {
    SkipSoftmaxSpec s;
    s.threshold = c.threshold;
    s.disabled_until_timestep = c.disabled_until;
    spec.skip_softmax = s;
  }
  return spec;
}

DenseRun run(const DenseCase& c, const DenseData& data, bool skip) {
  DenseRun r{HostTensor(DType::kBF16, {c.batch, c.sq, c.hq, c.dim}),
             HostTensor(DType::kF32, {c.batch, c.sq, c.hq})};
  r.out.fill(NAN);
  r.lse.fill(NAN);
  HostTensor stats(DType::kInt64, {2});
  std::memset(stats.data<int64_t>(), 0xff, 16);
  DeviceTensor d_q(data.q), d_k(data.k), d_v(data.v), d_out(r.out), d_lse(r.lse), d_stats(stats);
  DenseArgs args;
  args.q = d_q;
  args.k = d_k;
  args.v = d_v;
  args.out = d_out;
  args.lse = d_lse;
  args.timestep = c.timestep;
  args.stats = &r.stats;
  args.skip_stats = d_stats;
  dense(spec_of(c, skip), args);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  d_out.download(r.out);
  d_lse.download(r.lse);
  d_stats.download(stats);
  r.device_stats[0] = stats.data<int64_t>()[0];
  r.device_stats[1] = stats.data<int64_t>()[1];
  return r;
}

// The reference walked with the kernel's tiles (stats.block_m x block_n) and order (last key tile
// first), on the bf16 values the kernel reads. Fills out / lse [B, Sq, Hq, D] and returns the
// counts.
reference::DenseTileCounts reference_run(const DenseCase& c, const DenseData& data,
                                         const DenseStats& kernel_stats, std::vector<double>& out,
                                         std::vector<double>& lse) {
  reference::DenseTileRule rule;
  rule.block_m = kernel_stats.block_m;
  rule.block_n = kernel_stats.block_n;
  rule.softmax_scale = 1.0 / std::sqrt(static_cast<double>(c.dim));
  rule.skip = c.threshold > 0.0;
  rule.log_lambda = std::log(c.threshold);
  rule.last_tile_first = true;
  out.assign(static_cast<size_t>(c.batch) * c.sq * c.hq * c.dim, 0.0);
  lse.assign(static_cast<size_t>(c.batch) * c.sq * c.hq, 0.0);
  const std::vector<float> q_scale(c.sq, 1.f), k_scale(c.skv, 1.f), v_scale(c.dim, 1.f);
  std::vector<double> qh(static_cast<size_t>(c.sq) * c.dim), kh(static_cast<size_t>(c.skv) * c.dim),
      vh(kh.size()), oh(qh.size()), lh(c.sq);
  reference::DenseTileCounts total;
  const int group = c.hq / c.hkv;
  for (int b = 0; b < c.batch; ++b) {
    for (int h = 0; h < c.hq; ++h) {
      const int hk = h / group;
      for (int i = 0; i < c.sq; ++i)
        for (int d = 0; d < c.dim; ++d)
          qh[i * c.dim + d] = data.q.get(((int64_t{b} * c.sq + i) * c.hq + h) * c.dim + d);
      for (int j = 0; j < c.skv; ++j) {
        for (int d = 0; d < c.dim; ++d) {
          const int64_t at = ((int64_t{b} * c.skv + j) * c.hkv + hk) * c.dim + d;
          kh[j * c.dim + d] = data.k.get(at);
          vh[j * c.dim + d] = data.v.get(at);
        }
      }
      const reference::DenseTileCounts n = reference::dense_attend_head(
          qh.data(), q_scale.data(), kh.data(), k_scale.data(), vh.data(), v_scale.data(), c.sq,
          c.skv, c.dim, rule, oh.data(), lh.data());
      total.total += n.total;
      total.skipped += n.skipped;
      for (int i = 0; i < c.sq; ++i) {
        for (int d = 0; d < c.dim; ++d)
          out[((int64_t{b} * c.sq + i) * c.hq + h) * c.dim + d] = oh[i * c.dim + d];
        lse[(int64_t{b} * c.sq + i) * c.hq + h] = lh[i];
      }
    }
  }
  return total;
}

bool bitwise_equal(const HostTensor& a, const HostTensor& b) {
  return a.bytes().size() == b.bytes().size() &&
         std::memcmp(a.bytes().data(), b.bytes().data(), a.bytes().size()) == 0;
}

// ATTNKIT_TEST_SCALE=small: one batch entry instead of two (the fp64 walk of the reference is
// most of the time); the other tests here keep two, the kernel's batch stride included.
TEST(DenseSkipGpu, DecisionsAndOutputsMatchTheReference) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  for (FusedKernel kernel : {FusedKernel::kHopper, FusedKernel::kPortable}) {
    for (int dim : {128, 64, 256}) {
      if (!has_kernel(dim, kernel)) {
        std::printf("[ SKIPPED  ] no %s kernel for head_dim %d on this GPU / build\n",
                    fused_kernel_name(kernel), dim);
        continue;
      }
      for (double threshold : {1e-3, 3e-2}) {
        DenseCase c;
        c.batch = at_test_scale(2, 1);
        c.dim = dim;
        c.threshold = threshold;
        c.kernel = kernel;
        SCOPED_TRACE(testing::Message()
                     << fused_kernel_name(kernel) << " dim=" << dim << " threshold=" << threshold);
        const DenseData data(c, 11 + dim);
        const DenseRun got = run(c, data, /*skip=*/true);
        if (kernel == FusedKernel::kHopper) {
          EXPECT_EQ(got.stats.block_m, 64);
          EXPECT_EQ(got.stats.block_n,
                    cuda::prefill::prefill_block_n(PrefillTile::kSm90, dim, true));
        } else {
          // The portable kernel's skip tile is its CTA tile: 64 or 128 rows x 64 or 128 keys.
          EXPECT_TRUE(got.stats.block_m == 64 || got.stats.block_m == 128) << got.stats.block_m;
          EXPECT_TRUE(got.stats.block_n == 64 || got.stats.block_n == 128) << got.stats.block_n;
        }
        std::vector<double> ref, ref_lse;
        const reference::DenseTileCounts want = reference_run(c, data, got.stats, ref, ref_lse);
        EXPECT_EQ(got.stats.tiles_total, want.total);
        // Decisions agree except on tiles whose margin lies within float32 rounding of ln(lambda).
        const int64_t slack = std::max<int64_t>(2, want.total / 500);
        EXPECT_NEAR(static_cast<double>(got.stats.tiles_skipped), static_cast<double>(want.skipped),
                    static_cast<double>(slack));
        // The structured data must make the kernel skip, and not everything.
        EXPECT_GT(got.stats.tiles_skipped, want.total / 10) << "nothing skipped: the test is void";
        EXPECT_LT(got.stats.tiles_skipped, want.total * 9 / 10);
        EXPECT_EQ(got.device_stats[0], got.stats.tiles_total);
        EXPECT_EQ(got.device_stats[1], got.stats.tiles_skipped);
        const std::vector<double> out = got.out.to_double();
        ASSERT_FALSE(any_nan(out));
        double naive = 0.0, err = 0.0;
        for (size_t i = 0; i < out.size(); ++i) {
          naive = std::max(naive, std::fabs(round_bf16(ref[i]) - ref[i]));
          err = std::max(err, std::fabs(out[i] - ref[i]));
        }
        EXPECT_LE(err, 2 * naive + 1e-3) << "naive bf16 error " << naive;
        const std::vector<double> lse = got.lse.to_double();
        for (size_t i = 0; i < lse.size(); ++i) ASSERT_NEAR(lse[i], ref_lse[i], 2e-3) << i;
      }
    }
  }
}

TEST(DenseSkipGpu, ThresholdZeroAndAClosedGateAreThePlainCallBitForBit) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  for (FusedKernel kernel : {FusedKernel::kHopper, FusedKernel::kPortable}) {
    if (!has_kernel(128, kernel)) {
      std::printf("[ SKIPPED  ] no %s kernel for head_dim 128\n", fused_kernel_name(kernel));
      continue;
    }
    SCOPED_TRACE(fused_kernel_name(kernel));
    DenseCase c;
    c.kernel = kernel;
    const DenseData data(c, 21);
    const DenseRun plain = run(c, data, /*skip=*/false);
    c.threshold = 0.0;
    const DenseRun zero = run(c, data, /*skip=*/true);
    EXPECT_TRUE(bitwise_equal(zero.out, plain.out));
    EXPECT_TRUE(bitwise_equal(zero.lse, plain.lse));
    EXPECT_EQ(zero.stats.tiles_skipped, 0);
    EXPECT_EQ(zero.device_stats[1], 0);
    EXPECT_EQ(zero.device_stats[0], zero.stats.tiles_total);
    // Gate: active for timestep <= 0.5 only.
    c.threshold = 3e-2;
    c.disabled_until = 0.5;
    c.timestep = 0.8;
    const DenseRun closed = run(c, data, /*skip=*/true);
    EXPECT_TRUE(bitwise_equal(closed.out, plain.out));
    EXPECT_EQ(closed.stats.tiles_skipped, 0);
    c.timestep = 0.5;
    const DenseRun open = run(c, data, /*skip=*/true);
    EXPECT_GT(open.stats.tiles_skipped, 0);
    EXPECT_FALSE(bitwise_equal(open.out, plain.out));
  }
}

TEST(DenseSkipGpu, ALargeThresholdChangesTheOutput) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  for (FusedKernel kernel : {FusedKernel::kHopper, FusedKernel::kPortable}) {
    if (!has_kernel(128, kernel)) continue;
    SCOPED_TRACE(fused_kernel_name(kernel));
    DenseCase c;
    c.kernel = kernel;
    const DenseData data(c, 31);
    const DenseRun plain = run(c, data, /*skip=*/false);
    c.threshold = 0.9;  // skips tiles within ln(0.9) of the running maximum
    const DenseRun skipped = run(c, data, /*skip=*/true);
    EXPECT_GT(skipped.stats.tiles_skipped, skipped.stats.tiles_total / 4);
    const std::vector<double> a = plain.out.to_double(), b = skipped.out.to_double();
    EXPECT_GT(max_abs_diff(a, b), 0.05);
  }
}

TEST(DenseSkipGpu, UnservableCallsRaiseAndWriteNothing) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  DenseCase c;
  c.sq = c.skv = 256;
  c.threshold = 1e-2;
  const DenseData data(c, 41);
  HostTensor out(DType::kBF16, {c.batch, c.sq, c.hq, c.dim});
  out.fill(7.f);
  DeviceTensor d_q(data.q), d_k(data.k), d_v(data.v), d_out(out);
  DenseArgs args;
  args.q = d_q;
  args.k = d_k;
  args.v = d_v;
  args.out = d_out;
  AttentionSpec spec = spec_of(c, /*skip=*/true);
  spec.quant = SageQuantSpec{};
  try {
    dense(spec, args);
    ADD_FAILURE() << "skip_softmax with SAGE ran on the fused kernels";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("skip_softmax"), std::string::npos) << e.what();
  }
  spec.quant.reset();
  // skip_stats must be an int64 [2] tensor.
  spec.fused_kernel = FusedKernel::kAuto;
  HostTensor bad(DType::kInt32, {2});
  DeviceTensor d_bad(bad);
  args.skip_stats = d_bad;
  try {
    dense(spec, args);
    ADD_FAILURE() << "an int32 skip_stats was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("skip_stats"), std::string::npos) << e.what();
  }
  HostTensor after(DType::kBF16, {c.batch, c.sq, c.hq, c.dim});
  d_out.download(after);
  EXPECT_TRUE(bitwise_equal(after, out));
}

}  // namespace
}  // namespace attnkit::test
