// Validation of prefill() and decode(). See validate_util.h for the shared checks; values are
// read only from tensors in host memory (cpu).
#include <algorithm>
#include <limits>

#include "core/problem.h"
#include "core/validate_util.h"

namespace attnkit::detail {
namespace {

constexpr int64_t kMaxInt32 = std::numeric_limits<int32_t>::max();

// Packed-mode K/V lengths and the bottom-right alignment rule.
void check_packed_lengths(const Validator& v, const AttentionSpec& spec, const PrefillArgs& args,
                          int64_t batch) {
  for (int64_t i = 0; i < batch; ++i) {
    const int64_t n_q = host_i32(args.cu_seqlens_q, i + 1) - host_i32(args.cu_seqlens_q, i);
    const int64_t n_kv = host_i32(args.cu_seqlens_kv, i + 1) - host_i32(args.cu_seqlens_kv, i);
    // Queries sit at positions n_kv - n_q .. n_kv - 1; only an unmasked call (cross attention)
    // may have negative positions.
    v.check(n_q <= n_kv || spec.mask.kind == MaskKind::kNone, "cu_seqlens_q", "sequence ", i,
            " has ", n_q, " queries but ", n_kv, " keys; with the ", mask_name(spec.mask.kind),
            " mask the queries are the last keys (bottom-right aligned), so n_q <= n_kv is needed "
            "(only mask none accepts more queries than keys)");
  }
}

}  // namespace

PrefillProblem validate_prefill(const AttentionSpec& spec, const PrefillArgs& args) {
  spec.validate();
  const Validator v("prefill");
  check_no_dense_only_options(v, spec, /*allow_skip=*/true, /*allow_quant=*/true);
  // SAGE quantizes the call's own packed K and V per sequence (docs/diffusion.md) and walks the
  // key tiles as skip-softmax does.
  v.check(!spec.quant || args.kv_cache == nullptr, "spec.quant",
          "prefill() quantizes packed k / v (SAGE), not a kv_cache; unset kv_cache or quant");
  v.check(!spec.quant || spec.mask.kind != MaskKind::kSlidingWindow, "spec.quant",
          "prefill() quantizes (SAGE) under mask none or causal, got mask ",
          mask_name(spec.mask.kind));
  // Skip-softmax walks the key tiles of a query tile from the diagonal back (docs/diffusion.md);
  // a sliding window's walk (window, then sinks) has no skip rule defined.
  v.check(!spec.skip_softmax || spec.mask.kind != MaskKind::kSlidingWindow, "spec.skip_softmax",
          "prefill() skips tiles under mask none or causal, got mask ", mask_name(spec.mask.kind));
  v.check(!args.skip_stats.defined() || spec.mask.kind != MaskKind::kSlidingWindow, "skip_stats",
          "the skip-softmax statistics cover mask none or causal, got mask ",
          mask_name(spec.mask.kind));
  const int32_t hq = spec.num_q_heads, hkv = spec.num_kv_heads, d = spec.head_dim;

  PrefillProblem p;
  v.expect_given(args.q, "q");
  p.device = args.q.device;
  p.dtype = args.q.dtype;
  const bool fp8 = p.dtype == DType::kFp8E4M3;
  if (fp8) {
    v.check(p.device.is_cuda(), "q",
            "fp8_e4m3 queries run on cuda only (the FP8 kernel); the CPU reference takes f32, f16 "
            "or bf16 (dequantize first)");
  } else {
    v.expect_float_dtype(args.q, "q");
  }
  v.expect_shape(args.q, "q", {Dim("total_q"), Dim("Hq", hq), Dim("D", d)});
  v.expect_layout(args.q, "q", Access::kInput);
  p.total_q = args.q.shape[0];
  v.check(p.total_q <= kMaxInt32, "q", "total_q must fit in int32, got ", p.total_q);
  const Dim total_q("total_q", p.total_q);
  if (fp8) {
    v.expect_tensor(args.out, "out", {DType::kBF16, DType::kF16},
                    {total_q, Dim("Hq", hq), Dim("D", d)}, p.device, Access::kOutput, "fp8_e4m3 q");
    p.out_dtype = args.out.dtype;
  } else {
    v.expect_tensor(args.out, "out", {p.dtype}, {total_q, Dim("Hq", hq), Dim("D", d)}, p.device,
                    Access::kOutput, "the dtype of q");
    p.out_dtype = p.dtype;
  }
  p.has_lse = args.lse.defined();
  if (p.has_lse) {
    v.expect_tensor(args.lse, "lse", {DType::kF32}, {total_q, Dim("Hq", hq)}, p.device,
                    Access::kSmallOutput);
  }

  v.expect_tensor(args.cu_seqlens_q, "cu_seqlens_q", {DType::kInt32}, {Dim("B+1")}, p.device,
                  Access::kSmallInput);
  v.check(args.cu_seqlens_q.shape[0] >= 1, "cu_seqlens_q", "needs B + 1 >= 1 entries, got shape ",
          args.cu_seqlens_q.shape_str());
  const int64_t batch = args.cu_seqlens_q.shape[0] - 1;
  v.check(batch <= kMaxInt32, "cu_seqlens_q", "B = ", batch,
          " sequences, more than int32 holds (shape ", args.cu_seqlens_q.shape_str(), ")");
  p.batch = static_cast<int32_t>(batch);

  p.paged = args.kv_cache != nullptr;
  if (p.paged) {
    for (const auto& [t, name] : {std::pair{&args.k, "k"}, std::pair{&args.v, "v"},
                                  std::pair{&args.cu_seqlens_kv, "cu_seqlens_kv"}}) {
      v.check(!t->defined(), name,
              "must not be given together with kv_cache (packed mode: k, v, cu_seqlens_kv; "
              "paged mode: kv_cache)");
    }
    const KvCacheView& cache = *args.kv_cache;
    const KvCacheFacts facts = check_kv_cache(v, cache, "kv_cache", spec, p.dtype, p.device, true);
    p.kv_dtype = cache.dtype;
    v.check(
        cache.num_rows() == batch, "cu_seqlens_q", "expected num_rows + 1 = ", cache.num_rows() + 1,
        " entries (one row of kv_cache per sequence), got shape ", args.cu_seqlens_q.shape_str());
    if (p.device.is_cpu()) {
      p.max_seqlen_q = check_cu_seqlens_values(v, args.cu_seqlens_q, "cu_seqlens_q", p.total_q,
                                               "total_q = q.shape[0]");
      for (int64_t i = 0; i < batch; ++i) {
        const int64_t n_q = host_i32(args.cu_seqlens_q, i + 1) - host_i32(args.cu_seqlens_q, i);
        const int32_t kv_len = host_i32(cache.seq_lens, i);
        v.check(n_q <= kv_len, "cu_seqlens_q", "sequence ", i, " has ", n_q,
                " queries but kv_cache.seq_lens[", i, "] = ", kv_len,
                "; the cache must already hold the queries' own tokens (n_q <= seq_len)");
        check_cyclic_chunk(v, cache, spec, "cu_seqlens_q", n_q);
        check_row_blocks(v, cache, facts, "kv_cache", i, kv_len);
        p.max_seqlen_kv = std::max(p.max_seqlen_kv, kv_len);
      }
    }
  } else {
    v.expect_given(args.k, "k");
    v.expect_given(args.v, "v");
    v.expect_given(args.cu_seqlens_kv, "cu_seqlens_kv");
    v.expect_dtype(args.k, "k", {p.dtype}, "the dtype of q");
    v.expect_shape(args.k, "k", {Dim("total_kv"), Dim("Hkv", hkv), Dim("D", d)});
    p.total_kv = args.k.shape[0];
    const Dim total_kv("total_kv", p.total_kv);
    v.expect_device(args.k, "k", p.device);
    v.expect_layout(args.k, "k", Access::kInput);
    v.expect_tensor(args.v, "v", {p.dtype}, {total_kv, Dim("Hkv", hkv), Dim("D", d)}, p.device,
                    Access::kInput, "the dtype of q");
    v.check(p.total_kv <= kMaxInt32, "k", "total_kv must fit in int32, got ", p.total_kv);
    v.expect_tensor(args.cu_seqlens_kv, "cu_seqlens_kv", {DType::kInt32}, {Dim("B+1", batch + 1)},
                    p.device, Access::kSmallInput);
    p.kv_dtype = p.dtype;
    if (p.device.is_cpu()) {
      p.max_seqlen_q = check_cu_seqlens_values(v, args.cu_seqlens_q, "cu_seqlens_q", p.total_q,
                                               "total_q = q.shape[0]");
      p.max_seqlen_kv = check_cu_seqlens_values(v, args.cu_seqlens_kv, "cu_seqlens_kv", p.total_kv,
                                                "total_kv = k.shape[0]");
      check_packed_lengths(v, spec, args, batch);
    }
  }

  // The FP8 descales: fp8 q only; [1] or [B, Hkv] float32 on q's device.
  for (const auto& [t, name] :
       {std::pair{&args.q_descale, "q_descale"}, std::pair{&args.k_descale, "k_descale"},
        std::pair{&args.v_descale, "v_descale"}}) {
    if (!t->defined()) continue;
    v.check(fp8, name, "is taken with fp8_e4m3 q only, got q of dtype ", dtype_name(p.dtype));
    v.check(!p.paged || t == &args.q_descale, name,
            "must be absent in paged mode: the cache's k_scale / v_scale descale its codes");
    v.expect_dtype(*t, name, {DType::kF32});
    v.expect_device(*t, name, p.device);
    const bool per_tensor = t->ndim == 1 && t->shape[0] == 1;
    const bool per_head = t->ndim == 2 && t->shape[0] == batch && t->shape[1] == hkv;
    v.check(per_tensor || per_head, name, "expected shape [1] or [B, Hkv] = [", batch, ", ", hkv,
            "], got ", t->shape_str());
    v.check(per_tensor || (t->strides[1] == 1 && t->strides[0] == hkv), name,
            "a [B, Hkv] descale must be contiguous, got strides (", t->strides[0], ", ",
            t->strides[1], ")");
  }

  check_skip_args(v, args.skip_stats, 4, p.device, args.timestep, args.block_m, args.block_n);
  // max_seqlen_*: required on cuda (device lengths are not read back), an upper bound if given.
  v.check(args.max_seqlen_q >= 0, "max_seqlen_q", "must be >= 0, got ", args.max_seqlen_q);
  v.check(args.max_seqlen_kv >= 0, "max_seqlen_kv", "must be >= 0, got ", args.max_seqlen_kv);
  if (p.device.is_cuda()) {
    v.check(args.max_seqlen_q > 0, "max_seqlen_q",
            "required (> 0) for cuda tensors: cu_seqlens_q is not read back from the device");
    v.check(args.max_seqlen_kv > 0, "max_seqlen_kv",
            "required (> 0) for cuda tensors: the key lengths are not read back from the device");
    p.max_seqlen_q = args.max_seqlen_q;
    p.max_seqlen_kv = args.max_seqlen_kv;
  } else {
    v.check(args.max_seqlen_q == 0 || args.max_seqlen_q >= p.max_seqlen_q, "max_seqlen_q",
            "must bound the longest query sequence (", p.max_seqlen_q, ") or be 0, got ",
            args.max_seqlen_q);
    v.check(args.max_seqlen_kv == 0 || args.max_seqlen_kv >= p.max_seqlen_kv, "max_seqlen_kv",
            "must bound the longest key sequence (", p.max_seqlen_kv, ") or be 0, got ",
            args.max_seqlen_kv);
  }
  return p;
}

DecodeProblem validate_decode(const AttentionSpec& spec, const DecodeArgs& args) {
  spec.validate();
  const Validator v("decode");
  check_no_dense_only_options(v, spec);
  const int32_t hq = spec.num_q_heads, d = spec.head_dim;

  DecodeProblem p;
  v.expect_given(args.q, "q");
  p.device = args.q.device;
  p.dtype = args.q.dtype;
  v.expect_float_dtype(args.q, "q");
  v.expect_shape(args.q, "q", {Dim("num_rows"), Dim("Hq", hq), Dim("D", d)});
  v.expect_layout(args.q, "q", Access::kInput);
  p.num_rows = args.q.shape[0];
  v.check(p.num_rows <= kMaxInt32, "q", "num_rows = ", p.num_rows,
          " rows, more than int32 holds (shape ", args.q.shape_str(), ")");
  const Dim rows("num_rows", p.num_rows);
  v.expect_tensor(args.out, "out", {p.dtype}, {rows, Dim("Hq", hq), Dim("D", d)}, p.device,
                  Access::kOutput, "the dtype of q");
  p.has_lse = args.lse.defined();
  if (p.has_lse) {
    v.expect_tensor(args.lse, "lse", {DType::kF32}, {rows, Dim("Hq", hq)}, p.device,
                    Access::kSmallOutput);
  }

  const KvCacheView& cache = args.kv_cache;
  const KvCacheFacts facts = check_kv_cache(v, cache, "kv_cache", spec, p.dtype, p.device, true);
  p.kv_dtype = cache.dtype;
  v.check(cache.num_rows() == p.num_rows, "kv_cache.seq_lens",
          "expected shape [num_rows=", p.num_rows, "] (one entry per row of q), got ",
          cache.seq_lens.shape_str());

  v.check(args.beam_width >= 1, "beam_width", "must be >= 1, got ", args.beam_width);
  v.check(p.num_rows % args.beam_width == 0, "beam_width", "must divide num_rows (", p.num_rows,
          "), got ", args.beam_width);
  p.beam_width = args.beam_width;
  check_no_beams_with_cyclic(v, facts, "kv_cache", args.beam_width, args.cache_indirection);
  p.has_indirection = args.cache_indirection.defined();
  if (p.has_indirection) {
    v.expect_tensor(args.cache_indirection, "cache_indirection", {DType::kInt32},
                    {Dim("num_rows/beam_width", p.num_rows / args.beam_width),
                     Dim("beam_width", args.beam_width), Dim("max_seq")},
                    p.device, Access::kSmallInput);
  }
  v.check(args.num_splits >= 0, "num_splits", "must be >= 0 (0 = heuristic), got ",
          args.num_splits);
  v.check(!args.batch_invariant || args.num_splits == 0, "num_splits",
          "must be 0 with batch_invariant = true (the mode fixes the split length at 1024 keys), "
          "got ",
          args.num_splits);
  v.check(args.max_seq_len >= 0, "max_seq_len", "must be >= 0 (0 = the row capacity), got ",
          args.max_seq_len);
  if (args.workspace != nullptr) {
    v.check(args.workspace->device() == p.device, "workspace", "must be on the device of q (",
            p.device.str(), "), got one on ", args.workspace->device().str());
  }

  if (facts.host) {
    int32_t longest = 0;
    for (int64_t r = 0; r < p.num_rows; ++r) {
      const int32_t len = host_i32(cache.seq_lens, r);
      if (args.beam_width > 1) {
        const int64_t first = r - r % args.beam_width;
        v.check(len == host_i32(cache.seq_lens, first), "kv_cache.seq_lens",
                "the beams of one sequence must have equal lengths, got seq_lens[", first,
                "] = ", host_i32(cache.seq_lens, first), " and seq_lens[", r, "] = ", len);
      }
      check_row_blocks(v, cache, facts, "kv_cache", r, len);
      longest = std::max(longest, len);
    }
    v.check(args.max_seq_len == 0 || args.max_seq_len >= longest, "max_seq_len",
            "must bound kv_cache.seq_lens (longest ", longest, ") or be 0, got ", args.max_seq_len);
    if (p.has_indirection) {
      const TensorView& ind = args.cache_indirection;
      v.check(ind.shape[2] >= longest, "cache_indirection", "expected max_seq >= ", longest,
              " (the longest kv_cache.seq_lens), got shape ", ind.shape_str());
      check_indirection_values(v, ind, "cache_indirection", args.beam_width,
                               [&](int64_t row) { return host_i32(cache.seq_lens, row); });
    }
    p.max_seq_len = args.max_seq_len ? args.max_seq_len : longest;
  } else {
    const int64_t bound = std::min<int64_t>(facts.row_capacity, kMaxInt32);
    p.max_seq_len = args.max_seq_len ? args.max_seq_len : static_cast<int32_t>(bound);
  }
  return p;
}

}  // namespace attnkit::detail
