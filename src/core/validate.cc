// PLACEHOLDER: replaced by the full validation layer.
#include "core/check.h"
#include "core/problem.h"

namespace attnkit::detail {
PrefillProblem validate_prefill(const AttentionSpec& spec, const PrefillArgs&) {
  spec.validate();
  fail("validate_prefill: todo");
}
DecodeProblem validate_decode(const AttentionSpec& spec, const DecodeArgs&) {
  spec.validate();
  fail("todo");
}
AppendKvProblem validate_append_kv(const AttentionSpec& spec, const AppendKvArgs&) {
  spec.validate();
  fail("todo");
}
ForwardProblem validate_forward(const AttentionSpec& spec, const ForwardArgs&) {
  spec.validate();
  fail("todo");
}
DenseProblem validate_dense(const AttentionSpec& spec, const DenseArgs&) {
  spec.validate();
  fail("todo");
}
MergeStatesProblem validate_merge_states(const MergeStatesArgs&) { fail("todo"); }
}  // namespace attnkit::detail
