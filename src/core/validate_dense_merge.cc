// Validation of dense() and merge_states(). See validate_util.h for the shared checks.
#include <cmath>
#include <limits>

#include "core/problem.h"
#include "core/validate_util.h"

namespace attnkit::detail {

DenseProblem validate_dense(const AttentionSpec& spec, const DenseArgs& args) {
  spec.validate();
  const Validator v("dense");
  v.check(spec.mask.kind == MaskKind::kNone, "spec.mask",
          "dense() has no mask: expected kind none, got ", mask_name(spec.mask.kind),
          " (use prefill() for causal or sliding-window attention)");
  v.check(!spec.alibi, "spec.alibi",
          "dense() does not support ALiBi (use prefill() with packed k / v)");
  const int32_t hq = spec.num_q_heads, hkv = spec.num_kv_heads, d = spec.head_dim;

  DenseProblem p;
  v.expect_given(args.q, "q");
  p.device = args.q.device;
  p.dtype = args.q.dtype;
  v.expect_float_dtype(args.q, "q");
  v.expect_shape(args.q, "q", {Dim("B"), Dim("Sq"), Dim("Hq", hq), Dim("D", d)});
  v.expect_layout(args.q, "q", Access::kInput);
  const int64_t batch = args.q.shape[0], seqlen_q = args.q.shape[1];
  const Dim b("B", batch);
  v.expect_given(args.k, "k");
  v.expect_dtype(args.k, "k", {p.dtype}, "the dtype of q");
  v.expect_shape(args.k, "k", {b, Dim("Skv"), Dim("Hkv", hkv), Dim("D", d)});
  v.expect_device(args.k, "k", p.device);
  v.expect_layout(args.k, "k", Access::kInput);
  const int64_t seqlen_kv = args.k.shape[1];
  v.expect_tensor(args.v, "v", {p.dtype}, {b, Dim("Skv", seqlen_kv), Dim("Hkv", hkv), Dim("D", d)},
                  p.device, Access::kInput, "the dtype of q");
  v.expect_tensor(args.out, "out", {p.dtype}, {b, Dim("Sq", seqlen_q), Dim("Hq", hq), Dim("D", d)},
                  p.device, Access::kOutput, "the dtype of q");
  p.has_lse = args.lse.defined();
  if (p.has_lse) {
    v.expect_tensor(args.lse, "lse", {DType::kF32}, {b, Dim("Sq", seqlen_q), Dim("Hq", hq)},
                    p.device, Access::kSmallOutput);
  }
  check_skip_args(v, args.skip_stats, 2, p.device, args.timestep, args.block_m, args.block_n);
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  v.check(batch <= kMax && seqlen_q <= kMax, "q", "B and Sq must fit in int32, got shape ",
          args.q.shape_str());
  v.check(seqlen_kv <= kMax, "k", "Skv must fit in int32, got shape ", args.k.shape_str());
  p.batch = static_cast<int32_t>(batch);
  p.seqlen_q = static_cast<int32_t>(seqlen_q);
  p.seqlen_kv = static_cast<int32_t>(seqlen_kv);
  return p;
}

MergeStatesProblem validate_merge_states(const MergeStatesArgs& args) {
  const Validator v("merge_states");
  MergeStatesProblem p;
  v.expect_given(args.out_a, "out_a");
  p.device = args.out_a.device;
  p.dtype = args.out_a.dtype;
  // Partial results are often kept in f32 (split-KV, context parallelism): f32 on every device.
  v.expect_dtype(args.out_a, "out_a", {DType::kF32, DType::kF16, DType::kBF16});
  v.expect_shape(args.out_a, "out_a", {Dim("N"), Dim("H"), Dim("D")});
  v.expect_layout(args.out_a, "out_a", Access::kInput);
  p.num_tokens = args.out_a.shape[0];
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  v.check(args.out_a.shape[1] <= kMax && args.out_a.shape[2] <= kMax, "out_a",
          "H and D must fit in int32, got shape ", args.out_a.shape_str());
  p.num_heads = static_cast<int32_t>(args.out_a.shape[1]);
  p.head_dim = static_cast<int32_t>(args.out_a.shape[2]);
  const Dim n("N", p.num_tokens), h("H", p.num_heads), dd("D", p.head_dim);
  v.expect_tensor(args.out_b, "out_b", {p.dtype}, {n, h, dd}, p.device, Access::kInput,
                  "the dtype of out_a");
  v.expect_tensor(args.out, "out", {p.dtype}, {n, h, dd}, p.device, Access::kOutput,
                  "the dtype of out_a");
  v.expect_tensor(args.lse_a, "lse_a", {DType::kF32}, {n, h}, p.device, Access::kSmallInput);
  v.expect_tensor(args.lse_b, "lse_b", {DType::kF32}, {n, h}, p.device, Access::kSmallInput);
  p.has_lse = args.lse.defined();
  if (p.has_lse) {
    v.expect_tensor(args.lse, "lse", {DType::kF32}, {n, h}, p.device, Access::kSmallOutput);
  }
  return p;
}

}  // namespace attnkit::detail
