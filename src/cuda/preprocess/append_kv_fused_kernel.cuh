// The fused append_kv kernel. A CTA serves plan.tokens_per_cta tokens; thread (w, y, z) owns
// vector unit w of heads y, y + heads_per_pass, ... of its token, so its RoPE cos/sin values are
// the same for every head it moves and no index is ever divided at run time. A unit is one
// 16-byte vector (8 elements), or for GPT-NeoX a pair of vectors (dims d and d + rotary_dim / 2)
// so that the rotation never leaves registers; GPT-J pairs (2i, 2i + 1) sit inside one vector.
// All loads of a thread (up to kSteps units) go out before the token's cos/sin table is built,
// so that the table's math and the page-table lookup hide under their latency. The kernel is
// bound by the reads in flight (Little's law): on the H200 the fraction of copy bandwidth grew
// from 0.33 to 0.89 as the 16-byte loads in flight per SM grew from 12 KB to 98 KB, so the plan
// favours few threads per CTA (64 for 32 + 2 x 8 heads of D = 128), six units per thread, and
// few registers (ten such CTAs per SM).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "cuda/common/cuda_status.h"
#include "cuda/common/element_io.cuh"
#include "cuda/preprocess/append_kv_destination.cuh"
#include "cuda/preprocess/append_kv_params.h"

namespace attnkit::cuda {

struct AppendKvTraits {
  static constexpr int kVec = 8;                 // elements per 16-byte input vector
  static constexpr int kSteps = kAppendKvSteps;  // units whose loads a thread issues together
  // 96 registers: five warps per SM sub-partition instead of four (at 112), which is what keeps
  // the 8-bit caches near or above 0.85 of copy bandwidth; the RoPE factors are read from shared
  // memory at each use rather than held in registers, which is what lets 96 fit without spills.
  static constexpr int kMaxRegs = 96;
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

// Two floats rounded to nearest even into one 32-bit word (one cvt.rn.{bf16,f16}x2.f32), the
// first in the low half; bit-exact with numerics::float_to_{bf16,f16}_bits.
template <DType kOut>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  if constexpr (kOut == DType::kBF16) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

template <DType kOut>
__device__ __forceinline__ uint4 pack8(const float* x) {
  return make_uint4(pack2<kOut>(x[0], x[1]), pack2<kOut>(x[2], x[3]), pack2<kOut>(x[4], x[5]),
                    pack2<kOut>(x[6], x[7]));
}

// numerics::float_to_int8_sat: round half to even, saturate, NaN -> 0 (cvt.rni.s32 gives 0).
__device__ __forceinline__ uint32_t int8_bits(float x) {
  const int32_t r = min(max(__float2int_rn(x), -128), 127);
  return static_cast<uint32_t>(r) & 0xffu;
}

// Stores 8 values (already divided by the scale) in the cache dtype: 16 bytes for bf16 / f16,
// 8 bytes for fp8 / int8.
template <DType kKv>
__device__ __forceinline__ void store_cache8(uint8_t* dst, const float* x) {
  if constexpr (kKv == DType::kBF16 || kKv == DType::kF16) {
    *reinterpret_cast<uint4*>(dst) = pack8<kKv>(x);
  } else {
    uint32_t words[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float* y = x + 4 * half;
      if constexpr (kKv == DType::kFp8E4M3) {
        // cvt.rn.satfinite.e4m3x2.f32 (sm_89+): rounds and saturates like
        // numerics::float_to_fp8_e4m3_bits; the first element lands in the low byte.
        const uint32_t lo =
            __nv_cvt_float2_to_fp8x2(make_float2(y[0], y[1]), __NV_SATFINITE, __NV_E4M3);
        const uint32_t hi =
            __nv_cvt_float2_to_fp8x2(make_float2(y[2], y[3]), __NV_SATFINITE, __NV_E4M3);
        words[half] = lo | (hi << 16);
      } else {
        words[half] = int8_bits(y[0]) | (int8_bits(y[1]) << 8) | (int8_bits(y[2]) << 16) |
                      (int8_bits(y[3]) << 24);
      }
    }
    *reinterpret_cast<uint2*>(dst) = make_uint2(words[0], words[1]);
  }
}

// x / scale, correctly rounded like the reference's float division: with r = RN(1 / scale),
// q = RN(x r) is within an ulp and one FMA residual step (Markstein) rounds the quotient
// correctly; three instructions instead of a full division per element.
__device__ __forceinline__ float divide_by_scale(float x, float scale, float reciprocal) {
  const float q = x * reciprocal;
  return fmaf(fmaf(-q, scale, x), reciprocal, q);
}

// cos and sin of position * inv_freq, as accurate as the reference's double math rounded to
// float: the angle and its reduction to [-pi, pi] in double (exact enough at positions of 10^6;
// the reduction keeps sincos on its fast path), then a double sincos. Float sincosf of the
// reduced angle is cheaper, but its 2e-7 rad error turned one-unit f16 agreement into up to six
// units on near-cancelling outputs. Only rotary_dim / 2 values per token, under the loads.
__device__ __forceinline__ float2 rope_cos_sin_of(int32_t position, double inv_freq) {
  constexpr double kTwoPi = 6.283185307179586476925;
  constexpr double kInvTwoPi = 0.15915494309189533577;
  const double angle = static_cast<double>(position) * inv_freq;
  const double reduced = fma(-rint(angle * kInvTwoPi), kTwoPi, angle);
  double s, c;
  sincos(reduced, &s, &c);
  return make_float2(static_cast<float>(c), static_cast<float>(s));
}

// The raw 16-byte input vectors of one unit, loaded before anything is computed so that all of a
// thread's units are in flight together.
struct AppendKvRaw {
  uint4 lo, hi;
};

// Which of Q, K or V a head index (0 .. Hq + 2 Hkv - 1) belongs to, and its index inside it.
struct AppendKvHead {
  int32_t local;
  bool is_q, is_k;
};

__device__ __forceinline__ AppendKvHead classify_head(const AppendKvParams& params, int32_t head) {
  AppendKvHead h;
  const int32_t hq = params.num_q_heads, hkv = params.num_kv_heads;
  h.is_q = head < hq;
  h.is_k = !h.is_q && head < hq + hkv;
  h.local = h.is_q ? head : (h.is_k ? head - hq : head - hq - hkv);
  return h;
}

__device__ __forceinline__ uint4 load16(const void* base, int64_t offset) {
  return __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(base) + offset));
}

// This thread's dims: a NeoX paired unit w covers d0 = 8w and d1 = d0 + rotary_dim / 2, a NeoX
// pass-through unit the (w - paired_units)-th vector after the rotary dims, any other unit
// d0 = 8w. `paired` is uniform per thread, and false at compile time for other styles.
struct AppendKvThreadDims {
  bool paired;
  int32_t d0, d1;
};

template <RopeStyle kStyle>
__device__ __forceinline__ AppendKvThreadDims thread_dims(const AppendKvParams& params) {
  constexpr int kVec = AppendKvTraits::kVec;
  const int32_t rotary_half = params.rope.rotary_dim / 2;
  const int32_t w = threadIdx.x;
  AppendKvThreadDims t;
  t.paired = kStyle == RopeStyle::kGptNeox && w < params.plan.paired_units;
  t.d0 = w * kVec;
  if (kStyle == RopeStyle::kGptNeox && !t.paired) {
    t.d0 = 2 * rotary_half + (w - params.plan.paired_units) * kVec;
  }
  t.d1 = t.d0 + rotary_half;
  return t;
}

// Issues the loads of the units of heads first, first + heads_per_pass, ... (up to kSteps).
__device__ __forceinline__ void load_units(const AppendKvParams& params, int64_t token,
                                           int32_t first, const AppendKvThreadDims& t,
                                           AppendKvRaw* raw) {
  const int32_t total_heads = params.num_q_heads + 2 * params.num_kv_heads;
#pragma unroll
  for (int k = 0; k < AppendKvTraits::kSteps; ++k) {
    const int32_t head = first + k * params.plan.heads_per_pass;
    if (head >= total_heads) break;
    const AppendKvHead h = classify_head(params, head);
    const void* in;
    int64_t offset;
    if (h.is_q) {
      in = params.q_in;
      offset = token * params.q_stride_token + h.local * params.q_stride_head;
    } else if (h.is_k) {
      in = params.k_in;
      offset = token * params.k_stride_token + h.local * params.k_stride_head;
    } else {
      in = params.v_in;
      offset = token * params.v_stride_token + h.local * params.v_stride_head;
    }
    raw[k].lo = load16(in, offset + t.d0);
    if (t.paired) raw[k].hi = load16(in, offset + t.d1);
  }
}

// Per-thread RoPE factors of its unit: NeoX pairs d0 + i (i < 8), GPT-J pairs d0 / 2 + i (i < 4).
struct AppendKvRotation {
  float cos[AppendKvTraits::kVec], sin[AppendKvTraits::kVec];
};

template <RopeStyle kStyle>
__device__ __forceinline__ void read_rotation(const AppendKvParams& params,
                                              const float2* token_table,
                                              const AppendKvThreadDims& t, AppendKvRotation& rot) {
  constexpr int kVec = AppendKvTraits::kVec;
  if constexpr (kStyle == RopeStyle::kGptNeox) {
    if (t.paired) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float2 cs = token_table[t.d0 + i];
        rot.cos[i] = cs.x;
        rot.sin[i] = cs.y;
      }
    }
  } else if constexpr (kStyle == RopeStyle::kGptJ) {
    const int32_t rotary_half = params.rope.rotary_dim / 2;
#pragma unroll
    for (int i = 0; i < kVec / 2; ++i) {
      const int32_t pair = t.d0 / 2 + i;
      const float2 cs = token_table[pair < rotary_half ? pair : 0];
      rot.cos[i] = cs.x;
      rot.sin[i] = cs.y;
    }
  }
}

// The token's table: rotary_dim / 2 (cos, sin) pairs, shared by all its Q and K heads, filled by
// the threads of the token.
__device__ __forceinline__ void fill_rope_table(const AppendKvParams& params, float2* token_table,
                                                int32_t position) {
  const int32_t rotary_half = params.rope.rotary_dim / 2;
  const int32_t threads_per_token = blockDim.x * blockDim.y;
  for (int32_t i = threadIdx.x + threadIdx.y * blockDim.x; i < rotary_half;
       i += threads_per_token) {
    token_table[i] = rope_cos_sin_of(position, params.inv_freq[i]);
  }
}

// Bias, rotation, rounding and the stores of the units loaded by load_units.
template <DType kIn, DType kKv, RopeStyle kStyle>
__device__ __forceinline__ void finish_units(const AppendKvParams& params, int64_t token,
                                             int32_t first, const AppendKvThreadDims& t,
                                             const AppendKvRaw* raw, const float2* token_table,
                                             int64_t cache_offset) {
  constexpr int kVec = AppendKvTraits::kVec;
  const int32_t total_heads = params.num_q_heads + 2 * params.num_kv_heads;
  const int32_t elt = params.layout.element_bytes;
  const int64_t head_bytes = params.layout.head_stride_bytes;  // HND or NHD (KvLayout)
  const bool paired = t.paired;
  const int32_t d0 = t.d0, d1 = t.d1;
#pragma unroll
  for (int k = 0; k < AppendKvTraits::kSteps; ++k) {
    const int32_t head = first + k * params.plan.heads_per_pass;
    if (head >= total_heads) break;
    const AppendKvHead h = classify_head(params, head);
    if (!h.is_q && cache_offset < 0) continue;  // a faulting token writes nothing to the cache
    float lo[kVec], hi[kVec];
    unpack8<kIn>(raw[k].lo, lo);
    if (paired) unpack8<kIn>(raw[k].hi, hi);
    if (params.bias != nullptr) {
      // The bias is a few KB that every token reads: L1 / L2 hits, loaded late to keep the
      // registers for the streamed input.
      const int64_t bias_offset = static_cast<int64_t>(head) * params.head_dim;
      float b[kVec];
      unpack8<kIn>(load16(params.bias, bias_offset + d0), b);
#pragma unroll
      for (int i = 0; i < kVec; ++i) lo[i] += b[i];
      if (paired) {
        unpack8<kIn>(load16(params.bias, bias_offset + d1), b);
#pragma unroll
        for (int i = 0; i < kVec; ++i) hi[i] += b[i];
      }
    }
    if (h.is_q || h.is_k) {
      AppendKvRotation rot;
      read_rotation<kStyle>(params, token_table, t, rot);
      if constexpr (kStyle == RopeStyle::kGptNeox) {
        if (paired) {
#pragma unroll
          for (int i = 0; i < kVec; ++i) {
            const float a = lo[i], b = hi[i];
            lo[i] = a * rot.cos[i] - b * rot.sin[i];
            hi[i] = b * rot.cos[i] + a * rot.sin[i];
          }
        }
      } else if constexpr (kStyle == RopeStyle::kGptJ) {
        const int32_t rotary_half = params.rope.rotary_dim / 2;
#pragma unroll
        for (int i = 0; i < kVec; i += 2) {
          if (d0 / 2 + i / 2 < rotary_half) {
            const float a = lo[i], b = lo[i + 1];
            lo[i] = a * rot.cos[i / 2] - b * rot.sin[i / 2];
            lo[i + 1] = b * rot.cos[i / 2] + a * rot.sin[i / 2];
          }
        }
      }
    }
    if (h.is_q) {
      uint16_t* out = static_cast<uint16_t*>(params.q_out) + token * params.q_out_stride_token +
                      h.local * params.q_out_stride_head;
      // A faulting token's q_out is zeros.
      const uint4 zero = make_uint4(0, 0, 0, 0);
      *reinterpret_cast<uint4*>(out + d0) = cache_offset < 0 ? zero : pack8<kIn>(lo);
      if (paired) *reinterpret_cast<uint4*>(out + d1) = cache_offset < 0 ? zero : pack8<kIn>(hi);
      continue;
    }
    // The scale is one float per tensor or KV head: an L1 hit, loaded here rather than held.
    const float scale = h.is_k ? kv_scale_of(params.k_scale, params.k_scale_per_head, h.local)
                               : kv_scale_of(params.v_scale, params.v_scale_per_head, h.local);
    // x / 1 == x: an unscaled cache skips the division.
    if (scale != 1.0f) {
      const float reciprocal = __frcp_rn(scale);
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        lo[i] = divide_by_scale(lo[i], scale, reciprocal);
        if (paired) hi[i] = divide_by_scale(hi[i], scale, reciprocal);
      }
    }
    uint8_t* dst = (h.is_k ? params.layout.k_base : params.layout.v_base) + cache_offset +
                   h.local * head_bytes;
    store_cache8<kKv>(dst + static_cast<int64_t>(d0) * elt, lo);
    if (paired) store_cache8<kKv>(dst + static_cast<int64_t>(d1) * elt, hi);
  }
}

// Byte offset (from k_base or v_base) of element 0 of KV head 0 at `position` of the token's row,
// or -1 when the token's row, slot or block is outside the cache (append_kv_destination.cuh);
// KV head h's row is h x head_stride_bytes further. 32-bit slot math and a shift for the page,
// once per thread and token.
__device__ __forceinline__ int64_t cache_token_offset(const AppendKvParams& params, int64_t token,
                                                      int32_t position) {
  AppendKvDestination dst;
  if (!append_kv_destination(params, token, position, params.plan.page_shift, &dst)) {
    return -1;
  }
  return static_cast<int64_t>(dst.block) * params.layout.block_stride_bytes +
         static_cast<int64_t>(dst.in_block) * params.layout.token_stride_bytes;
}

template <DType kIn, DType kKv, RopeStyle kStyle>
__global__ void __maxnreg__(AppendKvTraits::kMaxRegs)
    fused_append_kv_kernel(const __grid_constant__ AppendKvParams params) {
  extern __shared__ float2 cos_sin_table[];
  const FusedAppendKvPlan& plan = params.plan;
  const int64_t token = static_cast<int64_t>(blockIdx.x) * plan.tokens_per_cta + threadIdx.z;
  const bool token_valid = token < params.num_tokens;
  const AppendKvThreadDims t = thread_dims<kStyle>(params);

  AppendKvRaw raw[AppendKvTraits::kSteps];
  const int32_t first = threadIdx.y;
  if (token_valid) load_units(params, token, first, t, raw);
  int32_t position = 0;
  int64_t cache_offset = -1;
  if (token_valid) {
    position = params.positions[token];
    cache_offset = cache_token_offset(params, token, position);
  }
  float2* token_table = cos_sin_table + threadIdx.z * (params.rope.rotary_dim / 2);
  if constexpr (kStyle != RopeStyle::kNone) {
    if (token_valid) fill_rope_table(params, token_table, position);
    __syncthreads();
  }
  if (!token_valid) return;
  const int32_t total_heads = params.num_q_heads + 2 * params.num_kv_heads;
  for (int32_t head = first;;) {
    finish_units<kIn, kKv, kStyle>(params, token, head, t, raw, token_table, cache_offset);
    head += AppendKvTraits::kSteps * plan.heads_per_pass;
    if (head >= total_heads) break;
    load_units(params, token, head, t, raw);
  }
  if (cache_offset < 0 && (threadIdx.x | threadIdx.y) == 0) {
    record_append_kv_fault(params, token, params.plan.page_shift);  // the token's first thread
  }
}

template <DType kIn, DType kKv, RopeStyle kStyle>
void launch_fused_append_kv_typed(const AppendKvParams& params, cudaStream_t stream) {
  const FusedAppendKvPlan& plan = params.plan;
  const int64_t blocks = (params.num_tokens + plan.tokens_per_cta - 1) / plan.tokens_per_cta;
  const dim3 threads(plan.units_per_head, plan.heads_per_pass, plan.tokens_per_cta);
  const size_t table_bytes = kStyle == RopeStyle::kNone ? 0
                                                        : sizeof(float2) * plan.tokens_per_cta *
                                                              (params.rope.rotary_dim / 2);
  fused_append_kv_kernel<kIn, kKv, kStyle>
      <<<static_cast<unsigned>(blocks), threads, table_bytes, stream>>>(params);
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
