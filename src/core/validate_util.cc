#include "core/validate_util.h"

#include <algorithm>
#include <cmath>
#include <sstream>

namespace attnkit::detail {
namespace {

std::string strides_str(const TensorView& t) {
  std::ostringstream out;
  if (t.ndim < 0 || t.ndim > TensorView::kMaxDims) return "[ndim " + std::to_string(t.ndim) + "]";
  out << '[';
  for (int d = 0; d < t.ndim; ++d) out << (d ? ", " : "") << t.strides[d];
  out << ']';
  return out.str();
}

std::string dtypes_str(std::initializer_list<DType> ok) {
  std::string text;
  size_t i = 0;
  for (DType dtype : ok) {
    if (i) text += (i + 1 == ok.size()) ? " or " : ", ";
    text += dtype_name(dtype);
    ++i;
  }
  return text;
}

bool is_pow2_page(int32_t tokens) {
  return tokens == 8 || tokens == 16 || tokens == 32 || tokens == 64 || tokens == 128;
}

}  // namespace

void Validator::expect_given(const TensorView& t, const std::string& name) const {
  check(t.defined(), name, "required, not given");
  check(t.ndim >= 0 && t.ndim <= TensorView::kMaxDims, name, "ndim must be in [0, ",
        TensorView::kMaxDims, "], got ", t.ndim);
  int64_t numel = 1;
  for (int d = 0; d < t.ndim; ++d) {
    check(t.shape[d] >= 0, name, "extents must be >= 0, got shape ", t.shape_str());
    check(!__builtin_mul_overflow(numel, t.shape[d], &numel), name, "shape ", t.shape_str(),
          " has more elements than int64 holds");
  }
  check(t.data != nullptr || numel == 0, name,
        "data is null; a tensor with elements needs a data pointer (shape ", t.shape_str(), ")");
}

void Validator::expect_dtype(const TensorView& t, const std::string& name,
                             std::initializer_list<DType> ok, const char* why) const {
  for (DType dtype : ok) {
    if (t.dtype == dtype) return;
  }
  fail(name, "expected dtype ", dtypes_str(ok), why ? " (" : "", why ? why : "", why ? ")" : "",
       ", got ", dtype_name(t.dtype));
}

void Validator::expect_shape(const TensorView& t, const std::string& name,
                             std::initializer_list<Dim> dims) const {
  bool match = t.ndim == static_cast<int>(dims.size());
  int d = 0;
  for (const Dim& dim : dims) {
    if (!match) break;
    if (dim.value != Dim::kAny && t.shape[d] != dim.value) match = false;
    if (t.shape[d] < 0) match = false;
    ++d;
  }
  if (match) return;
  std::ostringstream expected;
  expected << '[';
  d = 0;
  for (const Dim& dim : dims) {
    if (d++) expected << ", ";
    if (dim.name.empty()) {
      expected << dim.value;
    } else {
      expected << dim.name;
      if (dim.value != Dim::kAny) expected << '=' << dim.value;
    }
  }
  expected << ']';
  fail(name, "expected shape ", expected.str(), ", got ", t.shape_str());
}

void Validator::expect_device(const TensorView& t, const std::string& name, const Device& device,
                              const char* whose) const {
  check(t.device == device, name, "expected device ", device.str(), " (the device of ", whose,
        "), got ", t.device.str());
}

void Validator::expect_layout(const TensorView& t, const std::string& name, Access access) const {
  const bool output = access == Access::kOutput || access == Access::kSmallOutput;
  const bool vector = access == Access::kInput || access == Access::kOutput;
  check(t.device.index >= 0, name, "device ordinal must be >= 0, got ", t.device.index);
  check(t.ndim >= 0 && t.ndim <= TensorView::kMaxDims, name, "ndim must be in [0, ",
        TensorView::kMaxDims, "], got ", t.ndim);
  if (t.ndim == 0) return;
  const int last = t.ndim - 1;
  // An empty tensor has no element to lay out: any non-negative strides describe it (a
  // row-major view of an extent 0 has strides 0, as numpy gives them).
  bool empty = false;
  for (int d = 0; d < t.ndim; ++d) empty = empty || t.shape[d] == 0;
  check(empty || t.strides[last] == 1 || t.shape[last] <= 1, name,
        "the last dimension must be contiguous (stride 1), got strides ", strides_str(t),
        " for shape ", t.shape_str());
  const int64_t elt = static_cast<int64_t>(dtype_size(t.dtype));
  // The byte offset of the last element must fit in int64: every address is computed in it.
  int64_t last_byte = elt;
  for (int d = 0; d < t.ndim; ++d) {
    check(t.strides[d] >= 0, name, "strides must be >= 0, got strides ", strides_str(t));
    if (output && !empty && t.shape[d] > 1) {
      check(t.strides[d] > 0, name,
            "an output may not broadcast (stride 0 over an extent > 1), got strides ",
            strides_str(t), " for shape ", t.shape_str());
    }
    int64_t step = 0;
    const bool fits =
        t.shape[d] <= 1 || (!__builtin_mul_overflow(t.shape[d] - 1, t.strides[d], &step) &&
                            !__builtin_mul_overflow(step, elt, &step) &&
                            !__builtin_add_overflow(last_byte, step, &last_byte));
    check(fits, name, "strides ", strides_str(t), " address more than int64 bytes for shape ",
          t.shape_str());
  }
  if (t.data == nullptr) return;
  const auto address = reinterpret_cast<uintptr_t>(t.data);
  check(address % elt == 0, name, "data must be aligned to its ", elt,
        "-byte elements, got address 0x", std::hex, address);
  if (!t.device.is_cuda()) return;
  if (vector) {
    check(
        address % 16 == 0, name,
        "CUDA data must be 16-byte aligned (the kernels use 16-byte vector loads), got address 0x",
        std::hex, address);
    for (int d = 0; d < last; ++d) {
      check(t.shape[d] <= 1 || (t.strides[d] * elt) % 16 == 0, name,
            "CUDA strides other than the last must be multiples of 16 bytes (16-byte vector "
            "loads), got strides ",
            strides_str(t), " of ", elt, "-byte elements");
    }
  }
}

void Validator::expect_tensor(const TensorView& t, const std::string& name,
                              std::initializer_list<DType> ok, std::initializer_list<Dim> dims,
                              const Device& device, Access access, const char* dtype_why) const {
  expect_given(t, name);
  expect_dtype(t, name, ok, dtype_why);
  expect_shape(t, name, dims);
  expect_device(t, name, device);
  expect_layout(t, name, access);
}

void Validator::expect_float_dtype(const TensorView& t, const std::string& name) const {
  if (t.device.is_cuda()) {
    expect_dtype(t, name, {DType::kBF16, DType::kF16}, "on cuda");
  } else {
    expect_dtype(t, name, {DType::kF32, DType::kF16, DType::kBF16}, "on cpu");
  }
}

int32_t check_cu_seqlens_values(const Validator& v, const TensorView& cu, const std::string& name,
                                int64_t total, const std::string& total_what) {
  const int64_t n = cu.shape[0];
  v.check(host_i32(cu, 0) == 0, name, "the first entry must be 0, got ", host_i32(cu, 0));
  int32_t longest = 0;
  for (int64_t i = 0; i + 1 < n; ++i) {
    const int32_t a = host_i32(cu, i);
    const int32_t b = host_i32(cu, i + 1);
    v.check(b >= a, name, "must be non-decreasing, got ", name, "[", i, "] = ", a, " > ", name, "[",
            i + 1, "] = ", b);
    longest = std::max(longest, b - a);
  }
  v.check(host_i32(cu, n - 1) == total, name, "the last entry must equal ", total_what, " (", total,
          "), got ", host_i32(cu, n - 1));
  return longest;
}

KvCacheFacts check_kv_cache(const Validator& v, const KvCacheView& cache, const std::string& name,
                            const AttentionSpec& spec, DType q_dtype, const Device& device,
                            bool need_seq_lens) {
  const std::string n = name + ".";
  KvCacheFacts facts;
  v.check(cache.device == device, name + ".device", "expected ", device.str(),
          " (the device of the other tensors), got ", cache.device.str());
  facts.host = cache.device.is_cpu();
  v.check(cache.dtype == DType::kBF16 || cache.dtype == DType::kF16 ||
              cache.dtype == DType::kFp8E4M3 || cache.dtype == DType::kInt8,
          n + "dtype", "expected bf16, f16, fp8_e4m3 or int8, got ", dtype_name(cache.dtype));
  const bool quantized = cache.dtype == DType::kFp8E4M3 || cache.dtype == DType::kInt8;
  // f32 queries (cpu only) are the reference's high-precision mode: no cache dtype is f32, so
  // they read any cache dtype.
  v.check(quantized || cache.dtype == q_dtype || q_dtype == DType::kF32, n + "dtype",
          "an unquantized cache must have the dtype of the queries (", dtype_name(q_dtype),
          "), got ", dtype_name(cache.dtype));
  v.check(cache.num_kv_heads == spec.num_kv_heads, n + "num_kv_heads",
          "must equal spec.num_kv_heads (", spec.num_kv_heads, "), got ", cache.num_kv_heads);
  v.check(cache.head_dim == spec.head_dim, n + "head_dim", "must equal spec.head_dim (",
          spec.head_dim, "), got ", cache.head_dim);
  v.check(cache.layout == KvCacheLayout::kHND || cache.layout == KvCacheLayout::kNHD, n + "layout",
          "expected HND or NHD, got the value ", static_cast<int32_t>(cache.layout));
  if (cache.paged) {
    v.check(is_pow2_page(cache.tokens_per_block), n + "tokens_per_block",
            "expected 8, 16, 32, 64 or 128 for a paged cache, got ", cache.tokens_per_block);
  } else {
    v.check(cache.tokens_per_block >= 1, n + "tokens_per_block",
            "must be >= 1 (the row capacity of a contiguous cache), got ", cache.tokens_per_block);
  }
  v.check(cache.num_blocks >= 1, n + "num_blocks", "must be >= 1, got ", cache.num_blocks);
  v.check(cache.k_base != nullptr, n + "k_base", "required (K of block 0), got null");
  v.check(cache.v_base != nullptr, n + "v_base", "required (V of block 0), got null");
  const int64_t elt = static_cast<int64_t>(dtype_size(cache.dtype));
  const int64_t block_bytes =
      int64_t{cache.num_kv_heads} * cache.tokens_per_block * cache.head_dim * elt;
  v.check(cache.block_stride_bytes >= block_bytes, n + "block_stride_bytes",
          "must be >= num_kv_heads * tokens_per_block * head_dim * element size = ", block_bytes,
          ", got ", cache.block_stride_bytes);
  for (const auto& [base, what] : {std::pair{cache.k_base, "k_base"}, {cache.v_base, "v_base"}}) {
    const auto address = reinterpret_cast<uintptr_t>(base);
    v.check(address % elt == 0, n + what, "must be aligned to the ", elt,
            "-byte elements of the cache, got address 0x", std::hex, address);
  }
  v.check(cache.block_stride_bytes % elt == 0, n + "block_stride_bytes",
          "must be a multiple of the element size (", elt, "), got ", cache.block_stride_bytes);
  // Every block's byte offset is computed in int64: the last block must end within it.
  int64_t pool_bytes = 0;
  v.check(!__builtin_mul_overflow(int64_t{cache.num_blocks} - 1, cache.block_stride_bytes,
                                  &pool_bytes) &&
              !__builtin_add_overflow(pool_bytes, cache.block_stride_bytes, &pool_bytes),
          n + "block_stride_bytes", "num_blocks x block_stride_bytes = ", cache.num_blocks, " x ",
          cache.block_stride_bytes, " bytes is more than int64 holds");
  if (cache.device.is_cuda()) {
    for (const auto& [base, what] : {std::pair{cache.k_base, "k_base"}, {cache.v_base, "v_base"}}) {
      const auto address = reinterpret_cast<uintptr_t>(base);
      v.check(address % 16 == 0, n + what,
              "must be 16-byte aligned on cuda (16-byte vector loads), got address 0x", std::hex,
              address);
    }
    v.check(cache.block_stride_bytes % 16 == 0, n + "block_stride_bytes",
            "must be a multiple of 16 on cuda (16-byte vector loads), got ",
            cache.block_stride_bytes);
  }

  // Rows and capacity.
  if (cache.paged) {
    const std::string bt = n + "block_table";
    v.expect_given(cache.block_table, bt);
    v.expect_dtype(cache.block_table, bt, {DType::kInt32});
    v.expect_shape(cache.block_table, bt, {Dim("num_rows"), Dim("max_blocks_per_seq")});
    v.check(cache.block_table.shape[1] >= 1, bt, "needs at least one column, got shape ",
            cache.block_table.shape_str());
    v.expect_device(cache.block_table, bt, device);
    v.expect_layout(cache.block_table, bt, Access::kSmallInput);
    facts.rows = cache.block_table.shape[0];
    v.check(!__builtin_mul_overflow(cache.block_table.shape[1], int64_t{cache.tokens_per_block},
                                    &facts.row_capacity),
            bt, "max_blocks_per_seq x tokens_per_block overflows int64, got shape ",
            cache.block_table.shape_str());
  } else {
    facts.rows = cache.num_blocks;  // row r lives in block r
    facts.row_capacity = cache.tokens_per_block;
  }

  // Scales.
  for (const auto& [scale, what] :
       {std::pair{&cache.k_scale, "k_scale"}, std::pair{&cache.v_scale, "v_scale"}}) {
    const std::string sn = n + what;
    if (!scale->defined()) {
      v.check(!quantized, sn, "required for a cache of dtype ", dtype_name(cache.dtype),
              " (float32 [1] or [num_kv_heads]), not given");
      continue;
    }
    v.expect_given(*scale, sn);
    v.expect_dtype(*scale, sn, {DType::kF32});
    v.check(scale->ndim == 1 && (scale->shape[0] == 1 || scale->shape[0] == cache.num_kv_heads), sn,
            "expected shape [1] or [Hkv=", cache.num_kv_heads, "], got ", scale->shape_str());
    v.expect_device(*scale, sn, device);
    v.expect_layout(*scale, sn, Access::kSmallInput);
    if (scale->device.is_cpu()) {
      for (int64_t i = 0; i < scale->shape[0]; ++i) {
        const float value = static_cast<const float*>(scale->data)[i * scale->strides[0]];
        v.check(std::isfinite(value) && value > 0.0f, sn, "values must be finite and > 0, got ",
                value, " at index ", i);
      }
    }
  }

  // Cyclic sliding-window cache.
  v.check(cache.window_slots >= 0, n + "window_slots", "must be >= 0 (0 = not cyclic), got ",
          cache.window_slots);
  v.check(cache.sink_tokens >= 0, n + "sink_tokens", "must be >= 0, got ", cache.sink_tokens);
  facts.cyclic = cache.window_slots > 0;
  if (facts.cyclic) {
    v.check(spec.mask.kind == MaskKind::kSlidingWindow, n + "window_slots",
            "a cyclic cache (window_slots = ", cache.window_slots,
            ") needs spec.mask sliding_window, the mask is ", mask_name(spec.mask.kind));
    v.check(cache.window_slots >= spec.mask.window, n + "window_slots",
            "must be >= spec.mask.window (", spec.mask.window, "), got ", cache.window_slots);
    v.check(cache.sink_tokens == spec.mask.sink_tokens, n + "sink_tokens",
            "must equal spec.mask.sink_tokens (", spec.mask.sink_tokens,
            ") in a cyclic cache, got ", cache.sink_tokens);
    v.check(int64_t{cache.sink_tokens} + cache.window_slots <= facts.row_capacity,
            n + "window_slots", "sink_tokens + window_slots (", cache.sink_tokens, " + ",
            cache.window_slots, ") must fit in the row capacity of ", facts.row_capacity, " slots");
  }

  if (need_seq_lens) {
    const std::string sl = n + "seq_lens";
    v.expect_given(cache.seq_lens, sl);
    v.expect_dtype(cache.seq_lens, sl, {DType::kInt32});
    v.expect_shape(cache.seq_lens, sl, {Dim("num_rows")});
    v.expect_device(cache.seq_lens, sl, device);
    v.expect_layout(cache.seq_lens, sl, Access::kSmallInput);
    const int64_t rows = cache.seq_lens.shape[0];
    if (cache.paged) {
      v.check(rows == facts.rows, n + "block_table", "expected ", rows,
              " rows (one per entry of seq_lens), got shape ", cache.block_table.shape_str());
    } else {
      v.check(rows <= cache.num_blocks, n + "num_blocks",
              "a contiguous cache needs one block per row: >= ", rows,
              " (the entries of seq_lens), got ", cache.num_blocks);
    }
    facts.rows = rows;
    if (facts.host) {
      for (int64_t r = 0; r < rows; ++r) {
        const int32_t len = host_i32(cache.seq_lens, r);
        v.check(len >= 0, sl, "values must be >= 0, got ", len, " at row ", r);
        v.check(facts.cyclic || len <= facts.row_capacity, sl, "row ", r, " holds ", len,
                " tokens, more than the row capacity of ", facts.row_capacity,
                " slots (max_blocks_per_seq * tokens_per_block)");
      }
    }
  }
  return facts;
}

int64_t checked_block_of(const Validator& v, const KvCacheView& cache, const std::string& name,
                         int64_t row, int64_t slot, const std::string& what) {
  if (!cache.paged) return row;
  const int64_t index = slot / cache.tokens_per_block;
  const int32_t block = host_i32(cache.block_table, row, index);
  if (block < 0 || block >= cache.num_blocks) {
    v.fail(name + ".block_table", "row ", row, ", index ", index, " holds ", block,
           block == -1 ? " (an invalid entry)" : "", " but ", what, " uses slot ", slot,
           " in that block; accepted block ids are 0 .. ", cache.num_blocks - 1);
  }
  return block;
}

void check_row_blocks(const Validator& v, const KvCacheView& cache, const KvCacheFacts& facts,
                      const std::string& name, int64_t row, int64_t seq_len) {
  if (!cache.paged || seq_len <= 0) return;
  // Positions [0, seq_len) fill slots [0, n) in both the linear and the cyclic layout.
  int64_t slots = seq_len;
  if (facts.cyclic) slots = std::min<int64_t>(seq_len, cache.sink_tokens + cache.window_slots);
  const std::string what = name + ".seq_lens[" + std::to_string(row) +
                           "] = " + std::to_string(seq_len) + " (positions read)";
  for (int64_t slot = 0; slot < slots; slot += cache.tokens_per_block) {
    checked_block_of(v, cache, name, row, slot, what);
  }
}

void check_no_beams_with_cyclic(const Validator& v, const KvCacheFacts& facts,
                                const std::string& name, int32_t beam_width,
                                const TensorView& cache_indirection) {
  if (!facts.cyclic) return;
  v.check(beam_width == 1 && !cache_indirection.defined(), name + ".window_slots",
          "a cyclic (sliding-window) cache cannot be combined with beam search; got beam_width = ",
          beam_width, cache_indirection.defined() ? " and a cache_indirection" : "");
}

void check_no_dense_only_options(const Validator& v, const AttentionSpec& spec, bool allow_skip,
                                 bool allow_quant) {
  v.check(allow_skip || !spec.skip_softmax.has_value(), "spec.skip_softmax",
          "skip-softmax is implemented by dense() and prefill() only; unset it for ", v.op());
  v.check(allow_quant || !spec.quant.has_value(), "spec.quant",
          "SAGE quantization is implemented by dense() and prefill() only; unset it for ", v.op());
}

void check_skip_args(const Validator& v, const TensorView& skip_stats, int64_t stats_len,
                     const Device& device, double timestep, int32_t block_m, int32_t block_n) {
  if (skip_stats.defined()) {
    v.expect_tensor(skip_stats, "skip_stats", {DType::kInt64}, {stats_len}, device,
                    Access::kSmallOutput);
    v.check(skip_stats.strides[0] == 1, "skip_stats", "must be contiguous, got stride ",
            skip_stats.strides[0]);
  }
  v.check(std::isfinite(timestep) && timestep >= 0.0 && timestep <= 1.0, "timestep",
          "must be a normalized timestep in [0, 1], got ", timestep);
  const auto tile = [](int32_t size) {
    return size == 16 || size == 32 || size == 64 || size == 128 || size == 256;
  };
  v.check(tile(block_m), "block_m", "expected 16, 32, 64, 128 or 256, got ", block_m);
  v.check(tile(block_n), "block_n", "expected 16, 32, 64, 128 or 256, got ", block_n);
}

void check_cyclic_chunk(const Validator& v, const KvCacheView& cache, const AttentionSpec& spec,
                        const std::string& what, int64_t chunk_len) {
  if (cache.window_slots == 0 || chunk_len <= 1) return;
  v.check(chunk_len + spec.mask.window - 1 <= cache.window_slots, what, "a chunk of ", chunk_len,
          " tokens does not fit a cyclic cache with window_slots = ", cache.window_slots,
          " and window ", spec.mask.window,
          ": needs chunk + window - 1 <= window_slots (the first query's window would be "
          "overwritten)");
}

}  // namespace attnkit::detail
