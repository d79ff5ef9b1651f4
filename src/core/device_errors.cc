// Device faults on the host: the messages of DeviceFaultError, check_device_errors() and the
// checked mode's environment switch (include/attnkit/device_errors.h, docs/safety.md).
#include "attnkit/device_errors.h"

#include <cctype>
#include <cstdlib>
#include <mutex>
#include <sstream>

#include "core/check.h"
#include "core/device_checks.h"
#include "cuda/cuda_backend.h"

namespace attnkit {

const char* fault_kind_name(FaultKind kind) {
  switch (kind) {
    case FaultKind::kNone:
      return "none";
    case FaultKind::kBlockId:
      return "block_id";
    case FaultKind::kPosition:
      return "position";
    case FaultKind::kSeqLen:
      return "seq_len";
    case FaultKind::kCuSeqlensOrder:
      return "cu_seqlens_order";
    case FaultKind::kCuSeqlensRange:
      return "cu_seqlens_range";
    case FaultKind::kIndirection:
      return "indirection";
    case FaultKind::kRowIndex:
      return "row_index";
  }
  return "unknown";
}

const char* fault_arg_name(FaultArg arg) {
  switch (arg) {
    case FaultArg::kNone:
      return "(no argument)";
    case FaultArg::kBlockTable:
      return "kv_cache.block_table";
    case FaultArg::kSeqLens:
      return "kv_cache.seq_lens";
    case FaultArg::kPositions:
      return "positions";
    case FaultArg::kRowOfToken:
      return "row_of_token";
    case FaultArg::kCuSeqlensQ:
      return "cu_seqlens_q";
    case FaultArg::kCuSeqlensKv:
      return "cu_seqlens_kv";
    case FaultArg::kCacheIndirection:
      return "cache_indirection";
  }
  return "(unknown argument)";
}

namespace {

const char* op_of(int32_t op) {
  if (op < 0 || op > static_cast<int32_t>(Op::kMergeStates)) return "(unknown op)";
  return op_name(static_cast<Op>(op));
}

// The words are written by kernels: print whatever they hold, never trust them as enum values.
std::string what_happened(const DeviceFault& f) {
  std::ostringstream out;
  const auto kind = static_cast<FaultKind>(f.kind);
  switch (kind) {
    case FaultKind::kBlockId:
      out << "row " << f.row << ", index " << f.index << " holds block " << f.value
          << (f.value == -1 ? " (an invalid entry)" : "")
          << ", read by the kernel; accepted block ids are 0 .. " << f.bound - 1;
      break;
    case FaultKind::kPosition:
      out << "token " << f.index << " (block-table row " << f.row << ") at position " << f.value
          << " needs a slot outside its row of " << f.bound << " slots";
      break;
    case FaultKind::kSeqLen:
      out << "row " << f.row << " holds " << f.value << " tokens; accepted 0 .. " << f.bound
          << " (the row capacity: max_blocks_per_seq x tokens_per_block)";
      break;
    case FaultKind::kCuSeqlensOrder:
      out << "entry " << f.index << " = " << f.value << " is below entry " << f.index - 1 << " = "
          << f.bound << " (must be non-decreasing)";
      break;
    case FaultKind::kCuSeqlensRange:
      out << "entry " << f.index << " = " << f.value << " is outside 0 .. " << f.bound
          << " (the packed tokens of the tensor)";
      break;
    case FaultKind::kIndirection:
      out << "row " << f.row << ", position " << f.index << " names beam " << f.value
          << "; accepted beams 0 .. " << f.bound - 1;
      break;
    case FaultKind::kRowIndex:
      out << "token " << f.index << " names block-table row " << f.value << "; accepted rows 0 .. "
          << f.bound - 1;
      break;
    default:
      out << "fault kind " << f.kind << " (row " << f.row << ", index " << f.index << ", value "
          << f.value << ", bound " << f.bound << ")";
      break;
  }
  return out.str();
}

// checked_mode_from_environment()'s parse, kept for the first call's answer or error.
struct EnvSetting {
  bool on = false;
  std::string error;
};

EnvSetting parse_checked_env(const char* value) {
  EnvSetting s;
  if (value == nullptr) return s;
  std::string v(value);
  for (char& c : v) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (v == "1" || v == "true" || v == "on" || v == "yes") {
    s.on = true;
  } else if (!(v.empty() || v == "0" || v == "false" || v == "off" || v == "no")) {
    s.error = detail::concat(
        "ATTNKIT_CHECKED: accepted 1, true, on, yes (checked mode) or 0, false, off, no, unset "
        "(off), got '",
        value, "'");
  }
  return s;
}

}  // namespace

std::string describe_device_fault(const DeviceFault& fault, const Device& device) {
  const unsigned long long count = fault.count == 0 ? 1 : fault.count;
  return detail::concat(op_of(fault.op), ": ", fault_arg_name(static_cast<FaultArg>(fault.arg)),
                        ": ", what_happened(fault), " (device fault on ", device.str(), "; ", count,
                        count == 1 ? " fault" : " faults",
                        " recorded since the last check, this one first; faulting rows are "
                        "written as zeros, nothing outside the tensors is touched)");
}

DeviceFaultError::DeviceFaultError(const DeviceFault& fault, const Device& device)
    : Error(describe_device_fault(fault, device)), fault_(fault), device_(device) {}

void check_device_errors(void* stream) {
  DeviceFault fault;
  int device = 0;
  if (cuda::take_device_fault(stream, "check_device_errors", /*capture_is_error=*/true, &fault,
                              &device)) {
    throw DeviceFaultError(fault, Device::cuda(device));
  }
}

bool checked_mode_from_environment() {
  static const EnvSetting setting = parse_checked_env(std::getenv("ATTNKIT_CHECKED"));
  if (!setting.error.empty()) throw Error(setting.error);
  return setting.on;
}

namespace detail {

bool parse_checked_mode(const char* value) {
  const EnvSetting s = parse_checked_env(value);
  if (!s.error.empty()) throw Error(s.error);
  return s.on;
}

void check_after_cuda_call(const char* op, void* stream) {
  DeviceFault fault;
  int device = 0;
  if (cuda::take_device_fault(stream, op, /*capture_is_error=*/false, &fault, &device)) {
    throw DeviceFaultError(fault, Device::cuda(device));
  }
}

}  // namespace detail
}  // namespace attnkit
