// Reference prefill() with SAGE quantization (docs/diffusion.md): each packed sequence is
// quantized on its own, as dense() quantizes a batch element. A two-sequence call equals the two
// sequences run alone, bit for bit (K's mean and V's channel scales are the sequence's own), and a
// single sequence whose keys fit one tile equals dense() on it (one tile: the tile order, which
// the two walks take differently, cannot matter). Unservable calls are rejected by name.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "common/test_util.h"

namespace attnkit::test {
namespace {

constexpr int kHq = 4, kHkv = 2, kDim = 64;

AttentionSpec sage_spec(DType dtype_qk, MaskKind mask) {
  AttentionSpec spec;
  spec.num_q_heads = kHq;
  spec.num_kv_heads = kHkv;
  spec.head_dim = kDim;
  spec.mask.kind = mask;
  SageQuantSpec quant;
  quant.dtype_qk = dtype_qk;
  quant.q_block_size = 4;
  quant.k_block_size = 16;
  spec.quant = quant;
  return spec;
}

HostTensor gaussian(std::mt19937_64& rng, std::initializer_list<int64_t> shape) {
  HostTensor t(DType::kF32, shape);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, normal(rng));
  return t;
}

HostTensor cu_of(const std::vector<int32_t>& lens) {
  HostTensor cu(DType::kInt32, {static_cast<int64_t>(lens.size()) + 1});
  int32_t at = 0;
  for (size_t b = 0; b <= lens.size(); ++b) {
    cu.data<int32_t>()[b] = at;
    if (b < lens.size()) at += lens[b];
  }
  return cu;
}

// Rows [first, first + rows) of a [tokens, H, D] tensor.
HostTensor rows_of(const HostTensor& t, int64_t first, int64_t rows, int64_t heads) {
  HostTensor out(DType::kF32, {rows, heads, kDim});
  std::memcpy(out.data<float>(), t.data<float>() + first * heads * kDim,
              static_cast<size_t>(rows * heads * kDim) * sizeof(float));
  return out;
}

HostTensor run_prefill(const AttentionSpec& spec, const HostTensor& q, const HostTensor& k,
                       const HostTensor& v, const std::vector<int32_t>& q_lens,
                       const std::vector<int32_t>& kv_lens) {
  HostTensor out(DType::kF32, {q.view().shape[0], kHq, kDim});
  out.fill(NAN);
  const HostTensor cu_q = cu_of(q_lens), cu_kv = cu_of(kv_lens);
  PrefillArgs args;
  args.q = q;
  args.k = k;
  args.v = v;
  args.cu_seqlens_q = cu_q;
  args.cu_seqlens_kv = cu_kv;
  args.out = out;
  args.block_m = 16;
  args.block_n = 32;
  prefill(spec, args);
  return out;
}

void expect_bitwise(const HostTensor& a, const float* b, int64_t n, const std::string& what) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = a.data<float>()[i];
    ASSERT_EQ(std::memcmp(&x, b + i, sizeof(float)), 0)
        << what << " at " << i << ": " << x << " vs " << b[i];
  }
}

TEST(PrefillSageRef, EachSequenceIsQuantizedOnItsOwn) {
  std::mt19937_64 rng(test_seed());
  for (DType dt : {DType::kInt8, DType::kFp8E4M3}) {
    for (MaskKind mask : {MaskKind::kNone, MaskKind::kCausal}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " " + mask_name(mask));
      const std::vector<int32_t> q_lens = {37, 20}, kv_lens = {50, 20};
      const HostTensor q = gaussian(rng, {57, kHq, kDim});
      HostTensor k = gaussian(rng, {70, kHkv, kDim});
      const HostTensor v = gaussian(rng, {70, kHkv, kDim});
      // The second sequence's K far from the first's: a mean or scale shared across sequences
      // would change both.
      for (int64_t i = 50 * kHkv * kDim; i < k.numel(); ++i) k.set(i, k.get(i) * 8.f + 5.f);
      const AttentionSpec spec = sage_spec(dt, mask);
      const HostTensor both = run_prefill(spec, q, k, v, q_lens, kv_lens);
      const HostTensor first = run_prefill(spec, rows_of(q, 0, 37, kHq), rows_of(k, 0, 50, kHkv),
                                           rows_of(v, 0, 50, kHkv), {37}, {50});
      const HostTensor second = run_prefill(spec, rows_of(q, 37, 20, kHq), rows_of(k, 50, 20, kHkv),
                                            rows_of(v, 50, 20, kHkv), {20}, {20});
      expect_bitwise(first, both.data<float>(), first.numel(), "sequence 0");
      expect_bitwise(second, both.data<float>() + first.numel(), second.numel(), "sequence 1");
    }
  }
}

TEST(PrefillSageRef, OneTileSequenceEqualsDense) {
  std::mt19937_64 rng(test_seed());
  for (DType dt : {DType::kInt8, DType::kFp8E4M3}) {
    SCOPED_TRACE(dtype_name(dt));
    const HostTensor q = gaussian(rng, {24, kHq, kDim});
    const HostTensor k = gaussian(rng, {30, kHkv, kDim});
    const HostTensor v = gaussian(rng, {30, kHkv, kDim});
    const AttentionSpec spec = sage_spec(dt, MaskKind::kNone);
    const HostTensor packed = run_prefill(spec, q, k, v, {24}, {30});
    // The same memory as dense [1, S, H, D] tensors.
    TensorView dq = q.view(), dk = k.view(), dv = v.view();
    dq = TensorView(dq.data, DType::kF32, {1, 24, kHq, kDim});
    dk = TensorView(dk.data, DType::kF32, {1, 30, kHkv, kDim});
    dv = TensorView(dv.data, DType::kF32, {1, 30, kHkv, kDim});
    HostTensor out(DType::kF32, {1, 24, kHq, kDim});
    out.fill(NAN);
    DenseArgs args;
    args.q = dq;
    args.k = dk;
    args.v = dv;
    args.out = out;
    args.block_m = 16;
    args.block_n = 32;
    dense(spec, args);
    expect_bitwise(out, packed.data<float>(), out.numel(), "dense vs prefill");
  }
}

TEST(PrefillSageRef, RejectsACacheAndASlidingWindow) {
  std::mt19937_64 rng(test_seed());
  const HostTensor q = gaussian(rng, {8, kHq, kDim});
  const HostTensor k = gaussian(rng, {8, kHkv, kDim});
  const HostTensor v = gaussian(rng, {8, kHkv, kDim});
  AttentionSpec spec = sage_spec(DType::kInt8, MaskKind::kSlidingWindow);
  spec.mask.window = 4;
  try {
    run_prefill(spec, q, k, v, {8}, {8});
    ADD_FAILURE() << "a sliding window with quant was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("spec.quant"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace attnkit::test
