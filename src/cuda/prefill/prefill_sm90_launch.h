// Host-side declarations of the Hopper context FMHA: the explicitly instantiated launchers (one
// per head_dim, dtype, mask, logit-modifier and skip-softmax variant; the list is
// cmake/prefill_manifest.cmake) and the parameter builder of prefill_sm90_launch.cc.
#pragma once

#include <cuda_runtime.h>

#include "attnkit/types.h"
#include "cuda/prefill/prefill_sm90_params.h"

namespace attnkit::cuda::prefill {

// grid: persistent CTAs (one an SM; fewer when there are fewer work items). kSkip: skip-softmax
// (unmasked calls only).
// kSage: the SAGE kernels (kDType int8 or fp8 e4m3: the Q K^T codes).
template <int kHeadDim, DType kDType, bool kMasked, bool kMods, bool kSkip, bool kSage = false>
void launch_prefill_sm90(const Sm90PrefillParams& sp, int grid, cudaStream_t stream);

}  // namespace attnkit::cuda::prefill
