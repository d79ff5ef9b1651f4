// The fused append_kv kernel: one thread block per token. The block first tabulates the token's
// RoPE cos/sin in shared memory (once for all its heads), then each thread moves "units" of
// 16-byte vectors (8 elements): bias, rotation, rounding, and one vector store to q_out or the
// cache. A GPT-NeoX unit is a pair of vectors (dims d and d + rotary_dim / 2) so the rotation
// never leaves registers; GPT-J pairs (2i, 2i + 1) sit inside one vector.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/common/cuda_status.h"
#include "cuda/common/element_io.cuh"
#include "cuda/preprocess/append_kv_params.h"

namespace attnkit::cuda {

struct AppendKvTraits {
  static constexpr int kThreads = 128;
  static constexpr int kVec = 8;              // elements per 16-byte input vector
  static constexpr int kMaxRotaryHalf = 256;  // rotary_dim / 2 for head_dim <= 512
};

template <DType kIn>
__device__ __forceinline__ void unpack8(const uint4& raw, float* out) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (kIn == DType::kBF16) {
      out[2 * i] = __uint_as_float(words[i] << 16);
      out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    } else {
      const __half2 h = *reinterpret_cast<const __half2*>(&words[i]);
      const float2 f = __half22float2(h);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
}

template <DType kOut>
__device__ __forceinline__ uint16_t round16(float x) {
  if constexpr (kOut == DType::kBF16) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  } else {
    return __half_as_ushort(__float2half_rn(x));
  }
}

template <DType kOut>
__device__ __forceinline__ uint4 pack8(const float* x) {
  uint32_t words[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    words[i] = static_cast<uint32_t>(round16<kOut>(x[2 * i])) |
               (static_cast<uint32_t>(round16<kOut>(x[2 * i + 1])) << 16);
  }
  return make_uint4(words[0], words[1], words[2], words[3]);
}

// Stores 8 values (already divided by the scale) in the cache dtype: 16 bytes for bf16 / f16,
// 8 bytes for fp8 / int8.
template <DType kKv>
__device__ __forceinline__ void store_cache8(uint8_t* dst, const float* x) {
  if constexpr (kKv == DType::kBF16 || kKv == DType::kF16) {
    *reinterpret_cast<uint4*>(dst) = pack8<kKv>(x);
  } else {
    uint32_t words[2] = {0, 0};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      uint32_t code;
      if constexpr (kKv == DType::kFp8E4M3) {
        code = numerics::float_to_fp8_e4m3_bits(x[i]);
      } else {
        code = static_cast<uint8_t>(numerics::float_to_int8_sat(x[i]));
      }
      words[i / 4] |= code << (8 * (i % 4));
    }
    *reinterpret_cast<uint2*>(dst) = make_uint2(words[0], words[1]);
  }
}

template <DType kIn>
__device__ __forceinline__ void load_vec(const void* base, int64_t offset, const void* bias,
                                         int64_t bias_offset, float* x) {
  const uint4 raw = __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(base) + offset));
  unpack8<kIn>(raw, x);
  if (bias != nullptr) {
    float b[8];
    unpack8<kIn>(__ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(bias) + bias_offset)), b);
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] += b[i];
  }
}

template <DType kIn, DType kKv, RopeStyle kStyle>
__global__ void __launch_bounds__(AppendKvTraits::kThreads)
    fused_append_kv_kernel(const __grid_constant__ AppendKvParams params) {
  using Traits = AppendKvTraits;
  constexpr int kVec = Traits::kVec;
  __shared__ float2 cos_sin[kStyle == RopeStyle::kNone ? 1 : Traits::kMaxRotaryHalf];

  const int64_t token = blockIdx.x;
  const int64_t position = params.positions[token];
  const int32_t rotary_half = params.rope.rotary_dim / 2;
  if constexpr (kStyle != RopeStyle::kNone) {
    for (int i = threadIdx.x; i < rotary_half; i += Traits::kThreads) {
      float c, s;
      detail::rope_cos_sin<float>(params.rope, position, i, &c, &s);
      cos_sin[i] = make_float2(c, s);
    }
    __syncthreads();
  }
  const int64_t row = params.row_of_token[token];
  const int32_t hq = params.num_q_heads, hkv = params.num_kv_heads, dim = params.head_dim;
  // NeoX: rotary_half / 8 paired units, then the pass-through vectors; else one vector per unit.
  const int32_t paired_units = kStyle == RopeStyle::kGptNeox ? rotary_half / kVec : 0;
  const int32_t units_per_head = kStyle == RopeStyle::kGptNeox
                                     ? paired_units + (dim - 2 * rotary_half) / kVec
                                     : dim / kVec;
  const int32_t total_units = (hq + 2 * hkv) * units_per_head;

  for (int32_t unit = threadIdx.x; unit < total_units; unit += Traits::kThreads) {
    const int32_t head = unit / units_per_head;
    const int32_t u = unit % units_per_head;
    const bool is_q = head < hq;
    const bool is_k = !is_q && head < hq + hkv;
    const int32_t local = is_q ? head : (is_k ? head - hq : head - hq - hkv);
    const void* in = is_q ? params.q_in : (is_k ? params.k_in : params.v_in);
    const int64_t in_offset =
        is_q ? token * params.q_stride_token + local * params.q_stride_head
             : (is_k ? token * params.k_stride_token + local * params.k_stride_head
                     : token * params.v_stride_token + local * params.v_stride_head);
    const int64_t bias_offset = static_cast<int64_t>(head) * dim;
    const bool paired = u < paired_units;
    const int32_t d0 = paired ? u * kVec
                              : (kStyle == RopeStyle::kGptNeox ? 2 * rotary_half + (u - paired_units) * kVec
                                                               : u * kVec);
    const int32_t d1 = d0 + rotary_half;  // partner vector of a paired unit
    float lo[kVec], hi[kVec];
    load_vec<kIn>(in, in_offset + d0, params.bias, bias_offset + d0, lo);
    if (paired) load_vec<kIn>(in, in_offset + d1, params.bias, bias_offset + d1, hi);

    if (is_q || is_k) {
      if constexpr (kStyle == RopeStyle::kGptNeox) {
        if (paired) {
#pragma unroll
          for (int i = 0; i < kVec; ++i) {
            const float2 cs = cos_sin[d0 + i];
            const float a = lo[i], b = hi[i];
            lo[i] = a * cs.x - b * cs.y;
            hi[i] = b * cs.x + a * cs.y;
          }
        }
      } else if constexpr (kStyle == RopeStyle::kGptJ) {
#pragma unroll
        for (int i = 0; i < kVec; i += 2) {
          if (d0 + i < 2 * rotary_half) {
            const float2 cs = cos_sin[(d0 + i) / 2];
            const float a = lo[i], b = lo[i + 1];
            lo[i] = a * cs.x - b * cs.y;
            lo[i + 1] = b * cs.x + a * cs.y;
          }
        }
      }
    }

    if (is_q) {
      uint16_t* out = static_cast<uint16_t*>(params.q_out) + token * params.q_out_stride_token +
                      local * params.q_out_stride_head;
      *reinterpret_cast<uint4*>(out + d0) = pack8<kIn>(lo);
      if (paired) *reinterpret_cast<uint4*>(out + d1) = pack8<kIn>(hi);
      continue;
    }
    const float scale = is_k ? kv_scale_of(params.k_scale, params.k_scale_per_head, local)
                             : kv_scale_of(params.v_scale, params.v_scale_per_head, local);
    // Division, not a reciprocal multiply: stored = round(x / scale) exactly as numerics.h.
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      lo[i] = lo[i] / scale;
      hi[i] = hi[i] / scale;
    }
    uint8_t* dst = is_k ? params.layout.k_ptr(row, position, local) : params.layout.v_ptr(row, position, local);
    const int32_t elt = params.layout.element_bytes;
    store_cache8<kKv>(dst + static_cast<int64_t>(d0) * elt, lo);
    if (paired) store_cache8<kKv>(dst + static_cast<int64_t>(d1) * elt, hi);
  }
}

template <DType kIn, DType kKv, RopeStyle kStyle>
void launch_fused_append_kv_typed(const AppendKvParams& params, cudaStream_t stream) {
  fused_append_kv_kernel<kIn, kKv, kStyle>
      <<<static_cast<unsigned>(params.num_tokens), AppendKvTraits::kThreads, 0, stream>>>(params);
  check_launch("fused_append_kv_kernel");
}

template <DType kIn, DType kKv>
void launch_fused_append_kv_style(const AppendKvParams& params, cudaStream_t stream) {
  switch (params.rope.style) {
    case RopeStyle::kNone:
      return launch_fused_append_kv_typed<kIn, kKv, RopeStyle::kNone>(params, stream);
    case RopeStyle::kGptNeox:
      return launch_fused_append_kv_typed<kIn, kKv, RopeStyle::kGptNeox>(params, stream);
    case RopeStyle::kGptJ:
      return launch_fused_append_kv_typed<kIn, kKv, RopeStyle::kGptJ>(params, stream);
  }
}

// The one place where the runtime cache dtype and RoPE style become template arguments.
template <DType kIn>
void launch_fused_append_kv(const AppendKvParams& params, cudaStream_t stream) {
  if (params.num_tokens == 0) return;
  switch (params.kv_dtype) {
    case DType::kBF16:
      return launch_fused_append_kv_style<kIn, DType::kBF16>(params, stream);
    case DType::kF16:
      return launch_fused_append_kv_style<kIn, DType::kF16>(params, stream);
    case DType::kFp8E4M3:
      return launch_fused_append_kv_style<kIn, DType::kFp8E4M3>(params, stream);
    case DType::kInt8:
      return launch_fused_append_kv_style<kIn, DType::kInt8>(params, stream);
    default:
      detail::fail("fused append_kv: kv_cache.dtype must be bf16, f16, fp8_e4m3 or int8, got ",
                   dtype_name(params.kv_dtype));
  }
}

}  // namespace attnkit::cuda
