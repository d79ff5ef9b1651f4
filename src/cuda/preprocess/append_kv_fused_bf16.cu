// Explicit instantiation of the fused append_kv kernels for bf16 inputs.
#include "cuda/preprocess/append_kv_fused_kernel.cuh"

namespace attnkit::cuda {
template void launch_fused_append_kv<DType::kBF16>(const AppendKvParams&, cudaStream_t);
}  // namespace attnkit::cuda
