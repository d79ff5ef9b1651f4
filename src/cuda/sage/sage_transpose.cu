// fp8 V -> V^T (sage_quant_params.h) without rescaling: from a packed or dense fp8 tensor, and
// from the V pages of an fp8 KV cache gathered through its block table. The fp8 P*V wgmma reads
// V^T as its K-major B operand; these give an fp8 call the layout the SAGE pass writes.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "core/check.h"
#include "cuda/common/cuda_status.h"
#include "cuda/common/device_fault.h"
#include "cuda/sage/sage_quant_kernels.cuh"
#include "cuda/sage/sage_quant_launch.h"

namespace attnkit::cuda::sage {
namespace {

constexpr int kCodeVec = 16;  // fp8 codes per 16-byte load
constexpr int64_t kMaxGridY = 65535;

// The 16 codes of one load into tile column tt, rows c .. c + 15 (zeros when !valid).
__device__ __forceinline__ void put_codes(uint8_t* tile, int c, int tt, uint4 codes16) {
  const uint32_t w[4] = {codes16.x, codes16.y, codes16.z, codes16.w};
#pragma unroll
  for (int i = 0; i < kCodeVec; ++i) {
    tile[(c + i) * kVtTilePitch + tt] = static_cast<uint8_t>(w[i / 4] >> (8 * (i % 4)));
  }
}

// blockIdx.x = sequence x Hkv.
__global__ void __launch_bounds__(kThreads)
    fp8_transpose_kernel(const __grid_constant__ Fp8TransposeParams p) {
  __shared__ __align__(16) uint8_t tile[kMaxDim * kVtTilePitch];
  const int32_t dim = p.head_dim;
  const int64_t b = blockIdx.x / p.num_kv_heads;
  const int32_t h = blockIdx.x % p.num_kv_heads;
  const bool recorder = h == 0 && blockIdx.y == 0 && threadIdx.x == 0;
  const SeqSpan span = sequence_span(p.kv_seqs, b, recorder ? &p.fault : nullptr);
  if (!span.ok) return;
  const TokenLanes lanes = token_lanes(dim, kCodeVec);
  const auto* v =
      static_cast<const uint8_t*>(p.v.data) + input_base(p.v, p.kv_seqs, b, span, h) + lanes.c;
  uint8_t* dst =
      p.v_t + static_cast<int64_t>(h) * dim * p.v_t_stride + vt_seq_column(span.start, b);
  for_each_vt_tile(span.len, tile, dst, p.v_t_stride, dim, [&](int64_t t0, int cols) {
    if (lanes.r >= lanes.rows) return;
    for (int tt = lanes.r; tt < cols; tt += lanes.rows) {
      put_codes(tile, lanes.c, tt,
                __ldg(reinterpret_cast<const uint4*>(v + (t0 + tt) * p.v.stride_token)));
    }
  });
}

// kv_offsets: the exclusive prefix sum of the rows' guarded lengths (a length outside
// [0, capacity] faults and counts 0), clipped to v_t_columns. One CTA.
__global__ void __launch_bounds__(kThreads)
    paged_offsets_kernel(const __grid_constant__ PagedTransposeParams p) {
  using Scan = cub::BlockScan<int64_t, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  const int64_t capacity = p.kv.row_capacity();
  int64_t carry = 0;
  for (int64_t first = 0; first < p.rows; first += kThreads) {
    const int64_t row = first + threadIdx.x;
    int64_t len = 0;
    if (row < p.rows) {
      const int32_t stored = p.seq_lens[row];
      if (guard_seq_len(p.fault, stored, capacity, row)) len = stored;
    }
    int64_t before = 0, chunk = 0;
    Scan(scan_storage).ExclusiveSum(len, before, chunk);
    if (row < p.rows) {
      p.kv_offsets[row] = static_cast<int32_t>(min64(carry + before, p.v_t_columns));
    }
    carry += chunk;
    __syncthreads();  // scan_storage is reused
  }
  if (threadIdx.x == 0) p.kv_offsets[p.rows] = static_cast<int32_t>(min64(carry, p.v_t_columns));
}

// blockIdx.x = block-table row x Hkv.
// A page whose block-table entry is outside the pool is never read: its tokens are zeros, and the
// CTA of KV head 0 that meets it records it (pages of 8 .. 128 tokens never straddle a tile, so
// each bad entry is recorded once).
__global__ void __launch_bounds__(kThreads)
    paged_transpose_kernel(const __grid_constant__ PagedTransposeParams p) {
  __shared__ __align__(16) uint8_t tile[kMaxDim * kVtTilePitch];
  const detail::KvLayout& kv = p.kv;
  const int32_t dim = kv.head_dim;
  const int64_t row = blockIdx.x / kv.num_kv_heads;
  const int32_t h = blockIdx.x % kv.num_kv_heads;
  const int64_t start = p.kv_offsets[row];
  const int64_t len = p.kv_offsets[row + 1] - start;
  const TokenLanes lanes = token_lanes(dim, kCodeVec);
  const int32_t page_tokens = kv.tokens_per_block;
  // An fp8 cache: the layout's strides are in elements as well as bytes.
  const int64_t head_offset = static_cast<int64_t>(h) * kv.head_stride_bytes + lanes.c;
  uint8_t* dst = p.v_t + static_cast<int64_t>(h) * dim * p.v_t_stride + vt_seq_column(start, row);
  for_each_vt_tile(len, tile, dst, p.v_t_stride, dim, [&](int64_t t0, int cols) {
    if (lanes.r >= lanes.rows) return;
    for (int tt = lanes.r; tt < cols; tt += lanes.rows) {
      // len <= the row's capacity (the offsets kernel's guard): the page is a column of the row.
      const auto t = static_cast<int32_t>(t0 + tt);
      const int32_t page = t / page_tokens;
      const int32_t slot = t - page * page_tokens;
      int32_t block = static_cast<int32_t>(row);
      bool ok = true;
      if (kv.block_table != nullptr) {
        block = kv.block_table[row * kv.block_table_row_stride + page];
        const bool recorder = h == 0 && lanes.c == 0 && (tt == 0 || slot == 0);
        ok = recorder ? guard_block_id(p.fault, block, kv.num_blocks, row, page)
                      : static_cast<uint32_t>(block) < static_cast<uint32_t>(kv.num_blocks);
      }
      uint4 codes16 = make_uint4(0u, 0u, 0u, 0u);
      if (ok) {
        codes16 = __ldg(reinterpret_cast<const uint4*>(kv.v_base + block * kv.block_stride_bytes +
                                                       head_offset + slot * kv.token_stride_bytes));
      }
      put_codes(tile, lanes.c, tt, codes16);
    }
  });
}

unsigned grid_rows(int64_t max_len) {
  return static_cast<unsigned>(
      std::clamp<int64_t>((max_len + kTokensPerCta - 1) / kTokensPerCta, 1, kMaxGridY));
}

void check_vt_shape(const char* what, int32_t num_kv_heads, int32_t head_dim, int64_t columns,
                    int64_t seqs, const uint8_t* v_t, size_t v_t_bytes) {
  ATTNKIT_CHECK(num_kv_heads >= 1, what, ": num_kv_heads: accepted >= 1, got ", num_kv_heads);
  ATTNKIT_CHECK(head_dim >= 16 && head_dim <= kMaxHeadDim && head_dim % 16 == 0, what,
                ": head_dim: accepted multiples of 16 in 16 .. 256, got ", head_dim);
  ATTNKIT_CHECK(columns >= 0 && seqs >= 0 && vt_row_stride(columns, seqs) <= INT32_MAX, what,
                ": V^T columns: accepted tokens + 48 x sequences below 2^31, got ", columns,
                " tokens in ", seqs, " sequences");
  ATTNKIT_CHECK(v_t != nullptr && reinterpret_cast<uintptr_t>(v_t) % 16 == 0, what,
                ": v_t: a 16-byte aligned device pointer is required");
  const size_t needed = fp8_vt_bytes(num_kv_heads, head_dim, columns, seqs);
  ATTNKIT_CHECK(v_t_bytes >= needed, what, ": v_t: ", needed, " bytes are required, got ",
                v_t_bytes);
}

}  // namespace

void launch_fp8_transpose_v(const Fp8TransposeArgs& args, cudaStream_t stream) {
  constexpr const char* kWhat = "fp8 V transpose";
  check_vt_shape(kWhat, args.num_kv_heads, args.head_dim, args.total_kv, args.batch, args.v_t,
                 args.v_t_bytes);
  ATTNKIT_CHECK(args.batch >= 0, kWhat, ": batch: accepted >= 0, got ", args.batch);
  ATTNKIT_CHECK(args.seqlen_kv >= 0, kWhat, ": seqlen_kv: accepted >= 0, got ", args.seqlen_kv);
  const bool uniform = args.cu_seqlens_kv == nullptr;
  ATTNKIT_CHECK(!uniform || int64_t{args.batch} * args.seqlen_kv == args.total_kv, kWhat,
                ": seqlen_kv: without cu_seqlens_kv batch x seqlen_kv must equal total_kv = ",
                args.total_kv, ", got ", args.batch, " x ", args.seqlen_kv);
  if (args.total_kv > 0) {
    ATTNKIT_CHECK(args.v.data != nullptr && reinterpret_cast<uintptr_t>(args.v.data) % 16 == 0,
                  kWhat, ": v: a 16-byte aligned device pointer is required");
    const int64_t strides[] = {uniform ? args.v.stride_batch : 0, args.v.stride_token,
                               args.v.stride_head};
    for (int64_t stride : strides) {
      ATTNKIT_CHECK(stride >= 0 && stride % 16 == 0, kWhat,
                    ": v: strides must be non-negative multiples of 16 bytes, got ", stride);
    }
  }
  ATTNKIT_CHECK((int64_t{args.batch} + 1) * args.num_kv_heads <= INT32_MAX, kWhat,
                ": batch x num_kv_heads must stay below 2^31");
  if (args.batch == 0 && args.total_kv == 0) return;
  Fp8TransposeParams params;
  params.v = args.v;
  params.kv_seqs = {args.cu_seqlens_kv, args.seqlen_kv, args.total_kv, FaultArg::kCuSeqlensKv};
  params.batch = args.batch;
  params.num_kv_heads = args.num_kv_heads;
  params.head_dim = args.head_dim;
  params.v_t = args.v_t;
  params.v_t_stride = vt_row_stride(args.total_kv, args.batch);
  params.fault = fault_site(args.op);
  // Columns of no token (gaps, padding, bad entries) read as zeros.
  check_cuda(cudaMemsetAsync(
                 args.v_t, 0,
                 fp8_vt_bytes(args.num_kv_heads, args.head_dim, args.total_kv, args.batch), stream),
             "fp8 V transpose: cudaMemsetAsync (V^T)");
  const int64_t max_len = uniform              ? args.seqlen_kv
                          : args.seqlen_kv > 0 ? std::min(args.seqlen_kv, args.total_kv)
                                               : args.total_kv;
  const dim3 grid(static_cast<unsigned>(int64_t{args.batch} * args.num_kv_heads),
                  grid_rows(max_len));
  fp8_transpose_kernel<<<grid, kThreads, 0, stream>>>(params);
  check_launch("fp8_transpose_kernel");
}

void launch_paged_fp8_transpose_v(const PagedFp8TransposeArgs& args, cudaStream_t stream) {
  constexpr const char* kWhat = "paged fp8 V transpose";
  const KvCacheView& cache = args.cache;
  ATTNKIT_CHECK(cache.dtype == DType::kFp8E4M3, kWhat, ": kv_cache.dtype: accepted fp8_e4m3, got ",
                dtype_name(cache.dtype));
  ATTNKIT_CHECK(cache.window_slots == 0, kWhat,
                ": kv_cache: a cyclic (sliding-window) cache has no token order to transpose");
  ATTNKIT_CHECK(cache.tokens_per_block >= 1, kWhat,
                ": kv_cache.tokens_per_block: accepted >= 1, got ", cache.tokens_per_block);
  ATTNKIT_CHECK(!cache.paged || kVtTileTokens % cache.tokens_per_block == 0, kWhat,
                ": kv_cache.tokens_per_block: a paged cache accepts powers of two up to 128, got ",
                cache.tokens_per_block);
  ATTNKIT_CHECK(
      cache.seq_lens.defined() && cache.seq_lens.dtype == DType::kInt32 && cache.seq_lens.ndim == 1,
      kWhat, ": kv_cache.seq_lens: an int32 [rows] device tensor is required");
  const int64_t rows = cache.num_rows();
  check_vt_shape(kWhat, cache.num_kv_heads, cache.head_dim, args.v_t_columns, rows, args.v_t,
                 args.v_t_bytes);
  ATTNKIT_CHECK(
      !cache.paged || (cache.block_table.defined() && cache.block_table.dtype == DType::kInt32 &&
                       cache.block_table.ndim == 2 && cache.block_table.shape[0] >= rows),
      kWhat,
      ": kv_cache.block_table: an int32 [rows, max_blocks_per_seq] device tensor is "
      "required");
  ATTNKIT_CHECK(cache.paged || rows <= cache.num_blocks, kWhat,
                ": kv_cache: a contiguous cache needs a block per row: ", rows, " rows, ",
                cache.num_blocks, " blocks");
  ATTNKIT_CHECK(cache.v_base != nullptr && reinterpret_cast<uintptr_t>(cache.v_base) % 16 == 0 &&
                    cache.block_stride_bytes % 16 == 0,
                kWhat, ": kv_cache: v_base and block_stride_bytes must be 16-byte aligned");
  ATTNKIT_CHECK(args.kv_offsets != nullptr, kWhat,
                ": kv_offsets: a device int32 [rows + 1] pointer is required");
  ATTNKIT_CHECK((rows + 1) * cache.num_kv_heads <= INT32_MAX, kWhat,
                ": rows x num_kv_heads must stay below 2^31");
  PagedTransposeParams params;
  params.kv = detail::make_kv_layout(cache);
  params.seq_lens = static_cast<const int32_t*>(cache.seq_lens.data);
  params.rows = static_cast<int32_t>(rows);
  params.v_t_columns = static_cast<int32_t>(args.v_t_columns);
  params.v_t = args.v_t;
  params.v_t_stride = vt_row_stride(args.v_t_columns, rows);
  params.kv_offsets = args.kv_offsets;
  params.fault = fault_site(args.op);
  // Columns of no token (gaps, padding, bad pages' neighbours past a row) read as zeros.
  check_cuda(cudaMemsetAsync(
                 args.v_t, 0,
                 fp8_vt_bytes(cache.num_kv_heads, cache.head_dim, args.v_t_columns, rows), stream),
             "paged fp8 V transpose: cudaMemsetAsync (V^T)");
  paged_offsets_kernel<<<1, kThreads, 0, stream>>>(params);
  check_launch("paged_offsets_kernel");
  const int64_t capacity = params.kv.row_capacity();
  const int64_t max_len =
      args.max_seqlen_kv > 0 ? std::min<int64_t>(args.max_seqlen_kv, capacity) : capacity;
  const dim3 grid(static_cast<unsigned>(rows * cache.num_kv_heads), grid_rows(max_len));
  paged_transpose_kernel<<<grid, kThreads, 0, stream>>>(params);
  check_launch("paged_transpose_kernel");
}

}  // namespace attnkit::cuda::sage
