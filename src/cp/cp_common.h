// Pieces shared by the context-parallel drivers: views into one scratch allocation, row slices,
// and the chain of merge_states() calls that folds a row's partial (O, LSE) results together.
#pragma once

#include <cstdint>
#include <vector>

#include "attnkit/attention.h"

namespace attnkit::cp::detail {

// Hands out 256-byte aligned pieces of one allocation: first sized (bytes() after every take()
// with base == nullptr), then placed over the real base.
class ScratchLayout {
 public:
  explicit ScratchLayout(uint8_t* base = nullptr) : base_(base) {}
  uint8_t* take(int64_t bytes) {
    const int64_t offset = used_;
    used_ += (bytes + 255) / 256 * 256;
    return base_ == nullptr ? nullptr : base_ + offset;
  }
  int64_t bytes() const { return used_; }

 private:
  uint8_t* base_;
  int64_t used_ = 0;
};

// Rows [first, first + count) of a view whose first dimension is the token / row.
inline TensorView row_slice(const TensorView& t, int64_t first, int64_t count) {
  TensorView s = t;
  if (t.data != nullptr) {
    s.data = static_cast<uint8_t*>(t.data) +
             first * t.strides[0] * static_cast<int64_t>(dtype_size(t.dtype));
  }
  s.shape[0] = count;
  return s;
}

inline TensorView contiguous_view(void* data, DType dtype, int64_t rows, int64_t heads,
                                  int64_t head_dim, const Device& device) {
  return TensorView(data, dtype, {rows, heads, head_dim}, device);
}
inline TensorView lse_view(void* data, int64_t rows, int64_t heads, const Device& device) {
  return TensorView(data, DType::kF32, {rows, heads}, device);
}

// An (O, LSE) pair of views.
struct State {
  TensorView out, lse;
};

// The running merge of `count` partial results of the same rows. The result after partials
// 0 .. m lives at location(m), alternating between `final_state` and `scratch` so that the last
// one, location(count - 1), is final_state and no merge reads the buffer it writes. final_state
// must have an lse (the caller substitutes scratch for an lse it was not given).
class MergeChain {
 public:
  MergeChain(State final_state, State scratch, int32_t count)
      : final_(final_state), scratch_(scratch), count_(count) {}
  int32_t count() const { return count_; }
  const State& location(int32_t m) const { return (count_ - 1 - m) % 2 == 0 ? final_ : scratch_; }
  // merge_states(location(m - 1) or `first`, partial) -> location(m), for m >= 1.
  MergeStatesArgs merge(int32_t m, const State& previous, const State& partial,
                        bool checked) const {
    MergeStatesArgs a;
    a.out_a = previous.out;
    a.lse_a = previous.lse;
    a.out_b = partial.out;
    a.lse_b = partial.lse;
    a.out = location(m).out;
    a.lse = location(m).lse;
    a.checked = checked;
    return a;
  }

 private:
  State final_, scratch_;
  int32_t count_;
};

}  // namespace attnkit::cp::detail
