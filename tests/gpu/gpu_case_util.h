// Shared pieces of the CUDA backend tests (append_kv, vanilla, forward, merge_states): a device
// mirror of the oracle's KV cache, random cache contents per dtype, and the docs/testing.md
// tolerance check against an fp64 oracle and the CPU reference.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "common/reference_oracle.h"
#include "common/test_util.h"
#include "core/numerics.h"
#include "gpu/gpu_util.h"

namespace attnkit::test {

// Distance in units of the format: f16 / bf16 ulps at the larger magnitude, fp8 / int8 codes.
// Identical bit patterns (including NaN poison) are 0 apart.
inline double units_apart(DType dtype, const uint8_t* a, const uint8_t* b) {
  const size_t size = dtype_size(dtype);
  if (std::memcmp(a, b, size) == 0) return 0.0;
  switch (dtype) {
    case DType::kBF16:
    case DType::kF16: {
      uint16_t x, y;
      std::memcpy(&x, a, 2);
      std::memcpy(&y, b, 2);
      const float fx =
          dtype == DType::kBF16 ? numerics::bf16_bits_to_float(x) : numerics::f16_bits_to_float(x);
      const float fy =
          dtype == DType::kBF16 ? numerics::bf16_bits_to_float(y) : numerics::f16_bits_to_float(y);
      if (std::isnan(fx) || std::isnan(fy)) return INFINITY;
      const double m = std::max(std::fabs(fx), std::fabs(fy));
      const int mantissa_bits = dtype == DType::kBF16 ? 7 : 10;
      const double ulp =
          std::ldexp(1.0, std::max(std::ilogb(m == 0 ? 1e-30 : m), -14) - mantissa_bits);
      return std::fabs(fx - fy) / ulp;
    }
    case DType::kFp8E4M3: {
      // Sign-magnitude codes in value order.
      auto order = [](uint8_t c) { return (c & 0x80) ? -int(c & 0x7f) : int(c & 0x7f); };
      if ((a[0] & 0x7f) == 0x7f || (b[0] & 0x7f) == 0x7f) return INFINITY;  // NaN
      return std::abs(order(a[0]) - order(b[0]));
    }
    case DType::kInt8:
      return std::abs(int(static_cast<int8_t>(a[0])) - int(static_cast<int8_t>(b[0])));
    default:
      return INFINITY;
  }
}

// Elements of two tensors of one dtype compared by units_apart; worst: the index of the farthest
// pair (-1 when all are identical), its values for the failure message.
struct UnitsReport {
  double max_units = 0.0;
  int64_t differing = 0;
  int64_t total = 0;
  int64_t worst = -1;
  double worst_a = 0.0, worst_b = 0.0;
};

inline UnitsReport compare_bytes(DType dtype, const HostTensor& a, const HostTensor& b) {
  UnitsReport r;
  const size_t size = dtype_size(dtype);
  r.total = a.numel();
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double u = units_apart(dtype, a.bytes().data() + i * size, b.bytes().data() + i * size);
    if (u > 0) ++r.differing;
    if (u > r.max_units) r.max_units = u, r.worst = i, r.worst_a = a.get(i), r.worst_b = b.get(i);
  }
  return r;
}

// The same cache on the device: pool, block table, seq_lens and scales copied; KvCacheView with
// device pointers.
class DeviceKvCache {
 public:
  explicit DeviceKvCache(const OracleKvCache& host) : view_(host.view()) {
    const KvCacheView h = host.view();
    pool_ = DeviceTensor(host.pool());
    const int64_t v_offset = static_cast<uint8_t*>(h.v_base) - static_cast<uint8_t*>(h.k_base);
    view_.k_base = pool_.data();
    view_.v_base = static_cast<uint8_t*>(pool_.data()) + v_offset;
    view_.device = Device::cuda(0);
    view_.block_table = device_copy(h.block_table, block_table_);
    view_.seq_lens = device_copy(h.seq_lens, seq_lens_);
    view_.k_scale = device_copy(h.k_scale, k_scale_);
    view_.v_scale = device_copy(h.v_scale, v_scale_);
  }
  const KvCacheView& view() const { return view_; }
  void download_pool(OracleKvCache& host) const { pool_.download(host.pool()); }
  // After the host's seq_lens changed (a new step).
  void upload_seq_lens(const OracleKvCache& host) {
    const TensorView h = host.view().seq_lens;
    cudaMemcpy(seq_lens_.data(), h.data, h.numel() * sizeof(int32_t), cudaMemcpyHostToDevice);
  }

 private:
  KvCacheView view_;
  DeviceTensor pool_, block_table_, seq_lens_, k_scale_, v_scale_;
};

// Random stored values for a cache of `dtype` (finite everywhere, so masked keys are harmless to
// the fp64 oracle) and matching scales: fp8 / int8 use real scales, bf16 / f16 none.
inline void fill_cache_random(OracleKvCache& cache, DType dtype, int32_t num_kv_heads,
                              bool per_head_scales, std::mt19937_64& rng) {
  switch (dtype) {
    case DType::kFp8E4M3: {
      cache.pool().fill_uniform(rng, -6.0f, 6.0f);
      std::uniform_real_distribution<float> s(0.1f, 0.3f);
      std::vector<float> k(per_head_scales ? num_kv_heads : 1), v(k.size());
      for (auto& x : k) x = s(rng);
      for (auto& x : v) x = s(rng);
      cache.set_scales(k, v);
      break;
    }
    case DType::kInt8: {
      cache.pool().fill_uniform(rng, -120.0f, 120.0f);
      std::uniform_real_distribution<float> s(0.005f, 0.02f);
      std::vector<float> k(per_head_scales ? num_kv_heads : 1), v(k.size());
      for (auto& x : k) x = s(rng);
      for (auto& x : v) x = s(rng);
      cache.set_scales(k, v);
      break;
    }
    default:
      cache.pool().fill_uniform(rng, -1.0f, 1.0f);
      break;
  }
}

inline std::vector<double> head_values(const HostTensor& t, int64_t first, int64_t count) {
  std::vector<double> out(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) out[i] = t.get(first + i);
  return out;
}

inline OracleProblem oracle_problem_of(const AttentionSpec& spec) {
  OracleProblem pr;
  pr.num_q_heads = spec.num_q_heads;
  pr.num_kv_heads = spec.num_kv_heads;
  pr.head_dim = spec.head_dim;
  pr.mask = spec.mask;
  pr.scale = spec.effective_scale();
  pr.softcap = spec.logit_softcap;
  if (spec.alibi) {
    const std::vector<float> s =
        spec.alibi_slopes.empty() ? default_alibi_slopes(spec.num_q_heads) : spec.alibi_slopes;
    pr.alibi_slopes.assign(s.begin(), s.end());
  }
  return pr;
}

// Accumulates oracle results of several pieces (sequences, rows) into packed vectors.
struct OracleAccumulator {
  std::vector<double> ref64_out, ref64_lse, naive_out;
  void add(const OracleProblem& pr, DType dtype) {
    const OracleResult r = brute_force_attention(pr);
    const std::vector<double> naive = naive_same_precision(pr, dtype);
    ref64_out.insert(ref64_out.end(), r.out.begin(), r.out.end());
    ref64_lse.insert(ref64_lse.end(), r.lse.begin(), r.lse.end());
    naive_out.insert(naive_out.end(), naive.begin(), naive.end());
  }
};

// docs/testing.md: max |out - ref64| <= 2 * max |naive_same_precision - ref64| + 1e-3, for the GPU
// output and (as a cross-check of the oracle wiring) the CPU reference output; the LSE within
// 1e-3 and with the same -inf pattern. cpu_oracle: the CPU output's own oracle where its inputs
// may differ from the GPU's (forward(): caches and rotated Q within one unit); the GPU-vs-CPU
// cross-checks are then left out (each side is held to its own oracle instead).
inline void expect_attention_matches(const std::string& what, const OracleAccumulator& oracle,
                                     const HostTensor& gpu_out, const HostTensor* gpu_lse,
                                     const HostTensor& cpu_out, const HostTensor* cpu_lse,
                                     const OracleAccumulator* cpu_oracle = nullptr) {
  const std::vector<double> gpu = gpu_out.to_double();
  const std::vector<double> cpu = cpu_out.to_double();
  ASSERT_FALSE(any_nan(gpu)) << what << ": the GPU output has NaN (unwritten elements?)";
  const double yardstick = max_abs_diff(oracle.naive_out, oracle.ref64_out);
  const double tolerance = 2.0 * yardstick + 1e-3;
  const double gpu_error = max_abs_diff(gpu, oracle.ref64_out);
  EXPECT_LE(gpu_error, tolerance) << what << ": GPU vs fp64 oracle (naive yardstick " << yardstick
                                  << ")";
  const OracleAccumulator& cpu_ref = cpu_oracle != nullptr ? *cpu_oracle : oracle;
  const double cpu_tolerance = 2.0 * max_abs_diff(cpu_ref.naive_out, cpu_ref.ref64_out) + 1e-3;
  EXPECT_LE(max_abs_diff(cpu, cpu_ref.ref64_out), cpu_tolerance)
      << what << ": CPU reference vs fp64 oracle";
  if (cpu_oracle == nullptr) {
    EXPECT_LE(max_abs_diff(gpu, cpu), 2.0 * tolerance) << what << ": GPU vs CPU reference";
  }
  if (gpu_lse != nullptr) {
    bool pattern = false;
    const double lse_error = max_abs_diff_lse(gpu_lse->to_double(), oracle.ref64_lse, &pattern);
    EXPECT_TRUE(pattern) << what << ": LSE -inf pattern (or NaN) differs from the oracle";
    EXPECT_LE(lse_error, 1e-3) << what << ": LSE vs fp64 oracle";
    if (cpu_lse != nullptr && cpu_oracle != nullptr) {
      const double cpu_lse_error =
          max_abs_diff_lse(cpu_lse->to_double(), cpu_oracle->ref64_lse, &pattern);
      EXPECT_TRUE(pattern) << what << ": CPU LSE -inf pattern differs from its oracle";
      EXPECT_LE(cpu_lse_error, 1e-3) << what << ": CPU LSE vs fp64 oracle";
    } else if (cpu_lse != nullptr) {
      const double cpu_lse_error =
          max_abs_diff_lse(gpu_lse->to_double(), cpu_lse->to_double(), &pattern);
      EXPECT_TRUE(pattern) << what << ": LSE -inf pattern differs from the CPU reference";
      EXPECT_LE(cpu_lse_error, 1e-3) << what << ": LSE vs CPU reference";
    }
  }
}

// A paged cache's table for sequences of kv_lens tokens in pages of `page`: every sequence's
// blocks handed out in a random order from a pool with two spare blocks, one spare column of -1
// per row (entries past a row's blocks are -1), and the lengths.
struct ShuffledBlockTable {
  HostTensor table;     // int32 [B, max_blocks]
  HostTensor seq_lens;  // int32 [B]
  int num_blocks = 0;
  int max_blocks = 0;
  // The block of token j of sequence b.
  int32_t block_of(int b, int j, int page) const {
    return table.data<int32_t>()[b * max_blocks + j / page];
  }
};

inline ShuffledBlockTable shuffled_block_table(const std::vector<int>& kv_lens, int page,
                                               std::mt19937_64& rng) {
  ShuffledBlockTable t;
  const int batch = static_cast<int>(kv_lens.size());
  for (int len : kv_lens) {
    const int blocks = (len + page - 1) / page;
    t.max_blocks = std::max(t.max_blocks, blocks);
    t.num_blocks += blocks;
  }
  t.max_blocks = std::max(t.max_blocks, 1) + 1;
  t.num_blocks += 2;
  std::vector<int> ids(t.num_blocks);
  for (int i = 0; i < t.num_blocks; ++i) ids[i] = i;
  std::shuffle(ids.begin(), ids.end(), rng);
  t.table = HostTensor(DType::kInt32, {batch, t.max_blocks});
  t.seq_lens = HostTensor(DType::kInt32, {batch});
  int next = 0;
  for (int b = 0; b < batch; ++b) {
    const int blocks = (kv_lens[b] + page - 1) / page;
    for (int i = 0; i < t.max_blocks; ++i) {
      t.table.data<int32_t>()[b * t.max_blocks + i] = i < blocks ? ids[next++] : -1;
    }
    t.seq_lens.data<int32_t>()[b] = kv_lens[b];
  }
  return t;
}

inline HostTensor poisoned(DType dtype, std::initializer_list<int64_t> shape) {
  HostTensor t(dtype, shape);
  t.fill(NAN);
  return t;
}

inline HostTensor downloaded(const DeviceTensor& device, const HostTensor& like) {
  HostTensor host = like;
  device.download(host);
  return host;
}

}  // namespace attnkit::test
