// merge_states on CUDA against the CPU reference and an fp64 formula, including rows where one
// or both sides are empty (-inf), strided inputs, and two halves of an attention == the whole.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "gpu/gpu_case_util.h"

namespace attnkit::test {
namespace {

TEST(MergeStates, MatchesReferenceWithEmptyRows) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed());
  const int64_t n = 37, h = 5, d = 96;
  for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
    SCOPED_TRACE(dtype_name(dtype));
    HostTensor out_a(dtype, {n, h, d}), out_b(dtype, {n, h, d});
    out_a.fill_uniform(rng, -1.0f, 1.0f);
    out_b.fill_uniform(rng, -1.0f, 1.0f);
    HostTensor lse_a(DType::kF32, {n, h}), lse_b(DType::kF32, {n, h});
    lse_a.fill_uniform(rng, -4.0f, 6.0f);
    lse_b.fill_uniform(rng, -4.0f, 6.0f);
    // Token 0: both sides empty; token 1: a empty; token 2: b empty.
    for (int64_t j = 0; j < h; ++j) {
      lse_a.set(0 * h + j, -INFINITY);
      lse_b.set(0 * h + j, -INFINITY);
      lse_a.set(1 * h + j, -INFINITY);
      lse_b.set(2 * h + j, -INFINITY);
    }
    HostTensor cpu_out = poisoned(dtype, {n, h, d}), cpu_lse = poisoned(DType::kF32, {n, h});
    MergeStatesArgs args;
    args.out_a = out_a;
    args.lse_a = lse_a;
    args.out_b = out_b;
    args.lse_b = lse_b;
    args.out = cpu_out;
    args.lse = cpu_lse;
    merge_states(args);

    DeviceTensor da(out_a), db(out_b), dla(lse_a), dlb(lse_b), dout(poisoned(dtype, {n, h, d})),
        dlse(poisoned(DType::kF32, {n, h}));
    MergeStatesArgs gargs;
    gargs.out_a = da;
    gargs.lse_a = dla;
    gargs.out_b = db;
    gargs.lse_b = dlb;
    gargs.out = dout;
    gargs.lse = dlse;
    ASSERT_NO_THROW(merge_states(gargs));
    ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
    const HostTensor gpu_out = downloaded(dout, cpu_out), gpu_lse = downloaded(dlse, cpu_lse);

    // fp64 formula, rounded like the output.
    std::vector<double> ref(size_t(n * h * d)), ref_lse(size_t(n * h));
    for (int64_t i = 0; i < n * h; ++i) {
      const double la = lse_a.get(i), lb = lse_b.get(i);
      const double m = std::max(la, lb);
      if (m == -INFINITY) {
        ref_lse[i] = -INFINITY;
        continue;  // zeros
      }
      const double wa = std::exp(la - m), wb = std::exp(lb - m);
      ref_lse[i] = m + std::log(wa + wb);
      for (int64_t e = 0; e < d; ++e) {
        ref[i * d + e] = (wa * out_a.get(i * d + e) + wb * out_b.get(i * d + e)) / (wa + wb);
      }
    }
    const std::vector<double> gpu = gpu_out.to_double();
    ASSERT_FALSE(any_nan(gpu));
    // Output rounding of the dtype plus float32 weights.
    const double tolerance = dtype == DType::kF32 ? 1e-5 : (dtype == DType::kBF16 ? 8e-3 : 1e-3);
    EXPECT_LE(max_abs_diff(gpu, ref), tolerance);
    EXPECT_LE(max_abs_diff(gpu, cpu_out.to_double()), 2 * tolerance);
    for (int64_t e = 0; e < d; ++e) EXPECT_EQ(gpu[e], 0.0) << "both sides empty gives zeros";
    bool pattern = false;
    EXPECT_LE(max_abs_diff_lse(gpu_lse.to_double(), ref_lse, &pattern), 1e-5);
    EXPECT_TRUE(pattern);
    EXPECT_LE(max_abs_diff_lse(gpu_lse.to_double(), cpu_lse.to_double(), &pattern), 1e-5);
    EXPECT_TRUE(pattern);
  }
}

// Attention over keys [0, s) merged with attention over [s, n) equals attention over [0, n):
// the two halves come from the vanilla packed prefill with mask none.
TEST(MergeStates, TwoHalvesOfAttentionEqualTheWhole) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() + 1);
  const int32_t hq = 4, hkv = 2, d = 64, nq = 9, nkv = 70, split = 23;
  AttentionSpec spec;
  spec.num_q_heads = hq;
  spec.num_kv_heads = hkv;
  spec.head_dim = d;
  spec.mask.kind = MaskKind::kNone;
  spec.backend = Backend::kVanilla;
  HostTensor q(DType::kF16, {nq, hq, d}), k(DType::kF16, {nkv, hkv, d}),
      v(DType::kF16, {nkv, hkv, d});
  q.fill_uniform(rng, -1.0f, 1.0f);
  k.fill_uniform(rng, -1.0f, 1.0f);
  v.fill_uniform(rng, -1.0f, 1.0f);
  DeviceTensor dq(q), dk(k), dv(v);
  auto attend = [&](int32_t first, int32_t count, DeviceTensor& out, DeviceTensor& lse) {
    DeviceTensor cq(int32_tensor({0, nq})), ckv(int32_tensor({0, count}));
    PrefillArgs a;
    a.q = dq;
    a.k = TensorView(static_cast<uint16_t*>(dk.data()) + int64_t{first} * hkv * d, DType::kF16,
                     {count, hkv, d}, Device::cuda(0));
    a.v = TensorView(static_cast<uint16_t*>(dv.data()) + int64_t{first} * hkv * d, DType::kF16,
                     {count, hkv, d}, Device::cuda(0));
    a.cu_seqlens_q = cq;
    a.cu_seqlens_kv = ckv;
    a.out = out;
    a.lse = lse;
    a.max_seqlen_q = nq;
    a.max_seqlen_kv = count;
    prefill(spec, a);
    ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
  };
  HostTensor half_like = poisoned(DType::kF16, {nq, hq, d});
  const HostTensor lse_like = poisoned(DType::kF32, {nq, hq});
  DeviceTensor o1(half_like), l1(lse_like), o2(half_like), l2(lse_like), ow(half_like),
      lw(lse_like);
  attend(0, split, o1, l1);
  attend(split, nkv - split, o2, l2);
  attend(0, nkv, ow, lw);
  DeviceTensor merged(half_like), merged_lse(lse_like);
  MergeStatesArgs m;
  m.out_a = o1;
  m.lse_a = l1;
  m.out_b = o2;
  m.lse_b = l2;
  m.out = merged;
  m.lse = merged_lse;
  merge_states(m);
  ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
  // Each half is rounded to f16 before the merge: a few f16 ulps of |out| <= 1.
  EXPECT_LE(max_abs_diff(downloaded(merged, half_like).to_double(),
                         downloaded(ow, half_like).to_double()),
            2e-3);
  bool pattern = false;
  EXPECT_LE(max_abs_diff_lse(downloaded(merged_lse, lse_like).to_double(),
                             downloaded(lw, lse_like).to_double(), &pattern),
            1e-5);
  EXPECT_TRUE(pattern);
}

}  // namespace
}  // namespace attnkit::test
