// Build and device information, and the support matrix that `attnkit info` prints. The same
// functions that dispatch a call answer "is this supported" here.
#pragma once

#include <string>
#include <vector>

#include "attnkit/spec.h"
#include "attnkit/types.h"

namespace attnkit {

const char* version();
bool built_with_cuda();
std::string cuda_architectures();  // the architectures compiled in, e.g. "80;90a"; "" without CUDA

struct DeviceInfo {
  int ordinal = 0;
  std::string name;
  int cc_major = 0, cc_minor = 0;
  int sm_count = 0;
  size_t total_memory = 0;
  size_t l2_bytes = 0;
};
// CUDA devices visible to this process; empty without CUDA or without a driver/GPU.
std::vector<DeviceInfo> cuda_devices();

enum class Op : uint8_t { kPrefill, kDecode, kAppendKv, kForward, kDense, kMergeStates };
const char* op_name(Op op);

// One row of the support matrix: which backend serves `op` for q dtype / kv dtype / head_dim on
// `device`, and if not, why (empty reason = supported).
struct SupportQuery {
  Op op = Op::kPrefill;
  Backend backend = Backend::kFused;
  Device device{};
  DType q_dtype = DType::kBF16;
  DType kv_dtype = DType::kBF16;
  int32_t head_dim = 128;
};
// "" when supported, else the reason. Backend::kAuto answers for what auto would pick.
std::string unsupported_reason(const SupportQuery& query);
// The kernel the fused backend runs for a prefill (causal) or dense call of `seqlen` tokens a
// sequence: "sm90" (the Hopper warpgroup kernel) or a portable mma.sync tile ("m128w4", ...);
// "" for the other ops and where the fused backend does not serve the query. Dispatch uses the
// same selector.
std::string selected_kernel(const SupportQuery& query, int32_t seqlen = 4096);

}  // namespace attnkit
