// The fused decode's GPU test harness, shared by decode_test.cc and decode_split_test.cc: a
// case description, the paged / contiguous / cyclic host cache with NaN-poisoned unused slots, the
// fp64 oracle with its naive same-precision yardstick (docs/testing.md: max |out - ref64| <=
// 2 * max |naive_same_precision - ref64| + 1e-3), and a prepared case that runs on a stream.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "common/test_util.h"
#include "core/check.h"
#include "core/numerics.h"
#include "gpu/gpu_util.h"

namespace attnkit::test {

struct DecodeCase {
  int32_t hq = 8, hkv = 2, head_dim = 128;
  int32_t page = 16;  // tokens_per_block (paged)
  bool paged = true;
  KvCacheLayout layout = KvCacheLayout::kHND;  // blocks [Hkv, T, D] or [T, Hkv, D]
  DType dtype = DType::kBF16;
  DType kv_dtype = DType::kBF16;
  bool per_head_scale = false;
  std::vector<int32_t> seq_lens{1, 37, 128};  // per row (beams of one sequence share it)
  int32_t beam_width = 1;
  MaskSpec mask{};
  bool cyclic = false;
  bool alibi = false;
  double softcap = 0.0;
  float q_range = 1.0f;       // larger values make soft-cap and the softmax sharper
  float v_scale_base = 0.0f;  // > 0: V scales of [0.5, 2) times this, 16-bit caches included
  // V values of a row's first half of keys (by slot) shifted up by this, the rest down: the row's
  // mean near 0, the means of splits within one half near +-v_half_offset. Non-cyclic caches.
  float v_half_offset = 0.0f;
  int32_t num_splits = 0;
  int32_t max_seq_len = 0;    // DecodeArgs::max_seq_len (0: the longest row)
  int32_t unused_entry = -1;  // what block-table entries past a row's end hold (any value)
  bool with_lse = true;
  bool deterministic = true;  // DecodeArgs::deterministic
  Backend backend = Backend::kFused;

  std::string str() const {
    return detail::concat(
        "hq=", hq, " hkv=", hkv, " D=", head_dim, " page=", page, " paged=", paged,
        " layout=", kv_layout_name(layout), " q=", dtype_name(dtype), " kv=", dtype_name(kv_dtype),
        " per_head_scale=", per_head_scale, " beams=", beam_width, " mask=", mask_name(mask.kind),
        " W=", mask.window, " S=", mask.sink_tokens, " cyclic=", cyclic, " alibi=", alibi,
        " softcap=", softcap, " splits=", num_splits);
  }
};

inline double round_to(DType dtype, double x) {
  const float f = static_cast<float>(x);
  if (dtype == DType::kBF16) return numerics::bf16_bits_to_float(numerics::float_to_bf16_bits(f));
  if (dtype == DType::kF16) return numerics::f16_bits_to_float(numerics::float_to_f16_bits(f));
  return f;
}

struct HostCache {
  int32_t tokens_per_block = 0, max_blocks = 0, num_blocks = 0, window_slots = 0;
  HostTensor pool;         // [num_blocks, 2, Hkv, T, D] (HND) or [num_blocks, 2, T, Hkv, D]
  HostTensor block_table;  // int32 [rows, max_blocks]
  HostTensor seq_lens;     // int32 [rows]
  HostTensor k_scale, v_scale;
  HostTensor indirection;  // int32 [rows / beams, beams, max_seq]
  std::vector<float> k_scales, v_scales;

  int64_t element(int64_t block, int kv, int head, int64_t token, int d,
                  const DecodeCase& c) const {
    if (c.layout == KvCacheLayout::kNHD) {
      return (((block * 2 + kv) * tokens_per_block + token) * c.hkv + head) * c.head_dim + d;
    }
    return (((block * 2 + kv) * c.hkv + head) * tokens_per_block + token) * c.head_dim + d;
  }
};

struct Result {
  std::vector<double> out, lse;
};

inline int64_t slot_of(const DecodeCase& c, const HostCache& h, int64_t pos) {
  if (h.window_slots == 0 || pos < c.mask.sink_tokens) return pos;
  return c.mask.sink_tokens + (pos - c.mask.sink_tokens) % h.window_slots;
}

inline HostCache build_cache(const DecodeCase& c, std::mt19937_64& rng) {
  HostCache h;
  const int64_t rows = static_cast<int64_t>(c.seq_lens.size());
  const int32_t longest = *std::max_element(c.seq_lens.begin(), c.seq_lens.end());
  int64_t slots = longest;
  if (c.cyclic) {
    h.window_slots = cyclic_window_slots(c.mask.window, c.page);
    slots = std::min<int64_t>(slots, c.mask.sink_tokens + h.window_slots);
  }
  if (c.paged) {
    h.tokens_per_block = c.page;
    h.max_blocks = static_cast<int32_t>((slots + c.page - 1) / c.page);
    h.num_blocks = static_cast<int32_t>(rows * h.max_blocks + 3);
  } else {
    h.tokens_per_block = static_cast<int32_t>((slots + 15) / 16 * 16);
    h.max_blocks = 1;
    h.num_blocks = static_cast<int32_t>(rows);
  }
  h.pool = c.layout == KvCacheLayout::kNHD
               ? HostTensor(c.kv_dtype, {h.num_blocks, 2, h.tokens_per_block, c.hkv, c.head_dim})
               : HostTensor(c.kv_dtype, {h.num_blocks, 2, c.hkv, h.tokens_per_block, c.head_dim});
  // Poison: NaN for float types (fp8 0x7F); int8 has no NaN, so its poison is a huge value.
  h.pool.fill(c.kv_dtype == DType::kInt8 ? 127.0f : NAN);

  const bool quantized = c.kv_dtype == DType::kFp8E4M3 || c.kv_dtype == DType::kInt8;
  const int scales = c.per_head_scale ? c.hkv : 1;
  std::uniform_real_distribution<float> scale_dist(0.5f, 2.0f);
  const float base = c.kv_dtype == DType::kInt8 ? 1.0f / 64 : (quantized ? 1.0f / 128 : 1.0f);
  h.k_scale = HostTensor(DType::kF32, {scales});
  h.v_scale = HostTensor(DType::kF32, {scales});
  for (int i = 0; i < scales; ++i) {
    h.k_scale.set(i, base * scale_dist(rng));
    h.v_scale.set(i, (c.v_scale_base > 0.0f ? c.v_scale_base : base) * scale_dist(rng));
  }
  for (int i = 0; i < c.hkv; ++i) {
    h.k_scales.push_back(h.k_scale.get(c.per_head_scale ? i : 0));
    h.v_scales.push_back(h.v_scale.get(c.per_head_scale ? i : 0));
  }

  std::vector<int32_t> order(h.num_blocks);
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng);
  h.block_table = HostTensor(DType::kInt32, {rows, h.max_blocks});
  h.seq_lens = HostTensor(DType::kInt32, {rows});
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  for (int64_t r = 0; r < rows; ++r) {
    h.seq_lens.data<int32_t>()[r] = c.seq_lens[r];
    const int64_t used_slots = std::min<int64_t>(c.seq_lens[r], slots);
    for (int32_t b = 0; b < h.max_blocks; ++b) {
      const bool used = b * static_cast<int64_t>(h.tokens_per_block) < used_slots;
      h.block_table.data<int32_t>()[r * h.max_blocks + b] =
          used ? order[r * h.max_blocks + b] : c.unused_entry;
    }
    for (int64_t s = 0; s < used_slots; ++s) {
      const int64_t block =
          c.paged ? h.block_table.data<int32_t>()[r * h.max_blocks + s / h.tokens_per_block] : r;
      for (int kv = 0; kv < 2; ++kv) {
        for (int head = 0; head < c.hkv; ++head) {
          const float scale = kv == 0 ? h.k_scales[head] : h.v_scales[head];
          const float shift =
              kv == 0 ? 0.0f : (s < c.seq_lens[r] / 2 ? c.v_half_offset : -c.v_half_offset);
          for (int d = 0; d < c.head_dim; ++d) {
            // Stored values are round(x / scale) for quantized caches (docs/semantics.md).
            const float x = value(rng) + shift;
            h.pool.set(h.element(block, kv, head, s % h.tokens_per_block, d, c),
                       quantized ? x / scale : x);
          }
        }
      }
    }
  }
  if (c.beam_width > 1) {
    const int64_t seqs = rows / c.beam_width;
    h.indirection = HostTensor(DType::kInt32, {seqs, c.beam_width, longest});
    std::uniform_int_distribution<int32_t> beam(0, c.beam_width - 1);
    for (int64_t i = 0; i < h.indirection.numel(); ++i)
      h.indirection.data<int32_t>()[i] = beam(rng);
  }
  return h;
}

// fp64 oracle (ref) and the naive computation in the input precision (naive): float logits and
// sums, probabilities and the output rounded to the query dtype.
inline void oracle(const DecodeCase& c, const HostCache& h, const HostTensor& q, Result& ref,
                   Result& naive) {
  const int64_t rows = static_cast<int64_t>(c.seq_lens.size());
  const int group = c.hq / c.hkv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  const std::vector<float> slopes = default_alibi_slopes(c.hq);
  ref.out.assign(rows * c.hq * c.head_dim, 0.0);
  ref.lse.assign(rows * c.hq, -INFINITY);
  naive = ref;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t n = c.seq_lens[r], p = n - 1;
    const int64_t seq = r / c.beam_width, beam = r % c.beam_width;
    std::vector<int64_t> keys;
    for (int64_t j = 0; j < n; ++j) {
      const bool in = c.mask.kind != MaskKind::kSlidingWindow || p - j < c.mask.window ||
                      j < c.mask.sink_tokens;
      if (in) keys.push_back(j);
    }
    // Where each attended key is stored (a beam's keys through its indirection row).
    std::vector<int64_t> key_block(keys.size()), key_slot(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      const int64_t j = keys[i];
      const int64_t src =
          c.beam_width > 1
              ? seq * c.beam_width +
                    h.indirection.data<
                        int32_t>()[(seq * c.beam_width + beam) * h.indirection.view().shape[2] + j]
              : r;
      key_slot[i] = slot_of(c, h, j);
      key_block[i] =
          c.paged
              ? h.block_table.data<int32_t>()[src * h.max_blocks + key_slot[i] / h.tokens_per_block]
              : src;
    }
    // The keys' K and V of one KV head (x = stored * scale; the optional scales of 16-bit caches
    // are honoured too), read once for the query heads of its group.
    std::vector<double> k_rows(keys.size() * c.head_dim), v_rows(k_rows.size());
    std::vector<double> q_row(c.head_dim);
    for (int h_q = 0; h_q < c.hq; ++h_q) {
      const int head = h_q / group;
      if (h_q % group == 0) {
        for (size_t i = 0; i < keys.size(); ++i) {
          const int64_t t = key_slot[i] % h.tokens_per_block;
          for (int d = 0; d < c.head_dim; ++d) {
            double kv = h.pool.get(h.element(key_block[i], 0, head, t, d, c));
            double vv = h.pool.get(h.element(key_block[i], 1, head, t, d, c));
            kv *= h.k_scales[head];
            vv *= h.v_scales[head];
            k_rows[i * c.head_dim + d] = kv;
            v_rows[i * c.head_dim + d] = vv;
          }
        }
      }
      for (int d = 0; d < c.head_dim; ++d) q_row[d] = q.get((r * c.hq + h_q) * c.head_dim + d);
      std::vector<double> logit(keys.size()), logit_f(keys.size());
      for (size_t i = 0; i < keys.size(); ++i) {
        const int64_t j = keys[i];
        const double* k_row = &k_rows[i * c.head_dim];
        double dot = 0.0;
        float dot_f = 0.0f;
        for (int d = 0; d < c.head_dim; ++d) {
          dot += q_row[d] * k_row[d];
          dot_f += static_cast<float>(q_row[d]) * static_cast<float>(k_row[d]);
        }
        auto transform = [&](double x) {
          x *= scale;
          if (c.softcap > 0) x = c.softcap * std::tanh(x / c.softcap);
          if (c.alibi) x += slopes[h_q] * static_cast<double>(j - p);
          return x;
        };
        logit[i] = transform(dot);
        logit_f[i] = static_cast<float>(transform(static_cast<double>(dot_f)));
      }
      const int64_t o = (r * c.hq + h_q) * c.head_dim;
      if (keys.empty()) continue;
      const double m = *std::max_element(logit.begin(), logit.end());
      const float m_f = static_cast<float>(*std::max_element(logit_f.begin(), logit_f.end()));
      double sum = 0.0;
      float sum_f = 0.0f;
      std::vector<double> acc(c.head_dim, 0.0);
      std::vector<float> acc_f(c.head_dim, 0.0f);
      for (size_t i = 0; i < keys.size(); ++i) {
        const double w = std::exp(logit[i] - m);
        const float w_f = std::exp(static_cast<float>(logit_f[i]) - m_f);
        const float w_r = static_cast<float>(round_to(c.dtype, w_f));
        sum += w;
        sum_f += w_f;
        const double* v_row = &v_rows[i * c.head_dim];
        for (int d = 0; d < c.head_dim; ++d) {
          acc[d] += w * v_row[d];
          acc_f[d] += w_r * static_cast<float>(v_row[d]);
        }
      }
      for (int d = 0; d < c.head_dim; ++d) {
        ref.out[o + d] = acc[d] / sum;
        naive.out[o + d] = round_to(c.dtype, acc_f[d] / sum_f);
      }
      ref.lse[r * c.hq + h_q] = m + std::log(sum);
      naive.lse[r * c.hq + h_q] = m_f + std::log(sum_f);
    }
  }
}

// One case on the device: the cache, q, poisoned outputs and the DecodeArgs that point at them.
// run() launches on a stream (no synchronization); check() compares with the oracle.
struct PreparedCase {
  DecodeCase c;
  HostCache h;
  HostTensor q, out, lse;
  DeviceTensor d_q, d_out, d_lse, d_pool, d_table, d_lens, d_ks, d_vs, d_ind;
  AttentionSpec spec;
  DecodeArgs args;

  PreparedCase(const DecodeCase& dc, uint64_t salt) : c(dc) {
    std::mt19937_64 rng(test_seed() ^ (salt * 0x9E3779B97F4A7C15ull));
    h = build_cache(c, rng);
    const int64_t rows = static_cast<int64_t>(c.seq_lens.size());
    q = HostTensor(c.dtype, {rows, c.hq, c.head_dim});
    q.fill_uniform(rng, -c.q_range, c.q_range);
    out = HostTensor(c.dtype, {rows, c.hq, c.head_dim});
    out.fill(NAN);
    lse = HostTensor(DType::kF32, {rows, c.hq});
    lse.fill(NAN);
    d_q = DeviceTensor(q);
    d_out = DeviceTensor(out);
    d_lse = DeviceTensor(lse);
    d_pool = DeviceTensor(h.pool);
    d_table = DeviceTensor(h.block_table);
    d_lens = DeviceTensor(h.seq_lens);
    d_ks = DeviceTensor(h.k_scale);
    d_vs = DeviceTensor(h.v_scale);
    if (c.beam_width > 1) d_ind = DeviceTensor(h.indirection);

    spec.num_q_heads = c.hq;
    spec.num_kv_heads = c.hkv;
    spec.head_dim = c.head_dim;
    spec.mask = c.mask;
    spec.alibi = c.alibi;
    spec.logit_softcap = c.softcap;
    spec.backend = c.backend;

    args.q = d_q;
    args.out = d_out;
    if (c.with_lse) args.lse = d_lse;
    KvCacheView& cache = args.kv_cache;
    cache = paged_cache_view(d_pool.data(), c.kv_dtype, h.num_blocks, c.hkv, h.tokens_per_block,
                             c.head_dim);
    cache.paged = c.paged;
    cache.layout = c.layout;
    if (c.paged) cache.block_table = d_table;
    cache.seq_lens = d_lens;
    cache.k_scale = d_ks;
    cache.v_scale = d_vs;
    cache.window_slots = h.window_slots;
    cache.sink_tokens = c.cyclic ? c.mask.sink_tokens : 0;
    args.beam_width = c.beam_width;
    if (c.beam_width > 1) args.cache_indirection = d_ind;
    args.num_splits = c.num_splits;
    args.max_seq_len = c.max_seq_len;
    args.deterministic = c.deterministic;
  }

  // Poisons the device outputs again (NaN), stream-ordered.
  void poison(cudaStream_t stream) {
    ATTNKIT_CUDA_OK(cudaMemcpyAsync(d_out.data(), out.view().data, d_out.bytes(),
                                    cudaMemcpyHostToDevice, stream));
    ATTNKIT_CUDA_OK(cudaMemcpyAsync(d_lse.data(), lse.view().data, d_lse.bytes(),
                                    cudaMemcpyHostToDevice, stream));
  }

  // Downloads the outputs (after the caller synchronized) and compares them with the oracle.
  void check() {
    SCOPED_TRACE(c.str());
    HostTensor got_out(c.dtype, {static_cast<int64_t>(c.seq_lens.size()), c.hq, c.head_dim});
    HostTensor got_lse(DType::kF32, {static_cast<int64_t>(c.seq_lens.size()), c.hq});
    d_out.download(got_out);
    d_lse.download(got_lse);
    Result ref, naive;
    oracle(c, h, q, ref, naive);
    const std::vector<double> got = got_out.to_double();
    ASSERT_FALSE(any_nan(got)) << "unwritten (NaN) output elements";
    const double err = max_abs_diff(got, ref.out);
    const double bound = 2.0 * max_abs_diff(naive.out, ref.out) + 1e-3;
    EXPECT_LE(err, bound) << "max |out - ref64|";
    if (c.with_lse) {
      const std::vector<double> lse_values = got_lse.to_double();
      ASSERT_FALSE(any_nan(lse_values)) << "unwritten (NaN) lse elements";
      const double lse_err = max_abs_diff(lse_values, ref.lse);
      EXPECT_LE(lse_err, 2.0 * max_abs_diff(naive.lse, ref.lse) + 1e-3) << "max |lse - ref64|";
    }
  }
};

// Runs the case on the GPU (outputs poisoned first) and compares with the oracle.
// The workspace's arrival counters are zero between calls (the merging CTAs reset them).
inline void expect_counters_zero(const DecodeWorkspace& ws) {
  std::vector<int32_t> counters(static_cast<size_t>(ws.counter_capacity()));
  ATTNKIT_CUDA_OK(cudaMemcpy(counters.data(), ws.counters(), counters.size() * sizeof(int32_t),
                             cudaMemcpyDeviceToHost));
  int64_t nonzero = 0;
  for (int32_t x : counters) nonzero += x != 0;
  EXPECT_EQ(nonzero, 0) << "arrival counters left non-zero in the workspace";
}

// Captures one decode call per case on `stream` into a graph (*graph) and instantiates it (*exec).
inline void capture_decode_calls(std::vector<std::unique_ptr<PreparedCase>>& prepared,
                                 cudaStream_t stream, cudaGraph_t* graph, cudaGraphExec_t* exec) {
  ATTNKIT_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (auto& pc : prepared) ASSERT_NO_THROW(decode(pc->spec, pc->args, stream));
  ATTNKIT_CUDA_OK(cudaStreamEndCapture(stream, graph));
  ATTNKIT_CUDA_OK(cudaGraphInstantiate(exec, *graph, 0));
}

// Poisons every case's outputs, replays the graph and checks every case against its oracle.
inline void replay_and_check(std::vector<std::unique_ptr<PreparedCase>>& prepared,
                             cudaGraphExec_t exec, cudaStream_t stream) {
  for (auto& pc : prepared) pc->poison(stream);
  ATTNKIT_CUDA_OK(cudaGraphLaunch(exec, stream));
  ATTNKIT_CUDA_OK(cudaStreamSynchronize(stream));
  for (auto& pc : prepared) pc->check();
}

inline void run_case(const DecodeCase& c, uint64_t salt) {
  SCOPED_TRACE(c.str());
  PreparedCase pc(c, salt);
  ASSERT_NO_THROW(decode(pc.spec, pc.args, nullptr));
  ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
  pc.check();
}

// The case over an HND cache, then over an NHD cache of the same contents (the salt draws the
// same values: the cache's logical slots are filled in one order whatever the layout).
inline void run_case_layouts(DecodeCase c, uint64_t salt) {
  for (KvCacheLayout layout : kBothLayouts) {
    c.layout = layout;
    run_case(c, salt);
  }
}

// Random lengths that include 1, a block boundary and its neighbours.
inline std::vector<int32_t> lengths(std::mt19937_64& rng, int rows, int32_t page, int32_t max_len) {
  std::vector<int32_t> out{1, page, page + 1, 2 * page - 1};
  std::uniform_int_distribution<int32_t> dist(1, max_len);
  while (static_cast<int>(out.size()) < rows) out.push_back(dist(rng));
  out.resize(rows);
  for (int32_t& len : out) len = std::min(len, max_len);
  return out;
}

}  // namespace attnkit::test
