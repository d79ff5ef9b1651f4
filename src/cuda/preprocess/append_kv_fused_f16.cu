// Explicit instantiation of the fused append_kv kernels for f16 inputs (not in the
// ATTNKIT_KERNEL_SUBSET build, whose fused append_kv serves bf16 inputs only).
#include "cuda/preprocess/append_kv_fused_kernel.cuh"

namespace attnkit::cuda {
#if !defined(ATTNKIT_KERNEL_SUBSET)
template void launch_fused_append_kv<DType::kF16>(const AppendKvParams&, cudaStream_t);
#endif
}  // namespace attnkit::cuda
