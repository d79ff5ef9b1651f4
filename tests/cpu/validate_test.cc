// Bad-input tests of merge_states() and dense(): each test breaks one rule of a valid call and
// checks the error names the argument and that no output was written. The valid baselines are
// checked against the validator directly (the backends are tested elsewhere).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "common/test_util.h"
#include "core/problem.h"
#include "validate_fixtures.h"

namespace attnkit::test {
namespace {

struct MergeCall {
  std::unique_ptr<HostTensor> out_a = make_input(DType::kBF16, {5, 4, 16});
  std::unique_ptr<HostTensor> out_b = make_input(DType::kBF16, {5, 4, 16});
  std::unique_ptr<HostTensor> lse_a = make_input(DType::kF32, {5, 4});
  std::unique_ptr<HostTensor> lse_b = make_input(DType::kF32, {5, 4});
  std::unique_ptr<HostTensor> out = make_output(DType::kBF16, {5, 4, 16});
  std::unique_ptr<HostTensor> lse = make_output(DType::kF32, {5, 4});
  MergeStatesArgs args;

  MergeCall() {
    args.out_a = *out_a;
    args.out_b = *out_b;
    args.lse_a = *lse_a;
    args.lse_b = *lse_b;
    args.out = *out;
    args.lse = *lse;
  }
  void expect_rejected(const std::string& arg) {
    test::expect_rejected([&] { merge_states(args); }, "merge_states: " + arg + ":",
                          {out.get(), lse.get()});
  }
};

TEST(ValidateMergeStates, ValidBaseline) {
  MergeCall call;
  const detail::MergeStatesProblem p = detail::validate_merge_states(call.args);
  EXPECT_EQ(p.num_tokens, 5);
  EXPECT_EQ(p.num_heads, 4);
  EXPECT_EQ(p.head_dim, 16);
  EXPECT_TRUE(p.has_lse);
  call.args.lse = {};
  EXPECT_FALSE(detail::validate_merge_states(call.args).has_lse);
}

TEST(ValidateMergeStates, AcceptsStridedInputs) {
  MergeCall call;
  // Row stride larger than H * D: a slice of a wider buffer.
  HostTensor wide(DType::kBF16, {5, 8, 16});
  call.args.out_a = TensorView(wide.view().data, DType::kBF16, {5, 4, 16}, {128, 16, 1});
  EXPECT_NO_THROW(detail::validate_merge_states(call.args));
}

TEST(ValidateMergeStates, AcceptsF32OnCuda) {
  MergeCall call;
  for (TensorView* t : {&call.args.out_a, &call.args.out_b, &call.args.out}) {
    *t = fake_cuda(with_dtype(*t, DType::kF32));
  }
  for (TensorView* t : {&call.args.lse_a, &call.args.lse_b, &call.args.lse}) *t = fake_cuda(*t);
  EXPECT_EQ(detail::validate_merge_states(call.args).dtype, DType::kF32);
}

TEST(ValidateMergeStates, RejectsMissingInput) {
  MergeCall call;
  call.args.out_b = {};
  call.expect_rejected("out_b");
}

TEST(ValidateMergeStates, RejectsNullData) {
  MergeCall call;
  call.args.lse_b.data = nullptr;
  call.expect_rejected("lse_b");
}

TEST(ValidateMergeStates, RejectsShapeMismatch) {
  MergeCall call;
  HostTensor other(DType::kBF16, {5, 4, 8});
  call.args.out_b = other;
  call.expect_rejected("out_b");
}

TEST(ValidateMergeStates, RejectsDtypeMismatch) {
  MergeCall call;
  call.args.out = with_dtype(call.args.out, DType::kF16);
  call.expect_rejected("out");
}

TEST(ValidateMergeStates, RejectsIntegerData) {
  MergeCall call;
  call.args.out_a = with_dtype(call.args.out_a, DType::kInt32);
  call.expect_rejected("out_a");
}

TEST(ValidateMergeStates, RejectsLseDtype) {
  MergeCall call;
  call.args.lse_a = with_dtype(call.args.lse_a, DType::kBF16);
  call.expect_rejected("lse_a");
}

TEST(ValidateMergeStates, RejectsLseShape) {
  MergeCall call;
  HostTensor other(DType::kF32, {5, 3});
  call.args.lse = other;
  call.expect_rejected("lse");
}

TEST(ValidateMergeStates, RejectsDeviceMismatch) {
  MergeCall call;
  call.args.out_b = fake_cuda(call.args.out_b);
  call.expect_rejected("out_b");
}

TEST(ValidateMergeStates, RejectsStridedLastDim) {
  MergeCall call;
  call.args.out_a = with_stride(call.args.out_a, 2, 2);
  call.expect_rejected("out_a");
}

TEST(ValidateMergeStates, RejectsNegativeStride) {
  MergeCall call;
  call.args.out_b = with_stride(call.args.out_b, 0, -64);
  call.expect_rejected("out_b");
}

TEST(ValidateMergeStates, RejectsBroadcastOutput) {
  MergeCall call;
  call.args.out = with_stride(call.args.out, 0, 0);
  call.expect_rejected("out");
}

// ---------------------------------------------------------------------------------------------

struct DenseCall {
  AttentionSpec spec = small_spec(MaskKind::kNone);
  std::unique_ptr<HostTensor> q = make_input(DType::kBF16, {2, 5, 4, 16});
  std::unique_ptr<HostTensor> k = make_input(DType::kBF16, {2, 7, 2, 16});
  std::unique_ptr<HostTensor> v = make_input(DType::kBF16, {2, 7, 2, 16});
  std::unique_ptr<HostTensor> out = make_output(DType::kBF16, {2, 5, 4, 16});
  std::unique_ptr<HostTensor> lse = make_output(DType::kF32, {2, 5, 4});
  DenseArgs args;

  DenseCall() {
    args.q = *q;
    args.k = *k;
    args.v = *v;
    args.out = *out;
    args.lse = *lse;
    args.timestep = 0.5;
    args.block_m = 64;
    args.block_n = 32;
  }
  void to_fake_cuda() {
    args.q = fake_cuda(args.q, 0x10000);
    args.k = fake_cuda(args.k, 0x20000);
    args.v = fake_cuda(args.v, 0x30000);
    args.out = fake_cuda(args.out, 0x40000);
    args.lse = fake_cuda(args.lse, 0x50000);
  }
  void expect_rejected(const std::string& arg) {
    test::expect_rejected([&] { dense(spec, args); }, "dense: " + arg + ":",
                          {out.get(), lse.get()});
  }
};

TEST(ValidateDense, ValidBaseline) {
  DenseCall call;
  const detail::DenseProblem p = detail::validate_dense(call.spec, call.args);
  EXPECT_EQ(p.batch, 2);
  EXPECT_EQ(p.seqlen_q, 5);
  EXPECT_EQ(p.seqlen_kv, 7);
  EXPECT_TRUE(p.has_lse);
  call.to_fake_cuda();
  EXPECT_TRUE(detail::validate_dense(call.spec, call.args).device.is_cuda());
}

TEST(ValidateDense, RejectsMask) {
  DenseCall call;
  call.spec.mask.kind = MaskKind::kCausal;
  call.expect_rejected("spec.mask");
}

TEST(ValidateDense, RejectsAlibi) {
  DenseCall call;
  call.spec.alibi = true;
  call.expect_rejected("spec.alibi");
}

TEST(ValidateDense, RejectsInvalidSpec) {
  DenseCall call;
  call.spec.num_kv_heads = 3;
  test::expect_rejected([&] { dense(call.spec, call.args); }, "spec.num_kv_heads",
                        {call.out.get(), call.lse.get()});
}

TEST(ValidateDense, RejectsQHeadDim) {
  DenseCall call;
  HostTensor q(DType::kBF16, {2, 5, 4, 8});
  call.args.q = q;
  call.expect_rejected("q");
}

TEST(ValidateDense, RejectsKBatchMismatch) {
  DenseCall call;
  HostTensor k(DType::kBF16, {3, 7, 2, 16});
  call.args.k = k;
  call.expect_rejected("k");
}

TEST(ValidateDense, RejectsVLengthMismatch) {
  DenseCall call;
  HostTensor v(DType::kBF16, {2, 6, 2, 16});
  call.args.v = v;
  call.expect_rejected("v");
}

TEST(ValidateDense, RejectsKDtypeMismatch) {
  DenseCall call;
  call.args.k = with_dtype(call.args.k, DType::kF16);
  call.expect_rejected("k");
}

TEST(ValidateDense, RejectsOutDtype) {
  DenseCall call;
  call.args.out = with_dtype(call.args.out, DType::kF32);
  call.expect_rejected("out");
}

TEST(ValidateDense, RejectsMissingOut) {
  DenseCall call;
  call.args.out = {};
  call.expect_rejected("out");
}

TEST(ValidateDense, RejectsLseShape) {
  DenseCall call;
  HostTensor lse(DType::kF32, {2, 5});
  call.args.lse = lse;
  call.expect_rejected("lse");
}

TEST(ValidateDense, RejectsTimestep) {
  for (double t : {-0.1, 1.5, std::numeric_limits<double>::quiet_NaN()}) {
    DenseCall call;
    call.args.timestep = t;
    call.expect_rejected("timestep");
  }
}

TEST(ValidateDense, RejectsTileSizes) {
  for (int32_t size : {0, 8, 48, 512}) {
    DenseCall call;
    call.args.block_m = size;
    call.expect_rejected("block_m");
    DenseCall call_n;
    call_n.args.block_n = size;
    call_n.expect_rejected("block_n");
  }
}

TEST(ValidateDense, RejectsDeviceMismatch) {
  DenseCall call;
  call.args.v = fake_cuda(call.args.v);
  call.expect_rejected("v");
}

TEST(ValidateDense, RejectsF32OnCuda) {
  DenseCall call;
  call.to_fake_cuda();
  for (TensorView* t : {&call.args.q, &call.args.k, &call.args.v, &call.args.out}) {
    *t = with_dtype(*t, DType::kF32);
  }
  call.expect_rejected("q");
}

TEST(ValidateDense, RejectsUnalignedCudaPointer) {
  DenseCall call;
  call.to_fake_cuda();
  call.args.k.data = static_cast<char*>(call.args.k.data) + 8;
  call.expect_rejected("k");
}

TEST(ValidateDense, RejectsCudaStrideNotMultipleOf16Bytes) {
  DenseCall call;
  call.to_fake_cuda();
  // A q sliced with a row stride of 68 elements (136 bytes).
  call.args.q = with_stride(call.args.q, 2, 68);
  call.expect_rejected("q");
}

TEST(ValidateDense, RejectsNullDataAndStrides) {
  {
    DenseCall call;
    call.args.k.data = nullptr;
    call.expect_rejected("k");
  }
  {
    DenseCall call;
    call.args.v = with_stride(call.args.v, 3, 4);
    call.expect_rejected("v");
  }
}

}  // namespace
}  // namespace attnkit::test
