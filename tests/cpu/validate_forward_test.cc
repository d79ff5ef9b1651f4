// Bad-input tests of forward(), the in-flight batch: request layout, lengths, beams, cache.
#include <gtest/gtest.h>

#include "common/test_util.h"
#include "core/problem.h"
#include "validate_fixtures.h"

namespace attnkit::test {
namespace {

// Two context chunks (3 tokens after 0 cached, 2 after 8) and one generation request with two
// beams after 10 cached tokens. Rows: 0, 1 (context), 2, 3 (beams, sharing their first block).
struct ForwardCall {
  AttentionSpec spec = small_spec();
  CacheFixture cache{{3, 10, 11, 11}};
  std::unique_ptr<HostTensor> qkv = make_input(DType::kBF16, {7, 8 * 16});
  std::unique_ptr<HostTensor> cu_q = make_i32({0, 3, 5, 7}, {4});
  std::unique_ptr<HostTensor> past = make_i32({0, 8, 10}, {3});
  std::unique_ptr<HostTensor> indirection = make_i32(std::vector<int32_t>(2 * 16, 0), {1, 2, 16});
  std::unique_ptr<HostTensor> out = make_output(DType::kBF16, {7, 4, 16});
  std::unique_ptr<HostTensor> lse = make_output(DType::kF32, {7, 4});
  ForwardArgs args;

  ForwardCall() {
    cache.table_at(3, 0) = cache.table_at(2, 0);
    for (int t = 0; t < 11; t += 2) indirection->data<int32_t>()[16 + t] = 1;
    args.qkv = *qkv;
    args.num_context = 2;
    args.beam_width = 2;
    args.cu_seqlens_q = *cu_q;
    args.past_lens = *past;
    args.kv_cache = cache.view;
    args.cache_indirection = *indirection;
    args.out = *out;
    args.lse = *lse;
  }
  void to_fake_cuda() {
    args.qkv = fake_cuda(args.qkv, 0x10000);
    args.kv_cache = fake_cuda(args.kv_cache);
    args.cache_indirection = fake_cuda(args.cache_indirection, 0x20000);
    args.out = fake_cuda(args.out, 0x30000);
    args.lse = fake_cuda(args.lse, 0x40000);
  }
  void expect_rejected(const std::string& arg) {
    test::expect_rejected([&] { forward(spec, args); }, "forward: " + arg + ":",
                          {out.get(), lse.get(), cache.pool.get()});
  }
};

TEST(ValidateForward, ValidBaselines) {
  ForwardCall call;
  detail::ForwardProblem p = detail::validate_forward(call.spec, call.args);
  EXPECT_EQ(p.num_tokens, 7);
  EXPECT_EQ(p.num_context, 2);
  EXPECT_EQ(p.num_generation, 1);
  EXPECT_EQ(p.num_context_tokens, 5);
  EXPECT_EQ(p.max_context_len, 3);
  EXPECT_EQ(p.max_kv_len, 11);
  EXPECT_TRUE(p.has_lse);

  // On cuda the request layout stays in host memory.
  ForwardCall cuda;
  cuda.to_fake_cuda();
  p = detail::validate_forward(cuda.spec, cuda.args);
  EXPECT_TRUE(p.device.is_cuda());
  EXPECT_EQ(p.max_kv_len, 11);
}

TEST(ValidateForward, RejectsRequestLayoutInDeviceMemory) {
  ForwardCall call;
  call.to_fake_cuda();
  call.args.past_lens = fake_cuda(call.args.past_lens, 0x50000);
  call.expect_rejected("past_lens");
}

TEST(ValidateForward, RejectsUnknownCacheLayout) {
  ForwardCall call;
  call.args.kv_cache.layout = static_cast<KvCacheLayout>(2);
  call.expect_rejected("kv_cache.layout");
}

TEST(ValidateForward, RejectsCountsAndBeamWidth) {
  {
    ForwardCall call;
    call.args.num_context = 4;
    call.expect_rejected("num_context");
  }
  {
    ForwardCall call;
    call.args.beam_width = 0;
    call.expect_rejected("beam_width");
  }
  {
    ForwardCall call;
    call.args.num_splits = -2;
    call.expect_rejected("num_splits");
  }
  {
    ForwardCall call;  // batch_invariant fixes the decode rows' split length
    call.args.batch_invariant = true;
    call.args.num_splits = 2;
    call.expect_rejected("num_splits");
  }
}

TEST(ValidateForward, RejectsBadCuSeqlens) {
  {
    ForwardCall call;  // the generation request gets 3 tokens
    call.cu_q->data<int32_t>()[2] = 4;
    call.expect_rejected("cu_seqlens_q");
  }
  {
    ForwardCall call;  // an empty context chunk
    call.cu_q->data<int32_t>()[1] = 0;
    call.expect_rejected("cu_seqlens_q");
  }
  {
    ForwardCall call;
    call.cu_q->data<int32_t>()[3] = 6;
    call.expect_rejected("cu_seqlens_q");
  }
  {
    ForwardCall call;
    call.args.cu_seqlens_q = with_dtype(call.args.cu_seqlens_q, DType::kInt64);
    call.expect_rejected("cu_seqlens_q");
  }
}

TEST(ValidateForward, RejectsPastLens) {
  {
    ForwardCall call;
    call.past->data<int32_t>()[0] = -1;
    call.expect_rejected("past_lens");
  }
  {
    ForwardCall call;
    HostTensor past(DType::kInt32, {2});
    call.args.past_lens = past;
    call.expect_rejected("past_lens");
  }
  {
    ForwardCall call;  // 31 + 2 tokens do not fit 4 blocks of 8
    call.past->data<int32_t>()[1] = 31;
    call.expect_rejected("past_lens");
  }
}

TEST(ValidateForward, RejectsSeqLensInconsistentWithStep) {
  std::mt19937_64 rng(test_seed());
  ForwardCall call;
  const int64_t row = std::uniform_int_distribution<int64_t>(0, 3)(rng);
  call.cache.seq_lens->data<int32_t>()[row] -= 1;
  call.expect_rejected("kv_cache.seq_lens");
}

TEST(ValidateForward, RejectsRowCount) {
  {
    ForwardCall call;  // 2 + 1 * 2 rows expected, the cache has 3
    CacheFixture three_rows({3, 10, 11});
    call.args.kv_cache = three_rows.view;
    call.expect_rejected("kv_cache.seq_lens");
  }
  {
    ForwardCall call;
    const auto table = make_i32(std::vector<int32_t>(3 * 4, 0), {3, 4});
    call.args.kv_cache.block_table = *table;
    call.expect_rejected("kv_cache.block_table");
  }
}

TEST(ValidateForward, RejectsInvalidBlockThatWouldBeRead) {
  ForwardCall call;
  call.cache.table_at(1, 1) = -1;  // row 1 holds 10 tokens: slot 8 is in index 1
  call.expect_rejected("kv_cache.block_table");
}

TEST(ValidateForward, RejectsBeamsWritingOneBlock) {
  ForwardCall call;
  call.cache.table_at(3, 1) = call.cache.table_at(2, 1);  // the new token's block is shared
  call.expect_rejected("kv_cache.block_table");
}

TEST(ValidateForward, RejectsCacheIndirection) {
  {
    ForwardCall call;
    HostTensor ind(DType::kInt32, {1, 2, 10});  // generation rows hold 11 tokens
    call.args.cache_indirection = ind;
    call.expect_rejected("cache_indirection");
  }
  {
    ForwardCall call;
    call.indirection->data<int32_t>()[16 + 10] = 2;
    call.expect_rejected("cache_indirection");
  }
}

TEST(ValidateForward, RejectsCyclicCacheWithBeams) {
  ForwardCall call;
  call.spec.mask = {MaskKind::kSlidingWindow, 4, 0};
  call.args.kv_cache.window_slots = 16;
  call.expect_rejected("kv_cache.window_slots");
}

TEST(ValidateForward, RejectsTensors) {
  {
    ForwardCall call;
    HostTensor out_bad(DType::kBF16, {7, 4, 8});
    call.args.out = out_bad;
    call.expect_rejected("out");
  }
  {
    ForwardCall call;
    call.args.qkv = with_dtype(call.args.qkv, DType::kInt8);
    call.expect_rejected("qkv");
  }
  {
    ForwardCall call;
    HostTensor workspace(DType::kF32, {64});
    call.args.workspace = workspace;
    call.expect_rejected("workspace");
  }
  {
    ForwardCall call;
    call.args.kv_cache.k_base = nullptr;
    call.expect_rejected("kv_cache.k_base");
  }
}

TEST(ValidateForward, RejectsDenseOnlySpecOptions) {
  ForwardCall call;
  call.spec.skip_softmax = SkipSoftmaxSpec{};
  call.spec.skip_softmax->threshold = 0.5;
  call.expect_rejected("spec.skip_softmax");
}

TEST(ValidateForward, RejectsNullDataAndStrides) {
  {
    ForwardCall call;
    call.args.qkv.data = nullptr;
    call.expect_rejected("qkv");
  }
  {
    ForwardCall call;
    call.args.lse = with_stride(call.args.lse, 1, 3);
    call.expect_rejected("lse");
  }
  {
    ForwardCall call;
    call.args.out = with_stride(call.args.out, 0, -64);
    call.expect_rejected("out");
  }
}

}  // namespace
}  // namespace attnkit::test
