// Entry points: validate, pick the backend (docs/configuration.md), run. An explicit backend that
// cannot serve the call raises; only kAuto chooses. CUDA calls in checked mode synchronize and
// raise a recorded device fault at once (docs/safety.md).
#include <new>
#include <string>

#include "attnkit/attention.h"
#include "core/check.h"
#include "core/device_checks.h"
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

// Runs the route's backend. The reference's scratch memory grows with the call: a host that
// cannot give it is an Error like any other, not a std::bad_alloc.
template <typename Reference, typename CudaVanilla, typename CudaFused>
void run_route(Route route, const char* op, bool checked, Stream stream, Reference reference,
               CudaVanilla cuda_vanilla, CudaFused cuda_fused) {
  const bool check = detail::checked_call(checked);  // an invalid ATTNKIT_CHECKED raises here
  if (route == Route::kReference) {
    try {
      reference();
    } catch (const std::bad_alloc&) {
      detail::fail(op, ": the reference backend could not allocate its host scratch memory");
    }
    return;
  }
  const cuda::CudaCallScope call;  // the current device, read once for the call's launches
  if (route == Route::kCudaVanilla) {
    cuda_vanilla();
  } else {
    cuda_fused();
  }
  if (check) detail::check_after_cuda_call(op, stream);
}

}  // namespace

void prefill(const AttentionSpec& spec, const PrefillArgs& args, Stream stream) {
  const detail::PrefillProblem p = detail::validate_prefill(spec, args);
  const std::string reason =
      p.device.is_cuda() ? cuda::fused_prefill_unsupported(spec, p) : std::string();
  const Route route = choose_route(spec.backend, p.device, "prefill", reason);
  // fp8 q has the FP8 kernel alone (the vanilla kernels read 16-bit q): no other route.
  ATTNKIT_CHECK(p.dtype != DType::kFp8E4M3 || route == Route::kCudaFused,
                "prefill: fp8_e4m3 q runs on the fused FP8 kernel only (backend 'auto' or "
                "'fused'), which ",
                reason.empty() ? std::string("backend 'vanilla' does not select")
                               : "cannot serve this call: " + reason);
  // auto does not take a skip-softmax call to the vanilla kernels, which do not skip.
  ATTNKIT_CHECK(
      route != Route::kCudaVanilla || !spec.skip_softmax || spec.backend == Backend::kVanilla,
      "prefill: skip_softmax runs on the fused kernels, which cannot serve this call: ", reason);
  run_route(
      route, "prefill", args.checked, stream, [&] { reference::prefill(spec, args, p); },
      [&] { cuda::vanilla_prefill(spec, args, p, stream); },
      [&] { cuda::fused_prefill(spec, args, p, stream); });
}

void decode(const AttentionSpec& spec, const DecodeArgs& args, Stream stream) {
  const detail::DecodeProblem p = detail::validate_decode(spec, args);
  const std::string reason =
      p.device.is_cuda() ? cuda::fused_decode_unsupported(spec, p) : std::string();
  run_route(
      choose_route(spec.backend, p.device, "decode", reason), "decode", args.checked, stream,
      [&] { reference::decode(spec, args, p); },
      [&] { cuda::vanilla_decode(spec, args, p, stream); },
      [&] { cuda::fused_decode(spec, args, p, stream); });
}

void append_kv(const AttentionSpec& spec, const AppendKvArgs& args, Stream stream) {
  const detail::AppendKvProblem p = detail::validate_append_kv(spec, args);
  const std::string reason =
      p.device.is_cuda() ? cuda::fused_append_kv_unsupported(spec, p) : std::string();
  run_route(
      choose_route(spec.backend, p.device, "append_kv", reason), "append_kv", args.checked, stream,
      [&] { reference::append_kv(spec, args, p); },
      [&] { cuda::vanilla_append_kv(spec, args, p, stream); },
      [&] { cuda::fused_append_kv(spec, args, p, stream); });
}

void forward(const AttentionSpec& spec, const ForwardArgs& args, Stream stream) {
  const detail::ForwardProblem p = detail::validate_forward(spec, args);
  const std::string reason =
      p.device.is_cuda() ? cuda::fused_forward_unsupported(spec, p) : std::string();
  run_route(
      choose_route(spec.backend, p.device, "forward", reason), "forward", args.checked, stream,
      [&] { reference::forward(spec, args, p); },
      [&] { cuda::forward(spec, args, p, /*fused=*/false, stream); },
      [&] { cuda::forward(spec, args, p, /*fused=*/true, stream); });
}

void dense(const AttentionSpec& spec, const DenseArgs& args, Stream stream) {
  const detail::DenseProblem p = detail::validate_dense(spec, args);
  const std::string reason =
      p.device.is_cuda() ? cuda::fused_dense_unsupported(spec, p) : std::string();
  run_route(
      choose_route(spec.backend, p.device, "dense", reason), "dense", args.checked, stream,
      [&] { reference::dense(spec, args, p); }, [&] { cuda::vanilla_dense(spec, args, p, stream); },
      [&] { cuda::fused_dense(spec, args, p, stream); });
}

void merge_states(const MergeStatesArgs& args, Stream stream) {
  const detail::MergeStatesProblem p = detail::validate_merge_states(args);
  const auto cuda_merge = [&] { cuda::merge_states(args, p, stream); };
  run_route(
      p.device.is_cpu() ? Route::kReference : Route::kCudaFused, "merge_states", args.checked,
      stream, [&] { reference::merge_states(args, p); }, cuda_merge, cuda_merge);
}

}  // namespace attnkit
