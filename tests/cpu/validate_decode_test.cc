// Bad-input tests of decode(), including the KV-cache view checks shared by every entry point.
#include <gtest/gtest.h>

#include <cmath>

#include "common/test_util.h"
#include "core/problem.h"
#include "validate_fixtures.h"

namespace attnkit::test {
namespace {

// Three rows of lengths 5, 17 and 30 in a paged bf16 cache (T = 8, 4 blocks per row).
struct DecodeCall {
  AttentionSpec spec = small_spec();
  CacheFixture cache;
  std::unique_ptr<HostTensor> q, out, lse, indirection;
  DecodeArgs args;

  explicit DecodeCall(std::vector<int32_t> lens = {5, 17, 30}, DType kv_dtype = DType::kBF16)
      : cache(lens, kv_dtype) {
    const int64_t rows = static_cast<int64_t>(lens.size());
    q = make_input(DType::kBF16, {rows, 4, 16});
    out = make_output(DType::kBF16, {rows, 4, 16});
    lse = make_output(DType::kF32, {rows, 4});
    args.q = *q;
    args.out = *out;
    args.lse = *lse;
    args.kv_cache = cache.view;
  }
  // Two sequences of two beams: rows (0, 1) and (2, 3).
  static DecodeCall with_beams() {
    DecodeCall call({12, 12, 9, 9});
    call.args.beam_width = 2;
    call.indirection = make_i32(std::vector<int32_t>(2 * 2 * 16, 0), {2, 2, 16});
    for (int64_t i = 0; i < call.indirection->numel(); i += 3) {
      call.indirection->data<int32_t>()[i] = 1;
    }
    call.args.cache_indirection = *call.indirection;
    return call;
  }
  // A cyclic cache: window 6, 2 sinks, window_slots 16 of a 32-slot row.
  void make_cyclic() {
    spec.mask = {MaskKind::kSlidingWindow, 6, 2};
    args.kv_cache.window_slots = cyclic_window_slots(6, 8);
    args.kv_cache.sink_tokens = 2;
  }
  void expect_rejected(const std::string& arg) {
    test::expect_rejected([&] { decode(spec, args); }, "decode: " + arg + ":",
                          {out.get(), lse.get()});
  }
};

TEST(ValidateDecode, ValidBaselines) {
  DecodeCall call;
  detail::DecodeProblem p = detail::validate_decode(call.spec, call.args);
  EXPECT_EQ(p.num_rows, 3);
  EXPECT_EQ(p.max_seq_len, 30);
  EXPECT_TRUE(p.has_lse);
  EXPECT_FALSE(p.has_indirection);

  DecodeCall beams = DecodeCall::with_beams();
  p = detail::validate_decode(beams.spec, beams.args);
  EXPECT_EQ(p.beam_width, 2);
  EXPECT_TRUE(p.has_indirection);

  DecodeCall fp8({5, 17, 30}, DType::kFp8E4M3);
  EXPECT_EQ(detail::validate_decode(fp8.spec, fp8.args).kv_dtype, DType::kFp8E4M3);

  // f32 queries (cpu) read a bf16 cache: no cache dtype is f32.
  DecodeCall f32_q;
  const auto q32 = make_input(DType::kF32, {3, 4, 16});
  const auto out32 = make_output(DType::kF32, {3, 4, 16});
  f32_q.args.q = *q32;
  f32_q.args.out = *out32;
  EXPECT_EQ(detail::validate_decode(f32_q.spec, f32_q.args).dtype, DType::kF32);

  DecodeCall contiguous;
  contiguous.args.kv_cache.paged = false;
  contiguous.args.kv_cache.tokens_per_block = 32;
  contiguous.args.kv_cache.block_table = {};
  contiguous.args.kv_cache.block_stride_bytes = 2 * 2 * 32 * 16 * 2;
  contiguous.args.kv_cache.num_blocks = 3;
  EXPECT_NO_THROW(detail::validate_decode(contiguous.spec, contiguous.args));

  // A cyclic row may be longer than its capacity; only sinks + window_slots slots are read.
  DecodeCall cyclic({5, 17, 100});
  cyclic.make_cyclic();
  for (int j = 0; j < 4; ++j) cyclic.cache.table_at(2, j) = 12 + j;
  EXPECT_NO_THROW(detail::validate_decode(cyclic.spec, cyclic.args));

  DecodeCall cuda;
  cuda.args.q = fake_cuda(cuda.args.q, 0x10000);
  cuda.args.out = fake_cuda(cuda.args.out, 0x20000);
  cuda.args.lse = fake_cuda(cuda.args.lse, 0x30000);
  cuda.args.kv_cache = fake_cuda(cuda.args.kv_cache);
  p = detail::validate_decode(cuda.spec, cuda.args);
  EXPECT_TRUE(p.device.is_cuda());
  EXPECT_EQ(p.max_seq_len, 32);  // the row capacity: device lengths are not read
}

// DecodeWorkspace checks its arguments (naming each) before it touches a device, so these run in
// every build, with or without a GPU.
TEST(ValidateDecode, DecodeWorkspaceRejectsBadArguments) {
  const AttentionSpec spec = small_spec();
  auto error_of = [&](int64_t rows, int32_t splits, Device device, const AttentionSpec& s) {
    try {
      DecodeWorkspace ws(s, rows, splits, device);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_EQ(error_of(4, 8, Device::cpu(), spec),
            "DecodeWorkspace: device must be a CUDA device, got cpu");
  EXPECT_EQ(error_of(0, 8, Device::cuda(0), spec), "DecodeWorkspace: max_rows must be >= 1, got 0");
  EXPECT_EQ(error_of(4, 1, Device::cuda(0), spec),
            "DecodeWorkspace: max_splits must be in [2, 128] (calls with one split use no "
            "workspace), got 1");
  EXPECT_EQ(error_of(4, 129, Device::cuda(0), spec),
            "DecodeWorkspace: max_splits must be in [2, 128] (calls with one split use no "
            "workspace), got 129");
  AttentionSpec bad = spec;
  bad.num_kv_heads = 3;  // does not divide the query heads
  EXPECT_NE(error_of(4, 8, Device::cuda(0), bad), "accepted");
}

TEST(ValidateDecode, RejectsQRowsNotMatchingSeqLens) {
  DecodeCall call;
  HostTensor q(DType::kBF16, {2, 4, 16});
  HostTensor out(DType::kBF16, {2, 4, 16});
  call.args.q = q;
  call.args.out = out;
  call.args.lse = {};
  call.expect_rejected("kv_cache.seq_lens");
}

TEST(ValidateDecode, RejectsQShape) {
  DecodeCall call;
  HostTensor q(DType::kBF16, {3, 2, 16});
  call.args.q = q;
  call.expect_rejected("q");
}

TEST(ValidateDecode, RejectsOutDtype) {
  DecodeCall call;
  call.args.out = with_dtype(call.args.out, DType::kF16);
  call.expect_rejected("out");
}

TEST(ValidateDecode, RejectsLseDtype) {
  DecodeCall call;
  call.args.lse = with_dtype(call.args.lse, DType::kBF16);
  call.expect_rejected("lse");
}

TEST(ValidateDecode, RejectsDenseOnlySpecOptions) {
  DecodeCall call;
  call.spec.skip_softmax = SkipSoftmaxSpec{};
  call.spec.skip_softmax->threshold = 0.1;
  call.expect_rejected("spec.skip_softmax");
}

TEST(ValidateDecode, RejectsCacheDtype) {
  DecodeCall call;
  call.args.kv_cache.dtype = DType::kF32;
  call.expect_rejected("kv_cache.dtype");
}

TEST(ValidateDecode, RejectsUnquantizedCacheOfOtherDtype) {
  DecodeCall call({5, 17, 30}, DType::kF16);
  call.expect_rejected("kv_cache.dtype");
}

TEST(ValidateDecode, RejectsCacheGeometry) {
  {
    DecodeCall call;
    call.args.kv_cache.num_kv_heads = 4;
    call.expect_rejected("kv_cache.num_kv_heads");
  }
  {
    DecodeCall call;
    call.args.kv_cache.head_dim = 32;
    call.expect_rejected("kv_cache.head_dim");
  }
  {
    DecodeCall call;
    call.args.kv_cache.tokens_per_block = 12;
    call.expect_rejected("kv_cache.tokens_per_block");
  }
  {
    DecodeCall call;
    call.args.kv_cache.num_blocks = 0;
    call.expect_rejected("kv_cache.num_blocks");
  }
  {
    DecodeCall call;
    call.args.kv_cache.block_stride_bytes = 2 * 8 * 16 * 2 - 2;  // one block holds 512 bytes
    call.expect_rejected("kv_cache.block_stride_bytes");
  }
}

TEST(ValidateDecode, RejectsUnknownCacheLayout) {
  for (int32_t value : {2, -1, 255}) {
    DecodeCall call;
    call.args.kv_cache.layout = static_cast<KvCacheLayout>(value);
    call.expect_rejected("kv_cache.layout");
  }
  // A CUDA cache is checked on the host alike.
  DecodeCall cuda;
  cuda.args.kv_cache = fake_cuda(cuda.args.kv_cache);
  cuda.args.kv_cache.layout = static_cast<KvCacheLayout>(3);
  cuda.args.q = fake_cuda(cuda.args.q, 0x600000);
  cuda.args.out = fake_cuda(cuda.args.out, 0x700000);
  cuda.args.lse = fake_cuda(cuda.args.lse, 0x800000);
  cuda.expect_rejected("kv_cache.layout");
  DecodeCall nhd;
  nhd.args.kv_cache.layout = KvCacheLayout::kNHD;
  EXPECT_NO_THROW(detail::validate_decode(nhd.spec, nhd.args));
}

TEST(ValidateDecode, RejectsNullCacheBase) {
  DecodeCall call;
  call.args.kv_cache.v_base = nullptr;
  call.expect_rejected("kv_cache.v_base");
}

TEST(ValidateDecode, RejectsCacheOnOtherDevice) {
  DecodeCall call;
  call.args.kv_cache.device = Device::cuda(0);
  call.expect_rejected("kv_cache.device");
}

TEST(ValidateDecode, RejectsBlockTable) {
  {
    DecodeCall call;
    call.args.kv_cache.block_table = {};
    call.expect_rejected("kv_cache.block_table");
  }
  {
    DecodeCall call;
    call.args.kv_cache.block_table = with_dtype(call.args.kv_cache.block_table, DType::kInt64);
    call.expect_rejected("kv_cache.block_table");
  }
  {
    DecodeCall call;
    HostTensor table(DType::kInt32, {12});
    call.args.kv_cache.block_table = table;
    call.expect_rejected("kv_cache.block_table");
  }
  {
    DecodeCall call;
    HostTensor table(DType::kInt32, {2, 4});  // 3 rows in seq_lens
    call.args.kv_cache.block_table = table;
    call.expect_rejected("kv_cache.block_table");
  }
  {
    DecodeCall call;
    call.args.kv_cache.block_table = with_stride(call.args.kv_cache.block_table, 1, 2);
    call.expect_rejected("kv_cache.block_table");
  }
}

TEST(ValidateDecode, RejectsSeqLens) {
  {
    DecodeCall call;
    call.args.kv_cache.seq_lens = with_dtype(call.args.kv_cache.seq_lens, DType::kInt64);
    call.expect_rejected("kv_cache.seq_lens");
  }
  {
    DecodeCall call;
    call.cache.seq_lens->data<int32_t>()[1] = -1;
    call.expect_rejected("kv_cache.seq_lens");
  }
  {
    DecodeCall call;  // more than 4 blocks x 8 tokens
    call.cache.seq_lens->data<int32_t>()[2] = 33;
    call.expect_rejected("kv_cache.seq_lens");
  }
}

TEST(ValidateDecode, RejectsBlockIdOutOfRange) {
  std::mt19937_64 rng(test_seed());
  DecodeCall call;
  const int64_t index = std::uniform_int_distribution<int64_t>(0, 3)(rng);  // row 2 uses all 4
  call.cache.table_at(2, index) = std::uniform_int_distribution<int32_t>(0, 1)(rng) ? 20 : -7;
  call.expect_rejected("kv_cache.block_table");
}

TEST(ValidateDecode, RejectsInvalidEntryThatWouldBeRead) {
  DecodeCall call;
  call.cache.table_at(1, 2) = -1;  // row 1 holds 17 tokens: slot 16 is in block-table index 2
  test::expect_rejected([&] { decode(call.spec, call.args); },
                        "decode: kv_cache.block_table: row 1, index 2 holds -1",
                        {call.out.get(), call.lse.get()});
  // The same -1 beyond the row's length is never read.
  call.cache.seq_lens->data<int32_t>()[1] = 16;
  EXPECT_NO_THROW(detail::validate_decode(call.spec, call.args));
}

TEST(ValidateDecode, RejectsMissingScaleForQuantizedCache) {
  DecodeCall call({5, 17, 30}, DType::kInt8);
  call.args.kv_cache.v_scale = {};
  call.expect_rejected("kv_cache.v_scale");
}

TEST(ValidateDecode, RejectsBadScales) {
  for (float bad : {0.0f, -1.0f, NAN, INFINITY}) {
    DecodeCall call({5, 17, 30}, DType::kFp8E4M3);
    call.cache.v_scale->set(1, bad);
    call.expect_rejected("kv_cache.v_scale");
  }
  {
    DecodeCall call({5, 17, 30}, DType::kFp8E4M3);
    HostTensor scale(DType::kF32, {3});
    scale.fill(1.0f);
    call.args.kv_cache.k_scale = scale;
    call.expect_rejected("kv_cache.k_scale");
  }
  {
    DecodeCall call({5, 17, 30}, DType::kFp8E4M3);
    call.args.kv_cache.k_scale = with_dtype(call.args.kv_cache.k_scale, DType::kBF16);
    call.expect_rejected("kv_cache.k_scale");
  }
  {
    DecodeCall call({5, 17, 30}, DType::kFp8E4M3);
    call.args.kv_cache.k_scale = fake_cuda(call.args.kv_cache.k_scale);
    call.expect_rejected("kv_cache.k_scale");
  }
}

TEST(ValidateDecode, RejectsContiguousCacheViolations) {
  DecodeCall call;
  call.args.kv_cache.paged = false;
  call.args.kv_cache.tokens_per_block = 32;
  call.args.kv_cache.block_stride_bytes = 2 * 2 * 32 * 16 * 2;
  call.args.kv_cache.num_blocks = 2;  // three rows need three blocks
  call.expect_rejected("kv_cache.num_blocks");
  call.args.kv_cache.num_blocks = 3;
  call.args.kv_cache.tokens_per_block = 29;  // row 2 holds 30 tokens
  call.expect_rejected("kv_cache.seq_lens");
}

TEST(ValidateDecode, RejectsCyclicCacheViolations) {
  {
    DecodeCall call;
    call.args.kv_cache.window_slots = 16;  // causal mask
    call.expect_rejected("kv_cache.window_slots");
  }
  {
    DecodeCall call;
    call.make_cyclic();
    call.args.kv_cache.window_slots = 5;  // window 6
    call.expect_rejected("kv_cache.window_slots");
  }
  {
    DecodeCall call;
    call.make_cyclic();
    call.args.kv_cache.sink_tokens = 0;  // spec has 2
    call.expect_rejected("kv_cache.sink_tokens");
  }
  {
    DecodeCall call;
    call.make_cyclic();
    call.args.kv_cache.window_slots = 31;  // 2 sinks + 31 > 32 slots
    call.expect_rejected("kv_cache.window_slots");
  }
  {
    DecodeCall call;
    call.make_cyclic();
    call.args.kv_cache.window_slots = -8;
    call.expect_rejected("kv_cache.window_slots");
  }
}

TEST(ValidateDecode, RejectsCyclicCacheWithBeams) {
  DecodeCall call = DecodeCall::with_beams();
  call.make_cyclic();
  call.expect_rejected("kv_cache.window_slots");
  call.args.beam_width = 1;  // the indirection alone is beam search too
  call.expect_rejected("kv_cache.window_slots");
}

TEST(ValidateDecode, RejectsBeamWidth) {
  {
    DecodeCall call;
    call.args.beam_width = 0;
    call.expect_rejected("beam_width");
  }
  {
    DecodeCall call;  // 3 rows
    call.args.beam_width = 2;
    call.expect_rejected("beam_width");
  }
}

TEST(ValidateDecode, RejectsCacheIndirection) {
  {
    DecodeCall call = DecodeCall::with_beams();
    HostTensor ind(DType::kInt32, {4, 1, 16});
    call.args.cache_indirection = ind;
    call.expect_rejected("cache_indirection");
  }
  {
    DecodeCall call = DecodeCall::with_beams();
    HostTensor ind(DType::kInt32, {2, 2, 11});  // seq_lens reach 12
    call.args.cache_indirection = ind;
    call.expect_rejected("cache_indirection");
  }
  {
    DecodeCall call = DecodeCall::with_beams();
    call.args.cache_indirection = with_dtype(call.args.cache_indirection, DType::kInt64);
    call.expect_rejected("cache_indirection");
  }
  {
    DecodeCall call = DecodeCall::with_beams();
    call.indirection->data<int32_t>()[2 * 16 + 8] = 2;  // sequence 1, beam 0, t = 8 < 9
    call.expect_rejected("cache_indirection");
  }
}

TEST(ValidateDecode, AcceptsIndirectionValuesBeyondSeqLen) {
  DecodeCall call = DecodeCall::with_beams();
  call.indirection->data<int32_t>()[2 * 16 + 9] = 7;  // t = 9 is not read (seq_len 9)
  EXPECT_NO_THROW(detail::validate_decode(call.spec, call.args));
}

TEST(ValidateDecode, RejectsUnequalBeamLengths) {
  DecodeCall call = DecodeCall::with_beams();
  call.cache.seq_lens->data<int32_t>()[3] = 8;
  call.expect_rejected("kv_cache.seq_lens");
}

TEST(ValidateDecode, RejectsSplitAndLengthBounds) {
  {
    DecodeCall call;
    call.args.num_splits = -1;
    call.expect_rejected("num_splits");
  }
  {
    DecodeCall call;
    call.args.max_seq_len = -1;
    call.expect_rejected("max_seq_len");
  }
  {
    DecodeCall call;
    call.args.max_seq_len = 29;  // a row holds 30
    call.expect_rejected("max_seq_len");
  }
}

// batch_invariant fixes the split length: a forced split count is rejected, the heuristic's 0
// accepted (with deterministic = false too, which the mode overrides).
TEST(ValidateDecode, BatchInvariantTakesNoSplitCount) {
  for (int32_t splits : {1, 4}) {
    DecodeCall call;
    call.args.batch_invariant = true;
    call.args.num_splits = splits;
    call.expect_rejected("num_splits");
  }
  DecodeCall call;
  call.args.batch_invariant = true;
  call.args.deterministic = false;
  EXPECT_NO_THROW(detail::validate_decode(call.spec, call.args));
}

TEST(ValidateDecode, RejectsCudaAlignment) {
  auto cuda_call = [] {
    DecodeCall call;
    call.args.q = fake_cuda(call.args.q, 0x10000);
    call.args.out = fake_cuda(call.args.out, 0x20000);
    call.args.lse = fake_cuda(call.args.lse, 0x30000);
    call.args.kv_cache = fake_cuda(call.args.kv_cache);
    return call;
  };
  {
    DecodeCall call = cuda_call();
    call.args.kv_cache.k_base = static_cast<char*>(call.args.kv_cache.k_base) + 4;
    call.expect_rejected("kv_cache.k_base");
  }
  {
    DecodeCall call = cuda_call();
    call.args.kv_cache.block_stride_bytes += 8;
    call.expect_rejected("kv_cache.block_stride_bytes");
  }
  {
    DecodeCall call = cuda_call();
    call.args.out.data = static_cast<char*>(call.args.out.data) + 2;
    call.expect_rejected("out");
  }
  {
    DecodeCall call = cuda_call();
    call.args.q = with_dtype(call.args.q, DType::kF32);
    call.expect_rejected("q");
  }
}

}  // namespace
}  // namespace attnkit::test
