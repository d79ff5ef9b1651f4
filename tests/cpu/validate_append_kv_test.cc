// Bad-input tests of append_kv(): the KV cache is an output here, so it must stay untouched too.
#include <gtest/gtest.h>

#include "common/test_util.h"
#include "core/problem.h"
#include "validate_fixtures.h"

namespace attnkit::test {
namespace {

// Five tokens: positions 0..2 of row 0, position 16 of row 1, position 3 of row 2.
struct AppendCall {
  AttentionSpec spec = small_spec();
  CacheFixture cache{{5, 17, 30}};
  std::unique_ptr<HostTensor> qkv = make_input(DType::kBF16, {5, 8 * 16});
  std::unique_ptr<HostTensor> bias = make_input(DType::kBF16, {8 * 16});
  std::unique_ptr<HostTensor> positions = make_i32({0, 1, 2, 16, 3}, {5});
  std::unique_ptr<HostTensor> rows = make_i32({0, 0, 0, 1, 2}, {5});
  std::unique_ptr<HostTensor> q_out = make_output(DType::kBF16, {5, 4, 16});
  std::unique_ptr<HostTensor> q, k, v;
  AppendKvArgs args;

  AppendCall() {
    spec.rope.style = RopeStyle::kGptNeox;
    args.qkv = *qkv;
    args.qkv_bias = *bias;
    args.positions = *positions;
    args.row_of_token = *rows;
    args.kv_cache = cache.view;
    args.q_out = *q_out;
  }
  void use_separate_inputs() {
    q = make_input(DType::kBF16, {5, 4, 16});
    k = make_input(DType::kBF16, {5, 2, 16});
    v = make_input(DType::kBF16, {5, 2, 16});
    args.qkv = {};
    args.q = *q;
    args.k = *k;
    args.v = *v;
  }
  void expect_rejected(const std::string& arg) {
    test::expect_rejected([&] { append_kv(spec, args); }, "append_kv: " + arg + ":",
                          {q_out.get(), cache.pool.get()});
  }
};

TEST(ValidateAppendKv, ValidBaselines) {
  AppendCall fused;
  detail::AppendKvProblem p = detail::validate_append_kv(fused.spec, fused.args);
  EXPECT_TRUE(p.fused_qkv);
  EXPECT_TRUE(p.has_bias);
  EXPECT_EQ(p.num_tokens, 5);

  AppendCall separate;
  separate.use_separate_inputs();
  p = detail::validate_append_kv(separate.spec, separate.args);
  EXPECT_FALSE(p.fused_qkv);

  // seq_lens is not read by append_kv.
  AppendCall no_lens;
  no_lens.args.kv_cache.seq_lens = {};
  EXPECT_NO_THROW(detail::validate_append_kv(no_lens.spec, no_lens.args));

  // A cyclic cache wraps positions beyond its capacity.
  AppendCall cyclic;
  cyclic.spec.mask = {MaskKind::kSlidingWindow, 8, 0};
  cyclic.args.kv_cache.window_slots = 16;
  cyclic.positions->data<int32_t>()[3] = 1000;  // slot 1000 % 16 = 8: row 1, index 1
  EXPECT_NO_THROW(detail::validate_append_kv(cyclic.spec, cyclic.args));
}

TEST(ValidateAppendKv, RejectsBothFusedAndSeparateInputs) {
  AppendCall call;
  const auto k = make_input(DType::kBF16, {5, 2, 16});
  call.args.k = *k;
  call.expect_rejected("k");
}

TEST(ValidateAppendKv, RejectsMissingInputs) {
  {
    AppendCall call;
    call.args.qkv = {};
    call.expect_rejected("qkv");
  }
  {
    AppendCall call;
    call.use_separate_inputs();
    call.args.v = {};
    call.expect_rejected("v");
  }
  {
    AppendCall call;
    call.args.q_out = {};
    call.expect_rejected("q_out");
  }
}

TEST(ValidateAppendKv, RejectsShapes) {
  {
    AppendCall call;
    HostTensor qkv(DType::kBF16, {5, 6 * 16});
    call.args.qkv = qkv;
    call.expect_rejected("qkv");
  }
  {
    AppendCall call;
    HostTensor bias(DType::kBF16, {4 * 16});
    call.args.qkv_bias = bias;
    call.expect_rejected("qkv_bias");
  }
  {
    AppendCall call;
    call.use_separate_inputs();
    HostTensor k(DType::kBF16, {4, 2, 16});
    call.args.k = k;
    call.expect_rejected("k");
  }
  {
    AppendCall call;
    HostTensor positions(DType::kInt32, {4});
    call.args.positions = positions;
    call.expect_rejected("positions");
  }
  {
    AppendCall call;
    HostTensor q_out(DType::kBF16, {5, 2, 16});
    call.args.q_out = q_out;
    call.expect_rejected("q_out");
  }
}

TEST(ValidateAppendKv, RejectsDtypes) {
  {
    AppendCall call;
    call.args.qkv_bias = with_dtype(call.args.qkv_bias, DType::kF32);
    call.expect_rejected("qkv_bias");
  }
  {
    AppendCall call;
    call.args.row_of_token = with_dtype(call.args.row_of_token, DType::kInt64);
    call.expect_rejected("row_of_token");
  }
  {
    AppendCall call;
    call.args.q_out = with_dtype(call.args.q_out, DType::kF16);
    call.expect_rejected("q_out");
  }
  {
    AppendCall call;
    call.use_separate_inputs();
    call.args.v = with_dtype(call.args.v, DType::kF16);
    call.expect_rejected("v");
  }
  {
    AppendCall call;
    call.args.kv_cache.dtype = DType::kF16;
    call.expect_rejected("kv_cache.dtype");
  }
}

TEST(ValidateAppendKv, RejectsDeviceMismatch) {
  AppendCall call;
  call.args.positions = fake_cuda(call.args.positions);
  call.expect_rejected("positions");
}

TEST(ValidateAppendKv, RejectsPositionValues) {
  {
    AppendCall call;
    call.positions->data<int32_t>()[2] = -1;
    call.expect_rejected("positions");
  }
  {
    AppendCall call;
    call.positions->data<int32_t>()[4] = 32;  // 4 blocks of 8 per row
    call.expect_rejected("positions");
  }
}

TEST(ValidateAppendKv, RejectsUnknownCacheLayout) {
  AppendCall call;
  call.args.kv_cache.layout = static_cast<KvCacheLayout>(-1);
  call.expect_rejected("kv_cache.layout");
  // Both layouts are accepted.
  for (KvCacheLayout layout : {KvCacheLayout::kHND, KvCacheLayout::kNHD}) {
    AppendCall ok;
    ok.args.kv_cache.layout = layout;
    EXPECT_NO_THROW(detail::validate_append_kv(ok.spec, ok.args)) << kv_layout_name(layout);
  }
}

TEST(ValidateAppendKv, RejectsRowOutOfRange) {
  for (int32_t bad : {-1, 3}) {
    AppendCall call;
    call.rows->data<int32_t>()[1] = bad;
    call.expect_rejected("row_of_token");
  }
}

TEST(ValidateAppendKv, RejectsWriteIntoInvalidBlock) {
  AppendCall call;
  call.positions->data<int32_t>()[4] = 24;  // row 2 index 3 is valid; make it invalid
  call.cache.table_at(2, 3) = -1;
  call.expect_rejected("kv_cache.block_table");
}

TEST(ValidateAppendKv, RejectsTwoTokensWritingOneSlot) {
  AppendCall call;
  call.positions->data<int32_t>()[1] = 0;  // tokens 0 and 1 both at position 0 of row 0
  call.expect_rejected("positions");
  AppendCall shared;  // rows 0 and 2 pointing at the same block
  shared.cache.table_at(2, 0) = shared.cache.table_at(0, 0);
  shared.positions->data<int32_t>()[4] = 2;
  shared.expect_rejected("positions");
}

TEST(ValidateAppendKv, RejectsCudaLayout) {
  AppendCall call;
  call.args.qkv = fake_cuda(call.args.qkv, 0x10000);
  call.args.qkv_bias = fake_cuda(call.args.qkv_bias, 0x20008);  // 8-byte aligned only
  call.args.positions = fake_cuda(call.args.positions, 0x30000);
  call.args.row_of_token = fake_cuda(call.args.row_of_token, 0x40000);
  call.args.q_out = fake_cuda(call.args.q_out, 0x50000);
  call.args.kv_cache = fake_cuda(call.args.kv_cache);
  call.expect_rejected("qkv_bias");
  call.args.qkv_bias = fake_cuda(call.args.qkv_bias, 0x20000);
  EXPECT_NO_THROW(detail::validate_append_kv(call.spec, call.args));
}

TEST(ValidateAppendKv, RejectsNullDataAndStrides) {
  {
    AppendCall call;
    call.args.positions.data = nullptr;
    call.expect_rejected("positions");
  }
  {
    AppendCall call;
    call.args.qkv = with_stride(call.args.qkv, 1, 2);
    call.expect_rejected("qkv");
  }
  {
    AppendCall call;
    call.args.q_out = with_stride(call.args.q_out, 0, 0);
    call.expect_rejected("q_out");
  }
}

}  // namespace
}  // namespace attnkit::test
