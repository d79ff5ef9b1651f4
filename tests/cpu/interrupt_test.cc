// Interrupt checks (include/attnkit/interrupt.h) in the reference backend's long loops: a check
// that says stop abandons prefill, decode and dense with attnkit::Interrupted, the rows after the
// poll untouched; a check that says go on is polled at most once per interval and changes no bit
// of the result. Also default_alibi_slopes' range.
#include "attnkit/interrupt.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "attnkit/attention.h"
#include "common/test_util.h"

namespace attnkit {
namespace {

using test::HostTensor;

// How the installed check answers, and how often it was asked.
int g_calls = 0;
bool g_stop = false;
bool counting_check() {
  ++g_calls;
  return g_stop;
}

// Installs counting_check for one test and removes it afterwards.
class InterruptTest : public ::testing::Test {
 protected:
  void SetUp() override {
    g_calls = 0;
    g_stop = false;
  }
  void TearDown() override { set_interrupt_check(nullptr); }
};

AttentionSpec make_spec(int32_t hq, int32_t hkv, int32_t dim, MaskKind mask) {
  AttentionSpec spec;
  spec.num_q_heads = hq;
  spec.num_kv_heads = hkv;
  spec.head_dim = dim;
  spec.mask.kind = mask;
  return spec;
}

HostTensor random_tensor(DType dtype, std::initializer_list<int64_t> shape, std::mt19937_64& rng) {
  HostTensor t(dtype, shape);
  t.fill_uniform(rng, -1.0f, 1.0f);
  return t;
}

HostTensor poisoned(const std::vector<int64_t>& shape) {
  HostTensor t(DType::kF32, shape);
  t.fill(std::nanf(""));
  return t;
}

// One call of each long reference op; `scale` multiplies its rows (long_enough picks it). `run`
// writes `out` (f32, NaN before the call).
struct LongCall {
  const char* name;
  std::function<void(const HostTensor& out)> run;
  std::vector<int64_t> out_shape;
};

std::vector<LongCall> long_calls(std::mt19937_64& rng, int32_t scale) {
  constexpr int32_t kHq = 8, kHkv = 2, kDim = 64;
  const int32_t kTokens = 256 * scale;
  std::vector<LongCall> calls;

  auto q = std::make_shared<HostTensor>(random_tensor(DType::kF32, {kTokens, kHq, kDim}, rng));
  auto k = std::make_shared<HostTensor>(random_tensor(DType::kF32, {kTokens, kHkv, kDim}, rng));
  auto v = std::make_shared<HostTensor>(random_tensor(DType::kF32, {kTokens, kHkv, kDim}, rng));
  auto cu = std::make_shared<HostTensor>(DType::kInt32, std::initializer_list<int64_t>{2});
  cu->data<int32_t>()[0] = 0;
  cu->data<int32_t>()[1] = kTokens;
  calls.push_back({"prefill",
                   [=](const HostTensor& out) {
                     PrefillArgs args;
                     args.q = *q;
                     args.k = *k;
                     args.v = *v;
                     args.cu_seqlens_q = *cu;
                     args.cu_seqlens_kv = *cu;
                     args.out = out;
                     prefill(make_spec(kHq, kHkv, kDim, MaskKind::kNone), args);
                   },
                   {kTokens, kHq, kDim}});

  // Decode: every row reads the same 2048 cached tokens through its block table.
  constexpr int32_t kBlock = 64, kBlocks = 32;
  const int32_t kRows = 16 * scale;
  auto cache_k =
      std::make_shared<HostTensor>(random_tensor(DType::kF16, {kBlocks, kHkv, kBlock, kDim}, rng));
  auto cache_v =
      std::make_shared<HostTensor>(random_tensor(DType::kF16, {kBlocks, kHkv, kBlock, kDim}, rng));
  auto table =
      std::make_shared<HostTensor>(DType::kInt32, std::initializer_list<int64_t>{kRows, kBlocks});
  auto lens = std::make_shared<HostTensor>(DType::kInt32, std::initializer_list<int64_t>{kRows});
  for (int32_t r = 0; r < kRows; ++r) {
    for (int32_t b = 0; b < kBlocks; ++b) table->data<int32_t>()[r * kBlocks + b] = b;
    lens->data<int32_t>()[r] = kBlocks * kBlock;
  }
  auto dq = std::make_shared<HostTensor>(random_tensor(DType::kF32, {kRows, kHq, kDim}, rng));
  calls.push_back({"decode",
                   [=](const HostTensor& out) {
                     DecodeArgs args;
                     args.q = *dq;
                     args.out = out;
                     KvCacheView& c = args.kv_cache;
                     c.k_base = cache_k->data<void>();
                     c.v_base = cache_v->data<void>();
                     c.dtype = DType::kF16;
                     c.num_blocks = kBlocks;
                     c.num_kv_heads = kHkv;
                     c.tokens_per_block = kBlock;
                     c.head_dim = kDim;
                     c.block_stride_bytes = int64_t{kHkv} * kBlock * kDim * 2;
                     c.block_table = *table;
                     c.seq_lens = *lens;
                     decode(make_spec(kHq, kHkv, kDim, MaskKind::kCausal), args);
                   },
                   {kRows, kHq, kDim}});

  auto bq = std::make_shared<HostTensor>(random_tensor(DType::kF32, {1, kTokens, kHq, kDim}, rng));
  auto bk = std::make_shared<HostTensor>(random_tensor(DType::kF32, {1, kTokens, kHkv, kDim}, rng));
  auto bv = std::make_shared<HostTensor>(random_tensor(DType::kF32, {1, kTokens, kHkv, kDim}, rng));
  calls.push_back({"dense",
                   [=](const HostTensor& out) {
                     DenseArgs args;
                     args.q = *bq;
                     args.k = *bk;
                     args.v = *bv;
                     args.out = out;
                     dense(make_spec(kHq, kHkv, kDim, MaskKind::kNone), args);
                   },
                   {1, kTokens, kHq, kDim}});
  return calls;
}

constexpr size_t kLongCalls = 3;  // prefill, decode, dense

// Call `index` of long_calls at the smallest scale whose plain run (no check installed) lasts at
// least `intervals` poll intervals here, so that the tests observe polling on a machine of any
// speed; `plain` is that run's output.
struct TimedCall {
  LongCall call;
  HostTensor plain;
};
TimedCall long_enough(size_t index, std::mt19937_64& rng, int64_t intervals) {
  for (int32_t scale = 1;; scale *= 2) {
    LongCall call = long_calls(rng, scale).at(index);
    HostTensor plain = poisoned(call.out_shape);
    const auto start = std::chrono::steady_clock::now();
    call.run(plain);
    const auto elapsed = std::chrono::steady_clock::now() - start;
    if (elapsed >= intervals * kInterruptPollInterval || scale >= 256) {
      return {std::move(call), std::move(plain)};
    }
  }
}

int64_t count_nan(const HostTensor& t) {
  int64_t n = 0;
  for (int64_t i = 0; i < t.numel(); ++i) n += std::isnan(t.get(i)) ? 1 : 0;
  return n;
}

TEST_F(InterruptTest, ACheckThatSaysStopAbandonsTheLongReferenceCalls) {
  std::mt19937_64 rng(test::test_seed());
  for (size_t index = 0; index < kLongCalls; ++index) {
    const TimedCall timed = long_enough(index, rng, 4);
    const LongCall& call = timed.call;
    SCOPED_TRACE(call.name);
    ASSERT_EQ(count_nan(timed.plain), 0);  // no check installed: runs to the end

    set_interrupt_check(&counting_check);
    ASSERT_EQ(interrupt_check(), &counting_check);
    g_calls = 0;
    g_stop = true;
    const HostTensor out = poisoned(call.out_shape);
    try {
      call.run(out);
      FAIL() << "the call ran to the end";
    } catch (const Interrupted& e) {
      EXPECT_NE(std::string(e.what()).find(call.name), std::string::npos) << e.what();
    }
    set_interrupt_check(nullptr);
    // Stopped at the first poll after one interval: asked once, the later rows never written.
    EXPECT_EQ(g_calls, 1);
    EXPECT_GT(count_nan(out), 0);
    static_assert(std::is_base_of_v<Error, Interrupted>);
  }
}

TEST_F(InterruptTest, ACheckThatSaysGoOnIsPolledAtTheIntervalAndChangesNoBit) {
  std::mt19937_64 rng(test::test_seed());
  for (size_t index = 0; index < kLongCalls; ++index) {
    const TimedCall timed = long_enough(index, rng, 4);
    const LongCall& call = timed.call;
    const HostTensor& plain = timed.plain;
    SCOPED_TRACE(call.name);

    set_interrupt_check(&counting_check);
    g_calls = 0;
    const HostTensor polled = poisoned(call.out_shape);
    const auto start = std::chrono::steady_clock::now();
    call.run(polled);
    const auto elapsed = std::chrono::steady_clock::now() - start;
    set_interrupt_check(nullptr);

    EXPECT_EQ(plain.bytes(), polled.bytes());
    const int64_t intervals = elapsed / kInterruptPollInterval;
    ASSERT_GE(intervals, 2) << "the call is too short to observe the polling";
    EXPECT_GE(g_calls, 1);
    EXPECT_LE(g_calls, intervals);
  }
}

TEST(DefaultAlibiSlopes, RejectsHeadCountsOutsideTheSpecRange) {
  for (int32_t heads : {-1, 0, (1 << 16) + 1, INT32_MIN}) {
    try {
      default_alibi_slopes(heads);
      FAIL() << heads << " heads accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("num_heads: must be in [1, 65536], got " +
                                           std::to_string(heads)),
                std::string::npos)
          << e.what();
    }
  }
  EXPECT_EQ(default_alibi_slopes(1 << 16).size(), size_t{1} << 16);
  EXPECT_EQ(default_alibi_slopes(1), std::vector<float>{0.00390625f});
}

}  // namespace
}  // namespace attnkit
