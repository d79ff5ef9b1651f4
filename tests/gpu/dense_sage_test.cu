// SAGE attention on the GPU, dense() and prefill() (the quantize pass and the sm90 SAGE kernels,
// docs/diffusion.md)
// against host computations in fp64 from the reference's own codes and scales
// (reference/dense_ref.h, bit for bit those of the pass: tests/gpu/sage_quant_test.cu):
//   same_quant: the tile-faithful SAGE reference walked as the kernel walks (64-row query tiles,
//               128-key tiles, last tile first), P = fp8(448 p) against each tile's running max;
//   dequant:    exact attention over the dequantized Q, K, V codes (P not rounded);
//   exact:      exact attention over the bf16 inputs, no quantization at all.
// int8 Q K^T (exact in int32), tight: max|out - same_quant| <= max|same_quant - dequant| / 4 +
// 2^-7 max|same_quant|: the kernel differs from the same-quantization reference only where its
// float32 exponent puts a P value on the other side of an e4m3 rounding boundary (and by the
// output's bf16 rounding), a small part of what rounding P costs at all.
// fp8 Q K^T: the fp8 wgmma accumulates S in reduced precision (docs/diffusion.md), which moves
// many more P values across a rounding boundary; it takes the FP8 kernels' rule (docs/testing.md):
// max|out - dequant| <= 2 max|same_quant - dequant| + 1e-3.
// A kernel that misread any scale (Q or K per block, V per channel) is off by far more than
// either bound. Against exact attention: cos sim at the documented floors (docs/diffusion.md), and
// the relative L1 within 10% of the same-quantization reference's own.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "common/test_util.h"
#include "cuda/prefill/prefill_sm90.h"
#include "gpu/gpu_util.h"
#include "reference/dense_ref.h"

namespace attnkit::test {
namespace {

bool sage_runs(int head_dim) {
  int major = 0, minor = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0) != cudaSuccess) {
    return false;
  }
  return major == 9 && minor == 0 && cuda::prefill::sm90_sage_compiled(head_dim);
}

#define SKIP_WITHOUT_SAGE(D)                                                     \
  do {                                                                           \
    ATTNKIT_SKIP_WITHOUT_GPU();                                                  \
    if (!sage_runs(D)) GTEST_SKIP() << "no sm90 SAGE kernel for head_dim " << D; \
  } while (0)

struct SageCase {
  int batch = 2, sq = 300, skv = 333, hq = 4, hkv = 2, dim = 128;
  DType dtype_qk = DType::kInt8;
  int q_block = 1, k_block = 16;
  double softcap = 0.0;
  float k_channel_offset = 0.f;  // added to every third channel of K (outliers smoothing removes)

  std::string str() const {
    return std::string(dtype_name(dtype_qk)) + " q_block " + std::to_string(q_block) + " k_block " +
           std::to_string(k_block) + " D " + std::to_string(dim) + " B " + std::to_string(batch) +
           " Sq " + std::to_string(sq) + " Skv " + std::to_string(skv) + " Hq " +
           std::to_string(hq) + " Hkv " + std::to_string(hkv) + " softcap " +
           std::to_string(softcap);
  }
};

AttentionSpec spec_of(const SageCase& c) {
  AttentionSpec spec;
  spec.num_q_heads = c.hq;
  spec.num_kv_heads = c.hkv;
  spec.head_dim = c.dim;
  spec.mask.kind = MaskKind::kNone;
  spec.backend = Backend::kFused;
  spec.logit_softcap = c.softcap;
  SageQuantSpec quant;
  quant.dtype_qk = c.dtype_qk;
  quant.q_block_size = c.q_block;
  quant.k_block_size = c.k_block;
  spec.quant = quant;
  return spec;
}

struct SageInputs {
  HostTensor q, k, v;
};

SageInputs make_inputs(const SageCase& c, uint64_t salt) {
  SageInputs in{HostTensor(DType::kBF16, {c.batch, c.sq, c.hq, c.dim}),
                HostTensor(DType::kBF16, {c.batch, c.skv, c.hkv, c.dim}),
                HostTensor(DType::kBF16, {c.batch, c.skv, c.hkv, c.dim})};
  std::mt19937_64 rng(test_seed() + salt);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (HostTensor* t : {&in.q, &in.k, &in.v}) {
    for (int64_t i = 0; i < t->numel(); ++i) t->set(i, normal(rng));
  }
  if (c.k_channel_offset != 0.f) {
    for (int64_t i = 0; i < in.k.numel(); ++i) {
      if (i % c.dim % 3 == 0) in.k.set(i, in.k.get(i) + c.k_channel_offset);
    }
  }
  return in;
}

// Rows [len, dim] of head h from packed token `start` of a [tokens, H, D] (or [B, S, H, D])
// tensor, as float.
std::vector<float> head_rows(const HostTensor& t, int64_t start, int64_t len, int heads, int h,
                             int dim) {
  std::vector<float> rows(static_cast<size_t>(len) * dim);
  for (int64_t i = 0; i < len; ++i) {
    for (int d = 0; d < dim; ++d) {
      rows[static_cast<size_t>(i) * dim + d] = t.get(((start + i) * heads + h) * dim + d);
    }
  }
  return rows;
}

// The sequences of a call: packed starts and lengths (a dense call's batch element b starts at
// b x S), and whether the call is causal (bottom-right aligned).
struct Packing {
  std::vector<int64_t> q_start, q_len, kv_start, kv_len;
  bool causal = false;
  int64_t total_q() const { return q_start.empty() ? 0 : q_start.back() + q_len.back(); }
};

Packing dense_packing(const SageCase& c) {
  Packing pk;
  for (int b = 0; b < c.batch; ++b) {
    pk.q_start.push_back(int64_t{b} * c.sq);
    pk.q_len.push_back(c.sq);
    pk.kv_start.push_back(int64_t{b} * c.skv);
    pk.kv_len.push_back(c.skv);
  }
  return pk;
}

struct HostResult {
  std::vector<double> out, lse;  // [total_q, Hq, D], [total_q, Hq]
};

// The three host computations of the file comment. smooth = false quantizes K without subtracting
// its mean (what the pass would do without smoothing).
struct References {
  HostResult same_quant, dequant, exact;
};

References host_references(const SageCase& c, const HostTensor& q_in, const HostTensor& k_in,
                           const HostTensor& v_in, const Packing& pk, bool smooth = true) {
  const int64_t total_q = pk.total_q();
  References r;
  for (HostResult* h : {&r.same_quant, &r.dequant, &r.exact}) {
    h->out.assign(static_cast<size_t>(total_q * c.hq * c.dim), 0.0);
    h->lse.assign(static_cast<size_t>(total_q * c.hq), 0.0);
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.dim));
  const int group = c.hq / c.hkv;
  for (size_t b = 0; b < pk.q_len.size(); ++b) {
    const int64_t sq = pk.q_len[b], skv = pk.kv_len[b];
    std::vector<double> out(static_cast<size_t>(sq) * c.dim), lse(sq);
    for (int hk = 0; hk < c.hkv; ++hk) {
      std::vector<float> k = head_rows(k_in, pk.kv_start[b], skv, c.hkv, hk, c.dim);
      const std::vector<float> v = head_rows(v_in, pk.kv_start[b], skv, c.hkv, hk, c.dim);
      std::vector<float> k_smooth = k;
      if (smooth && skv > 0) {
        const std::vector<float> mean = reference::sage_channel_mean(k, skv, c.dim);
        for (size_t i = 0; i < k_smooth.size(); ++i) k_smooth[i] -= mean[i % c.dim];
      }
      const reference::SageRows kq =
          reference::sage_quantize_rows(k_smooth, skv, c.dim, c.k_block, c.dtype_qk);
      const reference::SageColumns vq = reference::sage_quantize_v(v, skv, c.dim);
      for (int g = 0; g < group; ++g) {
        const int h = hk * group + g;
        const std::vector<float> q = head_rows(q_in, pk.q_start[b], sq, c.hq, h, c.dim);
        const reference::SageRows qq =
            reference::sage_quantize_rows(q, sq, c.dim, c.q_block, c.dtype_qk);
        auto store = [&](HostResult& res) {
          for (int64_t i = 0; i < sq; ++i) {
            const int64_t row = (pk.q_start[b] + i) * c.hq + h;
            res.lse[row] = lse[i];
            for (int d = 0; d < c.dim; ++d) res.out[row * c.dim + d] = out[i * c.dim + d];
          }
        };
        reference::DenseTileRule rule;
        rule.block_m = 64;
        rule.block_n = 128;
        rule.softmax_scale = scale;
        rule.logit_softcap = c.softcap;
        rule.last_tile_first = true;
        rule.causal = pk.causal;
        rule.q_pos0 = skv - sq;
        rule.quantize_p = true;
        reference::dense_attend_head(qq.values.data(), qq.row_scale.data(), kq.values.data(),
                                     kq.row_scale.data(), vq.values.data(), vq.channel_scale.data(),
                                     sq, skv, c.dim, rule, out.data(), lse.data());
        store(r.same_quant);
        rule.quantize_p = false;
        reference::dense_attend_head(qq.values.data(), qq.row_scale.data(), kq.values.data(),
                                     kq.row_scale.data(), vq.values.data(), vq.channel_scale.data(),
                                     sq, skv, c.dim, rule, out.data(), lse.data());
        store(r.dequant);
        const std::vector<double> qd(q.begin(), q.end()), kd(k.begin(), k.end()),
            vd(v.begin(), v.end());
        const std::vector<float> ones_q(sq, 1.f), ones_k(skv, 1.f), ones_v(c.dim, 1.f);
        reference::dense_attend_head(qd.data(), ones_q.data(), kd.data(), ones_k.data(), vd.data(),
                                     ones_v.data(), sq, skv, c.dim, rule, out.data(), lse.data());
        store(r.exact);
      }
    }
  }
  return r;
}

References host_references(const SageCase& c, const SageInputs& in, bool smooth = true) {
  return host_references(c, in.q, in.k, in.v, dense_packing(c), smooth);
}

struct GpuResult {
  HostTensor out, lse;
};

GpuResult run_gpu(const SageCase& c, const SageInputs& in) {
  GpuResult r{HostTensor(DType::kBF16, {c.batch, c.sq, c.hq, c.dim}),
              HostTensor(DType::kF32, {c.batch, c.sq, c.hq})};
  r.out.fill(NAN);
  r.lse.fill(NAN);
  DeviceTensor d_q(in.q), d_k(in.k), d_v(in.v), d_out(r.out), d_lse(r.lse);
  DenseArgs args;
  args.q = d_q;
  args.k = d_k;
  args.v = d_v;
  args.out = d_out;
  args.lse = d_lse;
  dense(spec_of(c), args);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  d_out.download(r.out);
  d_lse.download(r.lse);
  return r;
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0.0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

double max_abs(const std::vector<double>& a) {
  double m = 0.0;
  for (double x : a) m = std::max(m, std::fabs(x));
  return m;
}

double cos_sim(const std::vector<double>& a, const std::vector<double>& b) {
  double ab = 0.0, aa = 0.0, bb = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    ab += a[i] * b[i];
    aa += a[i] * a[i];
    bb += b[i] * b[i];
  }
  return ab / std::sqrt(aa * bb);
}

double rel_l1(const std::vector<double>& a, const std::vector<double>& ref) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += std::fabs(a[i] - ref[i]);
    den += std::fabs(ref[i]);
  }
  return num / den;
}

// The rules of the file comment, the LSE against the same-quantization reference, and the accuracy
// against exact attention; returns the kernel's output.
std::vector<double> expect_matches(const SageCase& c, const GpuResult& gpu, const References& ref,
                                   double min_cos) {
  const std::vector<double> out = gpu.out.to_double();
  const std::vector<double> lse = gpu.lse.to_double();
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(out[i])) {
      ADD_FAILURE() << "non-finite output at " << i;
      return out;
    }
  }
  const double quant_p_err = max_abs_diff(ref.same_quant.out, ref.dequant.out);
  double err = 0.0, bound = 0.0;
  if (c.dtype_qk == DType::kInt8) {
    err = max_abs_diff(out, ref.same_quant.out);
    bound = quant_p_err / 4 + std::ldexp(max_abs(ref.same_quant.out), -7);
    EXPECT_LE(err, bound) << "max|out - same_quant| (rounding P costs " << quant_p_err << ")";
  } else {
    err = max_abs_diff(out, ref.dequant.out);
    bound = 2 * quant_p_err + 1e-3;
    EXPECT_LE(err, bound) << "max|out - dequant|";
  }
  // LSE: of the quantized scores in both; float32 exponent and sum against fp64.
  EXPECT_LE(max_abs_diff(lse, ref.same_quant.lse), 1e-3) << "lse";
  const double cs = cos_sim(out, ref.exact.out);
  const double l1 = rel_l1(out, ref.exact.out);
  const double ref_l1 = rel_l1(ref.same_quant.out, ref.exact.out);
  EXPECT_GE(cs, min_cos) << "cos sim against exact attention";
  EXPECT_LE(l1, 1.1 * ref_l1) << "relative L1 against exact attention (the reference's: " << ref_l1
                              << ")";
  std::printf("[sage] %s: error %.3g (bound %.3g), cos %.6f, rel L1 %.4f (reference %.4f)\n",
              c.str().c_str(), err, bound, cs, l1, ref_l1);
  return out;
}

// The documented accuracy floors on unit Gaussian data (docs/diffusion.md).
double min_cos_of(DType dtype_qk) { return dtype_qk == DType::kInt8 ? 0.999 : 0.998; }

TEST(DenseSageGpu, EveryDtypeAndBlockSizeMatchesTheSameQuantization) {
  SKIP_WITHOUT_SAGE(128);
  for (int dim : {128, 256}) {
    if (!sage_runs(dim)) {
      std::printf("[sage] head_dim %d: no SAGE kernel in this build\n", dim);
      continue;
    }
    for (DType dt : {DType::kInt8, DType::kFp8E4M3}) {
      for (int qb : {1, 4, 16}) {
        for (int kb : {1, 4, 16}) {
          SageCase c;
          c.dim = dim;
          c.dtype_qk = dt;
          c.q_block = qb;
          c.k_block = kb;
          if (dim == 256) c.sq = 150;
          SCOPED_TRACE(c.str());
          const SageInputs in = make_inputs(c, 7 * qb + kb + dim);
          expect_matches(c, run_gpu(c, in), host_references(c, in), min_cos_of(dt));
        }
      }
    }
  }
}

TEST(DenseSageGpu, SoftcapMqaLongAndShortSequences) {
  SKIP_WITHOUT_SAGE(128);
  const SageCase cases[] = {
      // soft-cap (the logit-modifier kernels); MQA; one query; many more work items than SMs
      {1, 1, 513, 8, 1, 128, DType::kInt8, 4, 4, 0.0},
      {3, 200, 129, 8, 8, 128, DType::kFp8E4M3, 16, 1, 30.0},
      {2, 1100, 1000, 16, 4, 128, DType::kInt8, 1, 16, 5.0},
      {1, 64, 1, 2, 2, 128, DType::kFp8E4M3, 1, 1, 0.0},
  };
  for (const SageCase& c : cases) {
    SCOPED_TRACE(c.str());
    const SageInputs in = make_inputs(c, static_cast<uint64_t>(c.sq + c.skv));
    expect_matches(c, run_gpu(c, in), host_references(c, in), min_cos_of(c.dtype_qk));
  }
}

// K with channel outliers (every third channel shifted by 64, as diffusion models' K often is):
// smoothing takes the shift out before quantization, so the kernel stays as accurate as on plain
// data, while the same quantization without smoothing is several times worse.
TEST(DenseSageGpu, SmoothingKeepsKOutliersAccurate) {
  SKIP_WITHOUT_SAGE(128);
  for (DType dt : {DType::kInt8, DType::kFp8E4M3}) {
    SageCase c;
    c.dtype_qk = dt;
    c.k_channel_offset = 64.f;
    SCOPED_TRACE(c.str());
    const SageInputs in = make_inputs(c, 99);
    const References smooth = host_references(c, in);
    const std::vector<double> out = expect_matches(c, run_gpu(c, in), smooth, min_cos_of(dt));
    const References raw = host_references(c, in, /*smooth=*/false);
    const double kernel_err = rel_l1(out, smooth.exact.out);
    const double unsmoothed_err = rel_l1(raw.same_quant.out, smooth.exact.out);
    std::printf("[sage] outliers %s: rel L1 smoothed (kernel) %.4f, unsmoothed %.4f\n",
                dtype_name(dt), kernel_err, unsmoothed_err);
    EXPECT_LT(kernel_err * 2, unsmoothed_err) << "smoothing should matter on this data";
  }
}

TEST(DenseSageGpu, NoKeysGiveZerosAndNoQueriesWriteNothing) {
  SKIP_WITHOUT_SAGE(128);
  {
    SageCase c;
    c.skv = 0;
    const SageInputs in = make_inputs(c, 1);
    const GpuResult r = run_gpu(c, in);
    for (int64_t i = 0; i < r.out.numel(); ++i) ASSERT_EQ(r.out.get(i), 0.f) << i;
    for (int64_t i = 0; i < r.lse.numel(); ++i) ASSERT_EQ(r.lse.get(i), -INFINITY) << i;
  }
  {
    SageCase c;
    c.sq = 0;
    const SageInputs in = make_inputs(c, 2);
    const GpuResult r = run_gpu(c, in);
    EXPECT_EQ(r.out.numel(), 0);
  }
}

TEST(DenseSageGpu, UnservableCallsRaiseAndWriteNothing) {
  SKIP_WITHOUT_SAGE(128);
  SageCase c;
  c.sq = 64;
  c.skv = 64;
  const SageInputs in = make_inputs(c, 3);
  auto expect_raises = [&](AttentionSpec spec, const std::string& needle) {
    HostTensor out(DType::kBF16, {c.batch, c.sq, c.hq, c.dim});
    out.fill(NAN);
    DeviceTensor d_q(in.q), d_k(in.k), d_v(in.v), d_out(out);
    DenseArgs args;
    args.q = d_q;
    args.k = d_k;
    args.v = d_v;
    args.out = d_out;
    try {
      dense(spec, args);
      ADD_FAILURE() << "no error; wanted one naming " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    d_out.download(out);
    for (int64_t i = 0; i < out.numel(); ++i) ASSERT_TRUE(std::isnan(out.get(i))) << "wrote " << i;
  };
  AttentionSpec skip = spec_of(c);
  SkipSoftmaxSpec s;
  s.threshold = 0.5;
  skip.skip_softmax = s;
  expect_raises(skip, "quant (SAGE)");
  AttentionSpec portable = spec_of(c);
  portable.fused_kernel = FusedKernel::kPortable;
  expect_raises(portable, "portable");
}

// ---- prefill() -------------------------------------------------------------------------------

struct PrefillData {
  Packing pk;
  HostTensor q, k, v, cu_q, cu_kv;
  int32_t max_q = 0, max_kv = 0;
};

PrefillData make_prefill(const SageCase& c, std::vector<int64_t> q_lens,
                         std::vector<int64_t> kv_lens, bool causal, uint64_t salt) {
  PrefillData d;
  d.pk.causal = causal;
  d.pk.q_len = std::move(q_lens);
  d.pk.kv_len = std::move(kv_lens);
  const auto batch = static_cast<int64_t>(d.pk.q_len.size());
  d.cu_q = HostTensor(DType::kInt32, {batch + 1});
  d.cu_kv = HostTensor(DType::kInt32, {batch + 1});
  int64_t tq = 0, tkv = 0;
  for (int64_t b = 0; b < batch; ++b) {
    d.cu_q.data<int32_t>()[b] = static_cast<int32_t>(tq);
    d.cu_kv.data<int32_t>()[b] = static_cast<int32_t>(tkv);
    d.pk.q_start.push_back(tq);
    d.pk.kv_start.push_back(tkv);
    tq += d.pk.q_len[b];
    tkv += d.pk.kv_len[b];
    d.max_q = std::max<int32_t>(d.max_q, static_cast<int32_t>(d.pk.q_len[b]));
    d.max_kv = std::max<int32_t>(d.max_kv, static_cast<int32_t>(d.pk.kv_len[b]));
  }
  d.cu_q.data<int32_t>()[batch] = static_cast<int32_t>(tq);
  d.cu_kv.data<int32_t>()[batch] = static_cast<int32_t>(tkv);
  d.q = HostTensor(DType::kBF16, {tq, c.hq, c.dim});
  d.k = HostTensor(DType::kBF16, {tkv, c.hkv, c.dim});
  d.v = HostTensor(DType::kBF16, {tkv, c.hkv, c.dim});
  std::mt19937_64 rng(test_seed() + salt);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (HostTensor* t : {&d.q, &d.k, &d.v}) {
    for (int64_t i = 0; i < t->numel(); ++i) t->set(i, normal(rng));
  }
  return d;
}

AttentionSpec prefill_spec(const SageCase& c, bool causal, Backend backend) {
  AttentionSpec spec = spec_of(c);
  spec.mask.kind = causal ? MaskKind::kCausal : MaskKind::kNone;
  spec.backend = backend;
  return spec;
}

// prefill() on the GPU, or on the CPU reference with the kernel's tiles (64 x 128).
GpuResult run_prefill(const SageCase& c, const PrefillData& d, bool gpu) {
  const int64_t tq = d.q.view().shape[0];
  GpuResult r{HostTensor(DType::kBF16, {tq, c.hq, c.dim}), HostTensor(DType::kF32, {tq, c.hq})};
  r.out.fill(NAN);
  r.lse.fill(NAN);
  PrefillArgs args;
  args.max_seqlen_q = d.max_q;
  args.max_seqlen_kv = d.max_kv;
  if (!gpu) {
    args.q = d.q;
    args.k = d.k;
    args.v = d.v;
    args.cu_seqlens_q = d.cu_q;
    args.cu_seqlens_kv = d.cu_kv;
    args.out = r.out;
    args.lse = r.lse;
    args.block_m = 64;
    args.block_n = 128;
    prefill(prefill_spec(c, d.pk.causal, Backend::kAuto), args);  // host tensors: the reference
    return r;
  }
  DeviceTensor q(d.q), k(d.k), v(d.v), cu_q(d.cu_q), cu_kv(d.cu_kv), out(r.out), lse(r.lse);
  args.q = q;
  args.k = k;
  args.v = v;
  args.cu_seqlens_q = cu_q;
  args.cu_seqlens_kv = cu_kv;
  args.out = out;
  args.lse = lse;
  prefill(prefill_spec(c, d.pk.causal, Backend::kFused), args);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  out.download(r.out);
  lse.download(r.lse);
  return r;
}

// Packed varlen prefill, causal (bottom-right aligned) and not, against the same host
// computations per sequence; the CPU reference's prefill() is the same-quantization reference to
// its output rounding.
TEST(PrefillSageGpu, PackedVarlenCausalAndNotMatchTheSameQuantization) {
  SKIP_WITHOUT_SAGE(128);
  struct Variant {
    DType dt;
    int q_block, k_block;
    double softcap;
    bool causal;
    std::vector<int64_t> q_lens, kv_lens;
  };
  const Variant variants[] = {
      {DType::kInt8, 1, 16, 0.0, true, {1, 300, 129, 700}, {1, 300, 129, 700}},
      {DType::kFp8E4M3, 4, 4, 0.0, true, {200, 64, 513}, {333, 64, 600}},
      {DType::kInt8, 16, 1, 20.0, false, {64, 200, 1}, {333, 50, 513}},
      {DType::kFp8E4M3, 1, 16, 0.0, false, {128, 77}, {256, 0}},
  };
  for (const Variant& v : variants) {
    SageCase c;
    c.hq = 8;
    c.hkv = 2;
    c.dtype_qk = v.dt;
    c.q_block = v.q_block;
    c.k_block = v.k_block;
    c.softcap = v.softcap;
    SCOPED_TRACE(c.str() + (v.causal ? " causal" : " mask none"));
    const PrefillData d = make_prefill(c, v.q_lens, v.kv_lens, v.causal, v.q_lens[0]);
    const References ref = host_references(c, d.q, d.k, d.v, d.pk);
    // The CPU reference: the same walk in fp64, its output rounded once to bf16.
    const GpuResult cpu = run_prefill(c, d, /*gpu=*/false);
    const std::vector<double> cpu_out = cpu.out.to_double();
    for (size_t i = 0; i < cpu_out.size(); ++i) {
      ASSERT_LE(std::fabs(cpu_out[i] - ref.same_quant.out[i]),
                std::ldexp(std::fabs(ref.same_quant.out[i]), -8) + 1e-30)
          << "reference prefill() at " << i;
    }
    expect_matches(c, run_prefill(c, d, /*gpu=*/true), ref, min_cos_of(v.dt));
  }
}

TEST(PrefillSageGpu, UnservableCallsRaise) {
  SKIP_WITHOUT_SAGE(128);
  SageCase c;
  const PrefillData d = make_prefill(c, {64}, {64}, false, 5);
  auto raises = [&](AttentionSpec spec, const std::string& needle) {
    DeviceTensor q(d.q), k(d.k), v(d.v), cu_q(d.cu_q), cu_kv(d.cu_kv);
    HostTensor out_host(DType::kBF16, {64, c.hq, c.dim});
    out_host.fill(NAN);
    DeviceTensor out(out_host);
    PrefillArgs args;
    args.q = q;
    args.k = k;
    args.v = v;
    args.cu_seqlens_q = cu_q;
    args.cu_seqlens_kv = cu_kv;
    args.out = out;
    args.max_seqlen_q = 64;
    args.max_seqlen_kv = 64;
    try {
      prefill(spec, args);
      ADD_FAILURE() << "no error; wanted one naming " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    out.download(out_host);
    for (int64_t i = 0; i < out_host.numel(); ++i) {
      ASSERT_TRUE(std::isnan(out_host.get(i))) << "wrote " << i;
    }
  };
  AttentionSpec window = prefill_spec(c, true, Backend::kFused);
  window.mask.kind = MaskKind::kSlidingWindow;
  window.mask.window = 16;
  raises(window, "spec.quant");
  AttentionSpec alibi = prefill_spec(c, true, Backend::kFused);
  alibi.alibi = true;
  raises(alibi, "alibi");
}

}  // namespace
}  // namespace attnkit::test
