// Brute-force oracles for the reference-backend tests, written independently of src/reference:
// dense masked attention in fp64 with the full score matrix materialized, an explicit mask
// predicate, and a KV cache whose addressing is computed here (not through KvLayout).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "attnkit/attention.h"
#include "common/test_util.h"
#include "core/numerics.h"
#include "reference/reference.h"

namespace attnkit::test {

// ---- dense masked attention in fp64 -----------------------------------------------------------

inline bool oracle_mask_allows(const MaskSpec& mask, int64_t p, int64_t j) {
  if (mask.kind == MaskKind::kNone) return true;
  if (j > p) return false;
  if (mask.kind == MaskKind::kCausal) return true;
  const bool in_window = p - j < mask.window;  // W keys, the query's own position included
  const bool is_sink = j < mask.sink_tokens;
  return in_window || is_sink;
}

struct OracleProblem {
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  std::vector<double> q;             // [num_q, Hq, D]
  std::vector<double> k, v;          // [num_k, Hkv, D]; key j sits at position j
  std::vector<int64_t> q_positions;  // [num_q]
  MaskSpec mask{};
  double scale = 0.0;  // 0: 1/sqrt(D)
  double softcap = 0.0;
  std::vector<double> alibi_slopes;  // [Hq] or empty
  std::vector<int32_t> kv_head_of;   // optional [Hq]: KV head of each q head (default h/group)
};

struct OracleResult {
  std::vector<double> out;  // [num_q, Hq, D]
  std::vector<double> lse;  // [num_q, Hq]
};

inline OracleResult brute_force_attention(const OracleProblem& pr) {
  const int64_t hq = pr.num_q_heads, hkv = pr.num_kv_heads, d_ = pr.head_dim;
  const int64_t num_q = static_cast<int64_t>(pr.q_positions.size());
  const int64_t num_k = static_cast<int64_t>(pr.k.size()) / (hkv * d_);
  const double scale = pr.scale != 0.0 ? pr.scale : 1.0 / std::sqrt(static_cast<double>(d_));
  const double neg_inf = -std::numeric_limits<double>::infinity();
  OracleResult res;
  res.out.assign(num_q * hq * d_, 0.0);
  res.lse.assign(num_q * hq, neg_inf);
  // Full score matrix S[h][i][j].
  std::vector<double> scores(hq * num_q * num_k, neg_inf);
  for (int64_t h = 0; h < hq; ++h) {
    const int64_t kh = pr.kv_head_of.empty() ? h / (hq / hkv) : pr.kv_head_of[h];
    for (int64_t i = 0; i < num_q; ++i) {
      const int64_t p = pr.q_positions[i];
      for (int64_t j = 0; j < num_k; ++j) {
        double s = 0.0;
        for (int64_t d = 0; d < d_; ++d) {
          s += pr.q[(i * hq + h) * d_ + d] * pr.k[(j * hkv + kh) * d_ + d];
        }
        s *= scale;
        if (pr.softcap > 0.0) s = pr.softcap * std::tanh(s / pr.softcap);
        if (!pr.alibi_slopes.empty()) s += pr.alibi_slopes[h] * static_cast<double>(j - p);
        scores[(h * num_q + i) * num_k + j] = oracle_mask_allows(pr.mask, p, j) ? s : neg_inf;
      }
    }
  }
  // Without keys every row keeps its zeros and -inf (and `scores` is empty: no row to point at).
  if (num_k == 0) return res;
  for (int64_t h = 0; h < hq; ++h) {
    const int64_t kh = pr.kv_head_of.empty() ? h / (hq / hkv) : pr.kv_head_of[h];
    for (int64_t i = 0; i < num_q; ++i) {
      const double* row = &scores[(h * num_q + i) * num_k];
      double m = neg_inf;
      for (int64_t j = 0; j < num_k; ++j) m = std::max(m, row[j]);
      if (m == neg_inf) continue;  // no attended key: zeros, -inf
      double l = 0.0;
      for (int64_t j = 0; j < num_k; ++j) l += std::exp(row[j] - m);
      for (int64_t j = 0; j < num_k; ++j) {
        const double pj = std::exp(row[j] - m) / l;
        for (int64_t d = 0; d < d_; ++d) {
          res.out[(i * hq + h) * d_ + d] += pj * pr.v[(j * hkv + kh) * d_ + d];
        }
      }
      res.lse[i * hq + h] = m + std::log(l);
    }
  }
  return res;
}

// The naive computation in the input precision (docs/testing.md yardstick): float32 logits and
// softmax, P rounded to bf16 (or f16) before P*V, float32 accumulation, output rounded.
inline std::vector<double> naive_same_precision(const OracleProblem& pr, DType dtype) {
  auto round = [dtype](float x) {
    return dtype == DType::kBF16 ? numerics::bf16_bits_to_float(numerics::float_to_bf16_bits(x))
                                 : numerics::f16_bits_to_float(numerics::float_to_f16_bits(x));
  };
  const int64_t hq = pr.num_q_heads, hkv = pr.num_kv_heads, d_ = pr.head_dim;
  const int64_t num_q = static_cast<int64_t>(pr.q_positions.size());
  const int64_t num_k = static_cast<int64_t>(pr.k.size()) / (hkv * d_);
  const float scale =
      static_cast<float>(pr.scale != 0.0 ? pr.scale : 1.0 / std::sqrt(static_cast<double>(d_)));
  std::vector<double> out(num_q * hq * d_, 0.0);
  std::vector<float> s(num_k);
  for (int64_t h = 0; h < hq; ++h) {
    const int64_t kh = h / (hq / hkv);
    for (int64_t i = 0; i < num_q; ++i) {
      const int64_t p = pr.q_positions[i];
      float m = -INFINITY;
      for (int64_t j = 0; j < num_k; ++j) {
        float x = 0.0f;
        for (int64_t d = 0; d < d_; ++d) {
          x += static_cast<float>(pr.q[(i * hq + h) * d_ + d]) *
               static_cast<float>(pr.k[(j * hkv + kh) * d_ + d]);
        }
        x *= scale;
        if (pr.softcap > 0.0) {
          x = static_cast<float>(pr.softcap) * std::tanh(x / static_cast<float>(pr.softcap));
        }
        if (!pr.alibi_slopes.empty()) x += static_cast<float>(pr.alibi_slopes[h]) * (j - p);
        s[j] = oracle_mask_allows(pr.mask, p, j) ? x : -INFINITY;
        m = std::max(m, s[j]);
      }
      if (m == -INFINITY) continue;
      float l = 0.0f;
      for (int64_t j = 0; j < num_k; ++j) l += std::exp(s[j] - m);
      for (int64_t d = 0; d < d_; ++d) {
        float acc = 0.0f;
        for (int64_t j = 0; j < num_k; ++j) {
          acc += round(std::exp(s[j] - m)) * static_cast<float>(pr.v[(j * hkv + kh) * d_ + d]);
        }
        out[(i * hq + h) * d_ + d] = round(acc / l);
      }
    }
  }
  return out;
}

// Error bound of the reference against the fp64 oracle: the result is rounded once to its dtype
// (plus float32 noise).
inline double rounding_bound(DType dtype, double ref) {
  const double rel = dtype == DType::kBF16  ? std::ldexp(1.0, -8)
                     : dtype == DType::kF16 ? std::ldexp(1.0, -11)
                                            : 1e-6;
  return std::fabs(ref) * rel + 1e-6;
}

// max |a - b| over entries where both are finite, and whether the -inf pattern matches.
inline double max_abs_diff_lse(const std::vector<double>& a, const std::vector<double>& b,
                               bool* inf_pattern_matches) {
  double m = 0.0;
  *inf_pattern_matches = a.size() == b.size();
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const bool ia = std::isinf(a[i]) && a[i] < 0;
    const bool ib = std::isinf(b[i]) && b[i] < 0;
    if (ia != ib || std::isnan(a[i]) || std::isnan(b[i])) *inf_pattern_matches = false;
    if (!ia && !ib) m = std::max(m, std::fabs(a[i] - b[i]));
  }
  return m;
}

// ---- tensors ------------------------------------------------------------------------------------

inline HostTensor tensor_from(DType dtype, const std::vector<int64_t>& shape,
                              const std::vector<double>& values) {
  HostTensor t(dtype, shape);
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, static_cast<float>(values[i]));
  return t;
}

inline HostTensor int32_tensor(const std::vector<int32_t>& values) {
  HostTensor t(DType::kInt32, {static_cast<int64_t>(values.size())});
  std::copy(values.begin(), values.end(), t.data<int32_t>());
  return t;
}

inline std::vector<double> random_values(std::mt19937_64& rng, int64_t n, double lo, double hi) {
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> v(static_cast<size_t>(n));
  for (double& x : v) x = dist(rng);
  return v;
}

// Values as they read back after rounding to dtype.
inline std::vector<double> rounded_to(DType dtype, const std::vector<double>& values) {
  HostTensor t = tensor_from(dtype, {static_cast<int64_t>(values.size())}, values);
  return t.to_double();
}

// ---- a KV cache addressed independently of KvLayout -------------------------------------------

// Pool [num_blocks, 2, Hkv, T, D] (HND) or [num_blocks, 2, T, Hkv, D] (NHD); row r's logical
// slot s lives in block table[r][s / T].
class OracleKvCache {
 public:
  // Paged: `blocks_per_row` blocks of `tokens_per_block` per row, block ids shuffled, plus spare
  // blocks that no row uses. Unused storage is poisoned.
  static OracleKvCache paged(DType dtype, int32_t num_kv_heads, int32_t head_dim,
                             int32_t tokens_per_block, int32_t rows, int32_t blocks_per_row,
                             std::mt19937_64& rng, KvCacheLayout layout = KvCacheLayout::kHND) {
    OracleKvCache c(dtype, num_kv_heads, head_dim, tokens_per_block, rows * blocks_per_row + 3,
                    layout);
    c.paged_ = true;
    std::vector<int32_t> ids(static_cast<size_t>(c.num_blocks_));
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    c.block_table_ = HostTensor(DType::kInt32, {rows, blocks_per_row});
    for (int64_t i = 0; i < int64_t{rows} * blocks_per_row; ++i) {
      c.block_table_.data<int32_t>()[i] = ids[i];
    }
    c.seq_lens_ = HostTensor(DType::kInt32, {rows});
    return c;
  }
  // Contiguous: one block of `capacity` tokens per row (row r uses block r).
  static OracleKvCache contiguous(DType dtype, int32_t num_kv_heads, int32_t head_dim, int32_t rows,
                                  int32_t capacity, KvCacheLayout layout = KvCacheLayout::kHND) {
    OracleKvCache c(dtype, num_kv_heads, head_dim, capacity, rows, layout);
    c.paged_ = false;
    c.seq_lens_ = HostTensor(DType::kInt32, {rows});
    return c;
  }

  // Scales: one value (per tensor) or one per KV head.
  void set_scales(const std::vector<float>& k, const std::vector<float>& v) {
    k_scale_ = HostTensor(DType::kF32, {static_cast<int64_t>(k.size())});
    v_scale_ = HostTensor(DType::kF32, {static_cast<int64_t>(v.size())});
    std::copy(k.begin(), k.end(), k_scale_.data<float>());
    std::copy(v.begin(), v.end(), v_scale_.data<float>());
  }
  void make_cyclic(int32_t window_slots, int32_t sink_tokens) {
    window_slots_ = window_slots;
    sink_tokens_ = sink_tokens;
  }
  void set_seq_len(int64_t row, int32_t len) { seq_lens_.data<int32_t>()[row] = len; }
  int32_t& block_id(int64_t row, int64_t block) {
    return block_table_.data<int32_t>()[row * block_table_.view().shape[1] + block];
  }
  int32_t block_table_entry(int64_t row, int64_t block) const {
    return block_table_.data<int32_t>()[row * block_table_.view().shape[1] + block];
  }

  int64_t slot_of(int64_t position) const {
    if (window_slots_ == 0 || position < sink_tokens_) return position;
    return sink_tokens_ + (position - sink_tokens_) % window_slots_;
  }
  // Element index in the pool of (row, position, head, d), K (kv = 0) or V (kv = 1).
  int64_t element_index(int64_t row, int64_t position, int32_t head, int32_t d, int kv) const {
    const int64_t slot = slot_of(position);
    const int64_t block =
        paged_ ? block_table_.data<int32_t>()[row * block_table_.view().shape[1] + slot / tpb_]
               : row;
    return block_element(block, kv, head, static_cast<int32_t>(slot % tpb_), d);
  }
  KvCacheLayout layout() const { return layout_; }
  float scale(int kv, int32_t head) const {
    const HostTensor& s = kv == 0 ? k_scale_ : v_scale_;
    if (!s.view().defined()) return 1.0f;
    return s.data<float>()[s.numel() == 1 ? 0 : head];
  }
  // Stores x quantized with the cache scale: stored = round(float(x) / scale).
  void write(int64_t row, int64_t position, int32_t head, int kv, const double* x) {
    for (int32_t d = 0; d < d_; ++d) {
      pool_.set(element_index(row, position, head, d, kv),
                static_cast<float>(x[d]) / scale(kv, head));
    }
  }
  // Dequantized value: float(stored) * scale.
  double read(int64_t row, int64_t position, int32_t head, int32_t d, int kv) const {
    return pool_.get(element_index(row, position, head, d, kv)) * scale(kv, head);
  }
  // Dense [len, Hkv, D] K or V of one row (positions 0 .. len-1, dequantized).
  std::vector<double> dense(int64_t row, int64_t len, int kv) const {
    std::vector<double> out(static_cast<size_t>(len * hkv_ * d_));
    for (int64_t p = 0; p < len; ++p) {
      for (int32_t h = 0; h < hkv_; ++h) {
        for (int32_t d = 0; d < d_; ++d) out[(p * hkv_ + h) * d_ + d] = read(row, p, h, d, kv);
      }
    }
    return out;
  }
  uint8_t byte_at(int64_t element) const { return pool_.bytes()[element * dtype_size(dtype_)]; }

  // The same logical cache in `layout`: every block's stored elements (poison included) moved to
  // their place in the other order; tables, lengths, scales and the cyclic window copied.
  OracleKvCache relaid(KvCacheLayout layout) const {
    OracleKvCache c = *this;
    c.layout_ = layout;
    c.pool_ = HostTensor(dtype_, layout == KvCacheLayout::kNHD
                                     ? std::vector<int64_t>{num_blocks_, 2, tpb_, hkv_, d_}
                                     : std::vector<int64_t>{num_blocks_, 2, hkv_, tpb_, d_});
    const size_t elt = dtype_size(dtype_);
    auto* dst = c.pool_.data<uint8_t>();
    const auto* src = pool_.data<uint8_t>();
    for (int64_t b = 0; b < num_blocks_; ++b) {
      for (int kv = 0; kv < 2; ++kv) {
        for (int32_t h = 0; h < hkv_; ++h) {
          for (int32_t t = 0; t < tpb_; ++t) {
            for (int32_t d = 0; d < d_; ++d) {
              std::memcpy(dst + c.block_element(b, kv, h, t, d) * elt,
                          src + block_element(b, kv, h, t, d) * elt, elt);
            }
          }
        }
      }
    }
    return c;
  }
  // Element index in the pool of element d of head h at slot t of block b (K: kv = 0, V: 1).
  int64_t block_element(int64_t b, int kv, int32_t h, int32_t t, int32_t d) const {
    if (layout_ == KvCacheLayout::kNHD) return (((b * 2 + kv) * tpb_ + t) * hkv_ + h) * d_ + d;
    return (((b * 2 + kv) * hkv_ + h) * tpb_ + t) * d_ + d;
  }

  KvCacheView view() const {
    KvCacheView v;
    const int64_t elt = static_cast<int64_t>(dtype_size(dtype_));
    v.k_base = pool_.view().data;
    v.v_base = static_cast<uint8_t*>(pool_.view().data) + int64_t{hkv_} * tpb_ * d_ * elt;
    v.block_stride_bytes = 2 * int64_t{hkv_} * tpb_ * d_ * elt;
    v.num_blocks = num_blocks_;
    v.dtype = dtype_;
    v.num_kv_heads = hkv_;
    v.tokens_per_block = tpb_;
    v.head_dim = d_;
    v.paged = paged_;
    v.layout = layout_;
    if (paged_) v.block_table = block_table_.view();
    v.seq_lens = seq_lens_.view();
    if (k_scale_.view().defined()) v.k_scale = k_scale_.view();
    if (v_scale_.view().defined()) v.v_scale = v_scale_.view();
    v.window_slots = window_slots_;
    v.sink_tokens = sink_tokens_;
    return v;
  }
  HostTensor& pool() { return pool_; }
  const HostTensor& pool() const { return pool_; }

 private:
  OracleKvCache(DType dtype, int32_t hkv, int32_t d, int32_t tpb, int32_t num_blocks,
                KvCacheLayout layout)
      : dtype_(dtype),
        hkv_(hkv),
        d_(d),
        tpb_(tpb),
        num_blocks_(num_blocks),
        layout_(layout),
        pool_(dtype, layout == KvCacheLayout::kNHD
                         ? std::vector<int64_t>{num_blocks, 2, tpb, hkv, d}
                         : std::vector<int64_t>{num_blocks, 2, hkv, tpb, d}) {
    // NaN poison for float caches; int8 has no NaN, so an extreme value instead.
    pool_.fill(dtype == DType::kInt8 ? 127.0f : NAN);
  }
  DType dtype_;
  int32_t hkv_, d_, tpb_, num_blocks_;
  KvCacheLayout layout_ = KvCacheLayout::kHND;
  bool paged_ = true;
  HostTensor pool_;
  HostTensor block_table_;
  HostTensor seq_lens_;
  HostTensor k_scale_, v_scale_;
  int32_t window_slots_ = 0;
  int32_t sink_tokens_ = 0;
};

// ---- the calls under test ---------------------------------------------------------------------

// The tests go through these so that one switch moves them between the reference functions
// (called directly while the validators were unfinished) and the public entry points.
#ifndef ATTNKIT_TEST_CALL_REFERENCE_DIRECTLY
#define ATTNKIT_TEST_CALL_REFERENCE_DIRECTLY 0
#endif
namespace call {
#if ATTNKIT_TEST_CALL_REFERENCE_DIRECTLY
inline void prefill(const AttentionSpec& s, const PrefillArgs& a) {
  reference::prefill(s, a, detail::PrefillProblem{});
}
inline void decode(const AttentionSpec& s, const DecodeArgs& a) {
  reference::decode(s, a, detail::DecodeProblem{});
}
inline void append_kv(const AttentionSpec& s, const AppendKvArgs& a) {
  reference::append_kv(s, a, detail::AppendKvProblem{});
}
inline void forward(const AttentionSpec& s, const ForwardArgs& a) {
  reference::forward(s, a, detail::ForwardProblem{});
}
inline void merge_states(const MergeStatesArgs& a) {
  reference::merge_states(a, detail::MergeStatesProblem{});
}
#else
inline void prefill(const AttentionSpec& s, const PrefillArgs& a) { attnkit::prefill(s, a); }
inline void decode(const AttentionSpec& s, const DecodeArgs& a) { attnkit::decode(s, a); }
inline void append_kv(const AttentionSpec& s, const AppendKvArgs& a) { attnkit::append_kv(s, a); }
inline void forward(const AttentionSpec& s, const ForwardArgs& a) { attnkit::forward(s, a); }
inline void merge_states(const MergeStatesArgs& a) { attnkit::merge_states(a); }
#endif
}  // namespace call

// append_kv with fused input (and an optional bias); returns the rotated Q (NaN-poisoned first).
inline HostTensor run_append_kv(const AttentionSpec& spec, const HostTensor& qkv,
                                const std::vector<int32_t>& positions,
                                const std::vector<int32_t>& rows, const KvCacheView& cache,
                                const HostTensor* bias = nullptr) {
  const int64_t n = static_cast<int64_t>(positions.size());
  HostTensor q_out(qkv.dtype(), {n, spec.num_q_heads, spec.head_dim});
  q_out.fill(NAN);
  HostTensor pos = int32_tensor(positions), row = int32_tensor(rows);
  AppendKvArgs args;
  args.qkv = qkv;
  if (bias) args.qkv_bias = *bias;
  args.positions = pos;
  args.row_of_token = row;
  args.kv_cache = cache;
  args.q_out = q_out;
  call::append_kv(spec, args);
  return q_out;
}

}  // namespace attnkit::test
