// The fused context FMHA (prefill) and the plain fused dense path: both run the portable
// prefill kernel family of src/cuda/prefill (dense = no mask, fixed lengths).
#include "cuda/cuda_backend.h"
#include "cuda/prefill/prefill_api.h"

namespace attnkit::cuda {

std::string fused_prefill_unsupported(const AttentionSpec& spec, const detail::PrefillProblem& p) {
  return prefill::prefill_unsupported(spec, p);
}
std::string fused_dense_unsupported(const AttentionSpec& spec, const detail::DenseProblem& p) {
  return prefill::dense_unsupported(spec, p);
}
std::string fused_prefill_kernel(const AttentionSpec& spec, const detail::PrefillProblem& p,
                                 int32_t seqlen) {
  return prefill::prefill_kernel_choice(spec, p, seqlen);
}
std::string fused_dense_kernel(const AttentionSpec& spec, const detail::DenseProblem& p,
                               int32_t seqlen) {
  return prefill::dense_kernel_choice(spec, p, seqlen);
}
void fused_prefill(const AttentionSpec& spec, const PrefillArgs& args,
                   const detail::PrefillProblem& p, Stream stream) {
  prefill::run_prefill(spec, args, p, stream);
}
void fused_dense(const AttentionSpec& spec, const DenseArgs& args, const detail::DenseProblem& p,
                 Stream stream) {
  prefill::run_dense(spec, args, p, stream);
}

}  // namespace attnkit::cuda
