// The SAGE quantize pass (src/cuda/sage) against the CPU reference's quantization
// (src/reference/dense_ref.h) bit for bit: codes, scales, K means and the transposed V, for every
// (dtype_qk, q_block_size, k_block_size), dense and packed calls with uneven lengths, K with
// outliers, K sums that round; the fp8 V transposes (packed and paged) against host transposes;
// bad device metadata guarded and recorded; bad launch arguments rejected before anything runs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attnkit/device_errors.h"
#include "core/numerics.h"
#include "cuda/sage/sage_quant_launch.h"
#include "gpu/fault_test_util.h"
#include "gpu/gpu_util.h"
#include "reference/dense_ref.h"

namespace attnkit::test {
namespace {

namespace sq = cuda::sage;

constexpr uint8_t kUnwritten = GuardedDeviceBuffer::kSentinel;

// ---- inputs -------------------------------------------------------------------------------------

// One call's sequences and tensors. Uniform calls have equal lengths and [B, S + 2, H, D] tensors
// (two unused tokens per batch element, so that stride_batch matters); packed calls have
// cu_seqlens, `extra` unused tokens after the last sequence, and K and V interleaved per token
// ([T, 2, Hkv, D], the token stride of a fused KV tensor).
struct Case {
  DType dtype = DType::kBF16;
  int32_t hq = 4, hkv = 2, dim = 128;
  std::vector<int64_t> q_lens, kv_lens;
  bool packed = false;
  int64_t extra = 0;
  SageQuantSpec quant;
  int64_t q_bound = 0, kv_bound = 0;  // packed: the seqlen bounds passed (0: unknown)

  int32_t batch() const { return static_cast<int32_t>(q_lens.size()); }
  int64_t total_q() const { return std::accumulate(q_lens.begin(), q_lens.end(), int64_t{0}); }
  int64_t total_kv() const { return std::accumulate(kv_lens.begin(), kv_lens.end(), int64_t{0}); }
  // Packed tokens of each side's tensor (uniform: B x S).
  int64_t tokens_q() const { return total_q() + (packed ? extra : 0); }
  int64_t tokens_kv() const { return total_kv() + (packed ? extra : 0); }
  std::vector<int64_t> starts(const std::vector<int64_t>& lens) const {
    std::vector<int64_t> s(lens.size() + 1, 0);
    for (size_t b = 0; b < lens.size(); ++b) s[b + 1] = s[b] + lens[b];
    return s;
  }
};

struct Strides {
  int64_t offset = 0, batch = 0, token = 0, head = 0;
};

// The 16-bit values of q, k, v in one host buffer (bits), and where each tensor lies in it.
struct Inputs {
  std::vector<uint16_t> bits;
  Strides q, k, v;
  DType dtype = DType::kBF16;
  bool packed = false;
  std::vector<int64_t> q_start, kv_start;

  int64_t index(const Strides& s, const std::vector<int64_t>& start, int64_t b, int64_t t,
                int32_t h, int32_t d) const {
    const int64_t token = packed ? (start[b] + t) * s.token : b * s.batch + t * s.token;
    return s.offset + token + h * s.head + d;
  }
  float value(int64_t i) const {
    return dtype == DType::kBF16 ? numerics::bf16_bits_to_float(bits[i])
                                 : numerics::f16_bits_to_float(bits[i]);
  }
  void set(int64_t i, float x) {
    bits[i] =
        dtype == DType::kBF16 ? numerics::float_to_bf16_bits(x) : numerics::float_to_f16_bits(x);
  }
  // Rows [len, D] of one (sequence, head) of q (which = 0), k (1) or v (2), as float.
  std::vector<float> rows(int which, int64_t b, int64_t len, int32_t h, int32_t dim) const {
    const Strides& s = which == 0 ? q : which == 1 ? k : v;
    const std::vector<int64_t>& start = which == 0 ? q_start : kv_start;
    std::vector<float> out(static_cast<size_t>(len * dim));
    for (int64_t t = 0; t < len; ++t) {
      for (int32_t d = 0; d < dim; ++d) out[t * dim + d] = value(index(s, start, b, t, h, d));
    }
    return out;
  }
};

// value(which, b, t, h, d) fills every element the sequences use (unused tokens get noise).
template <typename Value>
Inputs make_inputs(const Case& c, std::mt19937_64& rng, Value value) {
  Inputs in;
  in.dtype = c.dtype;
  in.packed = c.packed;
  in.q_start = c.starts(c.q_lens);
  in.kv_start = c.starts(c.kv_lens);
  const int64_t dim = c.dim;
  int64_t q_elems, kv_elems;
  if (c.packed) {
    in.q = {0, 0, c.hq * dim, dim};
    q_elems = c.tokens_q() * c.hq * dim;
    in.k = {q_elems, 0, 2 * c.hkv * dim, dim};
    in.v = {q_elems + c.hkv * dim, 0, 2 * c.hkv * dim, dim};
    kv_elems = c.tokens_kv() * 2 * c.hkv * dim;
  } else {
    const int64_t sq = c.q_lens.empty() ? 0 : c.q_lens[0];
    const int64_t skv = c.kv_lens.empty() ? 0 : c.kv_lens[0];
    in.q = {0, (sq + 2) * c.hq * dim, c.hq * dim, dim};
    q_elems = c.batch() * (sq + 2) * c.hq * dim;
    in.k = {q_elems, (skv + 2) * c.hkv * dim, c.hkv * dim, dim};
    in.v = {q_elems + c.batch() * (skv + 2) * c.hkv * dim, (skv + 2) * c.hkv * dim, c.hkv * dim,
            dim};
    kv_elems = 2 * c.batch() * (skv + 2) * c.hkv * dim;
  }
  in.bits.resize(static_cast<size_t>(q_elems + kv_elems));
  std::normal_distribution<float> noise(0.0f, 1.0f);
  for (auto& b : in.bits) b = numerics::float_to_bf16_bits(noise(rng));  // unused tokens
  for (int32_t b = 0; b < c.batch(); ++b) {
    for (int which = 0; which < 3; ++which) {
      const int64_t len = which == 0 ? c.q_lens[b] : c.kv_lens[b];
      const int32_t heads = which == 0 ? c.hq : c.hkv;
      const Strides& s = which == 0 ? in.q : which == 1 ? in.k : in.v;
      const std::vector<int64_t>& start = which == 0 ? in.q_start : in.kv_start;
      for (int64_t t = 0; t < len; ++t) {
        for (int32_t h = 0; h < heads; ++h) {
          for (int32_t d = 0; d < c.dim; ++d) {
            in.set(in.index(s, start, b, t, h, d), value(which, b, t, h, d));
          }
        }
      }
    }
  }
  return in;
}

// Gaussian data with a different scale per head and, for K, an offset per channel.
Inputs gaussian_inputs(const Case& c, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> k_offset(static_cast<size_t>(c.hkv * c.dim));
  for (float& o : k_offset) o = 0.5f * normal(rng);
  return make_inputs(c, rng, [&](int which, int64_t, int64_t, int32_t h, int32_t d) {
    const float x = normal(rng) * (1.0f + 0.5f * h);
    return which == 1 ? x + k_offset[h * c.dim + d] : x;
  });
}

// ---- the pass on the GPU ------------------------------------------------------------------------

struct GpuResult {
  sq::SageWorkspaceLayout layout;
  std::vector<uint8_t> ws;  // the workspace after the pass

  const uint8_t* at(size_t offset) const { return ws.data() + offset; }
  float f32(size_t offset, int64_t index) const {
    float x;
    std::memcpy(&x, at(offset) + 4 * index, 4);
    return x;
  }
};

sq::SageQuantShape shape_of(const Case& c) {
  sq::SageQuantShape s;
  s.batch = c.batch();
  s.total_q = c.tokens_q();
  s.total_kv = c.tokens_kv();
  s.num_q_heads = c.hq;
  s.num_kv_heads = c.hkv;
  s.head_dim = c.dim;
  s.quant = c.quant;
  return s;
}

std::vector<int32_t> cu_of(const std::vector<int64_t>& starts) {
  return std::vector<int32_t>(starts.begin(), starts.end());
}

template <typename T>
std::vector<uint8_t> bytes_of(const std::vector<T>& v) {
  std::vector<uint8_t> b(v.size() * sizeof(T));
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// The pass's arguments for a case whose inputs lie in `inputs` (a device copy of in.bits),
// without sequences or workspace.
sq::SageQuantArgs args_of(const Case& c, const Inputs& in, const GuardedDeviceBuffer& inputs) {
  sq::SageQuantArgs args;
  args.shape = shape_of(c);
  args.input_dtype = c.dtype;
  auto input = [&](const Strides& s) {
    return sq::SageInput{inputs.data() + 2 * s.offset, s.batch, s.token, s.head};
  };
  args.q = input(in.q);
  args.k = input(in.k);
  args.v = input(in.v);
  return args;
}

// `launch` must throw an Error whose message names `field`.
template <typename Launch>
void expect_rejected(const std::string& field, Launch launch) {
  try {
    launch();
    ADD_FAILURE() << field << ": accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
  }
}

// Runs the pass over a workspace of sentinel bytes between guard bands; cu overrides (packed
// calls) replace the cu_seqlens the data was laid out with.
GpuResult run_pass(const Case& c, const Inputs& in, Op op = Op::kDense,
                   const std::vector<int32_t>* cu_q_override = nullptr,
                   const std::vector<int32_t>* cu_kv_override = nullptr) {
  GpuResult result;
  result.layout = sq::sage_workspace_layout(shape_of(c));
  GuardedDeviceBuffer inputs(bytes_of(in.bits), 256);
  GuardedDeviceBuffer workspace(std::vector<uint8_t>(result.layout.bytes, kUnwritten), 4096);
  const std::vector<int32_t> cu_q = cu_q_override ? *cu_q_override : cu_of(in.q_start);
  const std::vector<int32_t> cu_kv = cu_kv_override ? *cu_kv_override : cu_of(in.kv_start);
  GuardedDeviceBuffer dcu_q(bytes_of(cu_q), 256), dcu_kv(bytes_of(cu_kv), 256);

  sq::SageQuantArgs args = args_of(c, in, inputs);
  if (c.packed) {
    args.cu_seqlens_q = reinterpret_cast<const int32_t*>(dcu_q.data());
    args.cu_seqlens_kv = reinterpret_cast<const int32_t*>(dcu_kv.data());
    args.seqlen_q = c.q_bound;
    args.seqlen_kv = c.kv_bound;
  } else {
    args.seqlen_q = c.q_lens.empty() ? 0 : c.q_lens[0];
    args.seqlen_kv = c.kv_lens.empty() ? 0 : c.kv_lens[0];
  }
  args.workspace = workspace.data();
  args.workspace_bytes = result.layout.bytes;
  args.op = op;
  EXPECT_NO_THROW(sq::launch_sage_quantize(args, nullptr));
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  result.ws = workspace.download_checking_guards("workspace");
  return result;
}

// ---- comparison with the reference
// ---------------------------------------------------------------

uint8_t code_of(DType dtype, double value) {
  if (dtype == DType::kInt8) return static_cast<uint8_t>(static_cast<int8_t>(value));
  return numerics::float_to_fp8_e4m3_bits(static_cast<float>(value));  // exact, sign kept
}

uint32_t bits_of(float x) { return numerics::float_bits(x); }

// Mismatch counts per output, with the first mismatch of each described.
struct Mismatches {
  std::vector<std::pair<std::string, int64_t>> counts;
  std::vector<std::string> first;
  void add(const std::string& what, bool equal, const std::string& where) {
    auto it = std::find_if(counts.begin(), counts.end(), [&](auto& p) { return p.first == what; });
    if (it == counts.end()) {
      counts.emplace_back(what, 0);
      it = counts.end() - 1;
    }
    if (!equal && it->second++ == 0) first.push_back(what + " at " + where);
  }
  void expect_none() const {
    for (const auto& [what, n] : counts) EXPECT_EQ(n, 0) << what << " mismatches";
    for (const std::string& f : first) ADD_FAILURE() << "first mismatch: " << f;
  }
};

std::string where(int64_t b, int32_t h, int64_t t, int32_t d) {
  return "sequence " + std::to_string(b) + ", head " + std::to_string(h) + ", token " +
         std::to_string(t) + ", channel " + std::to_string(d);
}

// Q and K codes and scales of one (sequence, head) against reference rows.
void compare_rows(Mismatches& m, const char* name, const Case& c, const GpuResult& r,
                  const reference::SageRows& ref, size_t codes, size_t scales, int64_t scale_stride,
                  int32_t heads, int64_t b, int64_t start, int64_t len, int32_t h, int32_t block) {
  for (int64_t t = 0; t < len; ++t) {
    const float gpu_scale = r.f32(scales, h * scale_stride + sq::scale_slot(start, b, t, block));
    m.add(std::string(name) + " scale", bits_of(gpu_scale) == bits_of(ref.row_scale[t]),
          where(b, h, t, 0));
    for (int32_t d = 0; d < c.dim; ++d) {
      const uint8_t gpu = r.at(codes)[((start + t) * heads + h) * c.dim + d];
      m.add(std::string(name) + " code",
            gpu == code_of(c.quant.dtype_qk, ref.values[t * c.dim + d]), where(b, h, t, d));
    }
  }
}

// Every output of the pass against the reference, for the sequences not in skip_q / skip_kv
// (sequences whose cu_seqlens fault, whose outputs must stay unwritten: checked too). V^T
// columns of no checked sequence must be zero.
void expect_matches_reference(const Case& c, const Inputs& in, const GpuResult& r,
                              const std::vector<int64_t>& skip_q = {},
                              const std::vector<int64_t>& skip_kv = {}) {
  Mismatches m;
  const sq::SageWorkspaceLayout& L = r.layout;
  const int64_t vt_stride = L.v_t_stride;
  std::vector<bool> vt_column_used(static_cast<size_t>(vt_stride), false);
  auto skipped = [](const std::vector<int64_t>& s, int64_t b) {
    return std::find(s.begin(), s.end(), b) != s.end();
  };
  for (int64_t b = 0; b < c.batch(); ++b) {
    const int64_t q_start = in.q_start[b], kv_start = in.kv_start[b];
    const int64_t q_len = c.q_lens[b], kv_len = c.kv_lens[b];
    if (skipped(skip_q, b)) {
      for (int64_t i = q_start * c.hq * c.dim; i < (q_start + q_len) * c.hq * c.dim; ++i) {
        m.add("unwritten q code", r.at(L.q)[i] == kUnwritten, "index " + std::to_string(i));
      }
    } else {
      for (int32_t h = 0; h < c.hq; ++h) {
        const reference::SageRows ref = reference::sage_quantize_rows(
            in.rows(0, b, q_len, h, c.dim), q_len, c.dim, c.quant.q_block_size, c.quant.dtype_qk);
        compare_rows(m, "q", c, r, ref, L.q, L.q_scale, L.q_scale_stride, c.hq, b, q_start, q_len,
                     h, c.quant.q_block_size);
      }
    }
    if (skipped(skip_kv, b)) {
      for (int64_t i = kv_start * c.hkv * c.dim; i < (kv_start + kv_len) * c.hkv * c.dim; ++i) {
        m.add("unwritten k code", r.at(L.k)[i] == kUnwritten, "index " + std::to_string(i));
      }
      continue;
    }
    for (int64_t t = 0; t < kv_len; ++t) vt_column_used[sq::vt_column(kv_start, b, t)] = true;
    for (int32_t h = 0; h < c.hkv; ++h) {
      std::vector<float> k = in.rows(1, b, kv_len, h, c.dim);
      const std::vector<float> mean = reference::sage_channel_mean(k, kv_len, c.dim);
      const int64_t channel0 = (b * c.hkv + h) * c.dim;
      for (int32_t d = 0; d < c.dim; ++d) {
        m.add("k_mean", bits_of(r.f32(L.k_mean, channel0 + d)) == bits_of(mean[d]),
              where(b, h, 0, d));
      }
      for (size_t i = 0; i < k.size(); ++i) k[i] -= mean[i % c.dim];
      const reference::SageRows k_ref =
          reference::sage_quantize_rows(k, kv_len, c.dim, c.quant.k_block_size, c.quant.dtype_qk);
      compare_rows(m, "k", c, r, k_ref, L.k, L.k_scale, L.k_scale_stride, c.hkv, b, kv_start,
                   kv_len, h, c.quant.k_block_size);
      const reference::SageColumns v_ref =
          reference::sage_quantize_v(in.rows(2, b, kv_len, h, c.dim), kv_len, c.dim);
      for (int32_t d = 0; d < c.dim; ++d) {
        m.add("v_scale", bits_of(r.f32(L.v_scale, channel0 + d)) == bits_of(v_ref.channel_scale[d]),
              where(b, h, 0, d));
        for (int64_t t = 0; t < kv_len; ++t) {
          const uint8_t gpu =
              r.at(L.v_t)[(h * c.dim + d) * vt_stride + sq::vt_column(kv_start, b, t)];
          m.add("v_t code", gpu == code_of(DType::kFp8E4M3, v_ref.values[t * c.dim + d]),
                where(b, h, t, d));
        }
      }
    }
  }
  for (int32_t row = 0; row < c.hkv * c.dim; ++row) {
    for (int64_t col = 0; col < vt_stride; ++col) {
      if (!vt_column_used[col]) {
        m.add("v_t column of no sequence is zero", r.at(L.v_t)[row * vt_stride + col] == 0,
              "row " + std::to_string(row) + ", column " + std::to_string(col));
      }
    }
  }
  m.expect_none();
}

// ---- quantize pass -----------------------------------------------------------------------------

TEST(SageQuantGpu, EveryBlockSizeMatchesTheReferenceBitForBit) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed());
  for (DType dtype_qk : {DType::kInt8, DType::kFp8E4M3}) {
    for (int32_t q_block : {1, 4, 16}) {
      for (int32_t k_block : {1, 4, 16}) {
        SCOPED_TRACE(std::string(dtype_name(dtype_qk)) + " q_block " + std::to_string(q_block) +
                     " k_block " + std::to_string(k_block));
        Case c;
        c.q_lens = {77, 77};  // neither a multiple of 4 nor of 16: short last blocks
        c.kv_lens = {301, 301};
        c.quant = {dtype_qk, q_block, k_block};
        const Inputs in = gaussian_inputs(c, rng);
        expect_matches_reference(c, in, run_pass(c, in));
      }
    }
  }
}

TEST(SageQuantGpu, PackedUnevenLengthsMatchTheReference) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed());
  struct Variant {
    DType dtype;
    int32_t hq, hkv, dim;
    SageQuantSpec quant;
    int64_t q_bound, kv_bound;
  };
  // Bounds: exact, unknown (0), and below the longest sequence (the grid covers fewer tokens
  // than a sequence holds: its CTAs must loop).
  const Variant variants[] = {
      {DType::kBF16, 6, 2, 64, {DType::kInt8, 1, 16}, 600, 1000},
      {DType::kF16, 4, 4, 256, {DType::kFp8E4M3, 4, 1}, 0, 0},
      {DType::kF16, 8, 1, 128, {DType::kInt8, 16, 4}, 40, 100},
      {DType::kBF16, 2, 2, 16, {DType::kFp8E4M3, 16, 16}, 0, 1},
  };
  for (const Variant& v : variants) {
    SCOPED_TRACE(std::string(dtype_name(v.dtype)) + " D " + std::to_string(v.dim) + " heads " +
                 std::to_string(v.hq) + "/" + std::to_string(v.hkv));
    Case c;
    c.dtype = v.dtype;
    c.hq = v.hq;
    c.hkv = v.hkv;
    c.dim = v.dim;
    c.packed = true;
    c.q_lens = {1, 0, 45, 600, 16, 17, 3};
    c.kv_lens = {5, 0, 1000, 1, 33, 130, 257};
    c.extra = 9;  // tokens past cu[B]: no sequence's, so their V^T columns are zero
    c.quant = v.quant;
    c.q_bound = v.q_bound;
    c.kv_bound = v.kv_bound;
    const Inputs in = gaussian_inputs(c, rng);
    expect_matches_reference(c, in, run_pass(c, in));
  }
}

// K whose channels sit far from zero (the outliers SageAttention smooths away): the pass must
// subtract the mean, and the smoothed codes represent K far better than unsmoothed ones would.
TEST(SageQuantGpu, KWithOutliersIsSmoothedLikeTheReference) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed());
  Case c;
  c.q_lens = {64};
  c.kv_lens = {500};
  c.hkv = 2;
  c.quant = {DType::kInt8, 1, 16};
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> offset(static_cast<size_t>(c.hkv * c.dim));
  for (float& o : offset) o = (normal(rng) > 0 ? 1.0f : -1.0f) * (20.0f + 10.0f * normal(rng));
  const Inputs in = make_inputs(c, rng, [&](int which, int64_t, int64_t, int32_t h, int32_t d) {
    return which == 1 ? offset[h * c.dim + d] + 0.5f * normal(rng) : normal(rng);
  });
  const GpuResult r = run_pass(c, in);
  expect_matches_reference(c, in, r);

  for (int32_t h = 0; h < c.hkv; ++h) {
    const std::vector<float> k = in.rows(1, 0, 500, h, c.dim);
    const reference::SageRows raw = reference::sage_quantize_rows(k, 500, c.dim, 16, DType::kInt8);
    int64_t differ = 0;
    double smoothed_error = 0.0, raw_error = 0.0;
    for (int64_t t = 0; t < 500; ++t) {
      const float scale =
          r.f32(r.layout.k_scale, h * r.layout.k_scale_stride + sq::scale_slot(0, 0, t, 16));
      for (int32_t d = 0; d < c.dim; ++d) {
        const auto code = static_cast<int8_t>(r.at(r.layout.k)[(t * c.hkv + h) * c.dim + d]);
        const float mean = r.f32(r.layout.k_mean, h * c.dim + d);
        differ += code != static_cast<int8_t>(raw.values[t * c.dim + d]);
        const double x = k[t * c.dim + d];
        smoothed_error = std::max(smoothed_error, std::fabs(code * double{scale} + mean - x));
        raw_error =
            std::max(raw_error, std::fabs(raw.values[t * c.dim + d] * raw.row_scale[t] - x));
      }
    }
    EXPECT_GT(differ, 500 * c.dim / 2) << "head " << h << ": smoothing changes most codes";
    EXPECT_LT(smoothed_error * 10, raw_error)
        << "head " << h << ": smoothed K error " << smoothed_error << ", unsmoothed " << raw_error;
  }
}

// Values 2^60 apart in one channel: the fp64 sum rounds and its result depends on the order, so
// the pass must fall back to the reference's token order (one sequence over several CTAs).
TEST(SageQuantGpu, AMeanWhoseSumRoundsFollowsTheReferenceOrder) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed());
  Case c;
  c.hq = 1;
  c.hkv = 1;
  c.dim = 32;
  c.q_lens = {8};
  c.kv_lens = {1200};
  std::uniform_real_distribution<float> small(-1.0f, 1.0f);
  // Per channel: as many +2^60 as -2^60 (the big parts cancel), small values between them that
  // survive or vanish depending on what the running sum holds when they arrive.
  std::vector<std::vector<float>> k(static_cast<size_t>(c.dim));
  for (auto& column : k) {
    for (int i = 0; i < 1200; ++i) {
      column.push_back(i % 4 == 0 ? (i % 8 == 0 ? 1.0f : -1.0f) * std::ldexp(1.0f, 60)
                                  : small(rng));
    }
    std::shuffle(column.begin(), column.end(), rng);
  }
  // Channels 0 .. 3 keep small values only: their sums are exact and take the parallel path.
  for (int32_t d = 0; d < 4; ++d) {
    for (float& x : k[d]) x = small(rng);
  }
  const Inputs in = make_inputs(c, rng, [&](int which, int64_t, int64_t t, int32_t, int32_t d) {
    return which == 1 ? k[d][t] : small(rng);
  });
  // The case is only meaningful where the order changes the mean.
  const std::vector<float> rows = in.rows(1, 0, 1200, 0, c.dim);
  int order_dependent = 0;
  for (int32_t d = 4; d < c.dim; ++d) {
    double forward = 0.0, backward = 0.0;
    for (int64_t t = 0; t < 1200; ++t) forward += rows[t * c.dim + d];
    for (int64_t t = 1199; t >= 0; --t) backward += rows[t * c.dim + d];
    order_dependent += static_cast<float>(forward / 1200) != static_cast<float>(backward / 1200);
  }
  EXPECT_GT(order_dependent, 0) << "no channel's mean depends on the summation order";
  for (DType dtype_qk : {DType::kInt8, DType::kFp8E4M3}) {
    c.quant = {dtype_qk, 4, 16};
    expect_matches_reference(c, in, run_pass(c, in));
  }
}

// cu_seqlens entries outside the tensors or out of order: the sequences they name are skipped
// (nothing of them written, their V^T columns zero), the others are exact, the fault is recorded
// once and reported under the caller's op; nothing outside the workspace is written.
TEST(SageQuantGpu, BadCuSeqlensAreGuardedAndRecorded) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed());
  Case c;
  c.packed = true;
  c.q_lens = {12, 20, 9};
  c.kv_lens = {10, 20, 30};
  c.quant = {DType::kInt8, 4, 4};
  const Inputs in = gaussian_inputs(c, rng);
  {
    SCOPED_TRACE("cu_seqlens_kv out of order");
    drain_device_faults();
    const std::vector<int32_t> bad_kv = {0, 10, 5, 60};  // entry 2 < entry 1
    const GpuResult r = run_pass(c, in, Op::kDense, nullptr, &bad_kv);
    expect_fault(take_device_fault(),
                 {FaultKind::kCuSeqlensOrder, FaultArg::kCuSeqlensKv, Op::kDense, 1, 2, 5, 10, 1});
    // Sequence 2 (5 .. 60) follows the bad entry: skipped too. Its columns are zero.
    expect_matches_reference(c, in, r, {}, {1, 2});
  }
  {
    SCOPED_TRACE("cu_seqlens_q past the tensor");
    drain_device_faults();
    const std::vector<int32_t> bad_q = {0, 12, 50, 41};  // total_q is 41
    const GpuResult r = run_pass(c, in, Op::kPrefill, &bad_q, nullptr);
    expect_fault(take_device_fault(), {FaultKind::kCuSeqlensRange, FaultArg::kCuSeqlensQ,
                                       Op::kPrefill, 1, 2, 50, 41, 1});
    expect_matches_reference(c, in, r, {1, 2}, {});
  }
}

// Launch arguments the pass cannot serve throw an Error naming the field, before anything is
// enqueued: the workspace keeps its bytes.
TEST(SageQuantGpu, BadArgumentsAreRejectedBeforeAnythingRuns) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed());
  Case c;
  c.q_lens = {32};
  c.kv_lens = {48};
  const Inputs in = gaussian_inputs(c, rng);
  const size_t bytes = sq::sage_workspace_bytes(shape_of(c));
  GuardedDeviceBuffer workspace(std::vector<uint8_t>(bytes, kUnwritten), 256);
  GuardedDeviceBuffer inputs(bytes_of(in.bits), 256);
  sq::SageQuantArgs good = args_of(c, in, inputs);
  good.seqlen_q = 32;
  good.seqlen_kv = 48;
  good.workspace = workspace.data();
  good.workspace_bytes = bytes;

  struct Bad {
    std::string field;
    sq::SageQuantArgs args;
  };
  std::vector<Bad> bad;
  auto with = [&](const std::string& field, auto change) {
    sq::SageQuantArgs a = good;
    change(a);
    bad.push_back({field, a});
  };
  with("head_dim", [](auto& a) { a.shape.head_dim = 72; });
  with("head_dim", [](auto& a) { a.shape.head_dim = 512; });
  with("q_block_size", [](auto& a) { a.shape.quant.q_block_size = 8; });
  with("dtype_qk", [](auto& a) { a.shape.quant.dtype_qk = DType::kBF16; });
  with("bf16 or f16", [](auto& a) { a.input_dtype = DType::kF32; });
  with("workspace", [&](auto& a) { a.workspace_bytes = bytes - 1; });
  with("workspace", [](auto& a) { a.workspace = static_cast<uint8_t*>(a.workspace) + 16; });
  with("k: strides", [](auto& a) { a.k.stride_token += 4; });
  with("v: the base", [](auto& a) { a.v.data = static_cast<const uint8_t*>(a.v.data) + 2; });
  with("seqlen_kv", [](auto& a) { a.seqlen_kv = 47; });
  with("num_q_heads", [](auto& a) { a.shape.num_q_heads = 0; });
  for (const Bad& b : bad) {
    expect_rejected(b.field, [&] { sq::launch_sage_quantize(b.args, nullptr); });
  }
  ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint8_t> after = workspace.download_checking_guards("workspace");
  EXPECT_TRUE(std::all_of(after.begin(), after.end(), [](uint8_t x) { return x == kUnwritten; }))
      << "a rejected call wrote into the workspace";
  ASSERT_NO_THROW(sq::launch_sage_quantize(good, nullptr)) << "the good arguments are served";
  ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
}

// ---- fp8 V transposes --------------------------------------------------------------------------

std::vector<uint8_t> random_bytes(std::mt19937_64& rng, size_t n) {
  std::vector<uint8_t> out(n);
  for (uint8_t& b : out) b = static_cast<uint8_t>(rng());  // every code, NaN ones included
  return out;
}

// The (sequence, token) that each V^T column holds ({-1, -1}: none) for sequences starting at
// packed tokens starts[b] with lens[b] tokens.
struct VtOwner {
  int64_t seq = -1, token = -1;
};
std::vector<VtOwner> vt_owners(int64_t stride, const std::vector<int64_t>& starts,
                               const std::vector<int64_t>& lens) {
  std::vector<VtOwner> owners(static_cast<size_t>(stride));
  for (size_t b = 0; b < lens.size(); ++b) {
    for (int64_t t = 0; t < lens[b]; ++t) {
      VtOwner& o = owners.at(static_cast<size_t>(sq::vt_column(starts[b], b, t)));
      EXPECT_EQ(o.seq, -1) << "two tokens in one V^T column";
      o = {static_cast<int64_t>(b), t};
    }
  }
  return owners;
}

// V^T [Hkv][D][stride] of the columns the expected function names (others zero).
template <typename Expected>
void expect_vt(const std::vector<uint8_t>& vt, int32_t hkv, int32_t dim, int64_t stride,
               Expected expected) {
  int64_t wrong = 0;
  std::string first;
  for (int32_t h = 0; h < hkv; ++h) {
    for (int32_t d = 0; d < dim; ++d) {
      for (int64_t col = 0; col < stride; ++col) {
        const uint8_t want = expected(h, d, col);
        const uint8_t got = vt[(int64_t{h} * dim + d) * stride + col];
        if (got != want && wrong++ == 0) {
          first = "head " + std::to_string(h) + ", channel " + std::to_string(d) + ", column " +
                  std::to_string(col) + ": " + std::to_string(got) + " != " + std::to_string(want);
        }
      }
    }
  }
  EXPECT_EQ(wrong, 0) << "first: " << first;
}

TEST(SageTransposeGpu, Fp8VMatchesAHostTranspose) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed());
  struct Variant {
    bool packed;
    int32_t hkv, dim;
    std::vector<int64_t> lens;
  };
  const Variant variants[] = {
      {false, 2, 128, {45, 45, 45}},
      {true, 3, 64, {0, 7, 130, 1, 300}},
      {true, 1, 256, {129, 2}},
  };
  for (const Variant& v : variants) {
    SCOPED_TRACE(std::string(v.packed ? "packed" : "uniform") + " D " + std::to_string(v.dim));
    const auto batch = static_cast<int32_t>(v.lens.size());
    std::vector<int64_t> start(v.lens.size() + 1, 0);
    for (size_t b = 0; b < v.lens.size(); ++b) start[b + 1] = start[b] + v.lens[b];
    const int64_t total = start.back() + (v.packed ? 5 : 0);
    // Token stride: Hkv x D plus 32 unused bytes; uniform batch stride with 3 unused tokens.
    const int64_t token_stride = int64_t{v.hkv} * v.dim + 32;
    const int64_t batch_stride = (v.lens[0] + 3) * token_stride;
    const int64_t bytes = v.packed ? total * token_stride : batch * batch_stride;
    const std::vector<uint8_t> src = random_bytes(rng, static_cast<size_t>(bytes));
    auto src_index = [&](int64_t b, int64_t t, int32_t h, int32_t d) {
      return (v.packed ? (start[b] + t) * token_stride : b * batch_stride + t * token_stride) +
             int64_t{h} * v.dim + d;
    };
    const int64_t stride = sq::vt_row_stride(total, batch);
    const size_t vt_bytes = sq::fp8_vt_bytes(v.hkv, v.dim, total, batch);
    GuardedDeviceBuffer dsrc(src, 256), dvt(std::vector<uint8_t>(vt_bytes, kUnwritten), 4096);
    GuardedDeviceBuffer dcu(bytes_of(cu_of(start)), 256);
    sq::Fp8TransposeArgs args;
    args.v = {dsrc.data(), batch_stride, token_stride, v.dim};
    args.batch = batch;
    args.num_kv_heads = v.hkv;
    args.head_dim = v.dim;
    args.total_kv = total;
    args.cu_seqlens_kv = v.packed ? reinterpret_cast<const int32_t*>(dcu.data()) : nullptr;
    args.seqlen_kv = v.packed ? 0 : v.lens[0];
    args.v_t = dvt.data();
    args.v_t_bytes = vt_bytes;
    ASSERT_NO_THROW(sq::launch_fp8_transpose_v(args, nullptr));
    ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint8_t> vt = dvt.download_checking_guards("v_t");
    const std::vector<VtOwner> owners = vt_owners(stride, start, v.lens);
    expect_vt(vt, v.hkv, v.dim, stride, [&](int32_t h, int32_t d, int64_t col) -> uint8_t {
      const VtOwner& o = owners[static_cast<size_t>(col)];
      return o.seq < 0 ? 0 : src[src_index(o.seq, o.token, h, d)];
    });
  }
}

// A paged fp8 cache ([num_blocks, 2, Hkv, T, D] pool) on the device with a shuffled block table.
struct PagedCase {
  int32_t hkv = 2, dim = 128, page = 16, table_cols = 0, num_blocks = 0;
  std::vector<int32_t> lens;
  std::vector<int32_t> table;  // [rows, table_cols]
  std::vector<uint8_t> pool;

  int64_t rows() const { return static_cast<int64_t>(lens.size()); }
  int64_t v_byte(int32_t block, int32_t h, int32_t slot, int32_t d) const {
    const int64_t half = int64_t{hkv} * page * dim;
    return block * 2 * half + half + (int64_t{h} * page + slot) * dim + d;
  }
};

PagedCase paged_case(std::mt19937_64& rng, int32_t page, std::vector<int32_t> lens, int32_t hkv,
                     int32_t dim) {
  PagedCase c;
  c.hkv = hkv;
  c.dim = dim;
  c.page = page;
  c.lens = std::move(lens);
  int32_t longest = *std::max_element(c.lens.begin(), c.lens.end());
  c.table_cols = (longest + page - 1) / page + 1;
  c.num_blocks = static_cast<int32_t>(c.rows()) * c.table_cols;
  std::vector<int32_t> ids(static_cast<size_t>(c.num_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);
  c.table = ids;
  c.pool = random_bytes(rng, static_cast<size_t>(c.num_blocks) * 2 * hkv * page * dim);
  return c;
}

struct PagedOutcome {
  std::vector<uint8_t> vt;
  std::vector<int32_t> offsets;
  TakenFault fault;
};

PagedOutcome run_paged(const PagedCase& c, int64_t columns, bool paged = true) {
  PagedOutcome out;
  drain_device_faults();
  GuardedDeviceBuffer pool(c.pool, 64 << 10);
  GuardedDeviceBuffer table(bytes_of(c.table), 256), lens(bytes_of(c.lens), 256);
  const size_t vt_bytes = sq::fp8_vt_bytes(c.hkv, c.dim, columns, c.rows());
  GuardedDeviceBuffer vt(std::vector<uint8_t>(vt_bytes, kUnwritten), 4096);
  GuardedDeviceBuffer offsets(std::vector<uint8_t>((c.rows() + 1) * 4, kUnwritten), 256);
  sq::PagedFp8TransposeArgs args;
  args.cache = paged_cache_view(pool.data(), DType::kFp8E4M3, c.num_blocks, c.hkv, c.page, c.dim);
  args.cache.paged = paged;
  if (paged) {
    args.cache.block_table.data = table.data();
    args.cache.block_table.dtype = DType::kInt32;
    args.cache.block_table.ndim = 2;
    args.cache.block_table.shape[0] = c.rows();
    args.cache.block_table.shape[1] = c.table_cols;
    args.cache.block_table.strides[0] = c.table_cols;
    args.cache.block_table.strides[1] = 1;
    args.cache.block_table.device = Device::cuda(0);
  }
  args.cache.seq_lens.data = lens.data();
  args.cache.seq_lens.dtype = DType::kInt32;
  args.cache.seq_lens.ndim = 1;
  args.cache.seq_lens.shape[0] = c.rows();
  args.cache.seq_lens.strides[0] = 1;
  args.cache.seq_lens.device = Device::cuda(0);
  args.v_t_columns = columns;
  args.max_seqlen_kv = 0;
  args.v_t = vt.data();
  args.v_t_bytes = vt_bytes;
  args.kv_offsets = reinterpret_cast<int32_t*>(offsets.data());
  EXPECT_NO_THROW(sq::launch_paged_fp8_transpose_v(args, nullptr));
  out.fault = take_device_fault();
  out.vt = vt.download_checking_guards("v_t");
  const std::vector<uint8_t> off = offsets.download_checking_guards("kv_offsets");
  out.offsets.resize(c.rows() + 1);
  std::memcpy(out.offsets.data(), off.data(), off.size());
  pool.download_checking_guards("pool");
  return out;
}

// The host gather: row r's token t from its page, zero where `bad_page(r, page)`.
template <typename BadPage>
void expect_paged_vt(const PagedCase& c, const PagedOutcome& out, int64_t columns,
                     const std::vector<int32_t>& lens, BadPage bad_page, bool paged = true) {
  std::vector<int32_t> offsets(lens.size() + 1, 0);
  for (size_t r = 0; r < lens.size(); ++r) offsets[r + 1] = offsets[r] + lens[r];
  EXPECT_EQ(out.offsets, offsets);
  const int64_t stride = sq::vt_row_stride(columns, c.rows());
  const std::vector<VtOwner> owners =
      vt_owners(stride, std::vector<int64_t>(offsets.begin(), offsets.end() - 1),
                std::vector<int64_t>(lens.begin(), lens.end()));
  expect_vt(out.vt, c.hkv, c.dim, stride, [&](int32_t h, int32_t d, int64_t col) -> uint8_t {
    const VtOwner& o = owners[static_cast<size_t>(col)];
    if (o.seq < 0) return 0;
    const auto t = static_cast<int32_t>(o.token);
    const int32_t page = t / c.page;
    if (bad_page(o.seq, page)) return 0;
    const int32_t block =
        paged ? c.table[o.seq * c.table_cols + page] : static_cast<int32_t>(o.seq);
    return c.pool[c.v_byte(block, h, t % c.page, d)];
  });
}

TEST(SageTransposeGpu, PagedFp8VIsGatheredThroughTheBlockTable) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed());
  for (int32_t page : {8, 16, 64, 128}) {
    SCOPED_TRACE("page " + std::to_string(page));
    const PagedCase c = paged_case(rng, page, {0, 1, 37, 128, 300, 16}, 2, page == 64 ? 256 : 64);
    const int64_t columns = 482 + 7;  // the total, and unused columns after it (zeroed)
    const PagedOutcome out = run_paged(c, columns);
    EXPECT_FALSE(out.fault.faulted) << out.fault.message;
    expect_paged_vt(c, out, columns, c.lens, [](int64_t, int32_t) { return false; });
  }
  {
    SCOPED_TRACE("contiguous cache");
    PagedCase c = paged_case(rng, 320, {5, 0, 320, 77}, 3, 128);  // one 320-token block a row
    const PagedOutcome out = run_paged(c, 402, false);
    EXPECT_FALSE(out.fault.faulted) << out.fault.message;
    expect_paged_vt(
        c, out, 402, c.lens, [](int64_t, int32_t) { return false; }, false);
  }
}

// Block-table entries outside the pool (an id past it, -1) where a page is read: the page's
// tokens are zeros and each bad entry is recorded once; -1 past a row's length is never read.
// A length beyond the row's capacity (or negative) faults and counts 0 tokens.
TEST(SageTransposeGpu, PagedBadTablesAndLengthsAreGuarded) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed());
  {
    SCOPED_TRACE("a block id past the pool, -1 in an unread column");
    PagedCase c = paged_case(rng, 16, {40, 100, 70}, 2, 128);  // table_cols = 8
    c.table[1 * c.table_cols + 2] = c.num_blocks + 3;
    c.table[2 * c.table_cols + 6] = -1;  // row 2 reads pages 0 .. 4
    const PagedOutcome out = run_paged(c, 210);
    expect_fault(out.fault, {FaultKind::kBlockId, FaultArg::kBlockTable, Op::kPrefill, 1, 2,
                             c.num_blocks + 3, c.num_blocks, 1});
    expect_paged_vt(c, out, 210, c.lens, [](int64_t r, int32_t p) { return r == 1 && p == 2; });
  }
  {
    SCOPED_TRACE("-1 in a read column");
    PagedCase c = paged_case(rng, 64, {40, 100, 70}, 1, 64);
    c.table[2 * c.table_cols + 1] = -1;
    const PagedOutcome out = run_paged(c, 210);
    expect_fault(out.fault, {FaultKind::kBlockId, FaultArg::kBlockTable, Op::kPrefill, 2, 1, -1,
                             c.num_blocks, 1});
    expect_paged_vt(c, out, 210, c.lens, [](int64_t r, int32_t p) { return r == 2 && p == 1; });
  }
  for (int32_t bad_len : {-5, 1000}) {
    SCOPED_TRACE("seq_lens " + std::to_string(bad_len));
    PagedCase c = paged_case(rng, 32, {40, 100, 70}, 2, 64);  // capacity 5 x 32 = 160
    const int32_t capacity = c.table_cols * c.page;
    c.lens[1] = bad_len;
    const PagedOutcome out = run_paged(c, 200);
    expect_fault(out.fault, {FaultKind::kSeqLen, FaultArg::kSeqLens, Op::kPrefill, 1, 0, bad_len,
                             capacity, 1});
    expect_paged_vt(c, out, 200, {40, 0, 70}, [](int64_t, int32_t) { return false; });
  }
  {
    SCOPED_TRACE("lengths past the columns the caller sized V^T for");
    PagedCase c = paged_case(rng, 16, {40, 100, 70}, 2, 64);
    const PagedOutcome out = run_paged(c, 120);  // rows 1 and 2 do not fit: clipped, no fault
    EXPECT_FALSE(out.fault.faulted) << out.fault.message;
    expect_paged_vt(c, out, 120, {40, 80, 0}, [](int64_t, int32_t) { return false; });
  }
}

TEST(SageTransposeGpu, BadArgumentsAreRejected) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed());
  const PagedCase c = paged_case(rng, 16, {10, 20}, 2, 64);
  GuardedDeviceBuffer pool(c.pool, 4096), vt(std::vector<uint8_t>(1 << 16, kUnwritten), 256);
  sq::PagedFp8TransposeArgs good;
  good.cache = paged_cache_view(pool.data(), DType::kFp8E4M3, c.num_blocks, c.hkv, c.page, c.dim);
  good.cache.seq_lens.data = vt.data();  // never read: every case below is rejected first
  good.cache.seq_lens.dtype = DType::kInt32;
  good.cache.seq_lens.ndim = 1;
  good.cache.seq_lens.shape[0] = 2;
  good.cache.block_table.data = vt.data();
  good.cache.block_table.dtype = DType::kInt32;
  good.cache.block_table.ndim = 2;
  good.cache.block_table.shape[0] = 2;
  good.cache.block_table.shape[1] = c.table_cols;
  good.v_t_columns = 30;
  good.v_t = vt.data();
  good.v_t_bytes = sq::fp8_vt_bytes(c.hkv, c.dim, 30, 2);
  good.kv_offsets = reinterpret_cast<int32_t*>(vt.data());
  auto paged = [&](const std::string& field, auto change) {
    sq::PagedFp8TransposeArgs a = good;
    change(a);
    expect_rejected(field, [&] { sq::launch_paged_fp8_transpose_v(a, nullptr); });
  };
  paged("kv_cache.dtype", [](auto& a) { a.cache.dtype = DType::kBF16; });
  paged("cyclic", [](auto& a) { a.cache.window_slots = 64; });
  paged("v_t", [](auto& a) { a.v_t_bytes -= 1; });
  paged("tokens_per_block", [](auto& a) { a.cache.tokens_per_block = 48; });
  paged("head_dim", [](auto& a) { a.cache.head_dim = 8; });
  paged("kv_offsets", [](auto& a) { a.kv_offsets = nullptr; });
  paged("block_table", [](auto& a) { a.cache.block_table.shape[0] = 1; });

  sq::Fp8TransposeArgs dense;
  dense.v = {pool.data(), 0, 64 * 2, 64};
  dense.batch = 1;
  dense.num_kv_heads = 2;
  dense.head_dim = 64;
  dense.total_kv = 10;
  dense.seqlen_kv = 10;
  dense.v_t = vt.data();
  dense.v_t_bytes = sq::fp8_vt_bytes(2, 64, 10, 1);
  auto packed = [&](const std::string& field, auto change) {
    sq::Fp8TransposeArgs a = dense;
    change(a);
    expect_rejected(field, [&] { sq::launch_fp8_transpose_v(a, nullptr); });
  };
  packed("seqlen_kv", [](auto& a) { a.seqlen_kv = 9; });
  packed("strides", [](auto& a) { a.v.stride_token = 136; });
  packed("v_t", [](auto& a) { a.v_t_bytes = 100; });
  ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint8_t> after = vt.download_checking_guards("v_t");
  EXPECT_TRUE(std::all_of(after.begin(), after.end(), [](uint8_t x) { return x == kUnwritten; }))
      << "a rejected call wrote";
}

}  // namespace
}  // namespace attnkit::test
