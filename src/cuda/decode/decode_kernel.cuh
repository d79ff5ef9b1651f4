// The fused GQA decode kernel (XQA style): one CTA serves up to 16 query heads of one KV head
// (the MMA rows), so every K/V byte is read once per group. Grid: x = split * head_blocks +
// head_block, y = KV head, z = row. Four warps; a tile of 64 keys is loaded into shared memory
// by a multi-stage cp.async pipeline, each warp takes 16 keys of the tile and keeps its own
// online-softmax state (m, l, O); the warps are merged at the end. QK^T and PV run on
// mma.sync m16n8k16 with float accumulation. 8-bit caches are widened to the query type in
// registers; their scales multiply the logits (K) and the output (V).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "cuda/common/cp_async_sm80.cuh"
#include "cuda/common/ldmatrix_sm80.cuh"
#include "cuda/common/mma_sm80.cuh"
#include "cuda/decode/decode_params.h"

namespace attnkit::cuda {

// KV-cache element types: the cache's storage, and how two stored bytes widen to the MMA type.
struct KvNative {  // the cache holds the query's own type: no conversion
  static constexpr int kBytes = 2;
};
struct KvFp8E4M3 {
  static constexpr int kBytes = 1;
  template <typename Tag>
  __device__ __forceinline__ static uint32_t widen_pair(uint16_t two) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(two, __NV_E4M3);
    if constexpr (std::is_same_v<Tag, F16Tag>) {
      return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
    } else {
      // e4m3 values are exact in bf16 as well.
      const float2 f = __half22float2(__half2(h));
      return pack_pair<Tag>(f.x, f.y);
    }
  }
};
struct KvInt8 {
  static constexpr int kBytes = 1;
  template <typename Tag>
  __device__ __forceinline__ static uint32_t widen_pair(uint16_t two) {
    // |x| <= 128 is exact in both f16 and bf16.
    const float lo = static_cast<float>(static_cast<int8_t>(two & 0xff));
    const float hi = static_cast<float>(static_cast<int8_t>(two >> 8));
    return pack_pair<Tag>(lo, hi);
  }
};

template <int kHeadDim_, typename QTag_, typename Kv_>
struct DecodeTraits {
  static constexpr int kHeadDim = kHeadDim_;
  using QTag = QTag_;
  using Kv = Kv_;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kKeysPerWarp = 16;
  static constexpr int kTileN = kWarps * kKeysPerWarp;
  static constexpr bool k8Bit = Kv::kBytes == 1;
  // 8-bit caches feed the MMAs from the stored bytes: ldmatrix on byte rows, widened to the
  // query type in registers (no widening pass through shared memory).
  static constexpr bool kDirect = k8Bit;
  // Byte rows of an 8-bit stage: padded so that their pitch is an odd number of 16-byte units
  // (conflict-free ldmatrix; D = 80 also gets room for the unused half of its last x4 load).
  static constexpr int kRawRowBytes = kHeadDim + ((kHeadDim / 16) % 2 == 0 ? 16 : 32);
  // Rows of 16-bit elements padded by 16 bytes: ldmatrix's 8 row addresses then fall into
  // distinct bank groups (the row pitch is an odd number of 16-byte units).
  static constexpr int kRowStride = kHeadDim + 8;
  static constexpr int kRowBytes = kRowStride * 2;
  static constexpr int kChunksPerToken = kHeadDim * Kv::kBytes / 16;  // 16-byte copies per row
  static constexpr int kQBytes = kDecodeHeadsPerCta * kRowBytes;
  // One pipeline stage: K and V of kTileN keys, stored (8-bit: unpadded) or ready for ldmatrix.
  static constexpr int kStageHalfBytes =
      k8Bit ? kTileN * kRawRowBytes : kTileN * kRowBytes;  // K (or V) of one stage
  static constexpr int kStageBytes = 2 * kStageHalfBytes;
  // ~104 KB per CTA leaves room for two CTAs per SM on sm_90 (228 KB).
  static constexpr int kBudget = 104 * 1024;
  static constexpr int kStagesFit = kBudget / kStageBytes;
  static constexpr int kStages = kStagesFit < 2 ? 2 : (kStagesFit > 6 ? 6 : kStagesFit);
  static constexpr int kPipelineBytes = kStages * kStageBytes;
  // The warp merge reuses the pipeline memory: O, m and l of every warp.
  static constexpr int kMergeBytes =
      kWarps * kDecodeHeadsPerCta * (kHeadDim + 2) * static_cast<int>(sizeof(float));
  static_assert(kMergeBytes <= kPipelineBytes);
  static constexpr int kSmemBytes = kQBytes + kPipelineBytes;
  static_assert(kHeadDim % 16 == 0 && (kHeadDim * Kv::kBytes) % 16 == 0);
};

// Logit transforms as a compile-time policy: kPlain is q.k * scale; kTransformed applies the
// soft-cap (when softcap > 0) and the ALiBi bias (slope 0 when off), in DESIGN.md's order.
enum class DecodeLogits { kPlain, kTransformed };

__device__ __forceinline__ float warp_max_quad(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float warp_sum_quad(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The keys a decode query attends, as a dense index range [0, num_keys): the sink keys
// [0, sink_count) followed by the window [window_begin, seq_len).
struct DecodeKeyRange {
  int32_t sink_count = 0;
  int32_t window_begin = 0;
  int32_t num_keys = 0;

  __device__ __forceinline__ DecodeKeyRange(int32_t seq_len, int32_t window, int32_t sinks) {
    if (seq_len <= 0) return;
    if (window > 0) {
      window_begin = max(0, seq_len - window);
      sink_count = min(sinks, window_begin);
    }
    num_keys = sink_count + (seq_len - window_begin);
  }
  __device__ __forceinline__ int32_t position(int32_t key) const {
    return key < sink_count ? key : window_begin + (key - sink_count);
  }
};

template <typename Traits, DecodeLogits kLogits>
__global__ void __launch_bounds__(Traits::kThreads)
    decode_kernel(const __grid_constant__ DecodeParams p) {
  using QTag = typename Traits::QTag;
  using QT = typename QTag::Storage;
  using Kv = typename Traits::Kv;
  constexpr int kD = Traits::kHeadDim;
  constexpr int kTileN = Traits::kTileN;
  constexpr int kStages = Traits::kStages;
  constexpr int kRowStride = Traits::kRowStride;
  constexpr int kM = kDecodeHeadsPerCta;
  constexpr float kLog2e = 1.4426950408889634f;

  extern __shared__ __align__(128) uint8_t smem[];
  QT* q_smem = reinterpret_cast<QT*>(smem);
  uint8_t* pipe_smem = smem + Traits::kQBytes;

  const int head_block = blockIdx.x % p.head_blocks;
  const int split = blockIdx.x / p.head_blocks;
  const int kv_head = blockIdx.y;
  const int row = blockIdx.z;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int first_head = kv_head * p.group_size + head_block * kM;
  const int heads_here = min(kM, p.group_size - head_block * kM);

  const int32_t seq_len = p.seq_lens[row];
  const int32_t q_pos = seq_len - 1;
  const DecodeKeyRange keys(seq_len, p.window, p.sink_tokens);
  const int32_t keys_per_split =
      ((keys.num_keys + p.num_splits - 1) / p.num_splits + kTileN - 1) / kTileN * kTileN;
  const int32_t key_begin = split * keys_per_split;
  const int32_t key_end = min(keys.num_keys, key_begin + keys_per_split);

  if (p.num_splits > 1 && key_begin >= key_end) {
    // Nothing to attend in this split: the combine skips partial results with LSE -inf.
    for (int h = threadIdx.x; h < heads_here; h += Traits::kThreads) {
      p.partial_lse[(static_cast<int64_t>(split) * p.num_rows + row) * p.num_q_heads + first_head +
                    h] = -INFINITY;
    }
    return;
  }

  // Query rows of this head block (rows past the group are zero).
  {
    const QT* q = static_cast<const QT*>(p.q) + row * p.q_row_stride;
    for (int i = threadIdx.x; i < kM * kD; i += Traits::kThreads) {
      const int r = i / kD, d = i % kD;
      int src = d;
      if constexpr (Traits::kDirect) {
        // Direct 8-bit K fragments hold 4 consecutive stored bytes (d 4t..4t+3 of a 16-d step)
        // where the MMA expects k = 2t, 2t+1, 2t+8, 2t+9: permute Q's d the same way.
        const int x = d % 16;
        src = d - x + 4 * ((x % 8) / 2) + (x % 2) + 2 * (x / 8);
      }
      q_smem[r * kRowStride + d] =
          r < heads_here ? q[(first_head + r) * p.q_head_stride + src] : QT(0.0f);
    }
  }

  const int beam_seq = row / p.beam_width;
  const int beam = row % p.beam_width;
  // Stage loader, in two steps. key_offset(): lane t < 16 of warp w computes the byte offset of
  // key 16w + t of a tile (block table, cyclic slot, beam indirection: all through KvLayout), or
  // -1 past the split. copy_tile(): the copy lanes fetch the offsets by shuffle so that
  // consecutive lanes copy consecutive 16 bytes. The main loop computes the offsets one tile
  // ahead, so that the block-table latency overlaps the math.
  auto key_offset = [&](int tile) -> int64_t {
    const int32_t key = key_begin + tile * kTileN + warp * Traits::kKeysPerWarp + lane;
    if (lane >= Traits::kKeysPerWarp || key >= key_end) return -1;
    const int32_t pos = keys.position(key);
    int64_t src_row = row;
    if (p.cache_indirection != nullptr) {
      const int32_t src_beam =
          p.cache_indirection[beam_seq * p.indirection_seq_stride +
                              beam * p.indirection_beam_stride + pos * p.indirection_pos_stride];
      src_row = static_cast<int64_t>(beam_seq) * p.beam_width + src_beam;
    }
    return p.kv.byte_offset_shift(src_row, p.kv.slot_of(pos), kv_head, 0, p.page_shift);
  };
  auto copy_tile = [&](int64_t my_offset, int stage) {
    uint8_t* k_dst = pipe_smem + stage * Traits::kStageBytes;
    uint8_t* v_dst = k_dst + Traits::kStageHalfBytes;
    constexpr int kDstRowBytes = Traits::k8Bit ? Traits::kRawRowBytes : Traits::kRowBytes;
    constexpr int kChunks = Traits::kKeysPerWarp * Traits::kChunksPerToken;
    // Every lane runs every iteration: the shuffles need the whole warp.
#pragma unroll
    for (int base = 0; base < kChunks; base += 32) {
      const int c = base + lane;
      const int token = min(c / Traits::kChunksPerToken, Traits::kKeysPerWarp - 1);
      const int part = c % Traits::kChunksPerToken;
      const int64_t key_offset = __shfl_sync(0xffffffffu, my_offset, token);
      const bool valid = key_offset >= 0;
      const int64_t offset = key_offset + part * 16;
      if (c < kChunks) {
        const int dst = (warp * Traits::kKeysPerWarp + token) * kDstRowBytes + part * 16;
        cp_async_16(smem_u32(k_dst + dst), valid ? p.kv.k_base + offset : p.kv.k_base, valid);
        cp_async_16(smem_u32(v_dst + dst), valid ? p.kv.v_base + offset : p.kv.v_base, valid);
      }
    }
  };

  const float k_scale = p.k_scale ? p.k_scale[p.k_scale_per_head ? kv_head : 0] : 1.0f;
  const float v_scale = p.v_scale ? p.v_scale[p.v_scale_per_head ? kv_head : 0] : 1.0f;
  const float qk_scale = p.softmax_scale * k_scale;
  const int g = lane / 4, t = lane % 4;
  float slope[2] = {0.0f, 0.0f};
  if constexpr (kLogits == DecodeLogits::kTransformed) {
    slope[0] = g < heads_here ? p.alibi_slopes[first_head + g] : 0.0f;
    slope[1] = g + 8 < heads_here ? p.alibi_slopes[first_head + g + 8] : 0.0f;
  }

  float o[kD / 8][4];
#pragma unroll
  for (int n = 0; n < kD / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY};  // log2 domain
  float l_run[2] = {0.0f, 0.0f};            // this thread's share of the row sums

  const int num_tiles = (key_end - key_begin + kTileN - 1) / kTileN;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < num_tiles) copy_tile(key_offset(s), s);
    cp_async_commit();
  }
  int64_t next_offset = kStages - 1 < num_tiles ? key_offset(kStages - 1) : -1;

  for (int tile = 0; tile < num_tiles; ++tile) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    {
      const int next = tile + kStages - 1;
      if (next < num_tiles) copy_tile(next_offset, next % kStages);
      cp_async_commit();
      // Next iteration's offsets (-1 past the split): issued here so that the block-table read
      // overlaps this tile's math.
      next_offset = key_offset(tile + kStages);
    }
    const int stage = tile % kStages;
    // S = Q K^T for this warp's 16 keys: two n8 tiles.
    float s[2][4] = {};
    if constexpr (Traits::kDirect) {
      const uint8_t* k_rows = pipe_smem + stage * Traits::kStageBytes +
                              warp * Traits::kKeysPerWarp * Traits::kRawRowBytes;
#pragma unroll
      for (int kk = 0; kk < kD / 16; kk += 2) {
        // Matrices: keys 0-7 / 8-15 of steps kk and kk + 1 (for D = 80 the last step's second
        // half reads row padding and is not used).
        uint32_t b[4];
        ldmatrix_x4(b, smem_u32(k_rows + (((lane / 8) % 2) * 8 + lane % 8) * Traits::kRawRowBytes +
                                (kk + lane / 16) * 16));
#pragma unroll
        for (int step = 0; step < 2; ++step) {
          if (kk + step < kD / 16) {
            uint32_t a[4];
            ldmatrix_x4(a, smem_u32(q_smem + (lane % 16) * kRowStride + (kk + step) * 16 +
                                    (lane / 16) * 8));
#pragma unroll
            for (int n = 0; n < 2; ++n) {
              const uint32_t word = b[2 * step + n];
              const uint32_t bn[2] = {Kv::template widen_pair<QTag>(word & 0xffff),
                                      Kv::template widen_pair<QTag>(word >> 16)};
              mma_m16n8k16<QTag>(s[n], a, bn);
            }
          }
        }
      }
    } else {
      const QT* k_rows = reinterpret_cast<const QT*>(pipe_smem + stage * Traits::kStageBytes) +
                         warp * Traits::kKeysPerWarp * kRowStride;
#pragma unroll
      for (int kk = 0; kk < kD / 16; ++kk) {
        uint32_t a[4], b[4];
        ldmatrix_x4(a, smem_u32(q_smem + (lane % 16) * kRowStride + kk * 16 + (lane / 16) * 8));
        ldmatrix_x4(b, smem_u32(k_rows + ((lane / 16) * 8 + lane % 8) * kRowStride + kk * 16 +
                                ((lane / 8) % 2) * 8));
        const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        mma_m16n8k16<QTag>(s[0], a, b0);
        mma_m16n8k16<QTag>(s[1], a, b1);
      }
    }

    const int32_t warp_key0 = key_begin + tile * kTileN + warp * Traits::kKeysPerWarp;
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int32_t key = warp_key0 + n * 8 + 2 * t + (e & 1);
        float x;
        if constexpr (kLogits == DecodeLogits::kPlain) {
          x = s[n][e] * (qk_scale * kLog2e);
        } else {
          x = s[n][e] * qk_scale;
          if (p.softcap > 0.0f) x = p.softcap * tanhf(x / p.softcap);
          x += slope[e / 2] * static_cast<float>(keys.position(key) - q_pos);
          x *= kLog2e;
        }
        s[n][e] = key < key_end ? x : -INFINITY;
        tile_max[e / 2] = fmaxf(tile_max[e / 2], s[n][e]);
      }
    }
    float alpha[2], m_use[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m_new = fmaxf(m_run[r], warp_max_quad(tile_max[r]));
      m_use[r] = m_new == -INFINITY ? 0.0f : m_new;  // a fully masked row stays at zero
      alpha[r] = exp2f(m_run[r] - m_use[r]);
      m_run[r] = m_new;
      l_run[r] *= alpha[r];
    }
    uint32_t pa[4];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const float p0 = exp2f(s[n][0] - m_use[0]), p1 = exp2f(s[n][1] - m_use[0]);
      const float p2 = exp2f(s[n][2] - m_use[1]), p3 = exp2f(s[n][3] - m_use[1]);
      l_run[0] += p0 + p1;
      l_run[1] += p2 + p3;
      pa[2 * n] = pack_pair<QTag>(p0, p1);
      pa[2 * n + 1] = pack_pair<QTag>(p2, p3);
    }
#pragma unroll
    for (int n = 0; n < kD / 8; ++n) {
      o[n][0] *= alpha[0];
      o[n][1] *= alpha[0];
      o[n][2] *= alpha[1];
      o[n][3] *= alpha[1];
    }
    // O += P V: V rows are k-major, so the B fragments come from ldmatrix.trans.
    if constexpr (Traits::kDirect) {
      // On byte rows, .trans gives lane (g, t) the stored bytes V[2t][2g], V[2t][2g+1],
      // V[2t+1][2g], V[2t+1][2g+1] of a 16-d chunk: bytes 0,2 feed the n8 tile of the even d's,
      // bytes 1,3 the tile of the odd d's (the epilogue undoes this column order).
      const uint8_t* v_rows = pipe_smem + stage * Traits::kStageBytes + Traits::kStageHalfBytes +
                              warp * Traits::kKeysPerWarp * Traits::kRawRowBytes;
#pragma unroll
      for (int cc = 0; cc < kD / 16; cc += 2) {
        uint32_t b[4];
        ldmatrix_x4_trans(
            b, smem_u32(v_rows + (((lane / 8) % 2) * 8 + lane % 8) * Traits::kRawRowBytes +
                        (cc + lane / 16) * 16));
#pragma unroll
        for (int step = 0; step < 2; ++step) {
          if (cc + step < kD / 16) {
            const uint32_t lo = b[2 * step], hi = b[2 * step + 1];  // keys 0-7, keys 8-15
            const uint32_t even[2] = {
                Kv::template widen_pair<QTag>(__byte_perm(lo, 0, 0x0020) & 0xffff),
                Kv::template widen_pair<QTag>(__byte_perm(hi, 0, 0x0020) & 0xffff)};
            const uint32_t odd[2] = {
                Kv::template widen_pair<QTag>(__byte_perm(lo, 0, 0x0031) & 0xffff),
                Kv::template widen_pair<QTag>(__byte_perm(hi, 0, 0x0031) & 0xffff)};
            mma_m16n8k16<QTag>(o[2 * (cc + step)], pa, even);
            mma_m16n8k16<QTag>(o[2 * (cc + step) + 1], pa, odd);
          }
        }
      }
    } else {
      const QT* v_rows = reinterpret_cast<const QT*>(pipe_smem + stage * Traits::kStageBytes +
                                                     Traits::kStageHalfBytes) +
                         warp * Traits::kKeysPerWarp * kRowStride;
#pragma unroll
      for (int dd = 0; dd < kD / 16; ++dd) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, smem_u32(v_rows + (((lane / 8) % 2) * 8 + lane % 8) * kRowStride +
                                      dd * 16 + (lane / 16) * 8));
        const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
        mma_m16n8k16<QTag>(o[2 * dd], pa, b0);
        mma_m16n8k16<QTag>(o[2 * dd + 1], pa, b1);
      }
    }
  }

  // Merge the four warps' states through shared memory (the pipeline is drained first).
  cp_async_wait<0>();
  __syncthreads();
  float* merge_o = reinterpret_cast<float*>(pipe_smem);  // [warp][kM][kD]
  float* merge_m = merge_o + Traits::kWarps * kM * kD;   // [warp][kM]
  float* merge_l = merge_m + Traits::kWarps * kM;        // [warp][kM]
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = warp_sum_quad(l_run[r]);
    if (t == 0) {
      merge_m[warp * kM + g + 8 * r] = m_run[r];
      merge_l[warp * kM + g + 8 * r] = l;
    }
  }
#pragma unroll
  for (int n = 0; n < kD / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int col = 2 * t + (e & 1);
      // Direct 8-bit PV: tile 2c holds the even d's of chunk c, tile 2c + 1 the odd ones.
      const int d = Traits::kDirect ? (n / 2) * 16 + 2 * col + n % 2 : n * 8 + col;
      merge_o[(warp * kM + g + 8 * (e / 2)) * kD + d] = o[n][e];
    }
  }
  __syncthreads();

  for (int i = threadIdx.x; i < heads_here * kD; i += Traits::kThreads) {
    const int r = i / kD, d = i % kD;
    float m_all = -INFINITY;
#pragma unroll
    for (int w = 0; w < Traits::kWarps; ++w) m_all = fmaxf(m_all, merge_m[w * kM + r]);
    float l_all = 0.0f, o_all = 0.0f;
    if (m_all != -INFINITY) {
#pragma unroll
      for (int w = 0; w < Traits::kWarps; ++w) {
        const float weight = exp2f(merge_m[w * kM + r] - m_all);
        l_all += weight * merge_l[w * kM + r];
        o_all += weight * merge_o[(w * kM + r) * kD + d];
      }
    }
    const bool empty = l_all == 0.0f;
    const float value = empty ? 0.0f : o_all / l_all * v_scale;
    const float lse = empty ? -INFINITY : (m_all + log2f(l_all)) * 0.6931471805599453f;
    const int head = first_head + r;
    if (p.num_splits == 1) {
      QT* out = static_cast<QT*>(p.out) + row * p.out_row_stride + head * p.out_head_stride;
      out[d] = QT(value);
      if (d == 0 && p.lse != nullptr) {
        p.lse[row * p.lse_row_stride + head * p.lse_head_stride] = lse;
      }
    } else {
      const int64_t slot = (static_cast<int64_t>(split) * p.num_rows + row) * p.num_q_heads + head;
      p.partial_out[slot * kD + d] = value;
      if (d == 0) p.partial_lse[slot] = lse;
    }
  }
}

}  // namespace attnkit::cuda
