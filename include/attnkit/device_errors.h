// Device faults: how a kernel reports device-resident metadata (block tables, seq_lens,
// positions, cu_seqlens, cache_indirection) that would steer it outside its tensors, and how the
// report reaches the caller (docs/safety.md).
//
// Host-side validation reads only host memory; metadata in device memory is checked by the
// kernels themselves. A guarded access that would leave its tensor is skipped (nothing is read or
// written outside the tensors, the faulting row's output is zeros) and the first such fault since
// the last check is kept in a small per-device status word, DeviceFault. Two ways to see it:
// - check_device_errors(stream): synchronizes the stream, reads the word, clears it and throws
//   DeviceFaultError naming the op, the argument, the row and the value. Nothing on the hot path
//   synchronizes: a serving engine calls it where it already waits for the device.
// - checked mode (ATTNKIT_CHECKED=1 in the environment, or the `checked` flag of a call's args):
//   every CUDA call synchronizes its stream when its work is enqueued and throws at once.
//
// Host-only header: plain integers, no CUDA types. The same struct is what the kernels write
// (src/cuda/common/device_fault.cuh).
#pragma once

#include <cstdint>
#include <string>

#include "attnkit/info.h"
#include "attnkit/types.h"

namespace attnkit {

// What was wrong with the value a kernel read from device memory.
enum class FaultKind : int32_t {
  kNone = 0,
  kBlockId = 1,         // a block-table entry outside [0, bound = num_blocks) (or -1) that is read
  kPosition = 2,        // a token's position needs a slot outside its row (bound = the capacity)
  kSeqLen = 3,          // a length < 0 or beyond the row's capacity (bound = the capacity)
  kCuSeqlensOrder = 4,  // cu_seqlens[index] = value < cu_seqlens[index - 1] = bound
  kCuSeqlensRange = 5,  // cu_seqlens[index] = value outside [0, bound = the packed extent]
  kIndirection = 6,     // a cache_indirection entry outside [0, bound = beam_width)
  kRowIndex = 7,        // a block-table row index (row_of_token) outside [0, bound = rows)
};

// The argument the value came from.
enum class FaultArg : int32_t {
  kNone = 0,
  kBlockTable = 1,        // kv_cache.block_table [rows, max_blocks]: row, index = the column
  kSeqLens = 2,           // kv_cache.seq_lens [rows]: row
  kPositions = 3,         // positions [num_tokens]: index = the token, row = its block-table row
  kRowOfToken = 4,        // row_of_token [num_tokens]: index = the token
  kCuSeqlensQ = 5,        // cu_seqlens_q [B + 1]: index = the entry, row = the sequence
  kCuSeqlensKv = 6,       // cu_seqlens_kv [B + 1]
  kCacheIndirection = 7,  // cache_indirection [S, beam, max_seq]: row = s * beam + b, index = t
};

// The per-device status word. state: 0 = no fault since the last check; 2 = a fault is recorded
// (1 while a kernel writes it). The first fault is kept whole; `count` counts all of them.
struct DeviceFault {
  int32_t state = 0;
  int32_t kind = 0;  // FaultKind
  int32_t op = 0;    // Op (attnkit/info.h) of the call that launched the kernel
  int32_t arg = 0;   // FaultArg
  int64_t row = 0;
  int64_t index = 0;
  int64_t value = 0;
  int64_t bound = 0;
  unsigned long long count = 0;
};
static_assert(sizeof(DeviceFault) == 56, "the kernels and the host share this layout");

const char* fault_kind_name(FaultKind kind);  // "block_id", "position", ...
const char* fault_arg_name(FaultArg arg);     // "kv_cache.block_table", "positions", ...

// Thrown by check_device_errors() and by checked calls for a recorded fault.
class DeviceFaultError : public Error {
 public:
  DeviceFaultError(const DeviceFault& fault, const Device& device);
  const DeviceFault& fault() const { return fault_; }
  const Device& device() const { return device_; }

 private:
  DeviceFault fault_;
  Device device_;
};

// The message of a DeviceFaultError, e.g. "decode: kv_cache.block_table: row 3, index 7 holds
// block 10000, outside the pool's blocks 0 .. 7 (device fault on cuda:0; 1 fault recorded since
// the last check; faulting rows are written as zeros)".
std::string describe_device_fault(const DeviceFault& fault, const Device& device);

// Synchronizes `stream` (a cudaStream_t as void*; nullptr = the legacy default stream), reads the
// status word of the stream's device and, when a fault was recorded since the last check, clears
// the word and throws DeviceFaultError. An asynchronous CUDA error of earlier work (a kernel that
// crashed; the CUDA context is then unusable) throws Error naming it. Returns at once, without a
// CUDA call, in a build without CUDA or when no CUDA tensor has reached attnkit in this process.
// Throws Error when `stream` is capturing a CUDA graph (check after replaying it).
void check_device_errors(void* stream = nullptr);

// Whether ATTNKIT_CHECKED asks for checked mode: "1", "true", "on", "yes" (any case) turn it on;
// unset, "", "0", "false", "off", "no" leave it off; anything else throws Error naming the
// variable. The environment is read once, at the first call.
bool checked_mode_from_environment();

}  // namespace attnkit
