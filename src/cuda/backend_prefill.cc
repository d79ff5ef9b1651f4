// PLACEHOLDER for the fused context FMHA (prefill) and dense kernels: replaced by the prefill
// issue's kernels.
#include "core/check.h"
#include "cuda/cuda_backend.h"

namespace attnkit::cuda {

std::string fused_prefill_unsupported(const AttentionSpec&, const detail::PrefillProblem&) {
  std::string fused_dense_unsupported(const AttentionSpec&, const detail::DenseProblem&) {
void fused_prefill(const AttentionSpec&, const PrefillArgs&, const detail::PrefillProblem&,
void fused_dense(const AttentionSpec&, const DenseArgs&, const detail::DenseProblem&, Stream) {

}  // namespace attnkit::cuda
