// Tile schedulers of the context FMHA: which (query block, head, sequence) a CTA computes.
//
// Both schedulers walk one order of the work items (query block, head, sequence): the (head,
// sequence) pairs in sections of p.section_pairs pairs (heads fastest, so GQA heads that share a KV
// head are neighbours); inside a section the query blocks run from the last (the most keys under a
// causal mask) to the first, the section's pairs fastest. A section of about one resident wave of
// CTAs reads each K/V tile from DRAM once and from L2 for its other query blocks, and its light
// blocks fill the tail (set_schedule in prefill_dispatch.cc sizes the sections).
//
// LongestFirstScheduler (the sm80 kernels, one work item per CTA): the launch index (x fastest,
// the hardware's dispatch order) is the item's rank in that order.
//
// PersistentScheduler (the sm90 kernel): one CTA per SM walks the items w = blockIdx.x,
// blockIdx.x + gridDim.x, ... of that order, so the CTAs working at one time hold consecutive
// items of one section. Under a causal mask that is longest-processing-time-first within a
// section over a static round robin: no heavy item starts late and stretches the tail, and a grid
// of exactly the SM count has no partial last wave. Sections instead of one global order: H200
// D=128 S=4k, 16k tokens, the DRAM traffic of the unsectioned order was 2.3 TB/s (every query
// block re-read its pairs' K/V from DRAM).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/prefill/prefill_params.h"

namespace attnkit::cuda::prefill {

struct PrefillWorkTile {
  int32_t head;
  int32_t batch;
  int32_t m_block;
};

// The item of rank `linear` in the sectioned order of `pairs` = heads x sequences pairs and
// `m_blocks` query blocks.
template <class I>
__device__ __forceinline__ PrefillWorkTile sectioned_tile(const PrefillParams& p, I linear, I heads,
                                                          I pairs, I m_blocks) {
  const I per_section = min(static_cast<I>(p.section_pairs), pairs);
  const I section = linear / (per_section * m_blocks);
  const I rest = linear - section * (per_section * m_blocks);
  const I first = section * per_section;
  const I in_section = min(per_section, pairs - first);  // the last section may be short
  const I m_rev = rest / in_section;
  const I pair = first + (rest - m_rev * in_section);
  const I batch = pair / heads;
  return {static_cast<int32_t>(pair - batch * heads), static_cast<int32_t>(batch),
          static_cast<int32_t>(m_blocks - 1 - m_rev)};
}

struct LongestFirstScheduler {
  template <class I>
  __device__ static PrefillWorkTile decompose(const PrefillParams& p, I linear) {
    return sectioned_tile<I>(p, linear, gridDim.x, static_cast<I>(gridDim.x) * gridDim.y,
                             gridDim.z);
  }
  __device__ static PrefillWorkTile get(const PrefillParams& p) {
    const uint64_t linear = blockIdx.x + static_cast<uint64_t>(gridDim.x) *
                                             (blockIdx.y + uint64_t{gridDim.y} * blockIdx.z);
    const uint64_t total = static_cast<uint64_t>(gridDim.x) * gridDim.y * gridDim.z;
    // 32-bit divisions where the grid allows (every practical launch).
    if (total <= 0xffffffffull) return decompose<uint32_t>(p, static_cast<uint32_t>(linear));
    return decompose<uint64_t>(p, linear);
  }
  static dim3 grid(const PrefillParams& p) { return dim3(p.num_q_heads, p.batch, p.num_m_blocks); }
};

struct PersistentScheduler {
  int64_t total;  // num_m_blocks x pairs
  int64_t pairs;  // batch x heads
  int32_t heads;  // the query heads, or the KV heads of a GQA-packed call (q_pack_log2)

  __device__ static PersistentScheduler make(const PrefillParams& p) {
    PersistentScheduler s;
    s.heads = p.num_q_heads >> p.q_pack_log2;
    s.pairs = static_cast<int64_t>(p.batch) * s.heads;
    s.total = s.pairs * p.num_m_blocks;
    return s;
  }
  __device__ int64_t first() const { return blockIdx.x; }
  __device__ int64_t next(int64_t w) const { return w + gridDim.x; }
  __device__ bool valid(int64_t w) const { return w < total; }
  __device__ PrefillWorkTile tile(const PrefillParams& p, int64_t w) const {
    // 32-bit divisions where the item count allows (every practical launch).
    if (total <= 0xffffffffll) {
      return sectioned_tile<uint32_t>(p, static_cast<uint32_t>(w), heads,
                                      static_cast<uint32_t>(pairs), p.num_m_blocks);
    }
    return sectioned_tile<int64_t>(p, w, heads, pairs, p.num_m_blocks);
  }
};

}  // namespace attnkit::cuda::prefill
