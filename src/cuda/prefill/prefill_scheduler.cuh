// Tile schedulers of the context FMHA: which (query block, head, sequence) a CTA computes.
//
// LongestFirstScheduler (the sm80 kernels, one work item per CTA): the launch index (x fastest,
// the hardware's dispatch order) walks the (head, sequence) pairs in sections of p.section_pairs
// pairs (heads fastest, so GQA heads that share a KV head are neighbours); inside a section the
// query blocks run from the last (the most keys under a causal mask) to the first, the section's
// pairs fastest. A section of about one resident wave of CTAs reads each K/V tile from DRAM once
// and from L2 for its other query blocks, and its light blocks fill the tail.
//
// PersistentScheduler (the sm90 kernel): one CTA per SM walks work items w = blockIdx.x,
// blockIdx.x + gridDim.x, ... of one global order, the query blocks from the last to the first and
// the (sequence, head) pairs fastest. Under a causal mask that is longest-processing-time-first
// over a static round robin: every CTA takes one of the heaviest items left, so no heavy item
// starts late and stretches the tail, and a grid of exactly the SM count has no partial last
// wave. The CTAs working at one time cover consecutive pairs of the same few query blocks, which
// read the same K/V tiles through L2.
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

struct LongestFirstScheduler {
  template <class I>
  __device__ static PrefillWorkTile decompose(const PrefillParams& p, I linear) {
    const I heads = gridDim.x, pairs = heads * gridDim.y, m_blocks = gridDim.z;
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
  int64_t total;  // num_m_blocks x batch x num_q_heads
  int64_t pairs;  // batch x num_q_heads

  __device__ static PersistentScheduler make(const PrefillParams& p) {
    PersistentScheduler s;
    s.pairs = static_cast<int64_t>(p.batch) * p.num_q_heads;
    s.total = s.pairs * p.num_m_blocks;
    return s;
  }
  __device__ int64_t first() const { return blockIdx.x; }
  __device__ int64_t next(int64_t w) const { return w + gridDim.x; }
  __device__ bool valid(int64_t w) const { return w < total; }
  __device__ PrefillWorkTile tile(const PrefillParams& p, int64_t w) const {
    const int64_t m_rev = w / pairs;
    const int64_t pair = w - m_rev * pairs;
    const int32_t batch = static_cast<int32_t>(pair / p.num_q_heads);
    return {static_cast<int32_t>(pair - static_cast<int64_t>(batch) * p.num_q_heads), batch,
            static_cast<int32_t>(p.num_m_blocks - 1 - m_rev)};
  }
};

}  // namespace attnkit::cuda::prefill
