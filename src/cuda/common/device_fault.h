// Launch side of the fault status word (device_fault.cuh has the device side): the word of a
// device, and the FaultSite a launch puts into its kernel's Params.
#pragma once

#include "attnkit/info.h"
#include "cuda/common/device_fault.cuh"

namespace attnkit::cuda {

// The status word of CUDA device `device` (a __device__ variable: every device's context holds
// its own, zero when the module loads; no allocation, so it is safe during graph capture).
// Throws Error when its address cannot be had.
DeviceFault* fault_word(int device);

// The site of a launch on the current device for a call of `op`, or the op and row offset of the
// innermost FaultOpScope of the calling thread where one is open.
FaultSite fault_site(Op op);

// While it lives, the kernels the calling thread launches record their faults under `op`, with
// block-table rows shifted by `table_row_offset` (FaultSite): forward() runs append_kv, prefill
// and decode kernels, and a fault of any of them names the call the user made (forward) and the
// row of the user's cache (its decode part runs on the rows after the context rows).
class FaultOpScope {
 public:
  explicit FaultOpScope(Op op, int32_t table_row_offset = 0);
  ~FaultOpScope();
  FaultOpScope(const FaultOpScope&) = delete;
  FaultOpScope& operator=(const FaultOpScope&) = delete;

 private:
  int32_t previous_op_;
  int32_t previous_offset_;
};

}  // namespace attnkit::cuda
