// The per-head_dim entry points of the fused decode kernels, instantiated in decode_hd<D>.cu.
#pragma once

#include <cuda_runtime.h>

#include "attnkit/types.h"
#include "cuda/decode/decode_params.h"

namespace attnkit::cuda {

struct DecodeKernelInfo {
  int ctas_per_sm = 1;  // resident CTAs per SM (the split heuristic's unit of parallelism)
  int tile_n = 64;      // keys per pipeline tile (splits are whole tiles)
  // Resident CTAs per SM of the kernel that wide grids take with plain logits (4 for the 8-bit
  // caches at head_dim 128 with groups <= 8); 0: none.
  int wide_ctas_per_sm = 0;
};

// Which tile configuration serves a call: heads_per_cta = DecodeTraits::kM (8: keys as MMA rows,
// groups <= 8; 16; 32: two M blocks, groups > 16).
struct DecodeKernelChoice {
  int heads_per_cta = 16;
  // The grid (splits included) has CTAs for about four per SM: 8-bit caches may then take the
  // 4-CTA kernel (launch_traits).
  bool wide_grid = true;
};

// Whether a decode grid is launched as a programmatic dependent of the previous kernel on the
// stream (decode_launch.cu): on sm_90+, for grids of more than one wave of resident CTAs and for
// calls of more than two splits; not for a grid resident at once with one or two splits.
bool decode_programmatic_launch(int compute_major, int32_t num_splits, int64_t grid_ctas,
                                int64_t resident_ctas);

// Launches the decode kernel of head_dim kHeadDim for the (q, cache) dtype pair; the logits
// policy is kTransformed when soft-cap or ALiBi is on.
template <int kHeadDim>
void launch_decode(const DecodeParams& p, DType q_dtype, DType kv_dtype, bool transformed_logits,
                   DecodeKernelChoice choice, cudaStream_t stream);
template <int kHeadDim>
DecodeKernelInfo decode_kernel_info(DType q_dtype, DType kv_dtype, DecodeKernelChoice choice);

// Query heads a CTA serves (DecodeKernelChoice::heads_per_cta, decode_launch.cu) for a group of
// group_size heads, given the cache's element size, rows x KV heads and the SM count.
int decode_heads_per_cta(int32_t group_size, bool eight_bit_cache, int64_t rows_x_kv_heads,
                         int sm_count);

// The split-KV heuristic (decode_launch.cu): splits per (row, KV head, head block) CTA given the
// CTA count, resident CTAs per SM, the SM count and the longest key range.
int32_t decode_num_splits(int64_t ctas, int ctas_per_sm, int sm_count, int64_t max_keys,
                          int tile_n);

#define ATTNKIT_DECLARE_DECODE(kHeadDim)                                                \
  extern template void launch_decode<kHeadDim>(const DecodeParams&, DType, DType, bool, \
                                               DecodeKernelChoice, cudaStream_t);       \
  extern template DecodeKernelInfo decode_kernel_info<kHeadDim>(DType, DType, DecodeKernelChoice);
ATTNKIT_DECLARE_DECODE(64)
ATTNKIT_DECLARE_DECODE(80)
ATTNKIT_DECLARE_DECODE(96)
ATTNKIT_DECLARE_DECODE(128)
ATTNKIT_DECLARE_DECODE(256)
#undef ATTNKIT_DECLARE_DECODE

}  // namespace attnkit::cuda
