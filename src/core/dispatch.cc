// Entry points: validate, pick the backend (docs/configuration.md), run. An explicit backend that
// cannot serve the call raises; only kAuto chooses.
#include <string>

#include "attnkit/attention.h"
#include "core/check.h"
#include "core/problem.h"
#include "cuda/cuda_backend.h"
#include "reference/reference.h"

namespace attnkit {
namespace {

enum class Route { kReference, kCudaVanilla, kCudaFused };

// `fused_reason` is "" when the fused kernels serve the call.
Route choose_route(Backend requested, const Device& device, const std::string& what,
                   const std::string& fused_reason) {
  if (device.is_cpu()) {
    ATTNKIT_CHECK(requested != Backend::kFused, what,
                  ": backend 'fused' needs CUDA tensors; the tensors are on cpu (accepted on cpu: "
                  "'auto' or 'vanilla')");
    return Route::kReference;
  }
  switch (requested) {
    case Backend::kVanilla:
      return Route::kCudaVanilla;
    case Backend::kFused:
      ATTNKIT_CHECK(fused_reason.empty(), what,
                    ": backend 'fused' cannot serve this call: ", fused_reason);
      return Route::kCudaFused;
    case Backend::kAuto:
      break;
  }
  return fused_reason.empty() ? Route::kCudaFused : Route::kCudaVanilla;
}

}  // namespace

void prefill(const AttentionSpec& spec, const PrefillArgs& args, Stream stream) {
  const detail::PrefillProblem p = detail::validate_prefill(spec, args);
  const std::string reason =
      p.device.is_cuda() ? cuda::fused_prefill_unsupported(spec, p) : std::string();
  switch (choose_route(spec.backend, p.device, "prefill", reason)) {
    case Route::kReference:
      return reference::prefill(spec, args, p);
    case Route::kCudaVanilla:
      return cuda::vanilla_prefill(spec, args, p, stream);
    case Route::kCudaFused:
      return cuda::fused_prefill(spec, args, p, stream);
  }
}

void decode(const AttentionSpec& spec, const DecodeArgs& args, Stream stream) {
  const detail::DecodeProblem p = detail::validate_decode(spec, args);
  const std::string reason =
      p.device.is_cuda() ? cuda::fused_decode_unsupported(spec, p) : std::string();
  switch (choose_route(spec.backend, p.device, "decode", reason)) {
    case Route::kReference:
      return reference::decode(spec, args, p);
    case Route::kCudaVanilla:
      return cuda::vanilla_decode(spec, args, p, stream);
    case Route::kCudaFused:
      return cuda::fused_decode(spec, args, p, stream);
  }
}

void append_kv(const AttentionSpec& spec, const AppendKvArgs& args, Stream stream) {
  const detail::AppendKvProblem p = detail::validate_append_kv(spec, args);
  const std::string reason =
      p.device.is_cuda() ? cuda::fused_append_kv_unsupported(spec, p) : std::string();
  switch (choose_route(spec.backend, p.device, "append_kv", reason)) {
    case Route::kReference:
      return reference::append_kv(spec, args, p);
    case Route::kCudaVanilla:
      return cuda::vanilla_append_kv(spec, args, p, stream);
    case Route::kCudaFused:
      return cuda::fused_append_kv(spec, args, p, stream);
  }
}

void forward(const AttentionSpec& spec, const ForwardArgs& args, Stream stream) {
  const detail::ForwardProblem p = detail::validate_forward(spec, args);
  const std::string reason =
      p.device.is_cuda() ? cuda::fused_forward_unsupported(spec, p) : std::string();
  switch (choose_route(spec.backend, p.device, "forward", reason)) {
    case Route::kReference:
      return reference::forward(spec, args, p);
    case Route::kCudaVanilla:
      return cuda::forward(spec, args, p, /*fused=*/false, stream);
    case Route::kCudaFused:
      return cuda::forward(spec, args, p, /*fused=*/true, stream);
  }
}

void dense(const AttentionSpec& spec, const DenseArgs& args, Stream stream) {
  const detail::DenseProblem p = detail::validate_dense(spec, args);
  const std::string reason =
      p.device.is_cuda() ? cuda::fused_dense_unsupported(spec, p) : std::string();
  switch (choose_route(spec.backend, p.device, "dense", reason)) {
    case Route::kReference:
      return reference::dense(spec, args, p);
    case Route::kCudaVanilla:
      return cuda::vanilla_dense(spec, args, p, stream);
    case Route::kCudaFused:
      return cuda::fused_dense(spec, args, p, stream);
  }
}

void merge_states(const MergeStatesArgs& args, Stream stream) {
  const detail::MergeStatesProblem p = detail::validate_merge_states(args);
  if (p.device.is_cpu()) return reference::merge_states(args, p);
  cuda::merge_states(args, p, stream);
}

}  // namespace attnkit
