// append_kv on CUDA (fused and vanilla) with bad device metadata (docs/safety.md): a token whose
// row_of_token, position or block-table entry is outside the cache writes nothing to the cache
// and zeros to its q_out row, the call returns, and check_device_errors() names the argument,
// the token's row and the value. The pool is compared byte for byte (with sentinel guard bands
// around it) with a call of the good tokens alone, and so are the good tokens' q_out rows.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "gpu/fault_test_util.h"
#include "gpu/gpu_case_util.h"

namespace attnkit::test {
namespace {

constexpr int32_t kHq = 4, kHkv = 2, kDim = 128, kTpb = 16;

struct Token {
  int32_t position;
  int32_t row;
  bool bad;
};

AttentionSpec append_spec(RopeStyle style) {
  AttentionSpec spec;
  spec.num_q_heads = kHq;
  spec.num_kv_heads = kHkv;
  spec.head_dim = kDim;
  spec.rope.style = style;
  return spec;
}

// Tokens of `good` (row, first position, count) in a shuffled order with `bad` inserted at random
// places.
std::vector<Token> shuffled_tokens(const std::vector<std::array<int32_t, 3>>& good,
                                   const std::vector<Token>& bad, std::mt19937_64& rng) {
  std::vector<Token> tokens;
  for (const auto& [row, first, count] : good) {
    for (int32_t i = 0; i < count; ++i) tokens.push_back({first + i, row, false});
  }
  tokens.insert(tokens.end(), bad.begin(), bad.end());
  std::shuffle(tokens.begin(), tokens.end(), rng);
  return tokens;
}

struct AppendOutcome {
  TakenFault fault;
  std::vector<uint8_t> pool;  // bytes after the call
  HostTensor q_out;           // [n, Hq, D]
};

// One append_kv call on a fresh guarded copy of `cache` with device metadata.
AppendOutcome run_append(AttentionSpec spec, Backend backend, const OracleKvCache& cache,
                         const HostTensor& qkv, const HostTensor* bias,
                         const std::vector<Token>& tokens, bool checked = false) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  std::vector<int32_t> positions, rows;
  for (const Token& t : tokens) {
    positions.push_back(t.position);
    rows.push_back(t.row);
  }
  GuardedDeviceCache dcache(cache);
  const HostTensor q_poison = poisoned(DType::kBF16, {n, kHq, kDim});
  DeviceTensor dqkv(qkv), dpos(int32_tensor(positions)), drow(int32_tensor(rows)), dqout(q_poison),
      dbias;
  AppendKvArgs args;
  args.qkv = dqkv;
  if (bias != nullptr) {
    dbias = DeviceTensor(*bias);
    args.qkv_bias = dbias;
  }
  args.positions = dpos;
  args.row_of_token = drow;
  args.kv_cache = dcache.view();
  args.q_out = dqout;
  args.checked = checked;
  spec.backend = backend;
  AppendOutcome out;
  if (checked) {
    try {
      append_kv(spec, args);
      ADD_FAILURE() << "a checked call with a bad token returned";
    } catch (const DeviceFaultError& e) {
      out.fault.faulted = true;
      out.fault.fault = e.fault();
      out.fault.message = e.what();
    }
    EXPECT_FALSE(take_device_fault().faulted) << "checked mode left the fault in the word";
  } else {
    EXPECT_NO_THROW(append_kv(spec, args));
    out.fault = take_device_fault();
  }
  out.pool = dcache.pool_checking_guards(std::string(backend_name(backend)) + " append_kv");
  out.q_out = downloaded(dqout, q_poison);
  return out;
}

// Runs `tokens` (some bad) and the good tokens alone on the same cache, for both backends, and
// checks the contract: the pool and the good tokens' q_out rows equal the good call's byte for
// byte, the bad tokens' q_out rows are zeros. Returns the fault of each backend's bad call.
std::vector<TakenFault> check_bad_tokens(const std::string& what, const AttentionSpec& spec,
                                         const OracleKvCache& cache,
                                         const std::vector<Token>& tokens, bool with_bias,
                                         std::mt19937_64& rng) {
  SCOPED_TRACE(what);
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t width = int64_t{kHq + 2 * kHkv} * kDim;
  HostTensor qkv(DType::kBF16, {n, width});
  qkv.fill_uniform(rng, -2.0f, 2.0f);
  HostTensor bias(DType::kBF16, {width});
  bias.fill_uniform(rng, -0.5f, 0.5f);
  std::vector<Token> good;
  std::vector<int64_t> good_index;
  for (int64_t t = 0; t < n; ++t) {
    if (!tokens[t].bad) {
      good.push_back(tokens[t]);
      good_index.push_back(t);
    }
  }
  const int64_t ng = static_cast<int64_t>(good.size());
  HostTensor good_qkv(DType::kBF16, {std::max<int64_t>(ng, 1), width});
  for (int64_t i = 0; i < ng; ++i) {
    std::memcpy(good_qkv.data<uint8_t>() + i * width * 2,
                qkv.data<uint8_t>() + good_index[i] * width * 2, width * 2);
  }
  const size_t q_row_bytes = size_t{kHq} * kDim * 2;
  std::vector<TakenFault> faults;
  for (Backend backend : {Backend::kFused, Backend::kVanilla}) {
    SCOPED_TRACE(backend_name(backend));
    drain_device_faults();
    const AppendOutcome bad =
        run_append(spec, backend, cache, qkv, with_bias ? &bias : nullptr, tokens);
    std::vector<uint8_t> expected_pool = cache.pool().bytes();
    HostTensor good_q;
    if (ng > 0) {
      const AppendOutcome ref =
          run_append(spec, backend, cache, good_qkv, with_bias ? &bias : nullptr, good);
      EXPECT_FALSE(ref.fault.faulted) << "the good tokens alone faulted: " << ref.fault.message;
      EXPECT_NE(first_difference(ref.pool, expected_pool), -1) << "the good tokens wrote nothing";
      expected_pool = ref.pool;
      good_q = ref.q_out;
    }
    const int64_t diff = first_difference(bad.pool, expected_pool);
    EXPECT_EQ(diff, -1) << "the pool differs from the good tokens' call at byte " << diff
                        << " (block " << diff / cache.view().block_stride_bytes << ")";
    const OutputRows got{bad.q_out.bytes().data(), q_row_bytes, nullptr, 0, n};
    const OutputRows ref{good_q.bytes().data(), q_row_bytes, nullptr, 0, ng};
    for (int64_t t = 0, g = 0; t < n; ++t) {
      if (tokens[t].bad) {
        EXPECT_TRUE(is_zeroed_row(got, t)) << "q_out of bad token " << t;
      } else {
        EXPECT_TRUE(same_row(got, t, ref, g++)) << "q_out of good token " << t;
      }
    }
    faults.push_back(bad.fault);
  }
  return faults;
}

int64_t index_of_bad(const std::vector<Token>& tokens) {
  for (size_t t = 0; t < tokens.size(); ++t) {
    if (tokens[t].bad) return static_cast<int64_t>(t);
  }
  return -1;
}

// Three rows of four blocks of 16 (capacity 64), random contents (other rows' blocks are
// sentinels too: the pool is compared whole).
OracleKvCache three_rows(DType kv_dtype, std::mt19937_64& rng) {
  OracleKvCache cache = OracleKvCache::paged(kv_dtype, kHkv, kDim, kTpb, 3, 4, rng);
  fill_cache_random(cache, kv_dtype, kHkv, /*per_head_scales=*/true, rng);
  return cache;
}

const std::vector<std::array<int32_t, 3>> kGoodTokens = {{0, 10, 5}, {1, 30, 6}, {2, 0, 4}};

// The reported bug: 8 tokens at positions 9000-9007 of a row whose table has 4 entries, 3 of
// them valid, died with cudaErrorIllegalAddress.
TEST(AppendKvFault, IssueReportPositionsPastTheTable) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed());
  OracleKvCache cache = OracleKvCache::paged(DType::kBF16, kHkv, kDim, kTpb, 1, 4, rng);
  fill_cache_random(cache, DType::kBF16, kHkv, false, rng);
  cache.block_id(0, 3) = -1;
  std::vector<Token> tokens;
  for (int32_t i = 0; i < 8; ++i) tokens.push_back({9000 + i, 0, true});
  const std::vector<TakenFault> faults =
      check_bad_tokens("issue report", append_spec(RopeStyle::kGptNeox), cache, tokens, true, rng);
  for (const TakenFault& taken : faults) {
    ASSERT_TRUE(taken.faulted);
    const DeviceFault& f = taken.fault;
    // Any of the 8 tokens may be recorded first; each names its own position.
    EXPECT_EQ(f.kind, static_cast<int32_t>(FaultKind::kPosition)) << taken.message;
    EXPECT_EQ(f.arg, static_cast<int32_t>(FaultArg::kPositions)) << taken.message;
    EXPECT_EQ(f.op, static_cast<int32_t>(Op::kAppendKv)) << taken.message;
    EXPECT_EQ(f.row, 0) << taken.message;
    EXPECT_GE(f.value, 9000) << taken.message;
    EXPECT_LE(f.value, 9007) << taken.message;
    EXPECT_EQ(f.index, f.value - 9000) << taken.message;
    EXPECT_EQ(f.bound, 4 * kTpb) << taken.message;
    EXPECT_EQ(f.count, 8u) << taken.message;
    const std::string expected = "append_kv: positions: token " + std::to_string(f.index) +
                                 " (block-table row 0) at position " + std::to_string(f.value) +
                                 " needs a slot outside its row of 64 slots";
    EXPECT_NE(taken.message.find(expected), std::string::npos) << taken.message;
  }
}

TEST(AppendKvFault, PositionOutsideTheRow) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() + 1);
  const OracleKvCache cache = three_rows(DType::kBF16, rng);
  // The first slot past the table, far past it, negative, and the most negative.
  for (int32_t position : {64, 9000, -1, INT32_MIN}) {
    const std::vector<Token> tokens = shuffled_tokens(kGoodTokens, {{position, 1, true}}, rng);
    const int64_t t = index_of_bad(tokens);
    for (const TakenFault& taken :
         check_bad_tokens("position " + std::to_string(position), append_spec(RopeStyle::kGptNeox),
                          cache, tokens, true, rng)) {
      expect_fault(taken, {FaultKind::kPosition, FaultArg::kPositions, Op::kAppendKv, 1, t,
                           position, 64, 1});
      EXPECT_NE(taken.message.find("at position " + std::to_string(position)), std::string::npos)
          << taken.message;
    }
  }
}

TEST(AppendKvFault, RowOfTokenOutsideTheTable) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() + 2);
  const OracleKvCache cache = three_rows(DType::kInt8, rng);
  for (int32_t row : {3, -1, 1 << 30}) {
    const std::vector<Token> tokens = shuffled_tokens(kGoodTokens, {{20, row, true}}, rng);
    const int64_t t = index_of_bad(tokens);
    for (const TakenFault& taken :
         check_bad_tokens("row " + std::to_string(row), append_spec(RopeStyle::kNone), cache,
                          tokens, false, rng)) {
      expect_fault(taken,
                   {FaultKind::kRowIndex, FaultArg::kRowOfToken, Op::kAppendKv, row, t, row, 3, 1});
    }
  }
}

TEST(AppendKvFault, BlockIdOutsideThePoolWhereWritten) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() + 3);
  OracleKvCache cache = three_rows(DType::kFp8E4M3, rng);
  const int32_t num_blocks = cache.view().num_blocks;
  // Row 0's last entry is -1 too, but its tokens never reach that page: no fault there.
  cache.block_id(0, 3) = -1;
  for (int32_t block : {-1, num_blocks, 10000, INT32_MIN}) {
    cache.block_id(2, 3) = block;  // row 2's good tokens are in page 0, the bad one in page 3
    const std::vector<Token> tokens = shuffled_tokens(kGoodTokens, {{50, 2, true}}, rng);
    const int64_t t = index_of_bad(tokens);
    SCOPED_TRACE("token " + std::to_string(t));
    for (const TakenFault& taken :
         check_bad_tokens("block " + std::to_string(block), append_spec(RopeStyle::kGptJ), cache,
                          tokens, true, rng)) {
      expect_fault(taken, {FaultKind::kBlockId, FaultArg::kBlockTable, Op::kAppendKv, 2, 3, block,
                           num_blocks, 1});
    }
  }
}

TEST(AppendKvFault, ContiguousCache) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() + 4);
  OracleKvCache cache = OracleKvCache::contiguous(DType::kBF16, kHkv, kDim, 3, 64);
  fill_cache_random(cache, DType::kBF16, kHkv, false, rng);
  {
    const std::vector<Token> tokens = shuffled_tokens(kGoodTokens, {{64, 0, true}}, rng);
    const int64_t t = index_of_bad(tokens);
    for (const TakenFault& taken :
         check_bad_tokens("contiguous position 64", append_spec(RopeStyle::kGptNeox), cache, tokens,
                          false, rng)) {
      expect_fault(taken,
                   {FaultKind::kPosition, FaultArg::kPositions, Op::kAppendKv, 0, t, 64, 64, 1});
    }
  }
  {
    // Row r is block r: a row past the blocks would write after the pool.
    const std::vector<Token> tokens = shuffled_tokens(kGoodTokens, {{5, 3, true}}, rng);
    const int64_t t = index_of_bad(tokens);
    for (const TakenFault& taken : check_bad_tokens(
             "contiguous row 3", append_spec(RopeStyle::kGptNeox), cache, tokens, false, rng)) {
      expect_fault(taken,
                   {FaultKind::kRowIndex, FaultArg::kRowOfToken, Op::kAppendKv, 3, t, 3, 3, 1});
    }
  }
}

TEST(AppendKvFault, CyclicCacheWrapsLargePositionsAndRefusesNegativeOnes) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() + 5);
  AttentionSpec spec = append_spec(RopeStyle::kGptNeox);
  spec.mask.kind = MaskKind::kSlidingWindow;
  spec.mask.window = 20;
  spec.mask.sink_tokens = 2;
  OracleKvCache cache = three_rows(DType::kBF16, rng);
  cache.make_cyclic(cyclic_window_slots(spec.mask.window, kTpb), spec.mask.sink_tokens);
  // Positions far past the capacity wrap inside the row: good tokens.
  const std::vector<std::array<int32_t, 3>> good = {{0, 100000, 6}, {1, 0, 4}, {2, 777, 9}};
  const std::vector<Token> tokens = shuffled_tokens(good, {{-7, 2, true}}, rng);
  const int64_t t = index_of_bad(tokens);
  for (const TakenFault& taken : check_bad_tokens("cyclic", spec, cache, tokens, true, rng)) {
    expect_fault(taken,
                 {FaultKind::kPosition, FaultArg::kPositions, Op::kAppendKv, 2, t, -7, 64, 1});
  }
}

TEST(AppendKvFault, ValidCallRecordsNoFault) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() + 6);
  OracleKvCache cache = three_rows(DType::kBF16, rng);
  cache.block_id(0, 3) = -1;  // never written: not a fault
  const std::vector<Token> tokens = shuffled_tokens(kGoodTokens, {}, rng);
  const int64_t width = int64_t{kHq + 2 * kHkv} * kDim;
  HostTensor qkv(DType::kBF16, {static_cast<int64_t>(tokens.size()), width});
  qkv.fill_uniform(rng, -2.0f, 2.0f);
  for (Backend backend : {Backend::kFused, Backend::kVanilla}) {
    drain_device_faults();
    const AppendOutcome out =
        run_append(append_spec(RopeStyle::kGptNeox), backend, cache, qkv, nullptr, tokens);
    EXPECT_FALSE(out.fault.faulted) << out.fault.message;
    EXPECT_FALSE(any_nan(out.q_out.to_double())) << "q_out not fully written";
  }
}

TEST(AppendKvFault, CheckedModeRaisesAtOnce) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() + 7);
  const OracleKvCache cache = three_rows(DType::kBF16, rng);
  const std::vector<Token> tokens = shuffled_tokens(kGoodTokens, {{9000, 1, true}}, rng);
  const int64_t t = index_of_bad(tokens);
  const int64_t width = int64_t{kHq + 2 * kHkv} * kDim;
  HostTensor qkv(DType::kBF16, {static_cast<int64_t>(tokens.size()), width});
  qkv.fill_uniform(rng, -2.0f, 2.0f);
  for (Backend backend : {Backend::kFused, Backend::kVanilla}) {
    drain_device_faults();
    const AppendOutcome out = run_append(append_spec(RopeStyle::kGptNeox), backend, cache, qkv,
                                         nullptr, tokens, /*checked=*/true);
    expect_fault(out.fault,
                 {FaultKind::kPosition, FaultArg::kPositions, Op::kAppendKv, 1, t, 9000, 64, 1});
  }
}

}  // namespace
}  // namespace attnkit::test
