// Split-KV decode: split bounds and counts against the fp64 oracle of decode_case_util.h. Forced
// counts that divide the row's tiles and counts that do not, up to one split per tile and beyond
// (empty splits), the heuristic's counts at batch 1 (short splits at two CTAs an SM), empty
// splits next to rows of different lengths, groups of 4 / 8 / 16 / 32 heads, 8-bit caches,
// window + sinks, ALiBi and soft-cap, outputs beyond f16's range (the partials' type), through a
// caller DecodeWorkspace and without, in a captured graph replayed several times, and the merge in
// a kernel of its own against the in-kernel one. Contexts are short (at most 32k keys over 2 KV
// heads): the host oracle's cost.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "attnkit/attention.h"
#include "cuda/decode/decode_launch.h"
#include "gpu/decode_case_util.h"
#include "gpu/gpu_util.h"

namespace attnkit::test {
namespace {

// Groups of 4 heads, head_dim 128, page 32: the batch-1 target's group (GQA 32/8) with fewer KV
// heads, so that the oracle stays cheap.
DecodeCase gqa4_case(std::vector<int32_t> seq_lens, int32_t splits, int32_t hkv = 2) {
  DecodeCase c;
  c.hq = 4 * hkv;
  c.hkv = hkv;
  c.page = 32;
  c.seq_lens = std::move(seq_lens);
  c.num_splits = splits;
  return c;
}

// Query heads, KV heads, head_dim and the query / cache dtype of a case.
struct HeadShape {
  int32_t hq, hkv, head_dim;
  DType dtype;
};

DecodeCase shaped_case(const HeadShape& s, int32_t page, std::vector<int32_t> seq_lens,
                       int32_t splits) {
  DecodeCase c;
  c.hq = s.hq;
  c.hkv = s.hkv;
  c.head_dim = s.head_dim;
  c.dtype = c.kv_dtype = s.dtype;
  c.page = page;
  c.seq_lens = std::move(seq_lens);
  c.num_splits = splits;
  return c;
}

// Runs the case through the caller workspace `ws`, then through the per-call workspace; outputs
// poisoned before each call.
void run_both_workspaces(const DecodeCase& c, uint64_t salt, DecodeWorkspace* ws) {
  SCOPED_TRACE(c.str());
  PreparedCase pc(c, salt);
  for (DecodeWorkspace* w : {ws, static_cast<DecodeWorkspace*>(nullptr)}) {
    SCOPED_TRACE(w != nullptr ? "caller workspace" : "per-call workspace");
    pc.args.workspace = w;
    pc.poison(nullptr);
    ASSERT_NO_THROW(decode(pc.spec, pc.args, nullptr));
    ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
    pc.check();
  }
}

// Captures the prepared calls into one graph on a stream of its own and replays it three times,
// outputs poisoned before and checked after each replay, `ws`'s counters zero after each.
void capture_and_replay(std::vector<std::unique_ptr<PreparedCase>>& prepared,
                        const DecodeWorkspace& ws) {
  cudaStream_t stream = nullptr;
  ATTNKIT_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  capture_decode_calls(prepared, stream, &graph, &exec);
  for (int replay = 0; replay < 3 && !::testing::Test::HasFatalFailure(); ++replay) {
    SCOPED_TRACE(detail::concat("replay ", replay));
    replay_and_check(prepared, exec, stream);
    expect_counters_zero(ws);
  }
  if (exec != nullptr) cudaGraphExecDestroy(exec);
  if (graph != nullptr) cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// Puts the split merge back under its rule (and the accumulating merge's range back to its
// default) when it goes out of scope, also when a test fails.
struct RestoreMergeRule {
  ~RestoreMergeRule() {
    cuda::set_decode_merge_mode(cuda::DecodeMergeMode::kAuto);
    cuda::set_decode_accumulate_range(cuda::kDecodeAccumulateMinLse2,
                                      cuda::kDecodeAccumulateMaxLse2);
  }
};

// Runs body() with each split merge forced in turn (the separate kernel, the last CTA's, the last
// CTA's over sums accumulated in L2) and puts the merge back under its rule afterwards.
template <typename Body>
void with_each_merge_forced(Body body) {
  RestoreMergeRule restore_rule;
  for (cuda::DecodeMergeMode mode :
       {cuda::DecodeMergeMode::kSeparate, cuda::DecodeMergeMode::kInKernel,
        cuda::DecodeMergeMode::kAccumulate}) {
    cuda::set_decode_merge_mode(mode);
    SCOPED_TRACE(mode == cuda::DecodeMergeMode::kSeparate   ? "separate merge"
                 : mode == cuda::DecodeMergeMode::kInKernel ? "in-kernel merge"
                                                            : "accumulating merge");
    body();
  }
}

std::unique_ptr<DecodeWorkspace> make_workspace(int32_t hq, int64_t rows) {
  AttentionSpec sizing;
  sizing.num_q_heads = hq;
  sizing.num_kv_heads = 1;
  sizing.head_dim = 256;
  return std::make_unique<DecodeWorkspace>(sizing, rows, DecodeWorkspace::kMaxSplits,
                                           Device::cuda(0));
}

// Forced counts that divide the row's tiles and counts that do not (2049 keys: 33 tiles of 64),
// up to one split per tile and beyond it (empty splits), and the heuristic.
TEST(DecodeSplit, ForcedCountsDividingTheTilesAndNot) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  auto ws = make_workspace(8, 1);
  uint64_t salt = 3000;
  for (int32_t splits : {2, 3, 5, 7, 11, 16, 32, 33, 40, 0}) {
    run_both_workspaces(gqa4_case({2049}, splits), salt++, ws.get());
  }
}

// The heuristic's counts at batch 1: GQA 32/8 at 8448 keys (short splits, two CTAs an SM: 27
// splits of 5 tiles on the H200) and 2 KV heads at 32k keys (64 splits of 8 tiles).
TEST(DecodeSplit, HeuristicCountsAtBatchOne) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  auto ws = make_workspace(32, 1);
  run_both_workspaces(gqa4_case({8448}, 0, 8), 3050, ws.get());
  run_both_workspaces(gqa4_case({32768}, 0), 3051, ws.get());
}

// Empty splits: rows shorter than splits x tile (1 key, one tile, a tile and one key, a few
// tiles) next to longer rows of different lengths in one batch.
TEST(DecodeSplit, EmptySplitsAndRowsOfDifferentLengths) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  auto ws = make_workspace(8, 5);
  uint64_t salt = 3100;
  for (int32_t splits : {33, 16, 6, 0}) {
    run_both_workspaces(gqa4_case({1, 64, 65, 300, 4100}, splits), salt++, ws.get());
  }
}

// Groups of 8 heads (keys as rows), 16 (one 16-row M block) and 32 (MQA: two M blocks), f16 and
// bf16, head_dim 64 / 256, with counts that do not divide the tiles.
TEST(DecodeSplit, GroupSizesAndHeadDims) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  auto ws = make_workspace(32, 2);
  uint64_t salt = 3200;
  for (const HeadShape& s : {HeadShape{8, 1, 128, DType::kF16}, HeadShape{16, 1, 128, DType::kBF16},
                             HeadShape{32, 1, 128, DType::kF16}, HeadShape{8, 2, 64, DType::kBF16},
                             HeadShape{8, 1, 256, DType::kF16}}) {
    for (int32_t splits : {0, 7}) {
      run_both_workspaces(shaped_case(s, 32, {1500, 333}, splits), salt++, ws.get());
    }
  }
}

// The merge's staging walks (split, vector) pairs by fixed steps without a division:
// 10 and 12 vectors a head (head_dim 80 / 96) and 8 (64) in groups of 1, 3, 5 and 6 heads, so that
// a split's vectors (10-72) do not divide the CTA's 128 threads and the steps wrap (powers of two
// and groups of 16-32 heads, whose vectors reach or exceed the threads, are in the tests above),
// with one chunk (7, 40 splits) and several (128 splits of 6 heads at head_dim 96).
TEST(DecodeSplit, MergeStagingStepsOfEveryShape) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  auto ws = make_workspace(12, 2);
  uint64_t salt = 3300;
  struct Shape {
    int32_t group, head_dim;
  };
  for (const Shape& s : {Shape{1, 80}, Shape{3, 80}, Shape{6, 96}, Shape{5, 64}, Shape{1, 96}}) {
    for (int32_t splits : {7, 40, 128}) {
      DecodeCase c;
      c.hq = 2 * s.group;
      c.hkv = 2;
      c.head_dim = s.head_dim;
      c.dtype = c.kv_dtype = DType::kBF16;
      c.page = 16;
      c.seq_lens = {1200, 517};
      c.num_splits = splits;
      run_both_workspaces(c, salt++, ws.get());
    }
  }
}

// 8-bit caches (per-tensor and per-head scales, against the same quantization; 128-key tiles),
// sliding window with sinks over a cyclic cache, ALiBi and soft-cap, split unevenly.
TEST(DecodeSplit, QuantizedWindowAlibiSoftcap) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  auto ws = make_workspace(8, 2);
  uint64_t salt = 3400;
  for (int32_t splits : {0, 7}) {
    for (DType kv : {DType::kFp8E4M3, DType::kInt8}) {
      DecodeCase c = gqa4_case({3000, 700}, splits);
      c.kv_dtype = kv;
      c.per_head_scale = kv == DType::kInt8;
      run_both_workspaces(c, salt++, ws.get());
    }
    DecodeCase w = gqa4_case({3000, 700}, splits);
    w.mask.kind = MaskKind::kSlidingWindow;
    w.mask.window = 1000;
    w.mask.sink_tokens = 4;
    w.cyclic = true;
    run_both_workspaces(w, salt++, ws.get());
    DecodeCase a = gqa4_case({2500, 50}, splits);
    a.alibi = true;
    a.softcap = 30.0;
    a.q_range = 4.0f;
    run_both_workspaces(a, salt++, ws.get());
  }
}

// Split calls (heuristic and forced counts) captured in one graph (through the caller workspace and
// through per-call workspaces), replayed three times with the outputs poisoned before each replay
// and the workspace counters zero after each.
TEST(DecodeSplit, CapturedGraphReplays) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  auto ws = make_workspace(8, 2);
  std::vector<std::unique_ptr<PreparedCase>> prepared;
  uint64_t salt = 3500;
  for (int32_t splits : {0, 7, 33}) {
    for (bool caller : {true, false}) {
      prepared.push_back(std::make_unique<PreparedCase>(gqa4_case({2100, 900}, splits), salt++));
      if (caller) prepared.back()->args.workspace = ws.get();
    }
  }
  capture_and_replay(prepared, *ws);
}

// Outputs near 1e6 (bf16 queries over a cache whose V scale puts them beyond f16's range, so f16
// partials would overflow), forced and heuristic counts, both workspaces. The splits' means are
// larger than the rows' where they cancel: partials rounded to the query's type (as FlashInfer
// keeps them) failed docs/testing.md's bound here for some seeds (388.7 against 366.9); f32
// partials.
TEST(DecodeSplit, PartialsKeepTheRangeOfTheOutputType) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  auto ws = make_workspace(8, 2);
  uint64_t salt = 3600;
  for (int32_t splits : {5, 16, 0}) {
    DecodeCase c = gqa4_case({2049, 700}, splits);
    c.v_scale_base = 1.0e6f;
    run_both_workspaces(c, salt++, ws.get());
  }
}

// The accumulating merge with outliers: splits whose LSE (log2) lies outside the range write
// their partials, which the last CTA merges with the sums of the others. Narrow ranges put some
// splits of a row on each side (a split of ~128 random keys has an LSE near 7), none or all
// outside, next to empty splits (a 1-key row) and rows of different lengths, forced and
// heuristic counts, both workspaces, the outputs and LSEs checked; then queries sharp enough
// (|q| up to 200) that the default range leaves splits out.
TEST(DecodeSplit, AccumulatingMergeWithOutliers) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  auto ws = make_workspace(8, 3);
  RestoreMergeRule restore_rule;
  cuda::set_decode_merge_mode(cuda::DecodeMergeMode::kAccumulate);
  uint64_t salt = 3800;
  const std::pair<float, float> ranges[] = {
      {cuda::kDecodeAccumulateMinLse2, cuda::kDecodeAccumulateMaxLse2},
      {1000.0f, 1001.0f},
      {-60.0f, 6.0f},
      {-60.0f, 7.5f},
      {7.0f, 100.0f}};
  for (const auto& [lo, hi] : ranges) {
    cuda::set_decode_accumulate_range(lo, hi);
    SCOPED_TRACE(detail::concat("lse2 range [", lo, ", ", hi, "]"));
    for (int32_t splits : {7, 16, 0}) {
      run_both_workspaces(gqa4_case({2049, 700, 1}, splits), salt++, ws.get());
    }
  }
  cuda::set_decode_accumulate_range(cuda::kDecodeAccumulateMinLse2, cuda::kDecodeAccumulateMaxLse2);
  for (int32_t splits : {7, 16, 0}) {
    DecodeCase c = gqa4_case({2049, 700, 1}, splits);
    c.q_range = 200.0f;
    run_both_workspaces(c, salt++, ws.get());
  }
}

// The public switch: deterministic calls (the default) give the same output bits on every run,
// split or not; a call with deterministic = false on a grid the rule accumulates (2 KV heads x 100
// forced splits: 200 CTAs, more than the SMs of the GPUs we run on) matches the oracle through
// both workspaces, leaves the workspace zeroed, and matches the deterministic call's output
// within the bound.
TEST(DecodeSplit, DeterministicByDefaultAndAccumulatingWhenAllowed) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  auto ws = make_workspace(8, 2);
  for (int32_t splits : {1, 16, 100}) {
    SCOPED_TRACE(detail::concat("splits ", splits));
    PreparedCase pc(gqa4_case({8192, 3000}, splits), 3900 + splits);
    pc.args.workspace = ws.get();
    std::vector<uint8_t> first;
    for (int run = 0; run < 3; ++run) {
      pc.poison(nullptr);
      ASSERT_NO_THROW(decode(pc.spec, pc.args, nullptr));
      ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
      std::vector<uint8_t> bytes(static_cast<size_t>(pc.d_out.bytes()));
      ATTNKIT_CUDA_OK(
          cudaMemcpy(bytes.data(), pc.d_out.data(), bytes.size(), cudaMemcpyDeviceToHost));
      if (run == 0) {
        pc.check();
        first = bytes;
      } else {
        EXPECT_EQ(bytes, first) << "a deterministic call's output bits changed in run " << run;
      }
    }
  }
  int sm_count = 0;
  ATTNKIT_CUDA_OK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, 0));
  ASSERT_LT(sm_count, 200) << "this GPU's SMs hold the 200-CTA grid in one CTA each";
  DecodeCase c = gqa4_case({8192, 3000}, 100);
  c.deterministic = false;
  run_both_workspaces(c, 3999, ws.get());
  expect_counters_zero(*ws);
}

// Splits whose means are far from the row's: V shifted by +0.5 over the first half of each row's
// keys and by -0.5 over the rest, so that a split's output is ~+-0.5 while the row's is ~0 and the
// error of any rounding of the partials, relative to the splits' means, dwarfs the naive
// computation's (a host model of the kernel at offset 0.5: bf16 partials broke the bound in 999 of
// 1000 seeds, f32 partials reached at most 0.81 of it). Both merges, bf16 and f16 queries, forced
// and heuristic counts, both workspaces.
TEST(DecodeSplit, SplitMeansFarFromTheRowsMean) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  auto ws = make_workspace(8, 2);
  uint64_t salt = 3650;
  with_each_merge_forced([&] {
    for (DType dtype : {DType::kBF16, DType::kF16}) {
      for (int32_t splits : {5, 16, 0}) {
        DecodeCase c = gqa4_case({2049, 700}, splits);
        c.dtype = c.kv_dtype = dtype;
        c.v_half_offset = 0.5f;
        // Outputs near 1000 (within f16's range), so that the bound's 1e-3 is negligible beside
        // the errors (with outputs near 1 it covered them: the 16-bit partials passed).
        c.v_scale_base = 1000.0f;
        run_both_workspaces(c, salt++, ws.get());
      }
    }
  });
}

// The split merge in a kernel of its own (decode_merge.cu) and inside the decode kernel, each
// forced on every shape below whichever the rule would take: head_dim 64 / 80 / 96 / 128 / 256 (8
// to 32 vectors a head; 10 and 12 leave lanes of the merge's warp idle), groups of 1 / 4 / 16 / 32
// heads, bf16 and f16, forced counts with empty splits (a 1-key row next to 1500 keys) and the
// heuristic, through both workspaces. Three rows take four warps a (row, head) in the separate
// merge from 97 SMs up, 40 rows (160-1280 (row, head) pairs) one warp up to 160 SMs, and the
// head_dim 256 cases have more splits than one batch of a lane's loads. Then the rule's own
// choice in a captured graph replayed with the outputs poisoned (MQA: its 32-head items merge
// apart; GQA 4 heads: in the kernel). ATTNKIT_TEST_SCALE=small: the 1500-key row of the shape
// loop has 700 (11 tiles of 64 keys: 40 splits still leave splits empty).
TEST(DecodeSplit, SeparateAndInKernelMergeOfEveryShape) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  auto ws = make_workspace(32, 40);
  uint64_t salt = 3700;
  with_each_merge_forced([&] {
    for (const HeadShape& s :
         {HeadShape{2, 2, 80, DType::kBF16}, HeadShape{8, 2, 96, DType::kF16},
          HeadShape{8, 2, 64, DType::kBF16}, HeadShape{8, 2, 128, DType::kF16},
          HeadShape{16, 1, 128, DType::kBF16}, HeadShape{32, 1, 128, DType::kBF16},
          HeadShape{4, 1, 256, DType::kF16}}) {
      for (int32_t splits : {2, 9, 40, 0}) {
        run_both_workspaces(shaped_case(s, 32, {at_test_scale(1500, 700), 1, 333}, splits), salt++,
                            ws.get());
      }
    }
    // Rows enough for one warp a (row, head), and splits beyond one batch of a lane's loads (8):
    // head_dim 256 (one lane group a warp) over 9-19 splits with one warp, over 40 with four.
    struct ManyRows {
      HeadShape shape;
      int32_t rows, max_len;
      std::vector<int32_t> splits;
    };
    for (const ManyRows& m : {ManyRows{HeadShape{32, 1, 128, DType::kBF16}, 40, 600, {3, 17}},
                              ManyRows{HeadShape{32, 4, 96, DType::kF16}, 40, 200, {3}},
                              ManyRows{HeadShape{4, 1, 256, DType::kF16}, 40, 1200, {17, 40}},
                              ManyRows{HeadShape{2, 1, 256, DType::kBF16}, 1, 4000, {40, 0}}}) {
      std::vector<int32_t> seq_lens;
      for (int32_t r = 0; r < m.rows; ++r) {
        seq_lens.push_back(m.rows == 1 ? m.max_len : 1 + (r * 97) % m.max_len);
      }
      for (int32_t splits : m.splits) {
        run_both_workspaces(shaped_case(m.shape, 16, seq_lens, splits), salt++, ws.get());
      }
    }
  });
  std::vector<std::unique_ptr<PreparedCase>> prepared;
  for (int32_t hkv : {1, 2}) {
    for (int32_t splits : {0, 5}) {
      for (bool caller : {true, false}) {
        DecodeCase c = gqa4_case({2100, 900}, splits, hkv);
        if (hkv == 1) {
          // MQA 32/1 over 10 rows: two M blocks a CTA (rows x KV heads >= SMs / 16 up to 160
          // SMs), 32-head items that the rule merges apart.
          c.hq = 32;
          c.seq_lens = {700, 300, 1, 65, 129, 1000, 64, 33, 500, 257};
        }
        prepared.push_back(std::make_unique<PreparedCase>(c, salt++));
        if (caller) prepared.back()->args.workspace = ws.get();
      }
    }
  }
  capture_and_replay(prepared, *ws);
}

}  // namespace
}  // namespace attnkit::test
