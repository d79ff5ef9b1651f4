// The naive GPU kernels (backend=vanilla on CUDA tensors) with bad device metadata
// (docs/safety.md): a seq_lens entry outside the row, a block-table entry outside the pool where
// a key is read, a cache_indirection beam outside [0, beam_width), cu_seqlens_q / cu_seqlens_kv
// entries out of order or outside the packed tensor. The call returns, check_device_errors()
// names the argument, the row and the value; the faulting query rows are zeros with LSE -inf and
// every other row equals the same call with good metadata bit for bit.
#include <gtest/gtest.h>

#include <climits>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "gpu/fault_test_util.h"
#include "gpu/gpu_case_util.h"

namespace attnkit::test {
namespace {

constexpr int32_t kHq = 4, kHkv = 2, kDim = 64, kTpb = 16;

AttentionSpec vanilla_spec() {
  AttentionSpec spec;
  spec.num_q_heads = kHq;
  spec.num_kv_heads = kHkv;
  spec.head_dim = kDim;
  spec.mask.kind = MaskKind::kCausal;
  spec.backend = Backend::kVanilla;
  return spec;
}

std::vector<int64_t> range_of(int64_t first, int64_t end) {
  std::vector<int64_t> rows;
  for (int64_t r = first; r < end; ++r) rows.push_back(r);
  return rows;
}

// ---- decode --------------------------------------------------------------------------------

AttnOutcome run_decode(const AttentionSpec& spec, const OracleKvCache& cache, const HostTensor& q,
                       int32_t beam = 1, const HostTensor* indirection = nullptr) {
  DeviceKvCache dcache(cache);
  DeviceTensor dq(q), dind;
  if (indirection != nullptr) dind = DeviceTensor(*indirection);
  return run_with_outputs(q.view().shape[0], kHq, kDim, [&](TensorView out, TensorView lse) {
    DecodeArgs args;
    args.q = dq;
    args.kv_cache = dcache.view();
    args.beam_width = beam;
    if (indirection != nullptr) args.cache_indirection = dind;
    args.out = out;
    args.lse = lse;
    args.num_splits = 1;
    decode(spec, args);
  });
}

// Four rows of four blocks of 16 (capacity 64): lengths 5, 20, 64, 33.
OracleKvCache decode_cache(DType dtype, std::mt19937_64& rng) {
  OracleKvCache cache = OracleKvCache::paged(dtype, kHkv, kDim, kTpb, 4, 4, rng);
  fill_cache_random(cache, dtype, kHkv, true, rng);
  const int32_t lens[] = {5, 20, 64, 33};
  for (int32_t r = 0; r < 4; ++r) cache.set_seq_len(r, lens[r]);
  return cache;
}

HostTensor random_q(int64_t rows, std::mt19937_64& rng) {
  HostTensor q(DType::kBF16, {rows, kHq, kDim});
  q.fill_uniform(rng, -1.0f, 1.0f);
  return q;
}

TEST(VanillaFault, DecodeSeqLenOutsideTheRow) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed());
  OracleKvCache cache = decode_cache(DType::kInt8, rng);
  const HostTensor q = random_q(4, rng);
  const AttnOutcome good = run_decode(vanilla_spec(), cache, q);
  for (int32_t len : {65, -1, 1 << 30, INT32_MIN}) {
    SCOPED_TRACE("seq_len " + std::to_string(len));
    cache.set_seq_len(1, len);
    const AttnOutcome bad = run_decode(vanilla_spec(), cache, q);
    expect_fault(bad.fault,
                 {FaultKind::kSeqLen, FaultArg::kSeqLens, Op::kDecode, 1, 0, len, 64, 1});
    expect_faulting_rows(bad, good, {1});
  }
}

TEST(VanillaFault, DecodeBlockIdOutsideThePoolWhereRead) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() + 1);
  OracleKvCache cache = decode_cache(DType::kBF16, rng);
  // Row 0 (5 tokens) never reads its last page: -1 there is no fault.
  cache.block_id(0, 3) = -1;
  const int32_t num_blocks = cache.view().num_blocks;
  const HostTensor q = random_q(4, rng);
  const AttnOutcome good = run_decode(vanilla_spec(), cache, q);
  const int32_t original = cache.block_id(2, 2);
  for (int32_t block : {-1, num_blocks, 10000}) {
    SCOPED_TRACE("block " + std::to_string(block));
    cache.block_id(2, 2) = block;  // row 2 (64 tokens) reads keys 32 .. 47 there
    const AttnOutcome bad = run_decode(vanilla_spec(), cache, q);
    // Recorded once per key of that page (the first query head's block).
    expect_fault(bad.fault, {FaultKind::kBlockId, FaultArg::kBlockTable, Op::kDecode, 2, 2, block,
                             num_blocks, 16});
    expect_faulting_rows(bad, good, {2});
  }
  cache.block_id(2, 2) = original;
}

TEST(VanillaFault, DecodeInvalidEntryOutsideTheWindowIsNotRead) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() + 2);
  AttentionSpec spec = vanilla_spec();
  spec.mask.kind = MaskKind::kSlidingWindow;
  spec.mask.window = 16;
  OracleKvCache cache = decode_cache(DType::kBF16, rng);
  const HostTensor q = random_q(4, rng);
  const AttnOutcome good = run_decode(spec, cache, q);
  cache.block_id(2, 0) = -1;  // row 2's query at 63 attends keys 48 .. 63 only
  const AttnOutcome released = run_decode(spec, cache, q);
  EXPECT_FALSE(released.fault.faulted) << released.fault.message;
  expect_faulting_rows(released, good, {});
}

// Two sequences of two beams, 30 tokens each; cache_indirection [2, 2, 40].
struct BeamCase {
  OracleKvCache cache;
  HostTensor indirection;
};

BeamCase beam_case(std::mt19937_64& rng) {
  BeamCase c{OracleKvCache::paged(DType::kBF16, kHkv, kDim, kTpb, 4, 4, rng),
             HostTensor(DType::kInt32, {2, 2, 40})};
  fill_cache_random(c.cache, DType::kBF16, kHkv, false, rng);
  for (int32_t r = 0; r < 4; ++r) c.cache.set_seq_len(r, 30);
  std::uniform_int_distribution<int32_t> beam_of(0, 1);
  for (int64_t i = 0; i < c.indirection.numel(); ++i)
    c.indirection.data<int32_t>()[i] = beam_of(rng);
  return c;
}

TEST(VanillaFault, DecodeIndirectionOutsideTheBeams) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() + 3);
  BeamCase c = beam_case(rng);
  const HostTensor q = random_q(4, rng);
  const AttnOutcome good = run_decode(vanilla_spec(), c.cache, q, 2, &c.indirection);
  int32_t& entry = c.indirection.data<int32_t>()[(1 * 2 + 0) * 40 + 5];  // s = 1, b = 0, t = 5
  for (int32_t beam : {2, -1, 1 << 20}) {
    SCOPED_TRACE("beam " + std::to_string(beam));
    entry = beam;
    const AttnOutcome bad = run_decode(vanilla_spec(), c.cache, q, 2, &c.indirection);
    expect_fault(bad.fault, {FaultKind::kIndirection, FaultArg::kCacheIndirection, Op::kDecode, 2,
                             5, beam, 2, 1});
    expect_faulting_rows(bad, good, {2});
  }
}

TEST(VanillaFault, DecodeSeqLenPastTheIndirection) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() + 4);
  BeamCase c = beam_case(rng);
  const HostTensor q = random_q(4, rng);
  const AttnOutcome good = run_decode(vanilla_spec(), c.cache, q, 2, &c.indirection);
  c.cache.set_seq_len(3, 50);  // within the row (64) but past cache_indirection's 40 positions
  const AttnOutcome bad = run_decode(vanilla_spec(), c.cache, q, 2, &c.indirection);
  expect_fault(bad.fault, {FaultKind::kSeqLen, FaultArg::kSeqLens, Op::kDecode, 3, 0, 50, 40, 1});
  expect_faulting_rows(bad, good, {3});
}

// ---- prefill over the cache ----------------------------------------------------------------

// Three sequences: 5, 3 and 4 queries over 5, 20 and 30 keys (cu_seqlens_q 0, 5, 8, 12).
struct PagedPrefill {
  OracleKvCache cache;
  HostTensor q;
};

PagedPrefill paged_prefill(std::mt19937_64& rng) {
  PagedPrefill p{OracleKvCache::paged(DType::kBF16, kHkv, kDim, kTpb, 3, 4, rng),
                 random_q(12, rng)};
  fill_cache_random(p.cache, DType::kBF16, kHkv, false, rng);
  const int32_t lens[] = {5, 20, 30};
  for (int32_t r = 0; r < 3; ++r) p.cache.set_seq_len(r, lens[r]);
  return p;
}

const std::vector<int32_t> kCuQ = {0, 5, 8, 12};

AttnOutcome run_paged_prefill(const AttentionSpec& spec, const PagedPrefill& p,
                              const std::vector<int32_t>& cu) {
  DeviceKvCache dcache(p.cache);
  DeviceTensor dq(p.q), dcu(int32_tensor(cu));
  return run_with_outputs(p.q.view().shape[0], kHq, kDim, [&](TensorView out, TensorView lse) {
    PrefillArgs args;
    args.q = dq;
    args.cu_seqlens_q = dcu;
    args.kv_cache = &dcache.view();
    args.out = out;
    args.lse = lse;
    args.max_seqlen_q = 64;
    args.max_seqlen_kv = 64;
    prefill(spec, args);
  });
}

TEST(VanillaFault, PrefillCuSeqlensQOutOfOrderOrOutsideTheTokens) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() + 5);
  const PagedPrefill p = paged_prefill(rng);
  const AttnOutcome good = run_paged_prefill(vanilla_spec(), p, kCuQ);
  // Tokens 5 .. 11 are routed to a sequence whose entries are bad: 7 faulting rows, each
  // recorded; tokens 0 .. 4 (sequence 0, entries 0 and 5) are computed as usual.
  struct Bad {
    std::vector<int32_t> cu;
    FaultKind kind;
    int64_t value, bound;
  };
  const Bad cases[] = {
      {{0, 5, 3, 12}, FaultKind::kCuSeqlensOrder, 3, 5},     // entry 2 below entry 1
      {{0, 5, 40, 12}, FaultKind::kCuSeqlensRange, 40, 12},  // past total_q
      {{0, 5, -3, 12}, FaultKind::kCuSeqlensRange, -3, 12},  // negative
  };
  for (const Bad& b : cases) {
    SCOPED_TRACE("cu_seqlens_q[2] = " + std::to_string(b.value));
    const AttnOutcome bad = run_paged_prefill(vanilla_spec(), p, b.cu);
    expect_fault(bad.fault,
                 {b.kind, FaultArg::kCuSeqlensQ, Op::kPrefill, 1, 2, b.value, b.bound, 7});
    expect_faulting_rows(bad, good, range_of(5, 12));
  }
}

TEST(VanillaFault, PrefillSeqLenOutsideTheRow) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() + 6);
  PagedPrefill p = paged_prefill(rng);
  const AttnOutcome good = run_paged_prefill(vanilla_spec(), p, kCuQ);
  for (int32_t len : {65, -2}) {
    SCOPED_TRACE("seq_len " + std::to_string(len));
    p.cache.set_seq_len(1, len);
    const AttnOutcome bad = run_paged_prefill(vanilla_spec(), p, kCuQ);
    // Recorded once for the sequence (by its first query); its 3 query rows are zeros.
    expect_fault(bad.fault,
                 {FaultKind::kSeqLen, FaultArg::kSeqLens, Op::kPrefill, 1, 0, len, 64, 1});
    expect_faulting_rows(bad, good, range_of(5, 8));
  }
}

TEST(VanillaFault, PrefillBlockIdOutsideThePoolWhereRead) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() + 7);
  PagedPrefill p = paged_prefill(rng);
  const int32_t num_blocks = p.cache.view().num_blocks;
  const AttnOutcome good = run_paged_prefill(vanilla_spec(), p, kCuQ);
  p.cache.block_id(2, 1) = 10000;
  // Sequence 2's queries sit at 26 .. 29 and each reads keys 16 .. q of page 1: 11 + 12 + 13 + 14
  // keys, each recorded once (the first query head's block); sequence 1 (20 keys) also reads its
  // page 1, which is valid.
  const AttnOutcome bad = run_paged_prefill(vanilla_spec(), p, kCuQ);
  expect_fault(bad.fault, {FaultKind::kBlockId, FaultArg::kBlockTable, Op::kPrefill, 2, 1, 10000,
                           num_blocks, 11 + 12 + 13 + 14});
  expect_faulting_rows(bad, good, range_of(8, 12));
}

// ---- packed prefill ------------------------------------------------------------------------

TEST(VanillaFault, PackedPrefillCuSeqlensKvOutsideTheKeys) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() + 8);
  // Queries 1, 6, 3 over keys 1, 6, 9.
  const std::vector<int32_t> cu_q = {0, 1, 7, 10}, good_cu_kv = {0, 1, 7, 16};
  const HostTensor q = random_q(10, rng);
  HostTensor k(DType::kBF16, {16, kHkv, kDim}), v(DType::kBF16, {16, kHkv, kDim});
  k.fill_uniform(rng, -1.0f, 1.0f);
  v.fill_uniform(rng, -1.0f, 1.0f);
  auto run = [&](const std::vector<int32_t>& cu_kv) {
    DeviceTensor dq(q), dk(k), dv(v), dcq(int32_tensor(cu_q)), dckv(int32_tensor(cu_kv));
    return run_with_outputs(10, kHq, kDim, [&](TensorView out, TensorView lse) {
      PrefillArgs args;
      args.q = dq;
      args.k = dk;
      args.v = dv;
      args.cu_seqlens_q = dcq;
      args.cu_seqlens_kv = dckv;
      args.out = out;
      args.lse = lse;
      args.max_seqlen_q = 16;
      args.max_seqlen_kv = 16;
      prefill(vanilla_spec(), args);
    });
  };
  const AttnOutcome good = run(good_cu_kv);
  // Entry 2 = 100 is past the 16 keys: sequences 1 and 2 (query rows 1 .. 9) fault, all with the
  // same fields.
  const AttnOutcome bad = run({0, 1, 100, 16});
  expect_fault(bad.fault, {FaultKind::kCuSeqlensRange, FaultArg::kCuSeqlensKv, Op::kPrefill, 1, 2,
                           100, 16, 9});
  expect_faulting_rows(bad, good, range_of(1, 10));
  // Entry 3 below entry 2: sequence 2 (rows 7 .. 9) only.
  const AttnOutcome order = run({0, 1, 7, 5});
  expect_fault(order.fault,
               {FaultKind::kCuSeqlensOrder, FaultArg::kCuSeqlensKv, Op::kPrefill, 2, 3, 5, 7, 3});
  expect_faulting_rows(order, good, range_of(7, 10));
}

}  // namespace
}  // namespace attnkit::test
