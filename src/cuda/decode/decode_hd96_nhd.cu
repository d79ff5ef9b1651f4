// Fused decode kernels for head_dim 96 over NHD caches (all query / cache types, both logits
// policies).
#include "cuda/decode/decode_dispatch.cuh"

namespace attnkit::cuda {
#if !defined(ATTNKIT_KERNEL_SUBSET)
ATTNKIT_INSTANTIATE_DECODE(96, true)
#endif
}  // namespace attnkit::cuda
