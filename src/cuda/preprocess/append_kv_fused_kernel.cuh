// The fused append_kv kernel: one thread block per token. The block first tabulates the token's
// RoPE cos/sin in shared memory (once for all its heads), then each thread moves "units" of
// 16-byte vectors (8 elements): bias, rotation, rounding, and one vector store to q_out or the
// cache. A GPT-NeoX unit is a pair of vectors (dims d and d + rotary_dim / 2) so the rotation
// never leaves registers; GPT-J pairs (2i, 2i + 1) sit inside one vector.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "cuda/common/cuda_status.h"
#include "cuda/common/element_io.cuh"
#include "cuda/preprocess/append_kv_params.h"

namespace attnkit::cuda {

struct AppendKvTraits {
  static constexpr int kThreads = 128;
  static constexpr int kVec = 8;              // elements per 16-byte input vector
  static constexpr int kMaxRotaryHalf = 256;  // rotary_dim / 2 for head_dim <= 512
  static constexpr int kUnitsInFlight = 2;    // units whose loads a thread issues together
  static constexpr int kTokensPerBlock = 4;   // amortizes the cos/sin table and the block start
  static constexpr int kMinBlocksPerSm = 5;   // <= 102 registers: 640 threads per SM
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
    for (int i = 0; i < 8; i += 2) {
      uint32_t pair;
      if constexpr (kKv == DType::kFp8E4M3) {
        // The hardware conversion (sm_89+; emulated on sm_80) rounds and saturates like
        // numerics::float_to_fp8_e4m3_bits.
        pair = __nv_cvt_float2_to_fp8x2(make_float2(x[i], x[i + 1]), __NV_SATFINITE, __NV_E4M3);
      } else {
        pair = static_cast<uint8_t>(numerics::float_to_int8_sat(x[i])) |
               (static_cast<uint32_t>(static_cast<uint8_t>(numerics::float_to_int8_sat(x[i + 1])))
                << 8);
      }
      words[i / 4] |= pair << (8 * (i % 4));
    }
    *reinterpret_cast<uint2*>(dst) = make_uint2(words[0], words[1]);
  }
}

// Where one unit lives: which head (Q, K or V), its input offset and its first dims.
struct AppendKvUnit {
  int64_t token;  // global token
  int32_t slot;   // token inside the block (its cos/sin table, position and row)
  int32_t head;   // 0 .. Hq + 2 Hkv - 1
  int32_t local;  // head index inside Q, K or V
  bool is_q, is_k, paired, valid;
  int32_t d0, d1;  // first dim of the vector and of its partner (paired units)
  int64_t in_offset;
};

// The raw 16-byte vectors of a unit, loaded before anything is computed so that several units'
// loads are in flight per thread.
struct AppendKvRaw {
  uint4 lo, hi, bias_lo, bias_hi;
};

template <RopeStyle kStyle>
__device__ __forceinline__ AppendKvUnit locate_unit(const AppendKvParams& params,
                                                    int64_t first_token, int32_t unit,
                                                    int32_t units_per_token, int32_t units_per_head,
                                                    int32_t paired_units, int32_t total_units) {
  constexpr int kVec = AppendKvTraits::kVec;
  AppendKvUnit u{};
  u.valid = unit < total_units;
  if (!u.valid) return u;
  const int32_t hq = params.num_q_heads, hkv = params.num_kv_heads;
  const int32_t rotary_half = params.rope.rotary_dim / 2;
  u.slot = unit / units_per_token;
  const int64_t token = first_token + u.slot;
  u.token = token;
  const int32_t in_token = unit % units_per_token;
  u.head = in_token / units_per_head;
  const int32_t w = in_token % units_per_head;
  u.is_q = u.head < hq;
  u.is_k = !u.is_q && u.head < hq + hkv;
  u.local = u.is_q ? u.head : (u.is_k ? u.head - hq : u.head - hq - hkv);
  u.in_offset = u.is_q ? token * params.q_stride_token + u.local * params.q_stride_head
                       : (u.is_k ? token * params.k_stride_token + u.local * params.k_stride_head
                                 : token * params.v_stride_token + u.local * params.v_stride_head);
  u.paired = w < paired_units;
  if (u.paired) {
    u.d0 = w * kVec;
  } else if constexpr (kStyle == RopeStyle::kGptNeox) {
    u.d0 = 2 * rotary_half + (w - paired_units) * kVec;
  } else {
    u.d0 = w * kVec;
  }
  u.d1 = u.d0 + rotary_half;
  return u;
}

__device__ __forceinline__ uint4 load16(const void* base, int64_t offset) {
  return __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(base) + offset));
}

__device__ __forceinline__ void load_unit(const AppendKvParams& params, const AppendKvUnit& u,
                                          AppendKvRaw& raw) {
  if (!u.valid) return;
  const void* in = u.is_q ? params.q_in : (u.is_k ? params.k_in : params.v_in);
  const int64_t bias_offset = static_cast<int64_t>(u.head) * params.head_dim;
  raw.lo = load16(in, u.in_offset + u.d0);
  if (u.paired) raw.hi = load16(in, u.in_offset + u.d1);
  if (params.bias != nullptr) {
    raw.bias_lo = load16(params.bias, bias_offset + u.d0);
    if (u.paired) raw.bias_hi = load16(params.bias, bias_offset + u.d1);
  }
}

// Bias, rotation, rounding and the stores of one unit.
template <DType kIn, DType kKv, RopeStyle kStyle>
__device__ __forceinline__ void finish_unit(const AppendKvParams& params, const AppendKvUnit& u,
                                            const AppendKvRaw& raw, const float2* cos_sin_table,
                                            const int64_t* positions, const int64_t* rows) {
  constexpr int kVec = AppendKvTraits::kVec;
  if (!u.valid) return;
  const float2* cos_sin = cos_sin_table + u.slot * AppendKvTraits::kMaxRotaryHalf;
  const int64_t token = u.token;
  const int64_t position = positions[u.slot];
  const int64_t row = rows[u.slot];
  float lo[kVec], hi[kVec];
  unpack8<kIn>(raw.lo, lo);
  if (u.paired) unpack8<kIn>(raw.hi, hi);
  if (params.bias != nullptr) {
    float b[kVec];
    unpack8<kIn>(raw.bias_lo, b);
#pragma unroll
    for (int i = 0; i < kVec; ++i) lo[i] += b[i];
    if (u.paired) {
      unpack8<kIn>(raw.bias_hi, b);
#pragma unroll
      for (int i = 0; i < kVec; ++i) hi[i] += b[i];
    }
  }
  if (u.is_q || u.is_k) {
    if constexpr (kStyle == RopeStyle::kGptNeox) {
      if (u.paired) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          const float2 cs = cos_sin[u.d0 + i];
          const float a = lo[i], b = hi[i];
          lo[i] = a * cs.x - b * cs.y;
          hi[i] = b * cs.x + a * cs.y;
        }
      }
    } else if constexpr (kStyle == RopeStyle::kGptJ) {
      const int32_t rotary_dim = params.rope.rotary_dim;
#pragma unroll
      for (int i = 0; i < kVec; i += 2) {
        if (u.d0 + i < rotary_dim) {
          const float2 cs = cos_sin[(u.d0 + i) / 2];
          const float a = lo[i], b = lo[i + 1];
          lo[i] = a * cs.x - b * cs.y;
          lo[i + 1] = b * cs.x + a * cs.y;
        }
      }
    }
  }
  if (u.is_q) {
    uint16_t* out = static_cast<uint16_t*>(params.q_out) + token * params.q_out_stride_token +
                    u.local * params.q_out_stride_head;
    *reinterpret_cast<uint4*>(out + u.d0) = pack8<kIn>(lo);
    if (u.paired) *reinterpret_cast<uint4*>(out + u.d1) = pack8<kIn>(hi);
    return;
  }
  const float scale = u.is_k ? kv_scale_of(params.k_scale, params.k_scale_per_head, u.local)
                             : kv_scale_of(params.v_scale, params.v_scale_per_head, u.local);
  // Division, not a reciprocal multiply: stored = round(x / scale) exactly as numerics.h
  // (x / 1 == x, so an unscaled cache skips it).
  if (scale != 1.0f) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      lo[i] = lo[i] / scale;
      hi[i] = hi[i] / scale;
    }
  }
  uint8_t* dst = u.is_k ? params.layout.k_ptr(row, position, u.local)
                        : params.layout.v_ptr(row, position, u.local);
  const int32_t elt = params.layout.element_bytes;
  store_cache8<kKv>(dst + static_cast<int64_t>(u.d0) * elt, lo);
  if (u.paired) store_cache8<kKv>(dst + static_cast<int64_t>(u.d1) * elt, hi);
}

template <DType kIn, DType kKv, RopeStyle kStyle>
__global__ void __launch_bounds__(AppendKvTraits::kThreads, AppendKvTraits::kMinBlocksPerSm)
    fused_append_kv_kernel(const __grid_constant__ AppendKvParams params) {
  using Traits = AppendKvTraits;
  constexpr int kVec = Traits::kVec;
  constexpr int kUnroll = Traits::kUnitsInFlight;
  constexpr int kTokens = Traits::kTokensPerBlock;
  __shared__ float2 cos_sin[kStyle == RopeStyle::kNone ? 1 : kTokens * Traits::kMaxRotaryHalf];
  __shared__ int64_t positions[kTokens], rows[kTokens];

  const int64_t first_token = static_cast<int64_t>(blockIdx.x) * kTokens;
  const int32_t tokens_here = static_cast<int32_t>(
      params.num_tokens - first_token < kTokens ? params.num_tokens - first_token : kTokens);
  const int32_t rotary_half = params.rope.rotary_dim / 2;
  const int32_t dim = params.head_dim;
  // NeoX: rotary_half / 8 paired units, then the pass-through vectors; else one vector per unit.
  const int32_t paired_units = kStyle == RopeStyle::kGptNeox ? rotary_half / kVec : 0;
  const int32_t units_per_head =
      kStyle == RopeStyle::kGptNeox ? paired_units + (dim - 2 * rotary_half) / kVec : dim / kVec;
  const int32_t units_per_token = (params.num_q_heads + 2 * params.num_kv_heads) * units_per_head;
  const int32_t total_units = tokens_here * units_per_token;

  // The first units' loads go out before the cos/sin table is built, so that the table's math
  // hides under their latency.
  AppendKvUnit unit[kUnroll];
  AppendKvRaw raw[kUnroll];
  int32_t base = threadIdx.x;
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    unit[k] = locate_unit<kStyle>(params, first_token, base + k * Traits::kThreads, units_per_token,
                                  units_per_head, paired_units, total_units);
    load_unit(params, unit[k], raw[k]);
  }
  if (threadIdx.x < tokens_here) {
    positions[threadIdx.x] = params.positions[first_token + threadIdx.x];
    rows[threadIdx.x] = params.row_of_token[first_token + threadIdx.x];
  }
  __syncthreads();
  if constexpr (kStyle != RopeStyle::kNone) {
    for (int idx = threadIdx.x; idx < tokens_here * rotary_half; idx += Traits::kThreads) {
      const int t = idx / rotary_half, i = idx % rotary_half;
      // The angle in double (once per token and pair, off the critical path): float angles lose
      // ~position * 1e-7 rad, several bf16 units at positions of a few thousand.
      double c, s;
      detail::rope_cos_sin<double>(params.rope, positions[t], i, &c, &s);
      cos_sin[t * Traits::kMaxRotaryHalf + i] =
          make_float2(static_cast<float>(c), static_cast<float>(s));
    }
    __syncthreads();
  }
  while (base < total_units) {
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      finish_unit<kIn, kKv, kStyle>(params, unit[k], raw[k], cos_sin, positions, rows);
    }
    base += kUnroll * Traits::kThreads;
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      unit[k] = locate_unit<kStyle>(params, first_token, base + k * Traits::kThreads,
                                    units_per_token, units_per_head, paired_units, total_units);
      load_unit(params, unit[k], raw[k]);
    }
  }
}

template <DType kIn, DType kKv, RopeStyle kStyle>
void launch_fused_append_kv_typed(const AppendKvParams& params, cudaStream_t stream) {
  const int64_t blocks =
      (params.num_tokens + AppendKvTraits::kTokensPerBlock - 1) / AppendKvTraits::kTokensPerBlock;
  fused_append_kv_kernel<kIn, kKv, kStyle>
      <<<static_cast<unsigned>(blocks), AppendKvTraits::kThreads, 0, stream>>>(params);
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
  // An unquantized cache has the dtype of the input (validate_append_kv), so three cache types
  // per input dtype.
  if (params.kv_dtype == kIn) return launch_fused_append_kv_style<kIn, kIn>(params, stream);
  switch (params.kv_dtype) {
    case DType::kFp8E4M3:
      return launch_fused_append_kv_style<kIn, DType::kFp8E4M3>(params, stream);
    case DType::kInt8:
      return launch_fused_append_kv_style<kIn, DType::kInt8>(params, stream);
    default:
      detail::fail("fused append_kv: kv_cache.dtype must be ", dtype_name(kIn),
                   " (the input dtype), fp8_e4m3 or int8, got ", dtype_name(params.kv_dtype));
  }
}

}  // namespace attnkit::cuda
