// PLACEHOLDER: replaced by the reference backend.
#include "core/check.h"
#include "reference/reference.h"

namespace attnkit::reference {
void prefill(const AttentionSpec&, const PrefillArgs&, const detail::PrefillProblem&) {
  detail::fail("todo");
}
void decode(const AttentionSpec&, const DecodeArgs&, const detail::DecodeProblem&) {
  detail::fail("todo");
}
void append_kv(const AttentionSpec&, const AppendKvArgs&, const detail::AppendKvProblem&) {
  detail::fail("todo");
}
void forward(const AttentionSpec&, const ForwardArgs&, const detail::ForwardProblem&) {
  detail::fail("todo");
}
void merge_states(const MergeStatesArgs&, const detail::MergeStatesProblem&) {
  detail::fail("todo");
}
}  // namespace attnkit::reference
