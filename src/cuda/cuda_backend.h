// The seam between the host-side dispatch (src/core/dispatch.cc) and the CUDA backend. Host-only
// declarations: no CUDA types. Without CUDA (ATTNKIT_WITH_CUDA off) src/cuda/no_cuda_stubs.cc
// defines these to throw. Every function receives a call already validated by
// src/core/validate.cc.
#pragma once

#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "attnkit/device_errors.h"
#include "attnkit/info.h"
#include "core/problem.h"

namespace attnkit::cuda {

// "" when the fused kernels serve the call, else why not (the reason `backend=fused` raises).
std::string fused_prefill_unsupported(const AttentionSpec& spec, const detail::PrefillProblem& p);
std::string fused_decode_unsupported(const AttentionSpec& spec, const detail::DecodeProblem& p);
std::string fused_append_kv_unsupported(const AttentionSpec& spec,
                                        const detail::AppendKvProblem& p);
std::string fused_dense_unsupported(const AttentionSpec& spec, const detail::DenseProblem& p);
// The kernel the fused context attention runs for sequences of `seqlen` tokens ("sm90", "m128w4",
// ...), "" where it does not serve the call.
std::string fused_prefill_kernel(const AttentionSpec& spec, const detail::PrefillProblem& p,
                                 int32_t seqlen);
std::string fused_dense_kernel(const AttentionSpec& spec, const detail::DenseProblem& p,
                               int32_t seqlen);

// Fused (optimized) kernels.
void fused_prefill(const AttentionSpec& spec, const PrefillArgs& args,
                   const detail::PrefillProblem& p, Stream stream);
// Throws (naming `what`) when args.workspace is given and too small for the fused call; writes
// nothing. forward() checks before it enqueues its first kernel.
void fused_decode_check_workspace(const AttentionSpec& spec, const DecodeArgs& args,
                                  const detail::DecodeProblem& p, const char* what);
// `op`: the call the decode serves, named by its device faults (forward() passes Op::kForward).
void fused_decode(const AttentionSpec& spec, const DecodeArgs& args, const detail::DecodeProblem& p,
                  Stream stream, Op op = Op::kDecode);
void fused_append_kv(const AttentionSpec& spec, const AppendKvArgs& args,
                     const detail::AppendKvProblem& p, Stream stream);
void fused_dense(const AttentionSpec& spec, const DenseArgs& args, const detail::DenseProblem& p,
                 Stream stream);

// Naive GPU kernels (scores materialized): backend=vanilla on CUDA tensors, and the GPU-side
// reference of the large gpu tests. They serve every feature the CPU reference serves.
void vanilla_prefill(const AttentionSpec& spec, const PrefillArgs& args,
                     const detail::PrefillProblem& p, Stream stream);
void vanilla_decode(const AttentionSpec& spec, const DecodeArgs& args,
                    const detail::DecodeProblem& p, Stream stream);
void vanilla_append_kv(const AttentionSpec& spec, const AppendKvArgs& args,
                       const detail::AppendKvProblem& p, Stream stream);
void vanilla_dense(const AttentionSpec& spec, const DenseArgs& args, const detail::DenseProblem& p,
                   Stream stream);
// forward(): append_kv, then prefill over the cache for the context part and decode for the
// generation part, each through the fused kernels (fused = true) or the naive ones.
std::string fused_forward_unsupported(const AttentionSpec& spec, const detail::ForwardProblem& p);
void forward(const AttentionSpec& spec, const ForwardArgs& args, const detail::ForwardProblem& p,
             bool fused, Stream stream);

void merge_states(const MergeStatesArgs& args, const detail::MergeStatesProblem& p, Stream stream);

// Device queries (empty / 0 without a driver).
std::vector<DeviceInfo> devices();

// Device faults (include/attnkit/device_errors.h). note_cuda_call() marks that a call reached the
// CUDA backend; until then take_device_fault() makes no CUDA call. take_device_fault()
// synchronizes `stream`, reads the status word of its device and, when a fault is recorded,
// clears the word, fills `fault` / `device` and returns true. A CUDA error throws Error prefixed
// by `what`; a capturing stream throws when capture_is_error, else returns false. Without CUDA:
// false.
void note_cuda_call();

// One entry-point call's work on the CUDA backend (core/dispatch.cc opens one around it): marks
// the call (note_cuda_call) and reads the calling thread's current device once, so that the
// launches of the call take it (and the device's fault word, fault_site) from here instead of
// asking the runtime again. The device is read at every call, never kept from one call to the
// next, so a caller that switches devices between calls is followed. Without CUDA: nothing.
class CudaCallScope {
 public:
  CudaCallScope();
  ~CudaCallScope();
  CudaCallScope(const CudaCallScope&) = delete;
  CudaCallScope& operator=(const CudaCallScope&) = delete;

 private:
  int previous_device_;
};
bool take_device_fault(Stream stream, const char* what, bool capture_is_error, DeviceFault* fault,
                       int* device);

}  // namespace attnkit::cuda
