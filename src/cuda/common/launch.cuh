// Kernel launches with an optional programmatic dependence on the stream's previous kernel.
#pragma once

#include <cuda_runtime.h>

#include <mutex>
#include <string>

#include "cuda/common/cuda_status.h"

namespace attnkit::cuda {

// Opts kKernel into smem_bytes of dynamic shared memory (beyond the default 48 KB), once per
// device: the attribute is per device, and 16 devices is plenty for one process. `what` names the
// call in the error a failure throws.
template <auto kKernel>
void opt_in_dynamic_smem_once(int smem_bytes, const char* what) {
  static std::once_flag flags[16];
  const int device = current_device("cudaGetDevice");
  std::call_once(flags[device & 15], [&] {
    check_cuda(
        cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes),
        what);
  });
}

// kernel<<<grid, block, smem_bytes, stream>>>(params), or, when `programmatic` (sm_90+), the same
// launch as a programmatic dependent of the stream's previous kernel: it may start before that
// kernel completes, so the kernel must wait (griddepcontrol.wait) before it reads that kernel's
// output. A failed launch throws naming `kernel_name` (with " (PDL)" for the programmatic one).
template <typename Params>
void launch_maybe_programmatic(void (*kernel)(Params), dim3 grid, dim3 block, size_t smem_bytes,
                               cudaStream_t stream, bool programmatic, const Params& params,
                               const char* kernel_name) {
  if (programmatic) {
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = smem_bytes;
    config.stream = stream;
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attribute;
    config.numAttrs = 1;
    const cudaError_t status = cudaLaunchKernelEx(&config, kernel, params);
    // The name is built on failure only: this is every decode call's launch.
    if (status != cudaSuccess) check_cuda(status, (std::string(kernel_name) + " (PDL)").c_str());
    return;
  }
  kernel<<<grid, block, smem_bytes, stream>>>(params);
  check_launch(kernel_name);
}

}  // namespace attnkit::cuda
