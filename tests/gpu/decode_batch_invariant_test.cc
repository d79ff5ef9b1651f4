// Batch-invariant decode (DecodeArgs::batch_invariant, docs/semantics.md): one row's output and
// LSE are bitwise equal whether it runs alone or inside batches of 7 and 64 rows whose other rows
// (fresh random data, random lengths, longer rows that raise the call's split count, an explicit
// max_seq_len) differ from batch to batch, for groups of 4 heads (keys-as-rows kernel), 16 (which
// would take the sm90 wgmma kernel from about 9 rows on without the mode) and 32 (the two-M-block
// kernel at large batches, head blocks of 8 at small ones without the mode), over paged bf16 and
// fp8 / int8 caches (the 4-CTA 8-bit kernel). The mode's results are checked against the fp64
// oracle (decode_case_util.h), also for a row longer than max_seq_len promises (the last split
// reads to the row's end).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "cuda/decode/decode_params.h"
#include "gpu/decode_case_util.h"
#include "gpu/gpu_util.h"

namespace attnkit::test {
namespace {

// The row under test: its length, its query, its stored K and V values ([len][Hkv][D], in the
// cache's stored domain) and the cache's scales, the same in every batch.
struct TargetRow {
  int32_t len = 0;
  std::vector<float> q, k, v;
};

TargetRow make_target(const DecodeCase& c, int32_t len, uint64_t seed) {
  std::mt19937_64 rng(seed);
  TargetRow t;
  t.len = len;
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  t.q.resize(static_cast<size_t>(c.hq) * c.head_dim);
  for (float& x : t.q) x = value(rng);
  const bool quantized = c.kv_dtype == DType::kFp8E4M3 || c.kv_dtype == DType::kInt8;
  const float stored = c.kv_dtype == DType::kInt8 ? 100.0f : (quantized ? 200.0f : 1.0f);
  t.k.resize(static_cast<size_t>(len) * c.hkv * c.head_dim);
  t.v.resize(t.k.size());
  for (float& x : t.k) x = value(rng) * stored;
  for (float& x : t.v) x = value(rng) * stored;
  return t;
}

// Writes the target row into row `row` of the prepared batch (its pages, its query) and sets the
// cache's scales to fixed values (1 for 16-bit caches); uploads what changed.
void plant(PreparedCase& pc, int64_t row, const TargetRow& t) {
  const DecodeCase& c = pc.c;
  ASSERT_EQ(c.seq_lens[row], t.len);
  HostCache& h = pc.h;
  for (int32_t s = 0; s < t.len; ++s) {
    const int64_t block =
        h.block_table.data<int32_t>()[row * h.max_blocks + s / h.tokens_per_block];
    for (int head = 0; head < c.hkv; ++head) {
      for (int d = 0; d < c.head_dim; ++d) {
        const size_t i = (static_cast<size_t>(s) * c.hkv + head) * c.head_dim + d;
        h.pool.set(h.element(block, 0, head, s % h.tokens_per_block, d, c), t.k[i]);
        h.pool.set(h.element(block, 1, head, s % h.tokens_per_block, d, c), t.v[i]);
      }
    }
  }
  const bool quantized = c.kv_dtype == DType::kFp8E4M3 || c.kv_dtype == DType::kInt8;
  const float k_scale = quantized ? 1.0f / 128 : 1.0f, v_scale = quantized ? 1.0f / 64 : 1.0f;
  for (int i = 0; i < h.k_scale.numel(); ++i) {
    h.k_scale.set(i, k_scale);
    h.v_scale.set(i, v_scale);
  }
  std::fill(h.k_scales.begin(), h.k_scales.end(), k_scale);
  std::fill(h.v_scales.begin(), h.v_scales.end(), v_scale);
  for (size_t i = 0; i < t.q.size(); ++i)
    pc.q.set(row * static_cast<int64_t>(t.q.size()) + i, t.q[i]);
  pc.d_pool.upload(h.pool);
  pc.d_ks.upload(h.k_scale);
  pc.d_vs.upload(h.v_scale);
  pc.d_q.upload(pc.q);
}

struct RowBits {
  std::vector<uint8_t> out;
  std::vector<float> lse;
};

// Runs the batch with batch_invariant and returns row `row`'s output bytes and LSEs.
RowBits run_row(PreparedCase& pc, int64_t row) {
  pc.args.batch_invariant = true;
  pc.poison(nullptr);
  EXPECT_NO_THROW(decode(pc.spec, pc.args, nullptr));
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const size_t row_bytes = static_cast<size_t>(pc.c.hq) * pc.c.head_dim * dtype_size(pc.c.dtype);
  RowBits bits;
  bits.out.resize(row_bytes);
  bits.lse.resize(static_cast<size_t>(pc.c.hq));
  EXPECT_EQ(cudaMemcpy(bits.out.data(), static_cast<uint8_t*>(pc.d_out.data()) + row * row_bytes,
                       row_bytes, cudaMemcpyDeviceToHost),
            cudaSuccess);
  EXPECT_EQ(cudaMemcpy(bits.lse.data(), static_cast<float*>(pc.d_lse.data()) + row * pc.c.hq,
                       bits.lse.size() * sizeof(float), cudaMemcpyDeviceToHost),
            cudaSuccess);
  return bits;
}

struct Shape {
  int32_t hq, hkv;
  DType kv_dtype;
};

// A batch of `rows` rows with the target at `at`: other lengths random in [1, max_other], one of
// them `long_row` keys (more splits than the target's) when > 0.
DecodeCase batch_case(const Shape& s, int rows, int at, int32_t target_len, int32_t max_other,
                      int32_t long_row, std::mt19937_64& rng) {
  DecodeCase c;
  c.hq = s.hq;
  c.hkv = s.hkv;
  c.kv_dtype = s.kv_dtype;
  c.page = 32;
  std::uniform_int_distribution<int32_t> len(1, max_other);
  c.seq_lens.resize(rows);
  for (int32_t& l : c.seq_lens) l = len(rng);
  if (long_row > 0 && rows > 1) c.seq_lens[at == 0 ? 1 : 0] = long_row;
  c.seq_lens[at] = target_len;
  return c;
}

// The batches a target row runs in: `rows` rows with the target at `at`, the others' lengths up
// to max_other, one of them long_row keys (> 0), an explicit max_seq_len (> 0).
struct Batch {
  int rows, at;
  int32_t max_other, long_row, max_seq_len;
};

// The target row (3000 keys: three 1024-key splits, the last one partial) alone, then inside
// batches of 7 and 64 rows, twice each with other rows and lengths, once with an explicit
// max_seq_len far above the longest row: every result equal to the first bit for bit.
// ATTNKIT_TEST_SCALE=small: a target of 2100 keys (three splits, the last partial), the other
// rows shorter (the 64-row batches' up to 150 keys, without a long row: the pool of a batch is
// sized by its longest row), a long row of 4100 keys (five splits) in a batch of 7.
void expect_invariant(const Shape& s, uint64_t salt) {
  std::mt19937_64 rng(test_seed() ^ (salt * 0x9E3779B97F4A7C15ull));
  const int32_t target_len = at_test_scale(3000, 2100);
  DecodeCase alone = batch_case(s, 1, 0, target_len, 1, 0, rng);
  const TargetRow target = make_target(alone, target_len, rng());
  SCOPED_TRACE(alone.str());
  PreparedCase first(alone, salt);
  plant(first, 0, target);
  const RowBits reference = run_row(first, 0);
  first.check();  // the mode's result against the oracle
  const std::vector<Batch> batches = at_test_scale<std::vector<Batch>>({{7, 3, 2500, 7000, 0},
                                                                        {7, 6, 4000, 0, 0},
                                                                        {64, 50, 1500, 9000, 0},
                                                                        {64, 0, 3000, 0, 0},
                                                                        {7, 2, 2000, 0, 20000},
                                                                        {1, 0, 1, 0, 12000}},
                                                                       {{7, 3, 1200, 4100, 0},
                                                                        {7, 6, 2500, 0, 0},
                                                                        {64, 50, 150, 0, 0},
                                                                        {64, 0, 150, 0, 0},
                                                                        {7, 2, 500, 0, 20000},
                                                                        {1, 0, 1, 0, 12000}});
  int n = 0;
  for (const Batch& b : batches) {
    SCOPED_TRACE(detail::concat("batch of ", b.rows, ", the row at ", b.at, ", max_seq_len ",
                                b.max_seq_len));
    DecodeCase c = batch_case(s, b.rows, b.at, target_len, b.max_other, b.long_row, rng);
    c.max_seq_len = b.max_seq_len;
    PreparedCase pc(c, salt + 1 + n++);
    plant(pc, b.at, target);
    const RowBits got = run_row(pc, b.at);
    EXPECT_EQ(std::memcmp(got.out.data(), reference.out.data(), got.out.size()), 0)
        << "the row's output differs from the row alone";
    EXPECT_EQ(std::memcmp(got.lse.data(), reference.lse.data(), got.lse.size() * sizeof(float)), 0)
        << "the row's lse differs from the row alone";
  }
}

TEST(DecodeBatchInvariant, GroupsOfFourBf16) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  expect_invariant({8, 2, DType::kBF16}, 12000);
}

TEST(DecodeBatchInvariant, GroupsOfFourEightBitCaches) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  expect_invariant({8, 2, DType::kFp8E4M3}, 12100);
  expect_invariant({8, 2, DType::kInt8}, 12200);
}

TEST(DecodeBatchInvariant, GroupsOfSixteenAndThirtyTwo) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  expect_invariant({16, 1, DType::kBF16}, 12300);
  expect_invariant({32, 1, DType::kBF16}, 12400);
}

// Through a caller DecodeWorkspace as well: the same bits as the per-call workspace.
// ATTNKIT_TEST_SCALE=small: a row of 2100 keys, the others up to 1200 and one of 4100.
TEST(DecodeBatchInvariant, CallerWorkspaceGivesTheSameBits) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() ^ 0xb17);
  DecodeCase c = batch_case({8, 2, DType::kBF16}, 7, 4, at_test_scale(3000, 2100),
                            at_test_scale(2500, 1200), at_test_scale(5000, 4100), rng);
  PreparedCase pc(c, 12500);
  const RowBits plain = run_row(pc, 4);
  DecodeWorkspace ws(pc.spec, 7, DecodeWorkspace::kMaxSplits, Device::cuda(0));
  pc.args.workspace = &ws;
  const RowBits through = run_row(pc, 4);
  EXPECT_EQ(std::memcmp(plain.out.data(), through.out.data(), plain.out.size()), 0);
  EXPECT_EQ(std::memcmp(plain.lse.data(), through.lse.data(), plain.lse.size() * sizeof(float)), 0);
  pc.check();
}

// Rows longer than the 1024 x 128 keys the splits of a call can cover are not tested here (the
// oracle's cost); a row longer than max_seq_len promises is: the last split reads to the row's
// end, so no key is dropped (the call breaks its contract, so the bits may differ from a call
// whose max_seq_len bounds the row, but the result is right).
TEST(DecodeBatchInvariant, LastSplitReadsToTheRowsEnd) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  DecodeCase c;
  c.hq = 8;
  c.hkv = 2;
  c.page = 32;
  c.seq_lens = {3000, 700, 2100};
  c.max_seq_len = 1500;  // two splits: [0, 1024) and [1024, the row's end)
  PreparedCase pc(c, 12600);
  pc.args.batch_invariant = true;
  pc.poison(nullptr);
  ASSERT_NO_THROW(decode(pc.spec, pc.args, nullptr));
  ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
  pc.check();
  static_assert(cuda::kDecodeBatchInvariantSplitKeys == 1024, "the comments above count on it");
}

// The mode's rejections: a forced split count.
TEST(DecodeBatchInvariant, RejectsAForcedSplitCount) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  DecodeCase c;
  c.seq_lens = {100};
  c.num_splits = 2;
  PreparedCase pc(c, 12700);
  pc.args.batch_invariant = true;
  try {
    decode(pc.spec, pc.args, nullptr);
    ADD_FAILURE() << "a forced split count was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("num_splits"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace attnkit::test
