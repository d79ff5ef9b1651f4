// Device parts of the SAGE quantize pass and the fp8 V transposes: the sequence guards, the block
// quantizer of Q and K, the column statistics of K and V, and the V^T tile store. The codes and
// scales come from core/sage_quant.h, the functions the CPU reference uses, so both produce the
// same bits (IEEE division, round to nearest even; no fast-math reciprocal).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/sage_quant.h"
#include "cuda/common/device_fault.cuh"
#include "cuda/sage/sage_quant_params.h"

namespace attnkit::cuda::sage {

namespace codes = ::attnkit::sage;

inline constexpr int kThreads = 256;
// Tokens of one sequence that one CTA covers per round of the grid's y dimension: the grid has
// ceil(max_seqlen / kTokensPerCta) rows of CTAs and each loops with that stride.
inline constexpr int kTokensPerCta = 256;
// V^T tiles: 128 tokens, so that each row of the tile is one 128-byte line of V^T.
inline constexpr int kVtTileTokens = 128;
inline constexpr int kVtTilePitch = kVtTileTokens + 4;  // bytes; a multiple of 4
inline constexpr int kMaxDim = 256;
// SageKvStats::k_low_bit_key = kLowBitBias - exponent of the lowest set bit (>= -149): positive
// for every nonzero float, so that a zeroed buffer means "no nonzero value yet" under atomicMax.
inline constexpr int kLowBitBias = 400;

// The tokens of one sequence: packed tokens start .. start + len - 1 (ok = false: the sequence's
// cu_seqlens entries fault; it has no tokens).
struct SeqSpan {
  int64_t start = 0;
  int64_t len = 0;
  bool ok = false;
};

// Sequence b of `s`, with the guards of docs/safety.md (those of the prefill kernels): 0 <= cu[b]
// <= cu[b + 1] <= total and cu[b - 1] <= cu[b]. With `record` the faults are recorded, each bad
// entry once, by the sequence that ends at it (entry 0 by sequence 0); the caller passes it from
// one thread of one CTA per sequence.
__device__ __forceinline__ SeqSpan sequence_span(const SageSequences& s, int64_t b,
                                                 const FaultSite* record) {
  if (s.cu_seqlens == nullptr) return {b * s.seqlen, s.seqlen, true};
  const int64_t start = s.cu_seqlens[b];
  const int64_t end = s.cu_seqlens[b + 1];
  const int64_t before = b > 0 ? s.cu_seqlens[b - 1] : 0;
  const bool start_ok = start >= 0 && start <= s.total;
  const bool ok = start_ok && start <= end && end <= s.total && before <= start;
  if (!ok && record != nullptr) {
    if (b == 0 && !start_ok) guard_cu_seqlens(*record, s.arg, 0, start, 0, s.total);
    guard_cu_seqlens(*record, s.arg, b + 1, end, start_ok ? start : 0, s.total);
  }
  if (!ok) return {};
  return {start, end - start, true};
}

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// Element offset of token 0, channel 0 of head h of the sequence.
__device__ __forceinline__ int64_t input_base(const SageInput& in, const SageSequences& s,
                                              int64_t b, const SeqSpan& span, int32_t h) {
  return (s.cu_seqlens ? span.start * in.stride_token : b * in.stride_batch) +
         static_cast<int64_t>(h) * in.stride_head;
}

// Thread (c, r) of a CTA laid over a tile of tokens: channels c .. c + width - 1 of the tile's
// tokens r, r + rows, ... (threads with r >= rows idle when dim / width does not divide kThreads).
struct TokenLanes {
  int c;
  int r;
  int rows;
};
__device__ __forceinline__ TokenLanes token_lanes(int32_t dim, int width) {
  const int vecs = dim / width;
  return {static_cast<int>(threadIdx.x % vecs) * width, static_cast<int>(threadIdx.x / vecs),
          kThreads / vecs};
}

// Eight consecutive 16-bit elements (16-byte aligned) widened to float (exact).
template <DType kIn>
__device__ __forceinline__ void load8(const void* data, int64_t offset, float (&x)[8]) {
  const uint4 u =
      __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(data) + offset));
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const auto lo = static_cast<uint16_t>(w[i] & 0xffffu);
    const auto hi = static_cast<uint16_t>(w[i] >> 16);
    if constexpr (kIn == DType::kBF16) {
      x[2 * i] = numerics::bf16_bits_to_float(lo);
      x[2 * i + 1] = numerics::bf16_bits_to_float(hi);
    } else {
      x[2 * i] = __half2float(__ushort_as_half(lo));
      x[2 * i + 1] = __half2float(__ushort_as_half(hi));
    }
  }
}

template <DType kIn>
__device__ __forceinline__ float load1(const void* data, int64_t offset) {
  const uint16_t bits = static_cast<const uint16_t*>(data)[offset];
  if constexpr (kIn == DType::kBF16) return numerics::bf16_bits_to_float(bits);
  return __half2float(__ushort_as_half(bits));
}

// ---- Q and K: per block of block_size tokens --------------------------------------------------

// Quantizes the blocks of one (sequence, head): `in` + in_base + t * in_stride + d is element d of
// token t, `out` + t * out_stride + d its code, scales[j] the scale of block j (tokens
// j * block_size ..). With kSmooth, mean[d] (shared memory) is subtracted first, in float32 as
// the reference does. A block is served by `group` lanes of one warp (a power of two: the block's
// 8-element vectors, at most 32), so that a block of one 64-channel token keeps 8 lanes busy and
// the block's amax is a shuffle reduction; the CTA's groups take consecutive blocks, and the CTA
// walks the sequence with the stride of the grid's rows. The block is read twice (amax, then
// codes); the second read hits L1.
template <DType kIn, bool kInt8, bool kSmooth>
__device__ __forceinline__ void quantize_blocks(const void* in, int64_t in_base, int64_t in_stride,
                                                uint8_t* out, int64_t out_stride, float* scales,
                                                int64_t len, int32_t block_size, int32_t dim,
                                                const float* mean) {
  const int vecs_per_token = dim / 8;
  const int block_vecs = block_size * vecs_per_token;
  const int group = min(32, 1 << (31 - __clz(block_vecs)));
  const int lane = threadIdx.x % 32;
  const int lane_in_group = lane % group;
  const int groups_per_warp = 32 / group;
  const int groups_per_cta = groups_per_warp * (kThreads / 32);
  const int64_t num_blocks = (len + block_size - 1) / block_size;

  auto element = [&](int d, float x) {
    if constexpr (kSmooth) return x - mean[d];
    return x;
  };
  // Warp-uniform loop: every lane takes part in the shuffles, lanes past the end with amax 0.
  for (int64_t first =
           static_cast<int64_t>(blockIdx.y) * groups_per_cta + (threadIdx.x / 32) * groups_per_warp;
       first < num_blocks; first += static_cast<int64_t>(gridDim.y) * groups_per_cta) {
    const int64_t j = first + lane / group;
    const int64_t t0 = j * block_size;
    const int vecs =
        j < num_blocks ? static_cast<int>(min64(block_size, len - t0)) * vecs_per_token : 0;
    float amax = 0.0f;
    for (int v = lane_in_group; v < vecs; v += group) {
      const int64_t t = t0 + v / vecs_per_token;
      const int c = (v % vecs_per_token) * 8;
      float x[8];
      load8<kIn>(in, in_base + t * in_stride + c, x);
#pragma unroll
      for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(element(c + i, x[i])));
    }
    for (int offset = group / 2; offset > 0; offset /= 2) {
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    }
    const float scale = kInt8 ? codes::int8_block_scale(amax) : codes::fp8_block_scale(amax);
    for (int v = lane_in_group; v < vecs; v += group) {
      const int64_t t = t0 + v / vecs_per_token;
      const int c = (v % vecs_per_token) * 8;
      float x[8];
      load8<kIn>(in, in_base + t * in_stride + c, x);
      uint32_t packed[2] = {0u, 0u};
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float value = element(c + i, x[i]);
        const uint32_t code = kInt8 ? static_cast<uint8_t>(codes::quantize_int8(value, scale))
                                    : codes::quantize_fp8(value, scale);
        packed[i / 4] |= code << (8 * (i % 4));
      }
      *reinterpret_cast<uint2*>(out + t * out_stride + c) = make_uint2(packed[0], packed[1]);
    }
    if (j < num_blocks && lane_in_group == 0) scales[j] = scale;
  }
}

// ---- K and V: per-channel statistics over a sequence ------------------------------------------

// kLowBitBias - the exponent of the lowest set bit of x, 0 for zero. Every nonzero value is an
// integer multiple of 2^(that exponent).
__device__ __forceinline__ uint32_t low_bit_key(float x) {
  const uint32_t u = __float_as_uint(x) & 0x7fffffffu;
  if (u == 0) return 0;
  const int biased = static_cast<int>(u >> 23);
  const uint32_t significand = biased == 0 ? u : (u & 0x7fffffu) | 0x800000u;
  const int low = (biased == 0 ? -149 : biased - 150) + (__ffs(significand) - 1);
  return static_cast<uint32_t>(kLowBitBias - low);
}

// Whether the fp64 sum of the values behind `stats` is exact in every order: all values are
// multiples of q = 2^low, so every partial sum is one too, and |partial| <= sum |x| < 2^53 q
// makes it representable. The factor-two margin (2^52) covers the rounding of k_abs_sum itself.
// Then the atomics' order cannot change the sum, and it equals the reference's token-order sum.
__device__ __forceinline__ bool k_sum_is_exact(const SageKvStats& stats) {
  if (stats.k_low_bit_key == 0) return true;  // every value is zero
  const int low = kLowBitBias - static_cast<int>(stats.k_low_bit_key);
  return stats.k_abs_sum <= ldexp(1.0, 52 + low);
}

// Reduces one statistic (8 channels per thread, `rows` threads per channel) over the CTA through
// `buffer` (kThreads x 8 doubles) and hands each channel's value to publish(d, value).
template <typename T, typename Combine, typename Publish>
__device__ __forceinline__ void reduce_channels(double* buffer, const T (&mine)[8], int c, int r,
                                                int rows, int dim, Combine combine,
                                                Publish publish) {
  __syncthreads();
  if (r < rows) {
#pragma unroll
    for (int i = 0; i < 8; ++i) buffer[r * dim + c + i] = static_cast<double>(mine[i]);
  }
  __syncthreads();
  for (int d = threadIdx.x; d < dim; d += kThreads) {
    double value = buffer[d];
    for (int rr = 1; rr < rows; ++rr) value = combine(value, buffer[rr * dim + d]);
    publish(d, value);
  }
}

// Adds this CTA's tokens of (sequence b, KV head h) to the statistics: K's sum, sum of |K| and
// lowest set bit (for the mean), V's max |V| (for its scale). Thread (c, r) reads channels
// c .. c + 7 of every rows-th token; one atomic per channel and statistic per CTA.
template <DType kIn>
__device__ __forceinline__ void accumulate_kv_stats(const SageQuantParams& p, int64_t b, int32_t h,
                                                    const SeqSpan& span, double* buffer) {
  const int dim = p.head_dim;
  const TokenLanes lanes = token_lanes(dim, 8);
  const int c = lanes.c, r = lanes.r, rows = lanes.rows;
  double k_sum[8] = {}, k_abs[8] = {};
  uint32_t low_key[8] = {};
  float v_max[8] = {};
  const int64_t k_base = input_base(p.k, p.kv_seqs, b, span, h) + c;
  const int64_t v_base = input_base(p.v, p.kv_seqs, b, span, h) + c;
  if (r < rows) {
    for (int64_t t0 = static_cast<int64_t>(blockIdx.y) * kTokensPerCta; t0 < span.len;
         t0 += static_cast<int64_t>(gridDim.y) * kTokensPerCta) {
      const int64_t t1 = min64(span.len, t0 + kTokensPerCta);
#pragma unroll 4
      for (int64_t t = t0 + r; t < t1; t += rows) {
        float kx[8], vx[8];
        load8<kIn>(p.k.data, k_base + t * p.k.stride_token, kx);
        load8<kIn>(p.v.data, v_base + t * p.v.stride_token, vx);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          k_sum[i] += kx[i];
          k_abs[i] += fabsf(kx[i]);
          low_key[i] = max(low_key[i], low_bit_key(kx[i]));
          v_max[i] = fmaxf(v_max[i], fabsf(vx[i]));  // a NaN is never the max, as in the reference
        }
      }
    }
  }
  SageKvStats* stats = p.stats + (b * p.num_kv_heads + h) * dim;
  auto add = [](double x, double y) { return x + y; };
  auto larger = [](double x, double y) { return fmax(x, y); };
  reduce_channels(buffer, k_sum, c, r, rows, dim, add,
                  [&](int d, double s) { atomicAdd(&stats[d].k_sum, s); });
  reduce_channels(buffer, k_abs, c, r, rows, dim, add,
                  [&](int d, double s) { atomicAdd(&stats[d].k_abs_sum, s); });
  reduce_channels(buffer, low_key, c, r, rows, dim, larger, [&](int d, double key) {
    if (key > 0.0) atomicMax(&stats[d].k_low_bit_key, static_cast<uint32_t>(key));
  });
  reduce_channels(buffer, v_max, c, r, rows, dim, larger, [&](int d, double amax) {
    if (amax > 0.0) atomicMax(&stats[d].v_amax_bits, __float_as_uint(static_cast<float>(amax)));
  });
}

// ---- V^T tiles ---------------------------------------------------------------------------------

// Writes `rows` V^T rows of the shared tile (row pitch kVtTilePitch, token tt at column tt, cols
// <= kVtTileTokens tokens) to dst + row * stride in the V^T column order (sage_quant_params.h:
// column c of a 32-token group holds token vt_key(c); the last group is written whole, zeros for
// the tokens past cols): one warp per row, four bytes a lane, as one 32-bit store where the
// destination is aligned (a sequence at an odd column stores bytes).
__device__ __forceinline__ void store_vt_tile(const uint8_t* tile, uint8_t* dst, int64_t stride,
                                              int rows, int cols) {
  const int col = (threadIdx.x % 32) * 4;
  const int out_cols = static_cast<int>(round_up(cols, 32));
  if (col >= out_cols) return;
  for (int d = threadIdx.x / 32; d < rows; d += kThreads / 32) {
    uint32_t word = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int token = prefill::fp8_layout::vt_key(col + k);
      if (token < cols) word |= static_cast<uint32_t>(tile[d * kVtTilePitch + token]) << (8 * k);
    }
    uint8_t* p = dst + d * stride + col;
    if (reinterpret_cast<uintptr_t>(p) % 4 == 0) {
      *reinterpret_cast<uint32_t*>(p) = word;
    } else {
      for (int k = 0; k < 4; ++k) p[k] = static_cast<uint8_t>(word >> (8 * k));
    }
  }
}

// Walks the sequence's tokens in V^T tiles of kVtTileTokens (the CTAs of the grid's rows take
// them in turn): fill(t0, cols) writes the codes of tokens t0 .. t0 + cols - 1 into the shared
// tile (tile[d * kVtTilePitch + t - t0]), then the tile goes to dst + t0 in V^T's column order
// (dst: V^T row 0 of the head at the sequence's first column, vt_seq_column).
template <typename Fill>
__device__ __forceinline__ void for_each_vt_tile(int64_t len, const uint8_t* tile, uint8_t* dst,
                                                 int64_t stride, int32_t dim, Fill fill) {
  for (int64_t t0 = static_cast<int64_t>(blockIdx.y) * kVtTileTokens; t0 < len;
       t0 += static_cast<int64_t>(gridDim.y) * kVtTileTokens) {
    const int cols = static_cast<int>(min64(kVtTileTokens, len - t0));
    fill(t0, cols);
    __syncthreads();
    store_vt_tile(tile, dst + t0, stride, dim, cols);
    __syncthreads();
  }
}

}  // namespace attnkit::cuda::sage
