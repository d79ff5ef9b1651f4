// Bad-input tests of prefill(), packed (k, v, cu_seqlens_kv) and paged (kv_cache) modes.
#include <gtest/gtest.h>

#include "common/test_util.h"
#include "core/problem.h"
#include "validate_fixtures.h"

namespace attnkit::test {
namespace {

// Packed: two sequences with 3 and 4 queries over 5 and 6 keys.
struct PackedCall {
  AttentionSpec spec = small_spec();
  std::unique_ptr<HostTensor> q = make_input(DType::kBF16, {7, 4, 16});
  std::unique_ptr<HostTensor> k = make_input(DType::kBF16, {11, 2, 16});
  std::unique_ptr<HostTensor> v = make_input(DType::kBF16, {11, 2, 16});
  std::unique_ptr<HostTensor> cu_q = make_i32({0, 3, 7}, {3});
  std::unique_ptr<HostTensor> cu_kv = make_i32({0, 5, 11}, {3});
  std::unique_ptr<HostTensor> out = make_output(DType::kBF16, {7, 4, 16});
  std::unique_ptr<HostTensor> lse = make_output(DType::kF32, {7, 4});
  PrefillArgs args;

  PackedCall() {
    args.q = *q;
    args.k = *k;
    args.v = *v;
    args.cu_seqlens_q = *cu_q;
    args.cu_seqlens_kv = *cu_kv;
    args.out = *out;
    args.lse = *lse;
  }
  void to_fake_cuda() {
    args.q = fake_cuda(args.q, 0x10000);
    args.k = fake_cuda(args.k, 0x20000);
    args.v = fake_cuda(args.v, 0x30000);
    args.cu_seqlens_q = fake_cuda(args.cu_seqlens_q, 0x40000);
    args.cu_seqlens_kv = fake_cuda(args.cu_seqlens_kv, 0x50000);
    args.out = fake_cuda(args.out, 0x60000);
    args.lse = fake_cuda(args.lse, 0x70000);
    args.max_seqlen_q = 4;
    args.max_seqlen_kv = 6;
  }
  void expect_rejected(const std::string& arg) {
    test::expect_rejected([&] { prefill(spec, args); }, "prefill: " + arg + ":",
                          {out.get(), lse.get()});
  }
};

// Paged: three cache rows of 5, 17 and 30 tokens with 5, 4 and 1 new queries.
struct PagedCall {
  AttentionSpec spec = small_spec();
  CacheFixture cache{{5, 17, 30}};
  std::unique_ptr<HostTensor> q = make_input(DType::kBF16, {10, 4, 16});
  std::unique_ptr<HostTensor> cu_q = make_i32({0, 5, 9, 10}, {4});
  std::unique_ptr<HostTensor> out = make_output(DType::kBF16, {10, 4, 16});
  std::unique_ptr<HostTensor> lse = make_output(DType::kF32, {10, 4});
  KvCacheView view = cache.view;
  PrefillArgs args;

  PagedCall() {
    args.q = *q;
    args.cu_seqlens_q = *cu_q;
    args.kv_cache = &view;
    args.out = *out;
    args.lse = *lse;
  }
  void expect_rejected(const std::string& arg) {
    test::expect_rejected([&] { prefill(spec, args); }, "prefill: " + arg + ":",
                          {out.get(), lse.get()});
  }
};

TEST(ValidatePrefill, ValidBaselines) {
  PackedCall packed;
  detail::PrefillProblem p = detail::validate_prefill(packed.spec, packed.args);
  EXPECT_FALSE(p.paged);
  EXPECT_EQ(p.batch, 2);
  EXPECT_EQ(p.total_q, 7);
  EXPECT_EQ(p.total_kv, 11);
  EXPECT_EQ(p.max_seqlen_q, 4);
  EXPECT_EQ(p.max_seqlen_kv, 6);

  PagedCall paged;
  p = detail::validate_prefill(paged.spec, paged.args);
  EXPECT_TRUE(paged.args.kv_cache != nullptr);
  EXPECT_TRUE(p.paged);
  EXPECT_EQ(p.batch, 3);
  EXPECT_EQ(p.max_seqlen_q, 5);
  EXPECT_EQ(p.max_seqlen_kv, 30);

  PackedCall cuda;
  cuda.to_fake_cuda();
  p = detail::validate_prefill(cuda.spec, cuda.args);
  EXPECT_TRUE(p.device.is_cuda());
  EXPECT_EQ(p.max_seqlen_kv, 6);
}

TEST(ValidatePrefill, AcceptsQSlicedFromFusedQkv) {
  PackedCall call;
  HostTensor qkv(DType::kBF16, {7, 8 * 16});
  call.args.q = TensorView(qkv.view().data, DType::kBF16, {7, 4, 16}, {128, 16, 1});
  EXPECT_NO_THROW(detail::validate_prefill(call.spec, call.args));
}

TEST(ValidatePrefill, AcceptsMoreQueriesThanKeysOnlyWithoutMask) {
  PackedCall call;
  call.cu_kv->data<int32_t>()[1] = 2;  // sequence 0: 3 queries, 2 keys
  call.expect_rejected("cu_seqlens_q");
  call.spec.mask.kind = MaskKind::kNone;
  EXPECT_NO_THROW(detail::validate_prefill(call.spec, call.args));
}

TEST(ValidatePrefill, RejectsMixedModes) {
  PackedCall call;
  PagedCall paged;
  call.args.kv_cache = &paged.view;
  call.expect_rejected("k");
}

TEST(ValidatePrefill, RejectsMissingPackedKv) {
  {
    PackedCall call;
    call.args.k = {};
    call.expect_rejected("k");
  }
  {
    PackedCall call;
    call.args.cu_seqlens_kv = {};
    call.expect_rejected("cu_seqlens_kv");
  }
}

TEST(ValidatePrefill, RejectsTensorShapes) {
  {
    PackedCall call;
    HostTensor q(DType::kBF16, {7, 4, 8});
    call.args.q = q;
    call.expect_rejected("q");
  }
  {
    PackedCall call;
    HostTensor k(DType::kBF16, {11, 4, 16});
    call.args.k = k;
    call.expect_rejected("k");
  }
  {
    PackedCall call;
    HostTensor v(DType::kBF16, {10, 2, 16});
    call.args.v = v;
    call.expect_rejected("v");
  }
  {
    PackedCall call;
    HostTensor out(DType::kBF16, {6, 4, 16});
    call.args.out = out;
    call.expect_rejected("out");
  }
  {
    PackedCall call;
    HostTensor lse(DType::kF32, {4, 7});
    call.args.lse = lse;
    call.expect_rejected("lse");
  }
  {
    PackedCall call;
    HostTensor cu(DType::kInt32, {4});
    call.args.cu_seqlens_kv = cu;
    call.expect_rejected("cu_seqlens_kv");
  }
}

TEST(ValidatePrefill, RejectsDtypes) {
  {
    PackedCall call;
    call.args.k = with_dtype(call.args.k, DType::kF16);
    call.expect_rejected("k");
  }
  {
    PackedCall call;
    call.args.q = with_dtype(call.args.q, DType::kFp8E4M3);
    call.expect_rejected("q");
  }
  {
    PackedCall call;
    call.args.cu_seqlens_q = with_dtype(call.args.cu_seqlens_q, DType::kInt64);
    call.expect_rejected("cu_seqlens_q");
  }
  {
    PackedCall call;
    call.args.lse = with_dtype(call.args.lse, DType::kF16);
    call.expect_rejected("lse");
  }
}

TEST(ValidatePrefill, RejectsBadCuSeqlens) {
  {
    PackedCall call;
    call.cu_q->data<int32_t>()[0] = 1;
    call.expect_rejected("cu_seqlens_q");
  }
  {
    PackedCall call;
    call.cu_q->data<int32_t>()[1] = 8;  // 8 > 7 further on
    call.expect_rejected("cu_seqlens_q");
  }
  {
    PackedCall call;
    call.cu_q->data<int32_t>()[2] = 6;  // q has 7 rows
    call.expect_rejected("cu_seqlens_q");
  }
  {
    PackedCall call;
    call.cu_kv->data<int32_t>()[2] = 12;  // k has 11 rows
    call.expect_rejected("cu_seqlens_kv");
  }
}

TEST(ValidatePrefill, RejectsDeviceMismatch) {
  PackedCall call;
  call.args.cu_seqlens_kv = fake_cuda(call.args.cu_seqlens_kv);
  call.expect_rejected("cu_seqlens_kv");
}

TEST(ValidatePrefill, RejectsMaxSeqlens) {
  {
    PackedCall call;
    call.args.max_seqlen_q = 3;  // sequence 1 has 4 queries
    call.expect_rejected("max_seqlen_q");
  }
  {
    PackedCall call;
    call.args.max_seqlen_kv = -1;
    call.expect_rejected("max_seqlen_kv");
  }
  {
    PackedCall call;
    call.to_fake_cuda();
    call.args.max_seqlen_kv = 0;  // required on cuda
    call.expect_rejected("max_seqlen_kv");
  }
}

TEST(ValidatePrefill, RejectsCudaLayout) {
  {
    PackedCall call;
    call.to_fake_cuda();
    call.args.v = with_stride(call.args.v, 0, 36);  // 72-byte rows
    call.expect_rejected("v");
  }
  {
    PackedCall call;
    call.to_fake_cuda();
    call.args.cu_seqlens_q.data = static_cast<char*>(call.args.cu_seqlens_q.data) + 2;
    call.expect_rejected("cu_seqlens_q");
  }
  {
    PackedCall call;  // misaligned even on cpu
    call.args.out.data = static_cast<char*>(call.args.out.data) + 1;
    call.expect_rejected("out");
  }
}

TEST(ValidatePrefill, RejectsPagedRowCount) {
  PagedCall call;
  const auto cu_q = make_i32({0, 5, 10}, {3});  // three cache rows
  call.args.cu_seqlens_q = *cu_q;
  call.expect_rejected("cu_seqlens_q");
}

TEST(ValidatePrefill, RejectsPagedMoreQueriesThanCachedTokens) {
  PagedCall call;
  call.cache.seq_lens->data<int32_t>()[2] = 0;  // one query, nothing in the cache
  call.expect_rejected("cu_seqlens_q");
}

TEST(ValidatePrefill, RejectsPagedInvalidBlockThatWouldBeRead) {
  std::mt19937_64 rng(test_seed());
  PagedCall call;
  const int64_t index = std::uniform_int_distribution<int64_t>(0, 2)(rng);  // row 1 uses 3
  call.cache.table_at(1, index) = -1;
  call.expect_rejected("kv_cache.block_table");
}

TEST(ValidatePrefill, RejectsPagedCacheProblems) {
  {
    PagedCall call;
    call.view.dtype = DType::kF16;
    call.expect_rejected("kv_cache.dtype");
  }
  {
    PagedCall call;
    call.view.layout = static_cast<KvCacheLayout>(2);  // neither HND nor NHD
    call.expect_rejected("kv_cache.layout");
  }
  {
    PagedCall call;
    call.view.seq_lens = {};
    call.expect_rejected("kv_cache.seq_lens");
  }
}

TEST(ValidatePrefill, RejectsChunkLongerThanCyclicCacheAllows) {
  PagedCall call;
  call.spec.mask = {MaskKind::kSlidingWindow, 12, 0};
  call.view.window_slots = 16;  // a chunk may have 16 - 12 + 1 = 5 tokens
  EXPECT_NO_THROW(detail::validate_prefill(call.spec, call.args));
  call.view.window_slots = 15;
  call.expect_rejected("cu_seqlens_q");
}

// SAGE quantizes packed k / v under mask none or causal: a cache or a sliding window is rejected.
TEST(ValidatePrefill, RejectsQuantOverACacheOrAWindow) {
  {
    PackedCall call;
    call.spec.quant = SageQuantSpec{};
    EXPECT_NO_THROW(detail::validate_prefill(call.spec, call.args));
    call.spec.mask = {MaskKind::kSlidingWindow, 12, 0};
    call.expect_rejected("spec.quant");
  }
  {
    PagedCall call;
    call.spec.quant = SageQuantSpec{};
    call.expect_rejected("spec.quant");
  }
}

TEST(ValidatePrefill, RejectsNullDataAndStrides) {
  {
    PackedCall call;
    call.args.q.data = nullptr;
    call.expect_rejected("q");
  }
  {
    PackedCall call;
    call.args.k = with_stride(call.args.k, 2, 2);
    call.expect_rejected("k");
  }
  {
    PackedCall call;  // two heads writing one place
    call.args.out = with_stride(call.args.out, 1, 0);
    call.expect_rejected("out");
  }
}

}  // namespace
}  // namespace attnkit::test
