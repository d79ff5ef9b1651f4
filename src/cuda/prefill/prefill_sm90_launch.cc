// Host side of the Hopper context FMHA: which calls it serves, the TMA tensor maps of a call, the
// K/V mode, the persistent grid, and the launch of the instantiation the manifest compiled.
#include "cuda/prefill/prefill_sm90_launch.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>

#include "core/check.h"
#include "cuda/common/cuda_status.h"
#include "cuda/prefill/prefill_build_set.h"
#include "cuda/prefill/prefill_sm90.h"
#include "cuda/prefill/prefill_sm90_traits.h"

namespace attnkit::cuda::prefill {
namespace {

// cuTensorMapEncodeTiled through the runtime's driver entry point: libattnkit links the static
// runtime only, not libcuda.
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                 const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                 const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

EncodeTiled encode_tiled() {
  static EncodeTiled fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000,
                                                             cudaEnableDefault, &found);
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      p = nullptr;
    }
    return reinterpret_cast<EncodeTiled>(p);
  }();
  return fn;
}

// A 4-d map of 16-bit (or 8-bit) elements with 128-byte swizzled boxes of 64 (8-bit: 128) x box1
// x box2 x 1 elements. strides[i]: bytes between consecutive indices of dim i + 1.
CUtensorMap make_map(DType dtype, const void* base, const uint64_t (&dims)[4],
                     const uint64_t (&strides)[3], uint32_t box1, uint32_t box2, const char* what) {
  const EncodeTiled encode = encode_tiled();
  ATTNKIT_CHECK(encode != nullptr, "prefill (sm90): the driver has no cuTensorMapEncodeTiled");
  CUtensorMap map;
  std::memset(&map, 0, sizeof(map));
  const cuuint64_t gdim[4] = {dims[0], dims[1], dims[2], dims[3]};
  const cuuint64_t gstride[3] = {strides[0], strides[1], strides[2]};
  const bool one_byte = dtype == DType::kFp8E4M3 || dtype == DType::kInt8;
  const cuuint32_t box[4] = {one_byte ? 128u : 64u, box1, box2, 1};
  const cuuint32_t elem_stride[4] = {1, 1, 1, 1};
  const CUtensorMapDataType type = one_byte                ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                   : dtype == DType::kBF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                           : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const CUresult r = encode(&map, type, 4, const_cast<void*>(base), gdim, gstride, box, elem_stride,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  ATTNKIT_CHECK(r == CUDA_SUCCESS, "prefill (sm90): cuTensorMapEncodeTiled failed for ", what,
                " (CUresult ", static_cast<int>(r), ")");
  return map;
}

// TMA takes strides that are positive multiples of 16 bytes below 2^40.
bool tma_stride_ok(int64_t bytes) {
  return bytes > 0 && bytes % 16 == 0 && bytes < (int64_t{1} << 40);
}

using Sm90Launcher = void (*)(const Sm90PrefillParams&, int, cudaStream_t);

template <int D, DType kDT>
Sm90Launcher sm90_launcher_for(bool masked, bool mods, bool skip) {
  if constexpr (sm90_compiled(D, kDT)) {
    if (skip) {  // unmasked 16-bit calls only (sm90_unsupported)
      if constexpr (kDT == DType::kFp8E4M3) return nullptr;
      return mods ? &launch_prefill_sm90<D, kDT, false, true, true>
                  : &launch_prefill_sm90<D, kDT, false, false, true>;
    }
    if (masked) {
      return mods ? &launch_prefill_sm90<D, kDT, true, true, false>
                  : &launch_prefill_sm90<D, kDT, true, false, false>;
    }
    return mods ? &launch_prefill_sm90<D, kDT, false, true, false>
                : &launch_prefill_sm90<D, kDT, false, false, false>;
  } else {
    return nullptr;
  }
}

template <DType kDT>
Sm90Launcher sm90_launcher_for(int head_dim, bool masked, bool mods, bool skip) {
  switch (head_dim) {
    case 64:
      return sm90_launcher_for<64, kDT>(masked, mods, skip);
    case 128:
      return sm90_launcher_for<128, kDT>(masked, mods, skip);
    case 256:
      return sm90_launcher_for<256, kDT>(masked, mods, skip);
    default:
      return nullptr;
  }
}

// The SAGE kernels: qk is the codes' dtype, int8 or fp8 e4m3; masked: causal.
template <int D, DType kQk>
Sm90Launcher sage_launcher_for(bool masked, bool mods) {
  if (masked) {
    return mods ? &launch_prefill_sm90<D, kQk, true, true, false, true>
                : &launch_prefill_sm90<D, kQk, true, false, false, true>;
  }
  return mods ? &launch_prefill_sm90<D, kQk, false, true, false, true>
              : &launch_prefill_sm90<D, kQk, false, false, false, true>;
}

template <int D>
Sm90Launcher sage_launcher_for(DType qk, bool masked, bool mods) {
  if constexpr (sage_compiled(D)) {
    return qk == DType::kInt8 ? sage_launcher_for<D, DType::kInt8>(masked, mods)
                              : sage_launcher_for<D, DType::kFp8E4M3>(masked, mods);
  } else {
    return nullptr;
  }
}

Sm90Launcher sage_launcher(int head_dim, DType qk, bool masked, bool mods) {
  if (qk != DType::kInt8 && qk != DType::kFp8E4M3) return nullptr;
  switch (head_dim) {
    case 128:
      return sage_launcher_for<128>(qk, masked, mods);
    case 256:
      return sage_launcher_for<256>(qk, masked, mods);
    default:
      return nullptr;
  }
}

Sm90Launcher sm90_launcher(int head_dim, DType dtype, bool masked, bool mods, bool skip) {
  if (dtype == DType::kBF16) return sm90_launcher_for<DType::kBF16>(head_dim, masked, mods, skip);
  if (dtype == DType::kF16) return sm90_launcher_for<DType::kF16>(head_dim, masked, mods, skip);
  if (dtype == DType::kFp8E4M3) {
    return sm90_launcher_for<DType::kFp8E4M3>(head_dim, masked, mods, skip);
  }
  return nullptr;
}

// The largest power of two that divides both a and b.
int32_t pow2_gcd(int32_t a, int32_t b) {
  int32_t g = 1;
  while (a % (2 * g) == 0 && b % (2 * g) == 0) g *= 2;
  return g;
}

}  // namespace

bool sm90_kernels_compiled(int head_dim, DType dtype) {
  return sm90_launcher(head_dim, dtype, false, false, false) != nullptr;
}

bool sm90_sage_compiled(int head_dim) {
  return sage_launcher(head_dim, DType::kInt8, false, false) != nullptr;
}

std::string sm90_unsupported(const Sm90Call& call) {
  using detail::concat;
  if (call.cc_major != 9 || call.cc_minor != 0) {
    return concat("compute capability ", call.cc_major, ".", call.cc_minor,
                  ": the warpgroup kernel runs on sm90 (H100 / H200)");
  }
  const bool fp8 = call.dtype == DType::kFp8E4M3;
  if (call.sage) {
    if (!sm90_sage_compiled(call.head_dim)) {
      return concat("head_dim ", call.head_dim,
                    ": no SAGE kernel in this build (SAGE serves head_dim 128 and 256; the build "
                    "needs the 90a architecture)");
    }
  } else if (!sm90_kernels_compiled(call.head_dim, call.dtype)) {
    return concat(
        "head_dim ", call.head_dim, " with ", dtype_name(call.dtype),
        fp8 ? ": no FP8 kernel in this build (the FP8 kernel serves head_dim 128 and 256; "
              "the build needs the 90a architecture)"
            : ": no sm90 kernel in this build (sm90 serves head_dim 64, 128 and 256; the "
              "build needs the 90a architecture)");
  }
  if (call.skip && (call.masked || fp8)) {
    return "skip_softmax with a mask or fp8 inputs: the sm90 kernel skips tiles of unmasked 16-bit "
           "(dense) calls only";
  }
  if (fp8 && call.cache != nullptr) {
    if (call.cache->dtype != DType::kFp8E4M3) {
      return concat("fp8 q over a ", dtype_name(call.cache->dtype),
                    " kv_cache: the FP8 kernel reads an fp8_e4m3 cache");
    }
    if (call.cache->window_slots > 0) {
      return "fp8 q over a cyclic (sliding-window) kv_cache: the FP8 kernel reads pages through "
             "TMA, which a cyclic cache's wrap-around does not allow";
    }
  }
  const int smem = sm90_smem_bytes(call.head_dim, call.masked, fp8, call.sage);
  if (call.smem_optin < smem) {
    return concat("the sm90 kernel needs ", smem,
                  " bytes of shared memory per block; the device allows ", call.smem_optin);
  }
  // TMA reads Q (and packed K / V) through tensor maps: strides must be positive multiples of 16
  // bytes.
  for (const TensorView* t : {call.q, call.k, call.v}) {
    if (t == nullptr || !t->defined()) continue;
    for (int d = 0; d < t->ndim - 1; ++d) {
      if (t->shape[d] > 1 && !tma_stride_ok(t->strides[d] * (fp8 || call.sage ? 1 : 2))) {
        return concat("a stride of ", t->strides[d],
                      " elements: the sm90 kernel's TMA loads need positive strides of whole 16 "
                      "bytes");
      }
    }
  }
  return "";
}

int sm90_smem_bytes(int head_dim, bool masked, bool fp8, bool sage) {
  if (sage) {
    switch (head_dim) {
      case 128:
        return Sm90PrefillTraits<128, false, false, true, true>::kSmemBytes;
      case 256:
        return Sm90PrefillTraits<256, false, false, true, true>::kSmemBytes;
      default:
        return 0;
    }
  }
  if (fp8) {
    switch (head_dim) {
      case 128:
        return Sm90PrefillTraits<128, true, false, true>::kSmemBytes;
      case 256:
        return Sm90PrefillTraits<256, true, false, true>::kSmemBytes;
      default:
        return 0;
    }
  }
  switch (head_dim) {
    case 64:
      return masked ? Sm90PrefillTraits<64, true>::kSmemBytes
                    : Sm90PrefillTraits<64, false>::kSmemBytes;
    case 128:
      return masked ? Sm90PrefillTraits<128, true>::kSmemBytes
                    : Sm90PrefillTraits<128, false>::kSmemBytes;
    case 256:
      return masked ? Sm90PrefillTraits<256, true>::kSmemBytes
                    : Sm90PrefillTraits<256, false>::kSmemBytes;
    default:
      return 0;
  }
}

void run_sm90(const PrefillParams& prm, const Sm90Call& call, cudaStream_t stream) {
  const Sm90Launcher launch =
      call.sage
          ? sage_launcher(call.head_dim, call.dtype, call.masked, needs_logit_mods(prm))
          : sm90_launcher(call.head_dim, call.dtype, call.masked, needs_logit_mods(prm), call.skip);
  ATTNKIT_CHECK(launch != nullptr, "prefill: no sm90 kernel for head_dim ", call.head_dim);
  const bool fp8 = call.dtype == DType::kFp8E4M3 || call.sage;
  const int block_n = sm90_block_n(call.head_dim, call.masked || call.skip, fp8);
  const int64_t eb = fp8 ? 1 : 2;

  Sm90PrefillParams sp;
  sp.base = prm;
  sp.skip_log2_lambda = call.skip_log2_lambda;
  sp.skip_counts = call.skip_counts;
  sp.sage = call.sage_scales;
  {
    // Q: (D, Hq, tokens, batch); packed calls are one batch of total_q tokens. A box holds one
    // head's kBlockM tokens, or, GQA-packed, a group's heads x kBlockM / group tokens.
    const TensorView& q = *call.q;
    const bool packed = prm.cu_seqlens_q != nullptr;
    const uint64_t tokens = static_cast<uint64_t>(packed ? q.shape[0] : q.shape[1]);
    const uint64_t batches = packed ? 1 : static_cast<uint64_t>(q.shape[0]);
    const int64_t tok_bytes = prm.q_tok_stride * eb, head_bytes = prm.q_head_stride * eb;
    const int64_t batch_bytes =
        packed ? tok_bytes * std::max<int64_t>(1, q.shape[0]) : prm.q_batch_stride * eb;
    sp.tma_q = make_map(call.dtype, prm.q,
                        {static_cast<uint64_t>(call.head_dim),
                         static_cast<uint64_t>(prm.num_q_heads), tokens, batches},
                        {static_cast<uint64_t>(head_bytes), static_cast<uint64_t>(tok_bytes),
                         static_cast<uint64_t>(batch_bytes)},
                        1u << prm.q_pack_log2,
                        static_cast<uint32_t>(sm90_block_m(call.head_dim) >> prm.q_pack_log2), "q");
  }
  if (!prm.paged) {
    sp.kv_mode = Sm90KvMode::kTmaTensor;
    const bool packed = prm.cu_seqlens_kv != nullptr;
    auto kv_map = [&](const TensorView& t, const void* base, int64_t tok_stride,
                      int64_t head_stride, int64_t batch_stride, const char* what) {
      const uint64_t tokens = static_cast<uint64_t>(packed ? t.shape[0] : t.shape[1]);
      const uint64_t batches = packed ? 1 : static_cast<uint64_t>(t.shape[0]);
      const int64_t batch_bytes =
          packed ? tok_stride * eb * std::max<int64_t>(1, t.shape[0]) : batch_stride * eb;
      return make_map(call.dtype, base,
                      {static_cast<uint64_t>(call.head_dim),
                       static_cast<uint64_t>(prm.num_kv_heads), tokens, batches},
                      {static_cast<uint64_t>(head_stride * eb),
                       static_cast<uint64_t>(tok_stride * eb), static_cast<uint64_t>(batch_bytes)},
                      1, static_cast<uint32_t>(block_n), what);
    };
    sp.tma_k = kv_map(*call.k, prm.k, prm.k_tok_stride, prm.k_head_stride, prm.k_batch_stride, "k");
    if (call.sage) {
      // V^T (columns, D, Hkv, 1): one box is a key tile's 128 columns of every head dim.
      const auto cols = static_cast<uint64_t>(call.v_t_stride);
      const auto dim = static_cast<uint64_t>(call.head_dim);
      sp.tma_v = make_map(DType::kFp8E4M3, call.v_t,
                          {cols, dim, static_cast<uint64_t>(prm.num_kv_heads), 1},
                          {cols, cols * dim, cols * dim * prm.num_kv_heads},
                          static_cast<uint32_t>(call.head_dim), 1, "v_t (SAGE)");
    } else {
      sp.tma_v =
          kv_map(*call.v, prm.v, prm.v_tok_stride, prm.v_head_stride, prm.v_batch_stride, "v");
    }
  } else {
    const KvCacheView& cache = *call.cache;
    const bool eight_bit = cache.dtype == DType::kFp8E4M3 || cache.dtype == DType::kInt8;
    // The FP8 kernel reads its fp8 cache natively (TMA); 16-bit kernels widen an 8-bit one.
    sp.kv_8bit = eight_bit && !fp8;
    if (sp.kv_8bit || cache.window_slots > 0) {
      sp.kv_mode = Sm90KvMode::kGather;
    } else {
      sp.kv_mode = Sm90KvMode::kTmaPaged;
      const int32_t t = cache.tokens_per_block;
      // A box never crosses a page: its rows divide the page and the key tile. A contiguous cache
      // (one block a row) takes whole key tiles.
      sp.page_box_rows = cache.paged ? std::min(pow2_gcd(t, block_n), t) : block_n;
      // The producer issues a tile's boxes one a lane of one warp.
      ATTNKIT_CHECK(block_n / sp.page_box_rows <= 32,
                    "prefill (sm90): ", block_n / sp.page_box_rows,
                    " page boxes a key tile, more than one warp issues");
      // Exactly the pool (a contiguous cache has a block a row, num_rows <= num_blocks): a block
      // coordinate outside it reads zeros, and the producer skips bad table entries before that.
      // The dims are (D, T, Hkv, blocks) in both layouts, with the layout's strides (HND: T rows
      // of D a head; NHD: a token's Hkv rows, so the token stride is the larger one): a box is
      // the same rows x 64 elements in shared memory and the producer's coordinates (d, token,
      // head, block) do not depend on the layout.
      const uint64_t blocks = static_cast<uint64_t>(std::max<int32_t>(1, cache.num_blocks));
      const uint64_t dims[4] = {static_cast<uint64_t>(call.head_dim), static_cast<uint64_t>(t),
                                static_cast<uint64_t>(prm.num_kv_heads), blocks};
      const uint64_t strides[3] = {static_cast<uint64_t>(prm.kv.token_stride_bytes),
                                   static_cast<uint64_t>(prm.kv.head_stride_bytes),
                                   static_cast<uint64_t>(cache.block_stride_bytes)};
      sp.tma_k = make_map(call.dtype, cache.k_base, dims, strides,
                          static_cast<uint32_t>(sp.page_box_rows), 1, "kv_cache (k)");
      sp.tma_v = make_map(call.dtype, cache.v_base, dims, strides,
                          static_cast<uint32_t>(sp.page_box_rows), 1, "kv_cache (v)");
    }
  }
  const int64_t work =
      static_cast<int64_t>(prm.num_m_blocks) * prm.batch * (prm.num_q_heads >> prm.q_pack_log2);
  int64_t grid = call.forced_ctas > 0 ? call.forced_ctas : call.sm_count;
  grid = std::clamp<int64_t>(grid, 1, std::max<int64_t>(1, work));
  launch(sp, static_cast<int>(grid), stream);
}

}  // namespace attnkit::cuda::prefill
