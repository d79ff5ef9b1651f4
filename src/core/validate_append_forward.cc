// Validation of append_kv() and forward(). See validate_util.h for the shared checks.
#include <algorithm>
#include <limits>
#include <utility>
#include <vector>

#include "core/problem.h"
#include "core/validate_util.h"

namespace attnkit::detail {
namespace {

// The fused QKV input and its optional bias: [N, (Hq + 2 Hkv) D] and [(Hq + 2 Hkv) D].
void check_fused_qkv(const Validator& v, const AttentionSpec& spec, const TensorView& qkv,
                     const TensorView& bias) {
  const int64_t width = int64_t{spec.num_q_heads + 2 * spec.num_kv_heads} * spec.head_dim;
  v.expect_given(qkv, "qkv");
  v.expect_float_dtype(qkv, "qkv");
  v.expect_shape(qkv, "qkv", {Dim("num_tokens"), Dim("(Hq+2*Hkv)*D", width)});
  v.expect_layout(qkv, "qkv", Access::kInput);
  v.check(qkv.shape[0] <= std::numeric_limits<int32_t>::max(), "qkv",
          "num_tokens must fit in int32, got ", qkv.shape[0]);
  if (bias.defined()) {
    v.expect_given(bias, "qkv_bias");
    v.expect_dtype(bias, "qkv_bias", {qkv.dtype}, "the dtype of the input");
    v.expect_shape(bias, "qkv_bias", {Dim("(Hq+2*Hkv)*D", width)});
    v.expect_device(bias, "qkv_bias", qkv.device);
    v.expect_layout(bias, "qkv_bias", Access::kInput);
  }
}

// Host only: no two tokens write the same physical cache slot (the result would depend on the
// order of the writes). `slots` holds (block * tokens_per_block + offset, token).
void check_distinct_writes(const Validator& v, std::vector<std::pair<int64_t, int64_t>>& slots,
                           int32_t tokens_per_block, const std::string& name) {
  std::sort(slots.begin(), slots.end());
  for (size_t i = 1; i < slots.size(); ++i) {
    if (slots[i].first != slots[i - 1].first) continue;
    v.fail(name, "tokens ", slots[i - 1].second, " and ", slots[i].second,
           " write the same cache slot (block ", slots[i].first / tokens_per_block, ", offset ",
           slots[i].first % tokens_per_block, ")");
  }
}

}  // namespace

AppendKvProblem validate_append_kv(const AttentionSpec& spec, const AppendKvArgs& args) {
  spec.validate();
  const Validator v("append_kv");
  check_no_dense_only_options(v, spec);
  const int32_t hq = spec.num_q_heads, hkv = spec.num_kv_heads, d = spec.head_dim;

  AppendKvProblem p;
  p.fused_qkv = args.qkv.defined();
  if (p.fused_qkv) {
    for (const auto& [t, name] :
         {std::pair{&args.q, "q"}, std::pair{&args.k, "k"}, std::pair{&args.v, "v"}}) {
      v.check(!t->defined(), name,
              "must not be given together with qkv (give either the fused qkv or q, k and v)");
    }
    check_fused_qkv(v, spec, args.qkv, args.qkv_bias);
    p.device = args.qkv.device;
    p.dtype = args.qkv.dtype;
    p.num_tokens = args.qkv.shape[0];
  } else {
    v.check(args.q.defined() || args.k.defined() || args.v.defined(), "qkv",
            "required: give the fused qkv [num_tokens, (Hq+2*Hkv)*D] or all of q, k and v");
    v.expect_given(args.q, "q");
    v.expect_float_dtype(args.q, "q");
    v.expect_shape(args.q, "q", {Dim("num_tokens"), Dim("Hq", hq), Dim("D", d)});
    v.expect_layout(args.q, "q", Access::kInput);
    p.device = args.q.device;
    p.dtype = args.q.dtype;
    p.num_tokens = args.q.shape[0];
    const Dim tokens("num_tokens", p.num_tokens);
    v.expect_tensor(args.k, "k", {p.dtype}, {tokens, Dim("Hkv", hkv), Dim("D", d)}, p.device,
                    Access::kInput, "the dtype of q");
    v.expect_tensor(args.v, "v", {p.dtype}, {tokens, Dim("Hkv", hkv), Dim("D", d)}, p.device,
                    Access::kInput, "the dtype of q");
    if (args.qkv_bias.defined()) {
      const int64_t width = int64_t{hq + 2 * hkv} * d;
      v.expect_tensor(args.qkv_bias, "qkv_bias", {p.dtype}, {Dim("(Hq+2*Hkv)*D", width)}, p.device,
                      Access::kInput);
    }
  }
  p.has_bias = args.qkv_bias.defined();
  const Dim tokens("num_tokens", p.num_tokens);
  v.expect_tensor(args.positions, "positions", {DType::kInt32}, {tokens}, p.device,
                  Access::kSmallInput);
  v.expect_tensor(args.row_of_token, "row_of_token", {DType::kInt32}, {tokens}, p.device,
                  Access::kSmallInput);
  v.expect_tensor(args.q_out, "q_out", {p.dtype}, {tokens, Dim("Hq", hq), Dim("D", d)}, p.device,
                  Access::kOutput, "the dtype of the input");

  const KvCacheView& cache = args.kv_cache;
  const KvCacheFacts facts = check_kv_cache(v, cache, "kv_cache", spec, p.dtype, p.device, false);
  p.kv_dtype = cache.dtype;
  if (facts.host) {
    std::vector<std::pair<int64_t, int64_t>> written;
    written.reserve(static_cast<size_t>(p.num_tokens));
    for (int64_t t = 0; t < p.num_tokens; ++t) {
      const int32_t position = host_i32(args.positions, t);
      const int32_t row = host_i32(args.row_of_token, t);
      v.check(position >= 0, "positions", "values must be >= 0, got ", position, " for token ", t);
      v.check(row >= 0 && row < facts.rows, "row_of_token",
              "values must be block-table rows in [0, ", facts.rows, "), got ", row, " for token ",
              t);
      const int64_t slot = cache.slot_of(position);
      v.check(slot < facts.row_capacity, "positions", "token ", t, " at position ", position,
              " needs slot ", slot, " but a row of kv_cache holds ", facts.row_capacity, " slots");
      const int64_t block =
          checked_block_of(v, cache, "kv_cache", row, slot, "token " + std::to_string(t));
      written.emplace_back(block * cache.tokens_per_block + slot % cache.tokens_per_block, t);
    }
    check_distinct_writes(v, written, cache.tokens_per_block, "positions");
  }
  return p;
}

ForwardProblem validate_forward(const AttentionSpec& spec, const ForwardArgs& args) {
  spec.validate();
  const Validator v("forward");
  check_no_dense_only_options(v, spec);
  const int32_t hq = spec.num_q_heads, d = spec.head_dim;

  ForwardProblem p;
  check_fused_qkv(v, spec, args.qkv, args.qkv_bias);
  p.device = args.qkv.device;
  p.dtype = args.qkv.dtype;
  p.num_tokens = args.qkv.shape[0];
  p.has_lse = args.lse.defined();
  const Dim tokens("num_tokens", p.num_tokens);
  v.expect_tensor(args.out, "out", {p.dtype}, {tokens, Dim("Hq", hq), Dim("D", d)}, p.device,
                  Access::kOutput, "the dtype of qkv");
  if (p.has_lse) {
    v.expect_tensor(args.lse, "lse", {DType::kF32}, {tokens, Dim("Hq", hq)}, p.device,
                    Access::kSmallOutput);
  }
  if (args.workspace.defined()) {
    v.expect_tensor(args.workspace, "workspace", {DType::kInt8}, {Dim("bytes")}, p.device,
                    Access::kOutput);
  }
  v.check(args.num_splits >= 0, "num_splits", "must be >= 0 (0 = heuristic), got ",
          args.num_splits);
  v.check(!args.batch_invariant || args.num_splits == 0, "num_splits",
          "must be 0 with batch_invariant = true (the mode fixes the split length at 1024 keys), "
          "got ",
          args.num_splits);
  if (args.decode_workspace != nullptr) {
    v.check(args.decode_workspace->device() == p.device, "decode_workspace",
            "must be on the device of qkv (", p.device.str(), "), got one on ",
            args.decode_workspace->device().str());
  }

  // Request layout: always in host memory.
  v.check(args.beam_width >= 1, "beam_width", "must be >= 1, got ", args.beam_width);
  // The request layout drives the host-side split into prefill and decode: host memory always.
  for (const auto& [t, name] :
       {std::pair{&args.cu_seqlens_q, "cu_seqlens_q"}, std::pair{&args.past_lens, "past_lens"}}) {
    v.check(!t->defined() || t->device.is_cpu(), name,
            "must be in host memory (cpu) for every device of the other tensors, got ",
            t->device.str());
  }
  v.expect_tensor(args.cu_seqlens_q, "cu_seqlens_q", {DType::kInt32}, {Dim("num_requests+1")},
                  Device::cpu(), Access::kSmallInput);
  v.check(args.cu_seqlens_q.shape[0] >= 1, "cu_seqlens_q",
          "needs num_requests + 1 >= 1 entries, got shape ", args.cu_seqlens_q.shape_str());
  const int64_t requests = args.cu_seqlens_q.shape[0] - 1;
  v.check(requests <= std::numeric_limits<int32_t>::max(), "cu_seqlens_q", requests,
          " requests, more than int32 holds (shape ", args.cu_seqlens_q.shape_str(), ")");
  v.expect_tensor(args.past_lens, "past_lens", {DType::kInt32}, {Dim("num_requests", requests)},
                  Device::cpu(), Access::kSmallInput);
  v.check(args.num_context >= 0 && args.num_context <= requests, "num_context",
          "must be in [0, num_requests=", requests, "], got ", args.num_context);
  p.num_context = args.num_context;
  p.num_generation = static_cast<int32_t>(requests - args.num_context);
  check_cu_seqlens_values(v, args.cu_seqlens_q, "cu_seqlens_q", p.num_tokens,
                          "num_tokens = qkv.shape[0]");
  p.num_context_tokens = host_i32(args.cu_seqlens_q, args.num_context);
  const int64_t num_rows = int64_t{p.num_context} + int64_t{p.num_generation} * args.beam_width;
  v.check(num_rows <= std::numeric_limits<int32_t>::max(), "beam_width",
          "num_context + num_generation * beam_width = ", num_rows,
          " block-table rows, more than int32 holds");

  const KvCacheView& cache = args.kv_cache;
  const KvCacheFacts facts = check_kv_cache(v, cache, "kv_cache", spec, p.dtype, p.device, true);
  p.kv_dtype = cache.dtype;
  v.check(facts.rows == num_rows, "kv_cache.seq_lens", "expected shape [num_rows=", num_rows,
          "] (num_context + num_generation * beam_width = ", p.num_context, " + ", p.num_generation,
          " * ", args.beam_width, "), got ", cache.seq_lens.shape_str());
  check_no_beams_with_cyclic(v, facts, "kv_cache", args.beam_width, args.cache_indirection);

  // Row r's length after the step, from past_lens and cu_seqlens_q (host).
  auto request_of_row = [&](int64_t row) {
    return row < p.num_context ? row : p.num_context + (row - p.num_context) / args.beam_width;
  };
  auto new_tokens = [&](int64_t request) {
    return int64_t{host_i32(args.cu_seqlens_q, request + 1)} - host_i32(args.cu_seqlens_q, request);
  };
  auto expected_len = [&](int64_t row) {
    const int64_t request = request_of_row(row);
    return host_i32(args.past_lens, request) + (row < p.num_context ? new_tokens(request) : 1);
  };
  int64_t longest_generation = 0;
  for (int64_t i = 0; i < requests; ++i) {
    const int32_t past = host_i32(args.past_lens, i);
    const int64_t n = new_tokens(i);
    v.check(past >= 0, "past_lens", "values must be >= 0, got ", past, " for request ", i);
    if (i < p.num_context) {
      v.check(n >= 1, "cu_seqlens_q", "context request ", i, " has ", n,
              " tokens; a context chunk needs >= 1");
      check_cyclic_chunk(v, cache, spec, "cu_seqlens_q", n);
      p.max_context_len = std::max<int32_t>(p.max_context_len, static_cast<int32_t>(n));
    } else {
      v.check(n == args.beam_width, "cu_seqlens_q", "generation request ", i, " has ", n,
              " tokens; each generation request has exactly beam_width = ", args.beam_width);
      longest_generation = std::max<int64_t>(longest_generation, int64_t{past} + 1);
    }
    const int64_t total = past + (i < p.num_context ? n : 1);
    v.check(total <= std::numeric_limits<int32_t>::max(), "past_lens", "request ", i, " grows to ",
            total, " tokens, more than int32 holds");
    v.check(facts.cyclic || total <= facts.row_capacity, "past_lens", "request ", i, " grows to ",
            total, " tokens, more than the row capacity of kv_cache (", facts.row_capacity,
            " slots)");
    p.max_kv_len = std::max<int32_t>(p.max_kv_len, static_cast<int32_t>(total));
    if (i < p.num_context) {
      p.max_context_kv_len = std::max<int32_t>(p.max_context_kv_len, static_cast<int32_t>(total));
    }
  }

  if (args.cache_indirection.defined()) {
    v.expect_tensor(args.cache_indirection, "cache_indirection", {DType::kInt32},
                    {Dim("num_generation", p.num_generation), Dim("beam_width", args.beam_width),
                     Dim("max_seq")},
                    p.device, Access::kSmallInput);
    v.check(args.cache_indirection.shape[2] >= longest_generation, "cache_indirection",
            "expected max_seq >= ", longest_generation,
            " (the longest generation row after this step), got shape ",
            args.cache_indirection.shape_str());
  }

  if (facts.host) {
    for (int64_t r = 0; r < num_rows; ++r) {
      const int32_t len = host_i32(cache.seq_lens, r);
      v.check(len == expected_len(r), "kv_cache.seq_lens", "row ", r, " (request ",
              request_of_row(r), ") must hold past_lens + new tokens = ", expected_len(r), ", got ",
              len);
      check_row_blocks(v, cache, facts, "kv_cache", r, len);
    }
    // The new tokens of different rows must not land in one slot (e.g. beams that still share
    // their last block).
    std::vector<std::pair<int64_t, int64_t>> written;
    written.reserve(static_cast<size_t>(p.num_tokens));
    for (int64_t r = 0; r < num_rows; ++r) {
      const int64_t request = request_of_row(r);
      const int64_t past = host_i32(args.past_lens, request);
      const int64_t first_token = host_i32(args.cu_seqlens_q, request);
      const int64_t n = r < p.num_context ? new_tokens(request) : 1;
      const int64_t token0 =
          r < p.num_context ? first_token : first_token + (r - p.num_context) % args.beam_width;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t slot = cache.slot_of(past + i);
        const int64_t block =
            cache.paged ? host_i32(cache.block_table, r, slot / cache.tokens_per_block) : r;
        written.emplace_back(block * cache.tokens_per_block + slot % cache.tokens_per_block,
                             token0 + i);
      }
    }
    check_distinct_writes(v, written, cache.tokens_per_block, "kv_cache.block_table");
    if (args.cache_indirection.defined()) {
      check_indirection_values(v, args.cache_indirection, "cache_indirection", args.beam_width,
                               [&](int64_t row) { return expected_len(p.num_context + row); });
    }
  }
  return p;
}

}  // namespace attnkit::detail
