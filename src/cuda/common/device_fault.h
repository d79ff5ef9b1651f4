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

// The site of a launch on the current device for a call of `op`.
FaultSite fault_site(Op op);

}  // namespace attnkit::cuda
