// The reference ("vanilla" on CPU) backend: plain C++, fp64 accumulation, every feature of
// docs/semantics.md. It defines the semantics that every other backend is tested against.
// Calls arrive validated (src/core/validate.cc).
#pragma once

#include "attnkit/attention.h"
#include "core/problem.h"

namespace attnkit::reference {

void prefill(const AttentionSpec& spec, const PrefillArgs& args, const detail::PrefillProblem& p);
void decode(const AttentionSpec& spec, const DecodeArgs& args, const detail::DecodeProblem& p);
void append_kv(const AttentionSpec& spec, const AppendKvArgs& args,
               const detail::AppendKvProblem& p);
void forward(const AttentionSpec& spec, const ForwardArgs& args, const detail::ForwardProblem& p);
void dense(const AttentionSpec& spec, const DenseArgs& args, const detail::DenseProblem& p);
void merge_states(const MergeStatesArgs& args, const detail::MergeStatesProblem& p);

}  // namespace attnkit::reference
