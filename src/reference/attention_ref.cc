// Reference prefill (packed varlen and paged cache) and decode (paged / contiguous cache, beam
// indirection). fp64 accumulation; outputs rounded once to their dtype.
#include <algorithm>
#include <cmath>
#include <vector>

#include "core/interrupt_poll.h"
#include "reference/dense_ref.h"
#include "reference/ref_common.h"
#include "reference/reference.h"

namespace attnkit::reference {
namespace internal {

// prefill() with skip-softmax active or with SAGE quantization runs the tile-faithful walk of
// dense_attend_head per (sequence, query head): the call's block_m x block_n tiles, the key tiles
// of a query tile from its diagonal (or the last, partial one) back to the first, as the fused
// kernels walk them, and lambda from the sequence's own kv_len. SAGE quantizes each sequence's
// Q, K and V as dense() quantizes a batch element (docs/diffusion.md): K smoothed over the
// sequence's keys, Q and K per block of the sequence's tokens, V per channel. Every other call
// attends row by row.
void prefill_impl(const AttentionSpec& spec, const PrefillArgs& args) {
  const LogitRule rule(spec);
  const int32_t group = spec.group_size();
  const int32_t head_dim = spec.head_dim;
  const int64_t batch = args.cu_seqlens_q.shape[0] - 1;
  const bool paged = args.kv_cache != nullptr;
  const CacheReader cache(paged ? *args.kv_cache : KvCacheView{});
  const bool skip_open = spec.skip_softmax && spec.skip_softmax->active_at(args.timestep);
  SkipStats stats{0, 0, args.block_m, args.block_n};
  std::vector<double> q(static_cast<size_t>(head_dim)), out(static_cast<size_t>(head_dim));
  std::vector<double> k, v, q_rows, out_rows, lse_rows;
  detail::InterruptPoll poll_interrupt("prefill");
  const std::vector<float> ones(static_cast<size_t>(std::max<int64_t>(head_dim, 1)), 1.0f);
  std::vector<float> q_ones, k_ones;

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
    DenseTileRule tiles;
    tiles.block_m = args.block_m;
    tiles.block_n = args.block_n;
    tiles.softmax_scale = rule.scale;
    tiles.logit_softcap = rule.softcap;
    tiles.last_tile_first = true;
    tiles.causal = spec.mask.kind == MaskKind::kCausal;
    tiles.q_pos0 = first_position;
    const double lambda = skip_open ? spec.skip_softmax->lambda(kv_len) : 0.0;
    tiles.skip = lambda > 0.0;  // lambda 0 never skips: the plain call
    tiles.log_lambda = tiles.skip ? std::log(lambda) : 0.0;
    const bool sage = spec.quant.has_value();
    tiles.quantize_p = sage;
    const bool tiled = tiles.skip || sage;
    if (!tiles.skip) {
      for (int64_t m0 = 0; m0 < num_q; m0 += args.block_m) {
        stats.tiles_total +=
            spec.num_q_heads *
            visited_key_tiles(tiles, m0, std::min<int64_t>(args.block_m, num_q - m0), kv_len);
      }
    }
    // Load the keys some query attends once (never the others: their blocks may be gone).
    const std::vector<int64_t> keys = rule.attended_keys(first_position, kv_len - 1, kv_len);
    k.assign(keys.size() * head_dim, 0.0);
    v.assign(keys.size() * head_dim, 0.0);
    if (tiled) {
      q_rows.assign(static_cast<size_t>(num_q * head_dim), 0.0);
      out_rows.assign(q_rows.size(), 0.0);
      lse_rows.assign(static_cast<size_t>(num_q), 0.0);
      q_ones.assign(static_cast<size_t>(num_q), 1.0f);
      k_ones.assign(keys.size(), 1.0f);
    }
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
      // SAGE: the sequence's K and V of this head quantized (mask none or causal: the keys are
      // positions 0 .. kv_len - 1, all of them loaded).
      SageRows k_codes;
      SageColumns v_codes;
      if (sage && !keys.empty()) {
        std::vector<float> kf(k.begin(), k.end());
        const std::vector<float> mean =
            sage_channel_mean(kf, static_cast<int64_t>(keys.size()), head_dim);
        for (size_t j = 0; j < kf.size(); ++j) kf[j] -= mean[j % head_dim];
        k_codes = sage_quantize_rows(kf, static_cast<int64_t>(keys.size()), head_dim,
                                     spec.quant->k_block_size, spec.quant->dtype_qk);
        v_codes = sage_quantize_v(std::vector<float>(v.begin(), v.end()),
                                  static_cast<int64_t>(keys.size()), head_dim);
      }
      for (int32_t h = kv_head * group; h < (kv_head + 1) * group; ++h) {
        if (tiled) {
          // Mask none or causal (validated): the keys are positions 0 .. kv_len - 1.
          for (int64_t t = 0; t < num_q; ++t)
            load_head(args.q, q_begin + t, h, &q_rows[t * head_dim]);
          tiles.alibi_slope = rule.alibi_slopes.empty() ? 0.0 : rule.alibi_slopes[h];
          DenseTileCounts counts;
          if (sage) {
            const SageRows q_codes =
                sage_quantize_rows(std::vector<float>(q_rows.begin(), q_rows.end()), num_q,
                                   head_dim, spec.quant->q_block_size, spec.quant->dtype_qk);
            counts = dense_attend_head(q_codes.values.data(), q_codes.row_scale.data(),
                                       k_codes.values.data(), k_codes.row_scale.data(),
                                       v_codes.values.data(), v_codes.channel_scale.data(), num_q,
                                       static_cast<int64_t>(keys.size()), head_dim, tiles,
                                       out_rows.data(), lse_rows.data());
          } else {
            counts =
                dense_attend_head(q_rows.data(), q_ones.data(), k.data(), k_ones.data(), v.data(),
                                  ones.data(), num_q, static_cast<int64_t>(keys.size()), head_dim,
                                  tiles, out_rows.data(), lse_rows.data());
          }
          if (tiles.skip) {  // otherwise counted above, per query tile
            stats.tiles_total += counts.total;
            stats.tiles_skipped += counts.skipped;
          }
          for (int64_t t = 0; t < num_q; ++t) {
            store_row(args.out, args.lse, q_begin + t, h, &out_rows[t * head_dim], lse_rows[t]);
          }
          continue;
        }
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
  if (args.skip_stats.defined()) {
    int64_t* dst = static_cast<int64_t*>(args.skip_stats.data);
    const int64_t values[4] = {stats.tiles_total, stats.tiles_skipped, stats.block_m,
                               stats.block_n};
    for (int j = 0; j < 4; ++j) dst[j * args.skip_stats.strides[0]] = values[j];
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
