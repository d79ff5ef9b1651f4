// Turns a decode call's runtime types into template arguments. decode_launch.cu calls
// launch_decode<kHeadDim, kNhd>(); each decode_hd<D>.cu (HND caches) and decode_hd<D>_nhd.cu (NHD
// caches) instantiates it for one head_dim and layout so that build time stays predictable and the
// two layouts compile in parallel (ATTNKIT_KERNEL_SUBSET compiles head_dim 128 only).
#pragma once

#include <cuda_runtime.h>

#include <atomic>

#include "attnkit/types.h"
#include "core/check.h"
#include "cuda/common/cuda_status.h"
#include "cuda/common/launch.cuh"
#include "cuda/decode/decode_kernel.cuh"
#include "cuda/decode/decode_launch.h"

namespace attnkit::cuda {

namespace decode_detail {

// The traits of a tile configuration for the cache's layout: HND kernels keep their DecodeTraits
// (so their code and names are the ones tuned before NHD), NHD kernels wrap them.
template <bool kNhd, typename Traits>
using LayoutTraits = std::conditional_t<kNhd, DecodeNhdTraits<Traits>, Traits>;

template <typename Traits, DecodeLogits kLogits>
void prepare_kernel() {
  opt_in_dynamic_smem_once<decode_kernel<Traits, kLogits>>(
      Traits::kSmemBytes, "decode: cudaFuncSetAttribute(max dynamic shared memory)");
}

template <typename Traits, DecodeLogits kLogits>
void launch_kernel_instance(const DecodeParams& p, dim3 grid, cudaStream_t stream) {
  prepare_kernel<Traits, kLogits>();
  // With p.pdl (sm_90+) the kernel waits for its predecessor (griddepcontrol.wait) before it reads
  // anything.
  launch_maybe_programmatic(decode_kernel<Traits, kLogits>, grid, dim3(Traits::kThreads),
                            Traits::kSmemBytes, stream, p.pdl != 0, p, "decode_kernel");
}

template <typename Traits>
void launch_traits(const DecodeParams& p, bool transformed, bool wide_grid, cudaStream_t stream) {
  const dim3 grid(p.num_splits * p.head_blocks, p.num_kv_heads, p.num_rows);
  // 8-bit caches, head_dim 128, groups of up to 8 heads, plain logits, and a grid that fills four
  // CTAs per SM: 4 CTAs per SM (<= 128 registers; 128-key tiles in 3 swizzled halves of 16 KB,
  // two in flight) rather than 2 CTAs of 7 halves: more warps hide the per-tile latency. Against 2
  // CTAs (H200): fp8 64 x 4k +2.4%, 128 x 2k +2.5%, 256 x 1k +3.7%; int8 64 x 4k +3.2%. Grids of
  // about two CTAs per SM keep 2 (4 CTAs lost 3% at fp8 32 x 4k and 16 x 8k). Other head_dims,
  // tiles and logit policies were not measured and keep 2.
  if constexpr (Traits::kHeadDim == 128 && Traits::k8Bit && Traits::kM == 8 &&
                Traits::kTargetCtasPerSm == 2) {
    if (!transformed && wide_grid) {
      using T4 = LayoutTraits<Traits::kNhd,
                              DecodeTraits<128, typename Traits::QTag, typename Traits::Kv, 8, 4>>;
      launch_kernel_instance<T4, DecodeLogits::kPlain>(p, grid, stream);
      return;
    }
  }
  if (transformed) {
    launch_kernel_instance<Traits, DecodeLogits::kTransformed>(p, grid, stream);
  } else {
    launch_kernel_instance<Traits, DecodeLogits::kPlain>(p, grid, stream);
  }
}

template <typename Traits>
DecodeKernelInfo info_traits() {
  prepare_kernel<Traits, DecodeLogits::kPlain>();
  // Cached per device: the heuristic runs on every call without a split override.
  static std::atomic<int> cached[16] = {};
  const int device = current_device("decode: cudaGetDevice");
  int ctas = cached[device & 15].load(std::memory_order_relaxed);
  if (ctas == 0) {
    int value = 0;
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                   &value, decode_kernel<Traits, DecodeLogits::kPlain>, Traits::kThreads,
                   Traits::kSmemBytes),
               "decode: cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    ctas = value < 1 ? 1 : value;
    cached[device & 15].store(ctas, std::memory_order_relaxed);
  }
  DecodeKernelInfo info;
  info.tile_n = Traits::kTileN;
  info.ctas_per_sm = ctas;
  if constexpr (Traits::kHeadDim == 128 && Traits::k8Bit && Traits::kM == 8 &&
                Traits::kTargetCtasPerSm == 2) {
    info.wide_ctas_per_sm = 4;  // launch_traits' 4-CTA kernel
  }
  return info;
}

// Calls f.template operator()<Traits>() for the tile configuration of `choice`. The two-M-block
// (32-head) kernel is built for 16-bit caches only: decode_heads_per_cta gives 8-bit caches head
// blocks of 8 for every group beyond 16 heads (their tuned keys-as-rows path was faster).
template <int kHeadDim, bool kNhd, typename QTag, typename Kv, typename R, typename F>
R with_config(DecodeKernelChoice choice, F&& f) {
  if (choice.heads_per_cta == 32) {
    if constexpr (Kv::kBytes == 2) {
      return f.template operator()<LayoutTraits<kNhd, DecodeTraits<kHeadDim, QTag, Kv, 32>>>();
    } else {
      detail::fail("decode: no 32-head kernel for an 8-bit cache (decode_heads_per_cta gives ",
                   "8-bit caches head blocks of 8)");
    }
  }
  if (choice.heads_per_cta == 8)
    return f.template operator()<LayoutTraits<kNhd, DecodeTraits<kHeadDim, QTag, Kv, 8>>>();
  return f.template operator()<LayoutTraits<kNhd, DecodeTraits<kHeadDim, QTag, Kv, 16>>>();
}

// Calls f.template operator()<Traits>() for the (query type, cache type) pair.
template <int kHeadDim, bool kNhd, typename R, typename F>
R with_traits(DType q_dtype, DType kv_dtype, DecodeKernelChoice choice, F&& f) {
  const bool native = kv_dtype == q_dtype;
  if (q_dtype == DType::kBF16) {
    if (native) return with_config<kHeadDim, kNhd, Bf16Tag, KvNative, R>(choice, f);
    if (kv_dtype == DType::kFp8E4M3) {
      return with_config<kHeadDim, kNhd, Bf16Tag, KvFp8E4M3, R>(choice, f);
    }
    if (kv_dtype == DType::kInt8) return with_config<kHeadDim, kNhd, Bf16Tag, KvInt8, R>(choice, f);
  } else if (q_dtype == DType::kF16) {
    if (native) return with_config<kHeadDim, kNhd, F16Tag, KvNative, R>(choice, f);
    if (kv_dtype == DType::kFp8E4M3) {
      return with_config<kHeadDim, kNhd, F16Tag, KvFp8E4M3, R>(choice, f);
    }
    if (kv_dtype == DType::kInt8) return with_config<kHeadDim, kNhd, F16Tag, KvInt8, R>(choice, f);
  }
  detail::fail("decode: no fused kernel for q dtype ", dtype_name(q_dtype), " with a ",
               dtype_name(kv_dtype), " cache");
}

}  // namespace decode_detail

namespace decode_detail {
// Functors for with_traits: with_traits calls op.template operator()<Traits>() of the traits a
// call selects.
struct LaunchOp {
  const DecodeParams& p;
  bool transformed;
  bool wide_grid;
  cudaStream_t stream;
  template <typename Traits>
  void operator()() const {
    launch_traits<Traits>(p, transformed, wide_grid, stream);
  }
};
struct InfoOp {
  template <typename Traits>
  DecodeKernelInfo operator()() const {
    return info_traits<Traits>();
  }
};
}  // namespace decode_detail

template <int kHeadDim, bool kNhd>
void launch_decode(const DecodeParams& p, DType q_dtype, DType kv_dtype, bool transformed_logits,
                   DecodeKernelChoice choice, cudaStream_t stream) {
  decode_detail::with_traits<kHeadDim, kNhd, void>(
      q_dtype, kv_dtype, choice,
      decode_detail::LaunchOp{p, transformed_logits, choice.wide_grid, stream});
}

template <int kHeadDim, bool kNhd>
DecodeKernelInfo decode_kernel_info(DType q_dtype, DType kv_dtype, DecodeKernelChoice choice) {
  return decode_detail::with_traits<kHeadDim, kNhd, DecodeKernelInfo>(q_dtype, kv_dtype, choice,
                                                                      decode_detail::InfoOp{});
}

#define ATTNKIT_INSTANTIATE_DECODE(kHeadDim, kNhd)                                     \
  template void launch_decode<kHeadDim, kNhd>(const DecodeParams&, DType, DType, bool, \
                                              DecodeKernelChoice, cudaStream_t);       \
  template DecodeKernelInfo decode_kernel_info<kHeadDim, kNhd>(DType, DType, DecodeKernelChoice);

}  // namespace attnkit::cuda
