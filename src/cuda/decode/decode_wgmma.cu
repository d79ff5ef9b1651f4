// The Hopper (sm_90a) decode kernel for large GQA groups: one warpgroup per CTA serves up to 64
// query heads of one KV head with warpgroup MMAs (wgmma), the query heads as the MMA's 64 rows.
//
// Why: the mma.sync kernels cover a group of 32 heads with two M blocks on 8 warps (the pair
// kernel), whose per-tile instructions (HMMA, ldmatrix, copies, softmax) bound its stream at
// ~3.5 TB/s on the H200 where the one-M-block kernels read at ~4.5 (docs/decode_design.md,
// "The warpgroup-MMA kernel for large groups"). A warpgroup MMA reads K and V from shared memory
// itself: S = Q K^T is eight m64n64k16 MMAs per 64-key tile (Q in registers), O += P V four
// m64n128k16 (P in registers: the S accumulator's layout is the A operand's), so a tile costs a few
// dozen instructions a thread besides the softmax. Heads past the group are zero rows (MQA 32/1:
// half the rows), which the tensor cores have time for. Against the mma.sync kernels (H200): MQA
// 32/1 64 x 4k +9%, 96 x 4k +14%, 256 x 2k +7%, 32 x 32k +7%; GQA 32/2 64 x 4k +4%. One CTA of it
// streams slower than one pair-kernel CTA, so grids that kernel covers with one CTA an SM keep it
// (decode_wgmma_plan, decode_launch.cu).
//
// Shape: 128 threads, two or three CTAs an SM (kCtasPerSm: a ring of six or four units). K and V
// of a 64-key tile are separate 16 KB units of the ring (K(t), V(t), K(t+1), ...), copied by
// cp.async into the 128-byte-swizzled layout the MMA descriptors name (two column blocks of 64 d,
// 128-byte rows, 16-byte chunk c of row r at chunk c ^ (r % 8)); each unit is waited for with one
// CTA barrier (the CTA is the warpgroup). Key offsets (block table) are computed four tiles ahead
// into shared memory. The softmax is the mma.sync kernels' (log2 units, ex2.approx, the lazy
// reference max of decode_update_max); P is rounded to the query's 16-bit type for the MMA, as
// there.
//
// Scope: 16-bit caches of the query's dtype, head_dim 128, plain logits (no ALiBi or soft-cap), no
// window or cyclic cache, no beams; split calls write f32 partials that decode_merge.cu's kernel
// merges. Every other call takes the mma.sync kernels.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstring>

#include "core/check.h"
#include "cuda/common/cp_async_sm80.cuh"
#include "cuda/common/cuda_status.h"
#include "cuda/common/fast_math.cuh"
#include "cuda/common/launch.cuh"
#include "cuda/common/memory_sm90.cuh"
#include "cuda/common/tma_sm90.cuh"
#include "cuda/common/warpgroup_sm90.cuh"
#include "cuda/common/wgmma_sm90.cuh"
#include "cuda/decode/decode_kernel.cuh"
#include "cuda/decode/decode_launch.h"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ATTNKIT_DECODE_WGMMA_DEVICE 1
#endif

namespace attnkit::cuda {
namespace {

constexpr int kWgHeadDim = 128;
constexpr int kWgTileN = 64;                           // keys per ring unit
constexpr int kWgThreads = 128;                        // one warpgroup
constexpr int kWgColumnBlockBytes = kWgTileN * 128;    // 64 keys x 64 d x 2 bytes
constexpr int kWgUnitBytes = 2 * kWgColumnBlockBytes;  // 16 KB
constexpr int kWgOffsetSlots = 4;                      // tiles of key offsets in flight
// The ring of K / V units that fits kCtasPerSm CTAs an SM (2: 6 units, 3: 4).
template <int kCtasPerSm>
constexpr int wg_units() {
  return kCtasPerSm == 2 ? 6 : 4;
}
template <int kCtasPerSm>
constexpr int wg_smem_bytes() {
  return 1024 /* the ring's 1024-byte alignment */ + wg_units<kCtasPerSm>() * kWgUnitBytes +
         kWgOffsetSlots * kWgTileN * 8;
}

#if defined(ATTNKIT_DECODE_WGMMA_DEVICE)

template <typename QT>
__device__ __forceinline__ uint32_t wg_pack_raw(QT lo, QT hi) {
  const uint16_t l = *reinterpret_cast<const uint16_t*>(&lo);
  const uint16_t h = *reinterpret_cast<const uint16_t*>(&hi);
  return static_cast<uint32_t>(l) | (static_cast<uint32_t>(h) << 16);
}

#endif  // ATTNKIT_DECODE_WGMMA_DEVICE

// kNhd: the cache is NHD ([T, Hkv, D] blocks): a key's row of this KV head starts at
// kv_head * 256 bytes in its token's Hkv rows (KvLayout::token_stride_bytes apart); only the key
// offsets see it.
template <typename QT, int kCtasPerSm, bool kNhd>
__global__ void __launch_bounds__(kWgThreads, kCtasPerSm)
    decode_wgmma_kernel(const __grid_constant__ DecodeParams p) {
#if defined(ATTNKIT_DECODE_WGMMA_DEVICE)
  constexpr int kWgUnits = wg_units<kCtasPerSm>();
  using Tag = std::conditional_t<std::is_same_v<QT, __nv_bfloat16>, Bf16Tag, F16Tag>;
  constexpr float kLog2e = 1.4426950408889634f;
  extern __shared__ uint8_t wg_smem_raw[];
  const uint32_t raw_addr = smem_u32(wg_smem_raw);
  const uint32_t ring = (raw_addr + 1023u) & ~1023u;
  int64_t* key_offsets =
      reinterpret_cast<int64_t*>(wg_smem_raw + (ring - raw_addr) + kWgUnits * kWgUnitBytes);

  const int head_block = blockIdx.x % p.head_blocks;
  const int split = blockIdx.x / p.head_blocks;
  if (p.pdl) {
    if (p.prefetch_keys > 0) {
      decode_prefetch_before_wait<256, kNhd>(p, blockIdx.z, blockIdx.y, split);
    }
    griddep_wait();
    griddep_launch_dependents();
  }
  const int kv_head = blockIdx.y;
  const int row = blockIdx.z;
  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int first_head = kv_head * p.group_size + head_block * kDecodeWgmmaHeads;
  const int heads_here = min(kDecodeWgmmaHeads, p.group_size - head_block * kDecodeWgmmaHeads);

  // The row's length, guarded as in the mma.sync kernel: a bad one reads nothing (zeros, LSE -inf),
  // recorded by the row's first CTA at the end.
  int32_t seq_len = p.seq_lens[row];
  const bool bad_len = seq_len < 0 || seq_len > decode_len_capacity(p);
  if (bad_len) seq_len = 0;
  // The A fragments of Q (rows r0 and r0 + 8 of the warp's 16, columns qc, qc + 1 and qc + 8,
  // qc + 9 of each 16-d step); heads past the group are zero rows.
  const int r0 = warp * 16 + lane / 4;
  const int qc = 2 * (lane % 4);
  uint32_t qa[kWgHeadDim / 16][4];
  {
    const QT* q = static_cast<const QT*>(p.q) + row * p.q_row_stride;
    const QT* q0 = q + static_cast<int64_t>(first_head + r0) * p.q_head_stride;
    const QT* q1 = q0 + 8 * p.q_head_stride;
    const bool ok0 = r0 < heads_here, ok1 = r0 + 8 < heads_here;
    const QT zero = QT(0.0f);
#pragma unroll
    for (int kk = 0; kk < kWgHeadDim / 16; ++kk) {
      const int c = 16 * kk + qc;
      qa[kk][0] = wg_pack_raw<QT>(ok0 ? q0[c] : zero, ok0 ? q0[c + 1] : zero);
      qa[kk][1] = wg_pack_raw<QT>(ok1 ? q1[c] : zero, ok1 ? q1[c + 1] : zero);
      qa[kk][2] = wg_pack_raw<QT>(ok0 ? q0[c + 8] : zero, ok0 ? q0[c + 9] : zero);
      qa[kk][3] = wg_pack_raw<QT>(ok1 ? q1[c + 8] : zero, ok1 ? q1[c + 9] : zero);
    }
  }

  const DecodeKeyRange keys(seq_len, 0, 0);
  // Batch-invariant calls (split_keys > 0) take the mma.sync kernels; this one shares each row's
  // keys out over the splits.
  const int32_t keys_per_split = decode_split_keys<int32_t>(keys.num_keys, p.num_splits, kWgTileN);
  const int32_t key_begin = split * keys_per_split;
  const int32_t key_end = min(keys.num_keys, key_begin + keys_per_split);
  const int num_tiles = key_end > key_begin ? (key_end - key_begin + kWgTileN - 1) / kWgTileN : 0;

  const int32_t* table_row =
      p.kv.block_table != nullptr ? p.kv.block_table + row * p.kv.block_table_row_stride : nullptr;
  const int64_t head_bytes = kNhd ? static_cast<int64_t>(kv_head) * 256
                                  : static_cast<int64_t>(kv_head) * p.kv.tokens_per_block * 256;
  const int32_t page_mask = (1 << p.page_shift) - 1;
  // Byte offset of key `tid` of a tile (threads 0-63), -1 past the split's keys. A block id outside
  // the pool gives -1 too (the copy writes zeros, nothing is read) and keeps the key in fault_key:
  // after the loop the CTA's result is zeros (a split: the faulted mark, decode_faulted_lse, for
  // the merge) and the fault is recorded (record_decode_faults, at the end).
  int32_t fault_key = -1;
  auto key_offset = [&](int tile) -> int64_t {
    const int32_t key = key_begin + tile * kWgTileN + tid;
    if (tid >= kWgTileN || tile >= num_tiles || key >= key_end) return -1;
    if (table_row != nullptr) {
      const int32_t block = table_row[key >> p.page_shift];
      if (static_cast<uint32_t>(block) >= static_cast<uint32_t>(p.kv.num_blocks)) {
        fault_key = key;
        return -1;
      }
      if constexpr (kNhd) {
        return static_cast<int64_t>(block) * p.kv.block_stride_bytes + head_bytes +
               (key & page_mask) * p.kv.token_stride_bytes;
      } else {
        return static_cast<int64_t>(block) * p.kv.block_stride_bytes + head_bytes +
               static_cast<int64_t>(key & page_mask) * 256;
      }
    }
    return decode_byte_offset<kNhd>(p.kv, row, key, kv_head, p.page_shift);
  };
  // Unit u of the ring: K (u even) or V (u odd) of tile u / 2, into buffer u % kWgUnits. Thread t
  // copies chunk t % 16 of keys t / 16 + 8 j, so that a warp's copies are two whole key rows, and
  // (key % 8), with it the swizzled chunk, is the thread's own: its destinations are one base plus
  // 1024 j. Keys past the split are zero-filled by the copy's ignore-src operand (their V rows meet
  // probability 0, which must not meet a NaN). Every thread commits one group per unit, copies or
  // not, so that the wait counts hold. This form (12 instructions a copy) against the address
  // computed per key with a src-size operand (~20), H200: MQA 32/1 64 x 4k +2.9%, 256 x 2k +2.7%,
  // 16 x 8k +3.2%, 32 x 32k +1.2%, GQA 32/2 64 x 4k +2.1%. (Leaving a tile's O MMAs in flight
  // until the next tile's S MMAs, both refills after the V barrier, lost: 256 x 2k -6.7%.)
  const int copy_key = tid >> 4;
  const int copy_chunk = tid & 15;
  const uint32_t copy_dst = (copy_chunk >> 3) * kWgColumnBlockBytes + copy_key * 128 +
                            (((copy_chunk & 7) ^ copy_key) << 4);
  const uint8_t* copy_k_src = p.kv.k_base + copy_chunk * 16;
  const uint8_t* copy_v_src = p.kv.v_base + copy_chunk * 16;
  auto issue_unit = [&](int u) {
    const int tile = u >> 1;
    if (tile < num_tiles) {
      const uint8_t* base = (u & 1) ? copy_v_src : copy_k_src;
      const int64_t* offs = key_offsets + (tile % kWgOffsetSlots) * kWgTileN + copy_key;
      const uint32_t dst = ring + (u % kWgUnits) * kWgUnitBytes + copy_dst;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int64_t off = offs[8 * j];
        // Past the split (off -1): the copy ignores its source and writes zeros.
        const int skip = static_cast<int>(off >> 32) < 0;
        cp_async_16_or_zeros(dst + j * 1024, base + (skip ? 0 : off), !skip);
      }
    }
    cp_async_commit();
  };
  auto wait_unit = [] {
    // Units issued after the one needed next: kWgUnits - 2.
    cp_async_wait<kWgUnits - 2>();
    // cp.async writes through the generic proxy; the MMAs read through the async proxy.
    sm90::fence_proxy_async_smem();
    __syncthreads();
  };

#pragma unroll
  for (int t = 0; t < kWgOffsetSlots; ++t) {
    const int64_t off = key_offset(t);
    if (tid < kWgTileN) key_offsets[t * kWgTileN + tid] = off;
  }
  __syncthreads();
#pragma unroll
  for (int u = 0; u < kWgUnits - 1; ++u) issue_unit(u);

  const float k_scale = p.k_scale ? p.k_scale[p.k_scale_per_head ? kv_head : 0] : 1.0f;
  const float v_scale = p.v_scale ? p.v_scale[p.v_scale_per_head ? kv_head : 0] : 1.0f;
  const float scale_log2 = p.softmax_scale * k_scale * kLog2e;

  float o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.0f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.0f, 0.0f};
  float s[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) s[i] = 0.0f;

  for (int t = 0; t < num_tiles; ++t) {
    // The offsets of tile t + 4: read now, stored after the tile (its latency under the math).
    const int64_t ahead = key_offset(t + kWgOffsetSlots);
    wait_unit();  // K(t)
    // Into V(t - 1)'s buffer, read by the last tile's MMAs.
    issue_unit(2 * t + kWgUnits - 1);
    const uint32_t k_unit = ring + ((2 * t) % kWgUnits) * kWgUnitBytes;
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kWgHeadDim / 16; ++kk) {
      const uint64_t desc =
          sm90::smem_desc_sw128(k_unit + (kk / 4) * kWgColumnBlockBytes + (kk % 4) * 32, 16, 1024);
      sm90::wgmma_rs_kmajor<kWgTileN, Tag>(s, qa[kk], desc, kk > 0 ? 1 : 0);
    }
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
    sm90::fence_operands(s);

    // Softmax in log2 units with the lazy reference max (decode_update_max). Accumulator element
    // 4 j + 2 i + e is row r0 + 8 i, key 8 j + qc + e of the tile.
    const int valid = key_end - (key_begin + t * kWgTileN);
    float m_tile[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float x = s[4 * j + 2 * i + e] * scale_log2;
          if (8 * j + qc + e >= valid) x = -INFINITY;
          s[4 * j + 2 * i + e] = x;
          m_tile[i] = fmaxf(m_tile[i], x);
        }
      }
    }
    float alpha[2], m_use[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      decode_update_max(warp_max_quad(m_tile[i]), m_run[i], l_run[i], alpha[i], m_use[i]);
    }
    uint32_t pa[kWgTileN / 16][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float p0 = fast_exp2(s[4 * j + 2 * i] - m_use[i]);
        const float p1 = fast_exp2(s[4 * j + 2 * i + 1] - m_use[i]);
        l_run[i] += p0 + p1;
        pa[j / 2][(j % 2) * 2 + i] = pack_pair<Tag>(p0, p1);
      }
    }
    if (alpha[0] != 1.0f || alpha[1] != 1.0f) {
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        o[4 * j] *= alpha[0];
        o[4 * j + 1] *= alpha[0];
        o[4 * j + 2] *= alpha[1];
        o[4 * j + 3] *= alpha[1];
      }
    }

    wait_unit();                   // V(t)
    issue_unit(2 * t + kWgUnits);  // into K(t)'s buffer, read by this tile's S MMAs
    const uint32_t v_unit = ring + ((2 * t + 1) % kWgUnits) * kWgUnitBytes;
    sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kWgTileN / 16; ++kk) {
      sm90::wgmma_rs<kWgHeadDim, Tag>(
          o, pa[kk], sm90::smem_desc_sw128(v_unit + kk * 16 * 128, kWgColumnBlockBytes, 1024), 1);
    }
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
    sm90::fence_operands(o);
    if (tid < kWgTileN) key_offsets[(t % kWgOffsetSlots) * kWgTileN + tid] = ahead;
  }
  cp_async_wait_all();
  // A guard failed in any key of the CTA: nothing of what it read is kept.
  const bool row_fault = __syncthreads_or(fault_key >= 0) != 0;
  if (row_fault) {
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.0f;
    m_run[0] = m_run[1] = -INFINITY;
    l_run[0] = l_run[1] = 0.0f;
  }

  // Epilogue: the quad's row sums, then O / l (times the V scale) and the LSE.
  float l_all[2], lse[2], scale[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l_all[i] = warp_sum_quad(l_run[i]);
    const bool empty = l_all[i] == 0.0f;
    scale[i] = empty ? 0.0f : v_scale / l_all[i];
    lse[i] = empty ? -INFINITY : (m_run[i] + log2f(l_all[i])) * 0.6931471805599453f;
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = r0 + 8 * i;
    if (r >= heads_here) continue;
    const int head = first_head + r;
    if (p.num_splits == 1) {
      QT* out = static_cast<QT*>(p.out) + row * p.out_row_stride + head * p.out_head_stride;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        out[8 * j + qc] = QT(o[4 * j + 2 * i] * scale[i]);
        out[8 * j + qc + 1] = QT(o[4 * j + 2 * i + 1] * scale[i]);
      }
      if (lane % 4 == 0 && p.lse != nullptr) {
        p.lse[row * p.lse_row_stride + head * p.lse_head_stride] = lse[i];
      }
    } else {
      const int64_t item = (static_cast<int64_t>(split) * p.num_rows + row) * p.num_q_heads + head;
      float* out = p.partial_out + item * kWgHeadDim;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        *reinterpret_cast<float2*>(out + 8 * j + qc) =
            make_float2(o[4 * j + 2 * i] * scale[i], o[4 * j + 2 * i + 1] * scale[i]);
      }
      if (lane % 4 == 0) p.partial_lse[item] = row_fault ? decode_faulted_lse() : lse[i];
    }
  }
  // Faults are recorded last (record_decode_faults), by the CTAs of KV head 0 and head block 0.
  if (blockIdx.y == 0 && head_block == 0 &&
      (fault_key >= 0 || (bad_len && tid == 0 && split == 0))) {
    record_decode_faults(p, row, bad_len, fault_key);
  }
#endif  // ATTNKIT_DECODE_WGMMA_DEVICE
}

template <typename QT, int kCtasPerSm, bool kNhd>
void launch_typed(const DecodeParams& p, cudaStream_t stream) {
  constexpr auto kernel = decode_wgmma_kernel<QT, kCtasPerSm, kNhd>;
  constexpr int kWgSmemBytes = wg_smem_bytes<kCtasPerSm>();
  opt_in_dynamic_smem_once<kernel>(
      kWgSmemBytes, "decode: cudaFuncSetAttribute(max dynamic shared memory, wgmma kernel)");
  const dim3 grid(p.num_splits * p.head_blocks, p.num_kv_heads, p.num_rows);
  launch_maybe_programmatic(kernel, grid, dim3(kWgThreads), kWgSmemBytes, stream, p.pdl != 0, p,
                            "decode_wgmma_kernel");
}

}  // namespace

bool decode_wgmma_compiled() { return std::strstr(ATTNKIT_CUDA_ARCHS, "90a") != nullptr; }

namespace {
std::atomic<int64_t> g_wgmma_launches[2] = {};  // 2 and 3 CTAs an SM
}  // namespace

int64_t decode_wgmma_launches(int ctas_per_sm) {
  return g_wgmma_launches[ctas_per_sm == 3 ? 1 : 0].load(std::memory_order_relaxed);
}

namespace {
template <typename QT>
void launch_layout(const DecodeParams& p, bool three, bool nhd, cudaStream_t stream) {
  if (nhd) {
    three ? launch_typed<QT, 3, true>(p, stream) : launch_typed<QT, 2, true>(p, stream);
  } else {
    three ? launch_typed<QT, 3, false>(p, stream) : launch_typed<QT, 2, false>(p, stream);
  }
}
}  // namespace

void launch_decode_wgmma(const DecodeParams& p, DType q_dtype, int ctas_per_sm, bool nhd,
                         cudaStream_t stream) {
  ATTNKIT_CHECK(p.head_dim == kWgHeadDim, "decode: the wgmma kernel takes head_dim ", kWgHeadDim,
                ", got ", p.head_dim);
  ATTNKIT_CHECK(p.split_keys == 0,
                "decode: the wgmma kernel does not take fixed split lengths (batch_invariant)");
  ATTNKIT_CHECK(ctas_per_sm == 2 || ctas_per_sm == 3,
                "decode: the wgmma kernel is built for 2 or 3 CTAs an SM, got ", ctas_per_sm);
  const bool three = ctas_per_sm == 3;
  if (q_dtype == DType::kBF16) {
    launch_layout<__nv_bfloat16>(p, three, nhd, stream);
  } else if (q_dtype == DType::kF16) {
    launch_layout<__half>(p, three, nhd, stream);
  } else {
    detail::fail("decode: the wgmma kernel takes bf16 or f16 q, got ", dtype_name(q_dtype));
  }
  g_wgmma_launches[three ? 1 : 0].fetch_add(1, std::memory_order_relaxed);
}

}  // namespace attnkit::cuda
