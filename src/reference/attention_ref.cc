// Reference prefill (packed varlen and paged cache) and decode (paged / contiguous cache, beam
// indirection). fp64 accumulation; outputs rounded once to their dtype.
#include <vector>

#include "core/interrupt_poll.h"
#include "reference/ref_common.h"
#include "reference/reference.h"

namespace attnkit::reference {
namespace internal {

void prefill_impl(const AttentionSpec& spec, const PrefillArgs& args) {
  const LogitRule rule(spec);
  const int32_t group = spec.group_size();
  const int32_t head_dim = spec.head_dim;
  const int64_t batch = args.cu_seqlens_q.shape[0] - 1;
  const bool paged = args.kv_cache != nullptr;
  const CacheReader cache(paged ? *args.kv_cache : KvCacheView{});
  std::vector<double> q(static_cast<size_t>(head_dim)), out(static_cast<size_t>(head_dim));
  std::vector<double> k, v;
  detail::InterruptPoll poll_interrupt("prefill");

  for (int64_t i = 0; i < batch; ++i) {
    const int64_t q_begin = index_at(args.cu_seqlens_q, i);
    const int64_t num_q = index_at(args.cu_seqlens_q, i + 1) - q_begin;
    int64_t kv_begin = 0;
    int64_t kv_len = 0;
    if (paged) {
      kv_len = index_at(args.kv_cache->seq_lens, i);
    } else {
      kv_begin = index_at(args.cu_seqlens_kv, i);
      kv_len = index_at(args.cu_seqlens_kv, i + 1) - kv_begin;
    }
    if (num_q == 0) continue;
    // Bottom-right aligned: the queries are the last num_q of the kv_len positions.
    const int64_t first_position = kv_len - num_q;
    // Load the keys some query attends once (never the others: their blocks may be gone).
    const std::vector<int64_t> keys = rule.attended_keys(first_position, kv_len - 1, kv_len);
    k.assign(keys.size() * head_dim, 0.0);
    v.assign(keys.size() * head_dim, 0.0);
    for (int32_t kv_head = 0; kv_head < spec.num_kv_heads; ++kv_head) {
      for (size_t n = 0; n < keys.size(); ++n) {
        if (paged) {
          cache.load_k(i, keys[n], kv_head, &k[n * head_dim]);
          cache.load_v(i, keys[n], kv_head, &v[n * head_dim]);
        } else {
          load_head(args.k, kv_begin + keys[n], kv_head, &k[n * head_dim]);
          load_head(args.v, kv_begin + keys[n], kv_head, &v[n * head_dim]);
        }
      }
      for (int32_t h = kv_head * group; h < (kv_head + 1) * group; ++h) {
        for (int64_t t = 0; t < num_q; ++t) {
          poll_interrupt();
          load_head(args.q, q_begin + t, h, q.data());
          double lse = 0.0;
          attend_row(rule, q.data(), head_dim, h, first_position + t, keys, k.data(), v.data(),
                     out.data(), &lse);
          store_row(args.out, args.lse, q_begin + t, h, out.data(), lse);
        }
      }
    }
  }
}

void decode_impl(const AttentionSpec& spec, const DecodeArgs& args) {
  const LogitRule rule(spec);
  const int32_t group = spec.group_size();
  const int32_t head_dim = spec.head_dim;
  const int64_t num_rows = args.kv_cache.num_rows();
  const int32_t beam_width = args.beam_width;
  const TensorView& ind = args.cache_indirection;
  const CacheReader cache(args.kv_cache);
  std::vector<double> q(static_cast<size_t>(head_dim)), out(static_cast<size_t>(head_dim));
  std::vector<double> k, v;
  detail::InterruptPoll poll_interrupt("decode");

  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t kv_len = index_at(args.kv_cache.seq_lens, r);
    const int64_t position = kv_len - 1;
    const int64_t seq = r / beam_width;
    const int64_t beam = r % beam_width;
    // Row whose cache holds key position j for this beam.
    auto source_row = [&](int64_t j) -> int64_t {
      if (!ind.defined()) return r;
      const int64_t src_beam =
          static_cast<const int32_t*>(ind.data)[detail::offset_of(ind, {seq, beam, j})];
      return seq * beam_width + src_beam;
    };
    const std::vector<int64_t> keys = rule.attended_keys(position, position, kv_len);
    k.assign(keys.size() * head_dim, 0.0);
    v.assign(keys.size() * head_dim, 0.0);
    for (int32_t kv_head = 0; kv_head < spec.num_kv_heads; ++kv_head) {
      for (size_t n = 0; n < keys.size(); ++n) {
        cache.load_k(source_row(keys[n]), keys[n], kv_head, &k[n * head_dim]);
        cache.load_v(source_row(keys[n]), keys[n], kv_head, &v[n * head_dim]);
      }
      for (int32_t h = kv_head * group; h < (kv_head + 1) * group; ++h) {
        poll_interrupt();
        load_head(args.q, r, h, q.data());
        double lse = 0.0;
        attend_row(rule, q.data(), head_dim, h, position, keys, k.data(), v.data(), out.data(),
                   &lse);
        store_row(args.out, args.lse, r, h, out.data(), lse);
      }
    }
  }
}

}  // namespace internal

void prefill(const AttentionSpec& spec, const PrefillArgs& args, const detail::PrefillProblem&) {
  internal::prefill_impl(spec, args);
}

void decode(const AttentionSpec& spec, const DecodeArgs& args, const detail::DecodeProblem&) {
  internal::decode_impl(spec, args);
}

}  // namespace attnkit::reference
