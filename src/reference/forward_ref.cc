// Reference forward (in-flight batch) and merge_states. forward() is literally append_kv on every
// token, then prefill over the cache for the context requests and decode for the generation
// rows, with the rotated Q kept in the input dtype in between (as separate calls would).
#include <cmath>
#include <limits>
#include <vector>

#include "reference/ref_common.h"
#include "reference/reference.h"

namespace attnkit::reference {

void forward(const AttentionSpec& spec, const ForwardArgs& args, const detail::ForwardProblem&) {
  using internal::index_at;
  using internal::slice_rows;
  const int32_t num_context = args.num_context;
  const int32_t beam_width = args.beam_width;
  const int64_t num_requests = args.past_lens.shape[0];
  const int64_t num_tokens = args.qkv.shape[0];
  const int64_t num_context_tokens = index_at(args.cu_seqlens_q, num_context);

  // Positions and block-table rows of every token.
  std::vector<int32_t> positions(static_cast<size_t>(num_tokens));
  std::vector<int32_t> rows(static_cast<size_t>(num_tokens));
  for (int64_t i = 0; i < num_requests; ++i) {
    const int64_t begin = index_at(args.cu_seqlens_q, i);
    const int64_t end = index_at(args.cu_seqlens_q, i + 1);
    const int64_t past = index_at(args.past_lens, i);
    for (int64_t t = begin; t < end; ++t) {
      if (i < num_context) {
        positions[t] = static_cast<int32_t>(past + (t - begin));
        rows[t] = static_cast<int32_t>(i);
      } else {
        // Generation request: one token per beam, all at the same position.
        positions[t] = static_cast<int32_t>(past);
        rows[t] = static_cast<int32_t>(num_context + (i - num_context) * beam_width + (t - begin));
      }
    }
  }

  const DType dtype = args.qkv.dtype;
  std::vector<uint8_t> q_storage(static_cast<size_t>(num_tokens) * spec.num_q_heads *
                                 spec.head_dim * dtype_size(dtype));
  const TensorView q_rot(q_storage.data(), dtype, {num_tokens, spec.num_q_heads, spec.head_dim});

  AppendKvArgs append;
  append.qkv = args.qkv;
  append.qkv_bias = args.qkv_bias;
  append.positions = TensorView(positions.data(), DType::kInt32, {num_tokens});
  append.row_of_token = TensorView(rows.data(), DType::kInt32, {num_tokens});
  append.kv_cache = args.kv_cache;
  append.q_out = q_rot;
  internal::append_kv_impl(spec, append);

  if (num_context > 0) {
    KvCacheView context_cache = args.kv_cache;
    context_cache.seq_lens = slice_rows(args.kv_cache.seq_lens, 0, num_context);
    context_cache.block_table = slice_rows(args.kv_cache.block_table, 0, num_context);
    PrefillArgs prefill;
    prefill.q = slice_rows(q_rot, 0, num_context_tokens);
    prefill.cu_seqlens_q = slice_rows(args.cu_seqlens_q, 0, num_context + 1);
    prefill.kv_cache = &context_cache;
    prefill.out = slice_rows(args.out, 0, num_context_tokens);
    prefill.lse = slice_rows(args.lse, 0, num_context_tokens);
    internal::prefill_impl(spec, prefill);
  }

  const int64_t num_generation_rows = num_tokens - num_context_tokens;
  if (num_generation_rows > 0) {
    DecodeArgs decode;
    decode.kv_cache = args.kv_cache;
    decode.kv_cache.seq_lens = slice_rows(args.kv_cache.seq_lens, num_context, num_generation_rows);
    decode.kv_cache.block_table =
        slice_rows(args.kv_cache.block_table, num_context, num_generation_rows);
    if (!args.kv_cache.paged) {
      // A contiguous cache addresses row r as block r: move the base past the context rows.
      const int64_t skip = num_context * args.kv_cache.block_stride_bytes;
      decode.kv_cache.k_base = static_cast<uint8_t*>(args.kv_cache.k_base) + skip;
      decode.kv_cache.v_base = static_cast<uint8_t*>(args.kv_cache.v_base) + skip;
      decode.kv_cache.num_blocks -= num_context;
    }
    decode.q = slice_rows(q_rot, num_context_tokens, num_generation_rows);
    decode.beam_width = beam_width;
    decode.cache_indirection = args.cache_indirection;
    decode.out = slice_rows(args.out, num_context_tokens, num_generation_rows);
    decode.lse = slice_rows(args.lse, num_context_tokens, num_generation_rows);
    internal::decode_impl(spec, decode);
  }
}

void merge_states(const MergeStatesArgs& args, const detail::MergeStatesProblem&) {
  const int64_t n = args.out.shape[0];
  const int64_t heads = args.out.shape[1];
  const int64_t head_dim = args.out.shape[2];
  const auto lse_at = [](const TensorView& t, int64_t i, int64_t h) -> double {
    return static_cast<const float*>(t.data)[detail::offset_of(t, {i, h})];
  };
  const auto value_at = [](const TensorView& t, int64_t i, int64_t h, int64_t d) -> double {
    return detail::load_as_float(t.data, t.dtype, detail::offset_of(t, {i, h, d}));
  };
  std::vector<double> merged(static_cast<size_t>(head_dim));
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t h = 0; h < heads; ++h) {
      const double lse_a = lse_at(args.lse_a, i, h);
      const double lse_b = lse_at(args.lse_b, i, h);
      const double max_lse = std::max(lse_a, lse_b);
      double lse = -std::numeric_limits<double>::infinity();
      if (max_lse == -std::numeric_limits<double>::infinity()) {
        for (double& x : merged) x = 0.0;
      } else {
        // A side with lse = -inf has weight exp(-inf) = 0, whatever its (unread) output holds.
        const double w_a = std::exp(lse_a - max_lse);
        const double w_b = std::exp(lse_b - max_lse);
        const double sum = w_a + w_b;
        for (int64_t d = 0; d < head_dim; ++d) {
          const double a = w_a > 0.0 ? w_a * value_at(args.out_a, i, h, d) : 0.0;
          const double b = w_b > 0.0 ? w_b * value_at(args.out_b, i, h, d) : 0.0;
          merged[d] = (a + b) / sum;
        }
        lse = max_lse + std::log(sum);
      }
      internal::store_row(args.out, args.lse, i, static_cast<int32_t>(h), merged.data(), lse);
    }
  }
}

}  // namespace attnkit::reference
