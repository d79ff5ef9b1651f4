// Internal helpers of the reference backend: strided index reads, KV-cache reads through the one
// shared accessor (KvLayout), and the fp64 attention of one query row (docs/semantics.md).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "attnkit/attention.h"
#include "core/element.h"
#include "core/kv_access.h"

namespace attnkit::reference::internal {

// Element i of a 1-D int32 tensor (host memory; any stride).
inline int64_t index_at(const TensorView& t, int64_t i) {
  return static_cast<const int32_t*>(t.data)[i * t.strides[0]];
}

// Sub-view of rows [begin, begin + count) along dim 0.
inline TensorView slice_rows(const TensorView& t, int64_t begin, int64_t count) {
  TensorView s = t;
  if (!t.defined()) return s;
  s.data = static_cast<uint8_t*>(t.data) +
           begin * t.strides[0] * static_cast<int64_t>(dtype_size(t.dtype));
  s.shape[0] = count;
  return s;
}

// Cache scale of KV head `head`: 1 when not given, [1] per tensor, [Hkv] per head.
inline float kv_scale(const TensorView& scale, int32_t head) {
  if (!scale.defined()) return 1.0f;
  const int64_t i = scale.numel() == 1 ? 0 : head;
  return static_cast<const float*>(scale.data)[i * scale.strides[0]];
}

// Reads K and V of the cache: x = float(stored) * scale in float32, exactly as the kernels do.
class CacheReader {
 public:
  explicit CacheReader(const KvCacheView& view)
      : layout_(detail::make_kv_layout(view)), view_(view) {}

  void load_k(int64_t row, int64_t position, int32_t head, double* out) const {
    load(layout_.k_ptr(row, position, head), kv_scale(view_.k_scale, head), out);
  }
  void load_v(int64_t row, int64_t position, int32_t head, double* out) const {
    load(layout_.v_ptr(row, position, head), kv_scale(view_.v_scale, head), out);
  }
  const detail::KvLayout& layout() const { return layout_; }

 private:
  void load(const uint8_t* ptr, float scale, double* out) const {
    for (int32_t d = 0; d < layout_.head_dim; ++d) {
      out[d] = detail::load_as_float(ptr, view_.dtype, d) * scale;
    }
  }
  detail::KvLayout layout_;
  KvCacheView view_;
};

// Everything that turns q.k into a masked logit, per query head.
struct LogitRule {
  double scale = 1.0;
  double softcap = 0.0;              // 0: off
  std::vector<double> alibi_slopes;  // empty: no ALiBi
  MaskSpec mask{};

  explicit LogitRule(const AttentionSpec& spec) : scale(spec.effective_scale()) {
    softcap = spec.logit_softcap;
    mask = spec.mask;
    if (spec.alibi) {
      const std::vector<float> slopes =
          spec.alibi_slopes.empty() ? default_alibi_slopes(spec.num_q_heads) : spec.alibi_slopes;
      alibi_slopes.assign(slopes.begin(), slopes.end());
    }
  }

  bool attends(int64_t p, int64_t j) const {
    switch (mask.kind) {
      case MaskKind::kNone:
        return true;
      case MaskKind::kCausal:
        return j <= p;
      case MaskKind::kSlidingWindow:
        return j <= p && (j > p - mask.window || j < mask.sink_tokens);
    }
    return false;
  }

  // Order: q.k * scale, soft-cap, + ALiBi bias; the mask is applied by the caller.
  double logit(double dot, int32_t head, int64_t p, int64_t j) const {
    double x = dot * scale;
    if (softcap > 0.0) x = softcap * std::tanh(x / softcap);
    if (!alibi_slopes.empty()) x += alibi_slopes[head] * static_cast<double>(j - p);
    return x;
  }

  // The key positions in [0, kv_len) that some query at a position in [first, last] attends, in
  // increasing order (which keys to load): never more than the sinks, the window and the queries
  // under a sliding window, however long the row (a cyclic cache's row may be INT32_MAX long).
  std::vector<int64_t> attended_keys(int64_t first, int64_t last, int64_t kv_len) const {
    std::vector<int64_t> keys;
    const int64_t end = mask.kind == MaskKind::kNone ? kv_len : std::min(kv_len, last + 1);
    int64_t window_begin = 0;
    if (mask.kind == MaskKind::kSlidingWindow) {
      const int64_t sinks = std::min<int64_t>(mask.sink_tokens, end);
      for (int64_t j = 0; j < sinks; ++j) keys.push_back(j);
      window_begin = std::max<int64_t>(sinks, first - mask.window + 1);
    }
    for (int64_t j = window_begin; j < end; ++j) keys.push_back(j);
    return keys;
  }
};

// Attention of query vector q (head `head`, position p) over the keys at `positions` (in
// increasing order) in fp64. k / v hold the key/value of positions[i] at
// [i * head_dim, (i + 1) * head_dim); only attended keys are read. A row with no attended key
// gives zeros and lse = -inf.
inline void attend_row(const LogitRule& rule, const double* q, int32_t head_dim, int32_t head,
                       int64_t p, const std::vector<int64_t>& positions, const double* k,
                       const double* v, double* out, double* lse) {
  std::vector<size_t> keys;
  std::vector<double> logits;
  for (size_t i = 0; i < positions.size(); ++i) {
    const int64_t j = positions[i];
    if (!rule.attends(p, j)) continue;
    const double* kj = k + i * head_dim;
    double dot = 0.0;
    for (int32_t d = 0; d < head_dim; ++d) dot += q[d] * kj[d];
    keys.push_back(i);
    logits.push_back(rule.logit(dot, head, p, j));
  }
  for (int32_t d = 0; d < head_dim; ++d) out[d] = 0.0;
  if (keys.empty()) {
    *lse = -std::numeric_limits<double>::infinity();
    return;
  }
  double max_logit = -std::numeric_limits<double>::infinity();
  for (double x : logits) max_logit = std::max(max_logit, x);
  double sum = 0.0;
  for (size_t i = 0; i < keys.size(); ++i) {
    const double w = std::exp(logits[i] - max_logit);
    sum += w;
    const double* vj = v + keys[i] * head_dim;
    for (int32_t d = 0; d < head_dim; ++d) out[d] += w * vj[d];
  }
  for (int32_t d = 0; d < head_dim; ++d) out[d] /= sum;
  *lse = max_logit + std::log(sum);
}

// Stores one row result: out[token, head, :] rounded to its dtype and lse[token, head] (float).
inline void store_row(const TensorView& out, const TensorView& lse, int64_t token, int32_t head,
                      const double* values, double row_lse) {
  const int64_t base = detail::offset_of(out, {token, head, 0});
  for (int64_t d = 0; d < out.shape[2]; ++d) {
    detail::store_from_float(out.data, out.dtype, base + d * out.strides[2],
                             static_cast<float>(values[d]));
  }
  if (lse.defined()) {
    static_cast<float*>(lse.data)[detail::offset_of(lse, {token, head})] =
        static_cast<float>(row_lse);
  }
}

// Loads q[token, head, :] as doubles.
inline void load_head(const TensorView& t, int64_t token, int32_t head, double* out) {
  const int64_t base = detail::offset_of(t, {token, head, 0});
  for (int64_t d = 0; d < t.shape[2]; ++d) {
    out[d] = detail::load_as_float(t.data, t.dtype, base + d * t.strides[2]);
  }
}

// Implementations without the Problem (forward() composes them on sub-views).
void prefill_impl(const AttentionSpec& spec, const PrefillArgs& args);
void decode_impl(const AttentionSpec& spec, const DecodeArgs& args);
void append_kv_impl(const AttentionSpec& spec, const AppendKvArgs& args);

}  // namespace attnkit::reference::internal
