#include <cmath>

#include "attnkit/spec.h"
#include "core/check.h"
#include "cuda/common/cuda_status.h"
#include "cuda/common/element_io.cuh"
#include "cuda/vanilla/vanilla_attention.cuh"

namespace attnkit::cuda {
namespace {

constexpr int kWarps = kVanillaThreads / 32;
constexpr int kAccPerThread = kVanillaMaxHeadDim / kVanillaThreads;
constexpr float kNegInf = -INFINITY;

__device__ float block_reduce(float value, float* scratch, bool is_max) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other = __shfl_xor_sync(0xffffffffu, value, offset);
    value = is_max ? fmaxf(value, other) : value + other;
  }
  const int warp = threadIdx.x / 32;
  __syncthreads();  // scratch may still be read by the previous reduction
  if (threadIdx.x % 32 == 0) scratch[warp] = value;
  __syncthreads();
  float result = scratch[0];
  for (int w = 1; w < kWarps; ++w)
    result = is_max ? fmaxf(result, scratch[w]) : result + scratch[w];
  return result;
}

// Entries seq and seq + 1 of a cu_seqlens array within [0, extent], entry seq + 1 >= entry seq and
// entry seq >= entry seq - 1 (a decreasing array is a fault of the rows the search routes to it).
__device__ bool sequence_entries_ok(const FaultSite& site, FaultArg arg, const int32_t* cu,
                                    int64_t seq, int64_t extent) {
  const int64_t begin = cu[seq];
  const int64_t before = seq > 0 ? cu[seq - 1] : 0;
  return guard_cu_seqlens(site, arg, seq, begin, before, extent) &&
         guard_cu_seqlens(site, arg, seq + 1, cu[seq + 1], begin, extent);
}

// Whether a query at position p attends key position j (docs/semantics.md).
__device__ bool attends(const VanillaAttentionParams& params, int64_t p, int64_t j) {
  switch (params.mask) {
    case MaskKind::kNone:
      return true;
    case MaskKind::kCausal:
      return j <= p;
    case MaskKind::kSlidingWindow:
      // Sinks are attended only by queries at or after them (the mask stays causal).
      return j <= p && (j > p - params.window || j < params.sink_tokens);
  }
  return false;
}

__global__ void __launch_bounds__(kVanillaThreads)
    vanilla_attention_kernel(const __grid_constant__ VanillaAttentionParams params) {
  __shared__ float q_s[kVanillaMaxHeadDim];
  __shared__ float score_s[kVanillaChunk];
  __shared__ float scratch[kWarps];

  const int64_t token = blockIdx.x;
  const int32_t head = blockIdx.y;
  const int32_t kv_head = head / params.group_size;
  const int32_t d_count = params.head_dim;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;

  // ---- which sequence, where the query sits, how many keys. Device metadata is checked before
  // it steers a read: a bad value makes the row a fault (nothing read through it, zeros out).
  // Head 0's block records: thread 0 a fault of the row's metadata, lane 0 of a warp a key's.
  const FaultSite row_site = head == 0 && threadIdx.x == 0 ? params.fault : FaultSite{};
  int64_t seq = 0, q_index = token, out_batch = 0;
  int64_t kv_len = 0, position = 0, kv_start = 0, cache_row = 0;
  bool valid = true, faulted = false;
  switch (params.mode) {
    case VanillaQueryMode::kVarlen: {
      int lo = 0, hi = params.batch;  // last sequence whose start <= token
      while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (params.cu_seqlens_q[mid] <= token)
          lo = mid;
        else
          hi = mid;
      }
      seq = lo;
      if (!sequence_entries_ok(row_site, FaultArg::kCuSeqlensQ, params.cu_seqlens_q, seq,
                               params.num_tokens)) {
        faulted = true;
        break;
      }
      const int64_t q_begin = params.cu_seqlens_q[seq];
      const int64_t q_len = params.cu_seqlens_q[seq + 1] - q_begin;
      valid = token >= q_begin && token - q_begin < q_len;
      if (!valid) break;  // a token of no sequence: nothing to read
      if (params.from_cache) {
        cache_row = seq;
        kv_len = params.seq_lens[seq];
        // A sequence's length is recorded once, by its first token.
        faulted = !guard_seq_len(token == q_begin ? row_site : FaultSite{}, kv_len,
                                 params.seq_len_bound, seq);
      } else {
        if (!sequence_entries_ok(row_site, FaultArg::kCuSeqlensKv, params.cu_seqlens_kv, seq,
                                 params.total_kv)) {
          faulted = true;
          break;
        }
        kv_start = params.cu_seqlens_kv[seq];
        kv_len = params.cu_seqlens_kv[seq + 1] - kv_start;
      }
      position = kv_len - q_len + (token - q_begin);
      break;
    }
    case VanillaQueryMode::kDense:
      seq = token / params.dense_seqlen_q;
      q_index = token % params.dense_seqlen_q;
      out_batch = seq;
      kv_len = params.dense_seqlen_kv;
      position = kv_len - params.dense_seqlen_q + q_index;
      break;
    case VanillaQueryMode::kDecode:
      cache_row = token;
      kv_len = params.seq_lens[token];
      faulted = !guard_seq_len(row_site, kv_len, params.seq_len_bound, token);
      position = kv_len - 1;
      break;
  }
  if (!valid || faulted) kv_len = 0;

  const float softmax_scale = params.softmax_scale;
  const float slope = params.alibi ? params.alibi_slopes[head] : 0.0f;
  const float k_scale = kv_scale_of(params.k_scale, params.k_scale_per_head, kv_head);
  const float v_scale = kv_scale_of(params.v_scale, params.v_scale_per_head, kv_head);

  const int64_t q_offset = out_batch * params.q_stride_batch + q_index * params.q_stride_token +
                           head * params.q_stride_head;
  for (int d = threadIdx.x; d < d_count; d += kVanillaThreads) {
    q_s[d] = load_element(params.q, params.dtype, q_offset + d);
  }
  __shared__ int key_fault_s;  // a key of this row named a beam or block outside the cache
  if (threadIdx.x == 0) key_fault_s = 0;
  __syncthreads();

  // Where the K / V vector of key j lives: (pointer, element offset) for packed or cached keys;
  // false (recorded at `site`) when its indirection entry or its block-table entry is outside
  // the cache. Key j < kv_len has a slot inside the row (the length was checked).
  auto key_location = [&](int64_t j, bool value, const FaultSite& site, const void** base,
                          int64_t* offset) -> bool {
    if (!params.from_cache) {
      if (value) {
        *base = params.v;
        *offset = out_batch * params.v_stride_batch + (kv_start + j) * params.v_stride_token +
                  kv_head * params.v_stride_head;
      } else {
        *base = params.k;
        *offset = out_batch * params.k_stride_batch + (kv_start + j) * params.k_stride_token +
                  kv_head * params.k_stride_head;
      }
      return true;
    }
    int64_t row = cache_row;
    if (params.cache_indirection != nullptr) {
      const int64_t s = cache_row / params.beam_width;
      const int64_t b = cache_row % params.beam_width;
      const int32_t beam =
          params.cache_indirection[s * params.ind_stride_seq + b * params.ind_stride_beam +
                                   j * params.ind_stride_token];
      if (!guard_index(site, FaultKind::kIndirection, FaultArg::kCacheIndirection, beam,
                       params.beam_width, cache_row, j)) {
        return false;
      }
      row = s * params.beam_width + beam;
    }
    const detail::KvLayout& layout = params.layout;
    const int64_t slot = layout.slot_of(j);
    int64_t block = row;  // contiguous: row r is block r
    if (layout.block_table != nullptr) {
      block = guarded_block(site, layout, row, slot / layout.tokens_per_block);
      if (block < 0) return false;
    }
    const int64_t bytes = layout.row_offset(block, slot % layout.tokens_per_block, kv_head);
    *base = (value ? layout.v_base : layout.k_base) + bytes;
    *offset = 0;
    return true;
  };
  const FaultSite key_site = head == 0 && lane == 0 ? params.fault : FaultSite{};

  float running_max = kNegInf;
  float running_sum = 0.0f;
  float acc[kAccPerThread];
  for (int i = 0; i < kAccPerThread; ++i) acc[i] = 0.0f;

  for (int64_t chunk = 0; chunk < kv_len; chunk += kVanillaChunk) {
    const int n = static_cast<int>(kv_len - chunk < kVanillaChunk ? kv_len - chunk : kVanillaChunk);
    for (int jj = warp; jj < n; jj += kWarps) {
      const int64_t j = chunk + jj;
      float logit = kNegInf;
      const void* base;
      int64_t offset;
      if (!attends(params, position, j)) {
      } else if (!key_location(j, false, key_site, &base, &offset)) {
        if (lane == 0) key_fault_s = 1;  // the same for every lane of the warp
      } else {
        float dot = 0.0f;
        for (int d = lane; d < d_count; d += 32) {
          dot += q_s[d] * (load_element(base, params.kv_dtype, offset + d) * k_scale);
        }
        for (int o = 16; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        logit = dot * softmax_scale;
        if (params.softcap > 0.0f) logit = params.softcap * tanhf(logit / params.softcap);
        if (params.alibi) logit += slope * static_cast<float>(j - position);
      }
      if (lane == 0) score_s[jj] = logit;
    }
    __syncthreads();
    float local_max = kNegInf;
    for (int jj = threadIdx.x; jj < n; jj += kVanillaThreads)
      local_max = fmaxf(local_max, score_s[jj]);
    const float new_max = fmaxf(running_max, block_reduce(local_max, scratch, true));
    if (new_max == kNegInf) {  // every key so far is masked
      __syncthreads();
      continue;
    }
    const float alpha = expf(running_max - new_max);  // 0 while running_max is -inf
    float local_sum = 0.0f;
    for (int jj = threadIdx.x; jj < n; jj += kVanillaThreads) {
      const float prob = expf(score_s[jj] - new_max);
      score_s[jj] = prob;
      local_sum += prob;
    }
    running_sum = running_sum * alpha + block_reduce(local_sum, scratch, false);
    for (int i = 0; i < kAccPerThread; ++i) acc[i] *= alpha;
    for (int jj = 0; jj < n; ++jj) {
      const float prob = score_s[jj];
      if (prob == 0.0f)
        continue;  // masked keys (their V, maybe in an invalid block, is never read)
      const void* base;
      int64_t offset;
      // The key's K was read: its V is in the same row and block (checked, not recorded, again).
      if (!key_location(chunk + jj, true, FaultSite{}, &base, &offset)) continue;
      for (int i = 0; i < kAccPerThread; ++i) {
        const int d = threadIdx.x + i * kVanillaThreads;
        if (d < d_count)
          acc[i] += prob * (load_element(base, params.kv_dtype, offset + d) * v_scale);
      }
    }
    running_max = new_max;
    __syncthreads();
  }

  // Every chunk ended with a barrier: key_fault_s holds what any warp found.
  const bool row_fault = faulted || key_fault_s != 0;
  const bool empty = row_fault || running_sum == 0.0f;
  const float inv_sum = empty ? 0.0f : 1.0f / running_sum;
  const int64_t out_offset = out_batch * params.out_stride_batch +
                             q_index * params.out_stride_token + head * params.out_stride_head;
  for (int i = 0; i < kAccPerThread; ++i) {
    const int d = threadIdx.x + i * kVanillaThreads;
    if (d < d_count)
      store_element(params.out, params.dtype, out_offset + d, row_fault ? 0.0f : acc[i] * inv_sum);
  }
  if (params.lse != nullptr && threadIdx.x == 0) {
    params.lse[out_batch * params.lse_stride_batch + q_index * params.lse_stride_token +
               head * params.lse_stride_head] = empty ? kNegInf : running_max + logf(running_sum);
  }
}

}  // namespace

void fill_vanilla_spec_fields(const AttentionSpec& spec, VanillaAttentionParams& params) {
  ATTNKIT_CHECK(spec.head_dim <= kVanillaMaxHeadDim,
                "vanilla CUDA kernels: spec.head_dim must be <= ", kVanillaMaxHeadDim, ", got ",
                spec.head_dim);
  params.num_q_heads = spec.num_q_heads;
  params.group_size = spec.group_size();
  params.head_dim = spec.head_dim;
  params.softmax_scale = static_cast<float>(spec.effective_scale());
  params.softcap = static_cast<float>(spec.logit_softcap);
  params.mask = spec.mask.kind;
  params.window = spec.mask.window;
  params.sink_tokens = spec.mask.sink_tokens;
  params.alibi = spec.alibi;
  if (spec.alibi) {
    ATTNKIT_CHECK(spec.num_q_heads <= kVanillaMaxAlibiHeads,
                  "vanilla CUDA kernels: ALiBi is served for at most ", kVanillaMaxAlibiHeads,
                  " query heads, spec.num_q_heads is ", spec.num_q_heads);
    const std::vector<float> slopes =
        spec.alibi_slopes.empty() ? default_alibi_slopes(spec.num_q_heads) : spec.alibi_slopes;
    for (int h = 0; h < spec.num_q_heads; ++h) params.alibi_slopes[h] = slopes[h];
  }
}

void launch_vanilla_attention(const VanillaAttentionParams& params, cudaStream_t stream) {
  if (params.num_tokens == 0 || params.num_q_heads == 0) return;
  ATTNKIT_CHECK(params.num_q_heads <= 65535,
                "vanilla CUDA kernels: at most 65535 query heads, got ", params.num_q_heads);
  const dim3 grid(static_cast<unsigned>(params.num_tokens),
                  static_cast<unsigned>(params.num_q_heads));
  vanilla_attention_kernel<<<grid, kVanillaThreads, 0, stream>>>(params);
  check_launch("vanilla_attention_kernel");
}

}  // namespace attnkit::cuda
