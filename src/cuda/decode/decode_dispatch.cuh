// Turns a decode call's runtime types into template arguments. decode_launch.cu calls
// launch_decode<kHeadDim>(); each decode_hd<D>.cu instantiates it for one head_dim so that
// build time stays predictable (ATTNKIT_KERNEL_SUBSET compiles head_dim 128 only).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <type_traits>

#include "attnkit/types.h"
#include "core/check.h"
#include "cuda/common/cuda_status.h"
#include "cuda/decode/decode_kernel.cuh"
#include "cuda/decode/decode_launch.h"

namespace attnkit::cuda {

namespace decode_detail {

// Experiment switch (dec8, head_dim 128, groups <= 8, plain logits). ATTNKIT_EXP_DEC8 unset = the
// default kernels; for 8-bit caches it may contain "k32" = 4 warps of 32 keys (128-key tiles,
// swizzled halves of 16 KB): 2 CTAs with 7 halves on every grid, with "c4" 4 CTAs with 3 halves
// on wide grids; "dt" = block-table entries used only at copy time (with k32, or alone on the
// default 8-bit kernels); "bdt" = bf16 caches with dt; "brk" below.
struct Dec8Variant {
  bool k32 = false, c4 = false, dt = false, bdt = false, brk = false;
};
inline Dec8Variant dec8_variant() {
  static const Dec8Variant v = [] {
    Dec8Variant r;
    const char* e = std::getenv("ATTNKIT_EXP_DEC8");
    if (e == nullptr) return r;
    r.k32 = std::strstr(e, "k32") != nullptr;
    r.c4 = std::strstr(e, "c4") != nullptr;
    r.bdt = std::strstr(e, "bdt") != nullptr;
    r.dt = !r.bdt && std::strstr(e, "dt") != nullptr;
    // "brk" (with k32): the second 16-key block of a warp masked as the first (a deliberate
    // break; the quantized tests must fail).
    r.brk = std::strstr(e, "brk") != nullptr;
    return r;
  }();
  return v;
}

template <typename QTag, typename Kv, int kCtas, int kDefer>
using Dec8K32 = DecodeTraits<128, QTag, Kv, 8, kCtas, DecodePipe::kSwizzledHalves, 4, 32, kDefer>;
template <typename QTag, typename Kv, int kCtas, int kDefer>
using Dec8Def = DecodeTraits<128, QTag, Kv, 8, kCtas,
                             decode_default_pipe(128, Kv::kBytes, 8, kCtas), 4, 16, kDefer>;
template <typename Traits>
constexpr bool dec8_applies() {
  return Traits::kHeadDim == 128 && Traits::kM == 8 && Traits::kTargetCtasPerSm == 2 &&
         Traits::kKeyWarps == 4 && Traits::kKeysPerWarp == 16 && !Traits::kDeferTable;
}

template <typename Traits, DecodeLogits kLogits>
void prepare_kernel() {
  // The shared-memory opt-in is per device; 16 devices is plenty for one process.
  static std::once_flag flags[16];
  int device = 0;
  check_cuda(cudaGetDevice(&device), "decode: cudaGetDevice");
  std::call_once(flags[device & 15], [] {
    check_cuda(
        cudaFuncSetAttribute(decode_kernel<Traits, kLogits>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes),
        "decode: cudaFuncSetAttribute(max dynamic shared memory)");
  });
}

template <typename Traits, DecodeLogits kLogits>
void launch_kernel_instance(const DecodeParams& p, dim3 grid, cudaStream_t stream) {
  prepare_kernel<Traits, kLogits>();
  decode_kernel<Traits, kLogits><<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(p);
  check_launch("decode_kernel");
}

template <typename QTag, typename Kv, int kDefer>
void dec8_launch(const DecodeParams& p, dim3 grid, bool wide_grid, cudaStream_t stream) {
  const Dec8Variant v = dec8_variant();
  if (v.k32 && v.c4 && wide_grid) {
    launch_kernel_instance<Dec8K32<QTag, Kv, 4, kDefer>, DecodeLogits::kPlain>(p, grid, stream);
  } else if (v.k32 || kDefer == 2) {
    launch_kernel_instance<Dec8K32<QTag, Kv, 2, kDefer>, DecodeLogits::kPlain>(p, grid, stream);
  } else if constexpr (kDefer == 2) {
    // unreachable (the break is a k32 kernel)
  } else if (wide_grid) {
    launch_kernel_instance<Dec8Def<QTag, Kv, 4, kDefer>, DecodeLogits::kPlain>(p, grid, stream);
  } else {
    launch_kernel_instance<Dec8Def<QTag, Kv, 2, kDefer>, DecodeLogits::kPlain>(p, grid, stream);
  }
}

template <typename Traits>
void launch_traits(const DecodeParams& p, bool transformed, bool wide_grid, cudaStream_t stream) {
  const dim3 grid(p.num_splits * p.head_blocks, p.num_kv_heads, p.num_rows);
  // 8-bit caches, head_dim 128, groups of up to 8 heads, plain logits, and a grid that fills four
  // CTAs per SM: 4 CTAs per SM (2 pipeline stages each, <= 128 registers) rather than 2 CTAs of 6
  // stages. These kernels are bound by instruction latency, not by bytes in flight: twice the
  // warps hide it. Measured on the H200 at 64 x 4k: fp8 3.48 -> 3.90 TB/s, int8 3.34 -> 3.90 (3
  // CTAs of 4 stages: 2.9). A grid of about two CTAs per SM keeps the 6 stages: fp8 32 x 4k 3.24
  // -> 3.34 TB/s, 16 x 8k 3.13 -> 3.23 (1 x 32k, split 32 ways: the same). Other head_dims,
  // tiles and logit policies were not measured and keep 2.
  if constexpr (dec8_applies<Traits>()) {
    using QTag = typename Traits::QTag;
    using Kv = typename Traits::Kv;
    if (!transformed) {
      if constexpr (Traits::k8Bit) {
        if (dec8_variant().brk) {
          dec8_launch<QTag, Kv, 2>(p, grid, wide_grid, stream);
        } else if (dec8_variant().dt) {
          dec8_launch<QTag, Kv, 1>(p, grid, wide_grid, stream);
        } else {
          dec8_launch<QTag, Kv, 0>(p, grid, wide_grid, stream);
        }
        return;
      } else if constexpr (std::is_same_v<QTag, Bf16Tag>) {
        if (dec8_variant().bdt) {
          launch_kernel_instance<Dec8Def<QTag, Kv, 2, 1>, DecodeLogits::kPlain>(p, grid, stream);
          return;
        }
      }
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
  if constexpr (dec8_applies<Traits>() && Traits::k8Bit) {
    // The k32 kernels' tile (128 keys) decides the splits (transformed logits keep the default
    // 64-key kernel: its splits are then sized for 128 keys, still whole tiles).
    if (dec8_variant().k32) {
      return info_traits<Dec8K32<typename Traits::QTag, typename Traits::Kv, 2, 0>>();
    }
  }
  prepare_kernel<Traits, DecodeLogits::kPlain>();
  // Cached per device: the heuristic runs on every call without a split override.
  static std::atomic<int> cached[16] = {};
  int device = 0;
  check_cuda(cudaGetDevice(&device), "decode: cudaGetDevice");
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
  return info;
}

// Calls f.template operator()<Traits>() for the tile configuration of `choice`.
template <int kHeadDim, typename QTag, typename Kv, typename R, typename F>
R with_config(DecodeKernelChoice choice, F&& f) {
  if (choice.heads_per_cta == 32)
    return f.template operator()<DecodeTraits<kHeadDim, QTag, Kv, 32>>();
  if (choice.heads_per_cta == 8)
    return f.template operator()<DecodeTraits<kHeadDim, QTag, Kv, 8>>();
  return f.template operator()<DecodeTraits<kHeadDim, QTag, Kv, 16>>();
}

// Calls f.template operator()<Traits>() for the (query type, cache type) pair.
template <int kHeadDim, typename R, typename F>
R with_traits(DType q_dtype, DType kv_dtype, DecodeKernelChoice choice, F&& f) {
  const bool native = kv_dtype == q_dtype;
  if (q_dtype == DType::kBF16) {
    if (native) return with_config<kHeadDim, Bf16Tag, KvNative, R>(choice, f);
    if (kv_dtype == DType::kFp8E4M3) return with_config<kHeadDim, Bf16Tag, KvFp8E4M3, R>(choice, f);
    if (kv_dtype == DType::kInt8) return with_config<kHeadDim, Bf16Tag, KvInt8, R>(choice, f);
  } else if (q_dtype == DType::kF16) {
    if (native) return with_config<kHeadDim, F16Tag, KvNative, R>(choice, f);
    if (kv_dtype == DType::kFp8E4M3) return with_config<kHeadDim, F16Tag, KvFp8E4M3, R>(choice, f);
    if (kv_dtype == DType::kInt8) return with_config<kHeadDim, F16Tag, KvInt8, R>(choice, f);
  }
  detail::fail("decode: no fused kernel for q dtype ", dtype_name(q_dtype), " with a ",
               dtype_name(kv_dtype), " cache");
}

}  // namespace decode_detail

namespace decode_detail {
// Functors for with_traits (C++17: no templated lambdas in this code).
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

template <int kHeadDim>
void launch_decode(const DecodeParams& p, DType q_dtype, DType kv_dtype, bool transformed_logits,
                   DecodeKernelChoice choice, cudaStream_t stream) {
  decode_detail::with_traits<kHeadDim, void>(
      q_dtype, kv_dtype, choice,
      decode_detail::LaunchOp{p, transformed_logits, choice.wide_grid, stream});
}

template <int kHeadDim>
DecodeKernelInfo decode_kernel_info(DType q_dtype, DType kv_dtype, DecodeKernelChoice choice) {
  return decode_detail::with_traits<kHeadDim, DecodeKernelInfo>(q_dtype, kv_dtype, choice,
                                                                decode_detail::InfoOp{});
}

#define ATTNKIT_INSTANTIATE_DECODE(kHeadDim)                                     \
  template void launch_decode<kHeadDim>(const DecodeParams&, DType, DType, bool, \
                                        DecodeKernelChoice, cudaStream_t);       \
  template DecodeKernelInfo decode_kernel_info<kHeadDim>(DType, DType, DecodeKernelChoice);

}  // namespace attnkit::cuda
