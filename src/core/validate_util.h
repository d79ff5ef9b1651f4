// Shared helpers of the validation layer (validate*.cc): uniform checks of tensor views and of
// KV-cache views. Every failure throws attnkit::Error as "<op>: <argument>: <what is expected>,
// got <what was given>". Values are read only from tensors in host (cpu) memory; reading device
// memory would synchronize the stream.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "attnkit/attention.h"
#include "core/check.h"

namespace attnkit::detail {

// One dimension of an expected shape: printed as "name=value", "name" (any extent) or "value".
struct Dim {
  static constexpr int64_t kAny = -1;
  std::string name;
  int64_t value = kAny;

  Dim(int64_t v) : value(v) {}  // NOLINT: anonymous fixed extent, e.g. {2, Dim("D", 128)}
  Dim(std::string n, int64_t v = kAny) : name(std::move(n)), value(v) {}
};

// How a tensor is accessed: outputs may not broadcast (stride 0 over an extent > 1), and the
// data tensors that kernels read with 16-byte vector loads have stricter CUDA alignment rules.
enum class Access : uint8_t {
  kInput,        // vector-loaded input (q, k, v, qkv, bias, out_a, ...)
  kOutput,       // vector-stored output (out, q_out, ...)
  kSmallInput,   // element-wise input (lengths, block tables, scales, lse_a)
  kSmallOutput,  // element-wise output (lse)
};

// The validation context of one entry-point call.
class Validator {
 public:
  explicit Validator(const char* op) : op_(op) {}
  const char* op() const { return op_; }

  template <typename... Parts>
  [[noreturn]] void fail(const std::string& arg, Parts&&... parts) const {
    detail::fail(op_, ": ", arg, ": ", std::forward<Parts>(parts)...);
  }
  template <typename... Parts>
  void check(bool cond, const std::string& arg, Parts&&... parts) const {
    if (!cond) fail(arg, std::forward<Parts>(parts)...);
  }

  // A required tensor: given, and with non-null data unless it has no elements.
  void expect_given(const TensorView& t, const std::string& name) const;
  void expect_dtype(const TensorView& t, const std::string& name, std::initializer_list<DType> ok,
                    const char* why = nullptr) const;
  void expect_shape(const TensorView& t, const std::string& name,
                    std::initializer_list<Dim> dims) const;
  void expect_device(const TensorView& t, const std::string& name, const Device& device,
                     const char* whose = "the other tensors") const;
  // Last dimension contiguous, other strides >= 0, no broadcast outputs, and on CUDA the
  // alignment the kernels need.
  void expect_layout(const TensorView& t, const std::string& name, Access access) const;

  // All of the above for one tensor.
  void expect_tensor(const TensorView& t, const std::string& name, std::initializer_list<DType> ok,
                     std::initializer_list<Dim> dims, const Device& device, Access access,
                     const char* dtype_why = nullptr) const;

  // q/k/v/out element types: f32, f16, bf16 on cpu; f16, bf16 on cuda.
  void expect_float_dtype(const TensorView& t, const std::string& name) const;

 private:
  const char* op_;
};

// Element i of a 1-D int32 host tensor / element (r, c) of a 2-D one.
inline int32_t host_i32(const TensorView& t, int64_t i) {
  return static_cast<const int32_t*>(t.data)[i * t.strides[0]];
}
inline int32_t host_i32(const TensorView& t, int64_t r, int64_t c) {
  return static_cast<const int32_t*>(t.data)[r * t.strides[0] + c * t.strides[1]];
}

// Checks cu_seqlens (host): [0] == 0, non-decreasing, last == total. Returns the longest length.
int32_t check_cu_seqlens_values(const Validator& v, const TensorView& cu, const std::string& name,
                                int64_t total, const std::string& total_what);

// What check_kv_cache() derived from a KvCacheView.
struct KvCacheFacts {
  int64_t rows = 0;          // block-table rows (paged) or blocks usable as rows (contiguous)
  int64_t row_capacity = 0;  // slots per row
  bool cyclic = false;
  bool host = false;  // cpu: seq_lens, block_table and scales may be read
};

// Checks everything of a KV-cache view that does not depend on the call's lengths: dtype,
// geometry against spec, pointers, strides, block table, scales, cyclic parameters. With
// need_seq_lens the view's seq_lens must be int32 [rows] and (host) hold lengths in
// [0, capacity] (cyclic rows may be longer than the capacity).
KvCacheFacts check_kv_cache(const Validator& v, const KvCacheView& cache, const std::string& name,
                            const AttentionSpec& spec, DType q_dtype, const Device& device,
                            bool need_seq_lens);

// Host only: every block-table entry that holds a slot of positions [0, seq_len) of `row` is a
// valid block id.
void check_row_blocks(const Validator& v, const KvCacheView& cache, const KvCacheFacts& facts,
                      const std::string& name, int64_t row, int64_t seq_len);

// Host only: the block id that holds `slot` of `row`, checked to be valid; `what` says why the
// slot is used (for the message).
int64_t checked_block_of(const Validator& v, const KvCacheView& cache, const std::string& name,
                         int64_t row, int64_t slot, const std::string& what);

// Rejects a combination of beam search with a cyclic cache.
void check_no_beams_with_cyclic(const Validator& v, const KvCacheFacts& facts,
                                const std::string& name, int32_t beam_width,
                                const TensorView& cache_indirection);

// Host only: cache_indirection [S, beam, max_seq] holds values in [0, beam) for every t <
// seq_lens[s * beam + b]; `seq_len_of_row` gives the length of a block-table row.
template <typename SeqLenOfRow>
void check_indirection_values(const Validator& v, const TensorView& ind, const std::string& name,
                              int32_t beam_width, SeqLenOfRow seq_len_of_row) {
  const auto* data = static_cast<const int32_t*>(ind.data);
  for (int64_t s = 0; s < ind.shape[0]; ++s) {
    for (int64_t b = 0; b < beam_width; ++b) {
      const int64_t len = seq_len_of_row(s * beam_width + b);
      for (int64_t t = 0; t < len; ++t) {
        const int32_t value = data[s * ind.strides[0] + b * ind.strides[1] + t * ind.strides[2]];
        v.check(value >= 0 && value < beam_width, name, "values must be beam indices in [0, ",
                beam_width, "), got ", value, " at [", s, "][", b, "][", t, "]");
      }
    }
  }
}

// Spec features that only dense() implements (prefill() takes skip_softmax and quant too:
// `allow_skip`, `allow_quant`).
void check_no_dense_only_options(const Validator& v, const AttentionSpec& spec,
                                 bool allow_skip = false, bool allow_quant = false);

// The skip-softmax arguments of dense() and prefill(): skip_stats (optional, int64 [stats_len],
// contiguous, on `device`), the normalized timestep in [0, 1], and the reference's tiles block_m /
// block_n (16, 32, 64, 128 or 256).
void check_skip_args(const Validator& v, const TensorView& skip_stats, int64_t stats_len,
                     const Device& device, double timestep, int32_t block_m, int32_t block_n);

// Cyclic caches hold window_slots positions after the sinks; a chunk of n new queries needs the
// window of its first query still present: n + window - 1 <= window_slots.
void check_cyclic_chunk(const Validator& v, const KvCacheView& cache, const AttentionSpec& spec,
                        const std::string& what, int64_t chunk_len);

}  // namespace attnkit::detail
