// Built instead of the CUDA backend when attnkit is configured without CUDA: every CUDA entry
// raises (dispatch only routes CUDA tensors here, so CPU-only users never reach these).
#include "core/check.h"
#include "core/decode_workspace_check.h"
#include "cuda/cuda_backend.h"

namespace attnkit::cuda {
namespace {
constexpr const char* kNoCuda =
    "attnkit was built without the CUDA backend (configure with ATTNKIT_WITH_CUDA=ON); CUDA "
    "tensors are not accepted";
[[noreturn]] void no_cuda() { throw Error(kNoCuda); }
}  // namespace

std::string fused_prefill_unsupported(const AttentionSpec&, const detail::PrefillProblem&) {
  return kNoCuda;
}
std::string fused_decode_unsupported(const AttentionSpec&, const detail::DecodeProblem&) {
  return kNoCuda;
}
std::string fused_append_kv_unsupported(const AttentionSpec&, const detail::AppendKvProblem&) {
  return kNoCuda;
}
std::string fused_dense_unsupported(const AttentionSpec&, const detail::DenseProblem&) {
  return kNoCuda;
}
std::string fused_prefill_kernel(const AttentionSpec&, const detail::PrefillProblem&, int32_t) {
  return "";
}
std::string fused_dense_kernel(const AttentionSpec&, const detail::DenseProblem&, int32_t) {
  return "";
}
std::string fused_forward_unsupported(const AttentionSpec&, const detail::ForwardProblem&) {
  return kNoCuda;
}
void fused_prefill(const AttentionSpec&, const PrefillArgs&, const detail::PrefillProblem&,
                   Stream) {
  no_cuda();
}
void fused_decode_check_workspace(const AttentionSpec&, const DecodeArgs&,
                                  const detail::DecodeProblem&, const char*) {
  no_cuda();
}
void fused_decode(const AttentionSpec&, const DecodeArgs&, const detail::DecodeProblem&, Stream,
                  Op) {
  no_cuda();
}
void fused_append_kv(const AttentionSpec&, const AppendKvArgs&, const detail::AppendKvProblem&,
                     Stream) {
  no_cuda();
}
void fused_dense(const AttentionSpec&, const DenseArgs&, const detail::DenseProblem&, Stream) {
  no_cuda();
}
void vanilla_prefill(const AttentionSpec&, const PrefillArgs&, const detail::PrefillProblem&,
                     Stream) {
  no_cuda();
}
void vanilla_decode(const AttentionSpec&, const DecodeArgs&, const detail::DecodeProblem&, Stream) {
  no_cuda();
}
void vanilla_append_kv(const AttentionSpec&, const AppendKvArgs&, const detail::AppendKvProblem&,
                       Stream) {
  no_cuda();
}
void vanilla_dense(const AttentionSpec&, const DenseArgs&, const detail::DenseProblem&, Stream) {
  no_cuda();
}
void forward(const AttentionSpec&, const ForwardArgs&, const detail::ForwardProblem&, bool,
             Stream) {
  no_cuda();
}
void merge_states(const MergeStatesArgs&, const detail::MergeStatesProblem&, Stream) { no_cuda(); }
std::vector<DeviceInfo> devices() { return {}; }
// Nothing runs on a device without CUDA: there is never a fault to report.
void note_cuda_call() {}
CudaCallScope::CudaCallScope() : previous_device_(-1) {}
CudaCallScope::~CudaCallScope() { (void)previous_device_; }
bool take_device_fault(Stream, const char*, bool, DeviceFault*, int*) { return false; }

}  // namespace attnkit::cuda

namespace attnkit {
// Without the CUDA backend a workspace cannot be created (its arguments are still checked).
DecodeWorkspace::DecodeWorkspace(const AttentionSpec& spec, int64_t max_rows, int32_t max_splits,
                                 Device device)
    : device_(device) {
  detail::decode_workspace_size(spec, max_rows, max_splits, device);
  throw Error(
      "DecodeWorkspace: attnkit was built without the CUDA backend (configure with "
      "ATTNKIT_WITH_CUDA=ON)");
}
DecodeWorkspace::~DecodeWorkspace() = default;
void DecodeWorkspace::reset(Stream) { throw Error("DecodeWorkspace: no CUDA backend"); }
}  // namespace attnkit
