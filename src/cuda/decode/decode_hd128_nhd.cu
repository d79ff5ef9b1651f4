// Fused decode kernels for head_dim 128 over NHD caches (all query / cache types, both logits
// policies).
#include "cuda/decode/decode_dispatch.cuh"

namespace attnkit::cuda {
ATTNKIT_INSTANTIATE_DECODE(128, true)
}  // namespace attnkit::cuda
