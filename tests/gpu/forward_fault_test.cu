// forward() on CUDA with bad device metadata (docs/safety.md): cu_seqlens_q and past_lens are host
// tensors validated on the host, so what can be bad on the device is the cache's block table and
// seq_lens. Faults of the kernels forward() runs (append_kv, prefill, decode) are reported as
// forward's, with the row of the caller's cache (the decode part runs on the rows after the
// context rows). backend=vanilla: the naive kernels serve every part.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "gpu/fault_test_util.h"
#include "gpu/gpu_case_util.h"

namespace attnkit::test {
namespace {

constexpr int32_t kHq = 4, kHkv = 2, kDim = 64, kTpb = 16;

struct ForwardOutcome {
  AttnOutcome attn;  // out [6, Hq, D], lse [6, Hq]
  std::vector<uint8_t> pool;
};

// One context request (row 0: 5 new tokens at 0 .. 4) and one generation request (row 1: 20
// cached tokens and the new one at 20); rows of two blocks of 16.
ForwardOutcome run_forward(const OracleKvCache& cache, const HostTensor& qkv) {
  AttentionSpec spec;
  spec.num_q_heads = kHq;
  spec.num_kv_heads = kHkv;
  spec.head_dim = kDim;
  spec.rope.style = RopeStyle::kGptNeox;
  spec.backend = Backend::kVanilla;
  GuardedDeviceCache dcache(cache);
  DeviceTensor dqkv(qkv);
  const HostTensor cu = int32_tensor({0, 5, 6}), past = int32_tensor({0, 20});
  ForwardOutcome outcome;
  outcome.attn = run_with_outputs(6, kHq, kDim, [&](TensorView out, TensorView lse) {
    ForwardArgs args;
    args.qkv = dqkv;
    args.num_context = 1;
    args.cu_seqlens_q = cu;
    args.past_lens = past;
    args.kv_cache = dcache.view();
    args.out = out;
    args.lse = lse;
    forward(spec, args);
  });
  outcome.pool = dcache.pool_checking_guards("forward");
  return outcome;
}

struct ForwardCase {
  OracleKvCache cache;
  HostTensor qkv;
};

ForwardCase forward_case(std::mt19937_64& rng) {
  ForwardCase c{OracleKvCache::paged(DType::kBF16, kHkv, kDim, kTpb, 2, 2, rng),
                HostTensor(DType::kBF16, {6, int64_t{kHq + 2 * kHkv} * kDim})};
  fill_cache_random(c.cache, DType::kBF16, kHkv, false, rng);
  c.cache.set_seq_len(0, 5);
  c.cache.set_seq_len(1, 21);
  c.qkv.fill_uniform(rng, -1.0f, 1.0f);
  return c;
}

// Rows 0 .. 4 (the context request) equal `good` byte for byte; row 5 (the generation request)
// is zeros, LSE -inf.
void expect_generation_row_faulted(const ForwardOutcome& bad, const ForwardOutcome& good) {
  expect_faulting_rows(bad.attn, good.attn, {5});
}

TEST(ForwardFault, BlockIdOfTheGenerationRowNamesForwardAndTheCacheRow) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed());
  ForwardCase c = forward_case(rng);
  const ForwardOutcome good = run_forward(c.cache, c.qkv);
  const int32_t written = c.cache.block_id(1, 1);  // where the good call put row 1's new token
  c.cache.block_id(1, 1) = 10000;
  const ForwardOutcome bad = run_forward(c.cache, c.qkv);
  // append_kv refuses the new token (1 fault) and decode its row's keys 16 .. 20 of that page
  // (5 faults): all name row 1 of the caller's cache, column 1.
  expect_fault(bad.attn.fault, {FaultKind::kBlockId, FaultArg::kBlockTable, Op::kForward, 1, 1,
                                10000, c.cache.view().num_blocks, 6});
  expect_generation_row_faulted(bad, good);
  // The pool is the good call's, less the token it wrote into block `written`.
  std::vector<uint8_t> expected = good.pool;
  const int64_t stride = c.cache.view().block_stride_bytes;
  std::memcpy(expected.data() + written * stride, c.cache.pool().bytes().data() + written * stride,
              static_cast<size_t>(stride));
  const int64_t diff = first_difference(bad.pool, expected);
  EXPECT_EQ(diff, -1) << "the pool differs at byte " << diff;
}

TEST(ForwardFault, SeqLenOfTheGenerationRowNamesTheCacheRow) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() + 1);
  ForwardCase c = forward_case(rng);
  const ForwardOutcome good = run_forward(c.cache, c.qkv);
  c.cache.set_seq_len(1, 1000);  // the row holds 32 slots
  const ForwardOutcome bad = run_forward(c.cache, c.qkv);
  expect_fault(bad.attn.fault,
               {FaultKind::kSeqLen, FaultArg::kSeqLens, Op::kForward, 1, 0, 1000, 32, 1});
  expect_generation_row_faulted(bad, good);
  // append_kv does not read seq_lens: it wrote the new tokens as the good call did.
  EXPECT_EQ(first_difference(bad.pool, good.pool), -1);
}

}  // namespace
}  // namespace attnkit::test
