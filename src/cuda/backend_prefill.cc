// PLACEHOLDER for the fused context FMHA (prefill) and dense kernels.
#include "core/check.h"
#include "cuda/cuda_backend.h"

namespace attnkit::cuda {

std::string fused_prefill_unsupported(const AttentionSpec&, const detail::PrefillProblem&) {
  return "no fused prefill kernel in this build";
}
std::string fused_dense_unsupported(const AttentionSpec&, const detail::DenseProblem&) {
  return "no fused dense kernel in this build";
}
void fused_prefill(const AttentionSpec&, const PrefillArgs&, const detail::PrefillProblem&,
                   Stream) {
  throw Error("prefill: no fused kernel in this build");
}
void fused_dense(const AttentionSpec&, const DenseArgs&, const detail::DenseProblem&, Stream) {
  throw Error("dense: no fused kernel in this build");
}

}  // namespace attnkit::cuda
