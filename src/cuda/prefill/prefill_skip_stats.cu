// write_skip_stats (prefill_skip_stats.h): one CTA walks the sequences' device lengths.
#include "cuda/common/cuda_status.h"
#include "cuda/prefill/prefill_skip_stats.h"
#include "cuda/prefill/prefill_variant.cuh"

namespace attnkit::cuda::prefill {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    skip_stats_kernel(const __grid_constant__ PrefillParams p, bool masked, bool count_tiles,
                      int32_t block_m, int32_t block_n, int64_t* stats) {
  __shared__ unsigned long long total;
  if (threadIdx.x == 0) total = 0;
  __syncthreads();
  if (count_tiles) {
    unsigned long long mine = 0;
    for (int32_t b = threadIdx.x; b < p.batch; b += kThreads) {
      const SequenceInfo seq = sequence_info(p, b, p.paged);
      if (seq.fault) continue;
      const int32_t q_pos0 = seq.kv_len - seq.q_len;  // bottom-right aligned
      for (int32_t m0 = 0; m0 < seq.q_len; m0 += block_m) {
        const int32_t p_hi = q_pos0 + min(seq.q_len, m0 + block_m) - 1;
        // The key blocks of the kernels' walk (key_block_range without a window).
        const int32_t key_end = masked ? min(seq.kv_len, p_hi + 1) : seq.kv_len;
        if (key_end > 0) mine += (key_end + block_n - 1) / block_n;
      }
    }
    if (mine != 0) atomicAdd(&total, mine);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    stats[0] = static_cast<int64_t>(total * static_cast<unsigned long long>(p.num_q_heads));
    stats[1] = 0;
    stats[2] = block_m;
    stats[3] = block_n;
  }
}

}  // namespace

void write_skip_stats(const PrefillParams& prm, bool masked, bool count_tiles, int block_m,
                      int block_n, int64_t* stats, cudaStream_t stream) {
  skip_stats_kernel<<<1, kThreads, 0, stream>>>(prm, masked, count_tiles, block_m, block_n, stats);
  check_launch("prefill: skip statistics");
}

}  // namespace attnkit::cuda::prefill
