// Validation at the edges of the integer types: element counts that overflow int64, ndim outside
// [0, 6], lengths and counts that do not fit the int32 the kernels use. Each is a clean
// attnkit::Error naming the argument (once: a wrapped count let null data through, a read past
// TensorView::shape, signed overflow in forward(), counts truncated to int32).
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cstdint>
#include <limits>

#include "attnkit/attention.h"
#include "validate_fixtures.h"

namespace attnkit::test {
namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

TEST(ValidateLimits, ElementCountsThatOverflowInt64AreRejected) {
  // [2^34, 2^30, 1] has 2^64 elements: the count wrapped to 0 and null data passed.
  MergeStatesArgs m;
  const int64_t n = int64_t{1} << 34, h = int64_t{1} << 30;
  m.out_a = TensorView(nullptr, DType::kF32, {n, h, 1});
  m.out_b = m.out_a;
  m.out = m.out_a;
  m.lse_a = TensorView(nullptr, DType::kF32, {n, h});
  m.lse_b = m.lse_a;
  expect_rejected([&] { merge_states(m); },
                  "merge_states: out_a: shape [17179869184, 1073741824, "
                  "1] has more elements than int64 holds");

  // [2^30, 2^30, 16, 256]: 2^72 elements (std::bad_alloc escaped from the reference).
  AttentionSpec spec;
  spec.num_q_heads = spec.num_kv_heads = 16;
  spec.head_dim = 256;
  spec.mask.kind = MaskKind::kNone;
  DenseArgs d;
  const int64_t b = int64_t{1} << 30;
  d.q = TensorView(nullptr, DType::kF32, {b, b, 16, 256});
  d.k = d.v = d.out = d.q;
  expect_rejected([&] { dense(spec, d); },
                  "dense: q: shape [1073741824, 1073741824, 16, 256] has "
                  "more elements than int64 holds");
  EXPECT_THROW(d.q.numel(), Error);
}

TEST(ValidateLimits, NdimOutsideTheViewIsRejectedBeforeAnyRead) {
  // A view's ndim is a public field; 7 (or -1, or 100) once read past shape[6].
  CacheFixture cache({5, 9});
  auto q = make_input(DType::kF32, {2, 4, 16});
  auto out = make_output(DType::kF32, {2, 4, 16});
  for (int ndim : {7, 100, -1}) {
    DecodeArgs args;
    args.q = *q;
    args.q.ndim = ndim;
    args.kv_cache = cache.view;
    args.out = *out;
    expect_rejected([&] { decode(small_spec(), args); },
                    "decode: q: ndim must be in [0, 6], got " + std::to_string(ndim), {out.get()});
    args.q = *q;
    args.kv_cache.seq_lens.ndim = ndim;
    expect_rejected([&] { decode(small_spec(), args); },
                    "decode: kv_cache.seq_lens: ndim must be in [0, 6]", {out.get()});
  }
  TensorView bad = *q;
  bad.ndim = 9;
  EXPECT_THROW(bad.numel(), Error);
  EXPECT_EQ(bad.shape_str(), "[ndim 9]");
  EXPECT_FALSE(bad.is_contiguous());
}

TEST(ValidateLimits, ForwardPastLensAtInt32MaxDoNotOverflow) {
  // A generation request with past_lens = INT32_MAX grows to 2^31 tokens (`past + 1` was int32).
  const AttentionSpec spec = small_spec();
  CacheFixture cache({1});
  const int64_t width = (4 + 2 * 2) * 16;
  auto qkv = make_input(DType::kF32, {1, width});
  auto out = make_output(DType::kF32, {1, 4, 16});
  auto cu = make_i32({0, 1}, {2});
  auto past = make_i32({static_cast<int32_t>(kInt32Max)}, {1});
  ForwardArgs args;
  args.qkv = *qkv;
  args.num_context = 0;
  args.cu_seqlens_q = *cu;
  args.past_lens = *past;
  args.kv_cache = cache.view;
  args.out = *out;
  expect_rejected([&] { forward(spec, args); },
                  "forward: past_lens: request 0 grows to 2147483648 tokens, more than int32 "
                  "holds",
                  {out.get()});
}

// Zero-filled host memory of `bytes` that is never committed (reads see the zero page).
class ZeroPages {
 public:
  explicit ZeroPages(size_t bytes) : bytes_(bytes) {
    data_ = mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (data_ == MAP_FAILED) data_ = nullptr;
  }
  ~ZeroPages() {
    if (data_ != nullptr) munmap(data_, bytes_);
  }
  void* data() const { return data_; }

 private:
  void* data_ = nullptr;
  size_t bytes_;
};

TEST(ValidateLimits, BatchAndRequestCountsMustFitInt32) {
  // 2^32 + 1 sequences: the count was truncated to 1 (and the CUDA batch guard then tested the
  // truncated value). Device tensors: validation does not read them.
  const int64_t entries = (int64_t{1} << 32) + 2;
  PrefillArgs p;
  p.q = fake_cuda(TensorView(nullptr, DType::kBF16, {0, 4, 16}));
  p.q.data = nullptr;
  p.out = p.q;
  p.k = fake_cuda(TensorView(nullptr, DType::kBF16, {0, 2, 16}));
  p.k.data = nullptr;
  p.v = p.k;
  p.cu_seqlens_q = fake_cuda(TensorView(nullptr, DType::kInt32, {entries}));
  p.cu_seqlens_kv = fake_cuda(TensorView(nullptr, DType::kInt32, {entries}), 0x20000);
  p.max_seqlen_q = p.max_seqlen_kv = 1;
  expect_rejected([&] { prefill(small_spec(MaskKind::kNone), p); },
                  "prefill: cu_seqlens_q: B = 4294967297 sequences, more than int32 holds");

  // forward() reads its request layout from host memory: 2^32 + 1 requests of zeros.
  ZeroPages cu(static_cast<size_t>(entries) * 4), past(static_cast<size_t>(entries - 1) * 4);
  ASSERT_NE(cu.data(), nullptr);
  ASSERT_NE(past.data(), nullptr);
  ForwardArgs f;
  f.qkv = TensorView(nullptr, DType::kF32, {0, (4 + 2 * 2) * 16});
  f.out = TensorView(nullptr, DType::kF32, {0, 4, 16});
  f.cu_seqlens_q = TensorView(cu.data(), DType::kInt32, {entries});
  f.past_lens = TensorView(past.data(), DType::kInt32, {entries - 1});
  CacheFixture cache({1});
  f.kv_cache = cache.view;
  expect_rejected([&] { forward(small_spec(), f); },
                  "forward: cu_seqlens_q: 4294967297 requests, more than int32 holds");
}

TEST(ValidateLimits, BlockStridesWhoseLastBlockPassesInt64AreRejected) {
  // Found by the entry-point fuzzer: block_stride_bytes = 2^62 passed (it is >= the block bytes
  // and a multiple of the element size), and block 2's offset overflowed int64 in the reference.
  CacheFixture cache({5, 9});
  auto q = make_input(DType::kF32, {2, 4, 16});
  auto out = make_output(DType::kF32, {2, 4, 16});
  DecodeArgs args;
  args.q = *q;
  args.kv_cache = cache.view;
  args.kv_cache.block_stride_bytes = int64_t{1} << 62;
  args.out = *out;
  expect_rejected([&] { decode(small_spec(), args); },
                  "decode: kv_cache.block_stride_bytes: num_blocks x block_stride_bytes = 20 x "
                  "4611686018427387904 bytes is more than int64 holds",
                  {out.get()});
}

TEST(ValidateLimits, SpansBeyondInt64BytesAreRejected) {
  // Strides whose last element lies past 2^63 bytes: offsets would overflow int64.
  CacheFixture cache({5, 9});
  auto q = make_input(DType::kF32, {2, 4, 16});
  auto out = make_output(DType::kF32, {2, 4, 16});
  DecodeArgs args;
  args.q = with_stride(*q, 0, int64_t{1} << 62);
  args.kv_cache = cache.view;
  args.out = *out;
  expect_rejected([&] { decode(small_spec(), args); },
                  "decode: q: strides [4611686018427387904, 16, 1] address more than int64 bytes",
                  {out.get()});
}

}  // namespace
}  // namespace attnkit::test
