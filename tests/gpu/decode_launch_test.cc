// How the fused decode is launched (src/cuda/decode/decode_launch.cu): which grids are
// programmatic dependents of the previous kernel on the stream (PDL, sm_90+), which prefetch before
// their wait, which merge in a kernel of their own. Host logic only (no device call): these run
// without a GPU, so CI checks the rules too.
#include "cuda/decode/decode_launch.h"

#include <gtest/gtest.h>

namespace attnkit::test {
namespace {

TEST(DecodeLaunch, ProgrammaticLaunchRule) {
  // sm_90+: a grid resident at once with one or two splits is an ordinary launch (bf16 32 x 32k:
  // 256 CTAs in 264 slots; fp8 64 x 4k: 512 in 528; fp8 32 x 32k: 2 splits, 512 in 528).
  EXPECT_FALSE(cuda::decode_programmatic_launch(9, 1, 256, 264));
  EXPECT_FALSE(cuda::decode_programmatic_launch(9, 1, 512, 528));
  EXPECT_FALSE(cuda::decode_programmatic_launch(9, 2, 512, 528));
  EXPECT_FALSE(cuda::decode_programmatic_launch(10, 1, 8, 264));
  EXPECT_FALSE(cuda::decode_programmatic_launch(9, 1, 264, 264));
  // More than one wave, or more than two splits (the merge tail), is a programmatic one.
  EXPECT_TRUE(cuda::decode_programmatic_launch(9, 1, 265, 264));
  EXPECT_TRUE(cuda::decode_programmatic_launch(9, 1, 2048, 528));
  EXPECT_TRUE(cuda::decode_programmatic_launch(9, 2, 1024, 528));
  EXPECT_TRUE(cuda::decode_programmatic_launch(9, 3, 24, 264));
  EXPECT_TRUE(cuda::decode_programmatic_launch(9, 32, 256, 264));
  EXPECT_TRUE(cuda::decode_programmatic_launch(10, 16, 256, 264));
  // Before sm_90 there is no programmatic launch.
  EXPECT_FALSE(cuda::decode_programmatic_launch(8, 32, 256, 264));
  EXPECT_FALSE(cuda::decode_programmatic_launch(8, 1, 2048, 264));
}

// Which programmatic launches prefetch their first tiles to L2 before griddepcontrol.wait: grids
// resident in one wave, of the mma.sync kernels with 32 or more splits of groups of at most 8
// heads or of the wgmma kernel with groups of 32 or more heads; 32 KB of K and V a CTA.
TEST(DecodeLaunch, PrefetchBeforeTheWaitRule) {
  // bf16 / fp8 batch 1 x 32k at head_dim 128 (32 splits of 4 heads, 256 CTAs in 264 slots): 64 /
  // 128 keys; GQA 32/4 (64 splits of 8 heads); bf16 at head_dim 256.
  EXPECT_EQ(cuda::decode_prefetch_keys(false, 32, 256, 264, 4, 256), 64);
  EXPECT_EQ(cuda::decode_prefetch_keys(false, 32, 256, 264, 4, 128), 128);
  EXPECT_EQ(cuda::decode_prefetch_keys(false, 64, 256, 264, 8, 256), 64);
  EXPECT_EQ(cuda::decode_prefetch_keys(false, 128, 256, 264, 1, 512), 32);
  // Fewer splits (batch 1 x 8k / 16k, 2 x 32k), more than one wave, groups of 16 and 32: none.
  EXPECT_EQ(cuda::decode_prefetch_keys(false, 16, 128, 132, 4, 256), 0);
  EXPECT_EQ(cuda::decode_prefetch_keys(false, 31, 248, 264, 4, 256), 0);
  EXPECT_EQ(cuda::decode_prefetch_keys(false, 32, 265, 264, 4, 256), 0);
  EXPECT_EQ(cuda::decode_prefetch_keys(false, 128, 256, 264, 16, 256), 0);
  EXPECT_EQ(cuda::decode_prefetch_keys(false, 64, 256, 264, 32, 256), 0);
  // The wgmma kernel: MQA 32/1 64 x 4k (4 splits, 256 CTAs) and 64-head groups; not groups of
  // 16 (GQA 32/2) or grids of more than one wave.
  EXPECT_EQ(cuda::decode_prefetch_keys(true, 4, 256, 264, 32, 256), 64);
  EXPECT_EQ(cuda::decode_prefetch_keys(true, 3, 384, 396, 64, 256), 64);
  EXPECT_EQ(cuda::decode_prefetch_keys(true, 4, 256, 264, 16, 256), 0);
  EXPECT_EQ(cuda::decode_prefetch_keys(true, 4, 512, 264, 32, 256), 0);
}

// Which split calls merge in a kernel of their own: groups of 16 or more heads, or KV heads of
// more than 64 KB of f32 partials; the batch-1 target's (32 splits of 4 heads at head_dim 128:
// 64 KB) keep the in-kernel merge, and calls without splits never merge.
TEST(DecodeLaunch, SeparateMergeRule) {
  cuda::set_decode_merge_mode(cuda::DecodeMergeMode::kAuto);
  EXPECT_FALSE(cuda::decode_separate_merge(32, 4, 128));   // 64 KB: not more
  EXPECT_FALSE(cuda::decode_separate_merge(8, 8, 128));    // 32 KB
  EXPECT_FALSE(cuda::decode_separate_merge(16, 8, 128));   // 64 KB
  EXPECT_TRUE(cuda::decode_separate_merge(17, 8, 128));    // 68 KB
  EXPECT_TRUE(cuda::decode_separate_merge(33, 4, 128));    // 66 KB
  EXPECT_TRUE(cuda::decode_separate_merge(64, 8, 128));    // 256 KB
  EXPECT_TRUE(cuda::decode_separate_merge(2, 16, 128));    // 16 heads (GQA 32/2)
  EXPECT_TRUE(cuda::decode_separate_merge(4, 32, 128));    // MQA 32/1, any head block
  EXPECT_TRUE(cuda::decode_separate_merge(128, 16, 128));  // GQA 32/2 1 x 32k
  EXPECT_FALSE(cuda::decode_separate_merge(1, 32, 256));
  EXPECT_FALSE(cuda::decode_separate_merge(64, 1, 256));  // 64 KB
  EXPECT_TRUE(cuda::decode_separate_merge(128, 1, 256));  // 128 KB
  // The tests' overrides.
  cuda::set_decode_merge_mode(cuda::DecodeMergeMode::kSeparate);
  EXPECT_TRUE(cuda::decode_separate_merge(2, 4, 128));
  EXPECT_FALSE(cuda::decode_separate_merge(1, 4, 128));
  cuda::set_decode_merge_mode(cuda::DecodeMergeMode::kInKernel);
  EXPECT_FALSE(cuda::decode_separate_merge(128, 32, 256));
  cuda::set_decode_merge_mode(cuda::DecodeMergeMode::kAuto);
  // Four warps a (row, head) for fewer pairs than SMs: MQA 32/1 1 x 32k's 32 pairs on 132 SMs;
  // one warp for 16 x 8k's 512 and 64 x 4k's 2048.
  EXPECT_EQ(cuda::decode_merge_warps_per_item(32, 132), 4);
  EXPECT_EQ(cuda::decode_merge_warps_per_item(131, 132), 4);
  EXPECT_EQ(cuda::decode_merge_warps_per_item(132, 132), 1);
  EXPECT_EQ(cuda::decode_merge_warps_per_item(512, 132), 1);
  EXPECT_EQ(cuda::decode_merge_warps_per_item(2048, 132), 1);
}

// Which split calls accumulate their outputs in L2 (decode_accumulate_merge): only calls that
// allow run-to-run variation (deterministic = false), on sm_90+, on the mma.sync kernels of up to
// 16 heads a CTA, where the merge stays in the kernel, on grids of more CTAs than SMs (1 x 32k: 8
// KV heads x 32 splits = 256 CTAs on 132 SMs; a grid of one CTA an SM, 16 splits of 8, does not).
TEST(DecodeLaunch, AccumulateMergeRule) {
  struct RestoreMergeRule {
    ~RestoreMergeRule() { cuda::set_decode_merge_mode(cuda::DecodeMergeMode::kAuto); }
  } restore;
  cuda::set_decode_merge_mode(cuda::DecodeMergeMode::kAuto);
  // (deterministic, compute major, splits, group, head_dim, heads a CTA, other kernel, grid CTAs,
  // SMs)
  EXPECT_TRUE(cuda::decode_accumulate_merge(false, 9, 32, 4, 128, 8, false, 256, 132));
  EXPECT_FALSE(cuda::decode_accumulate_merge(true, 9, 32, 4, 128, 8, false, 256, 132));
  EXPECT_FALSE(cuda::decode_accumulate_merge(false, 8, 32, 4, 128, 8, false, 256, 108));
  EXPECT_FALSE(cuda::decode_accumulate_merge(false, 9, 16, 4, 128, 8, false, 128, 132));
  EXPECT_FALSE(cuda::decode_accumulate_merge(false, 9, 1, 4, 128, 8, false, 264, 132));
  EXPECT_FALSE(cuda::decode_accumulate_merge(false, 9, 32, 4, 128, 8, true, 256, 132));
  EXPECT_FALSE(cuda::decode_accumulate_merge(false, 9, 4, 32, 128, 32, false, 256, 132));
  // Where the rule merges in a kernel of its own: groups of 16, more than 64 KB of partials.
  EXPECT_FALSE(cuda::decode_accumulate_merge(false, 9, 16, 16, 128, 16, false, 256, 132));
  EXPECT_FALSE(cuda::decode_accumulate_merge(false, 9, 33, 4, 128, 8, false, 264, 132));
  EXPECT_TRUE(cuda::decode_accumulate_merge(false, 9, 16, 8, 128, 8, false, 512, 132));
  // The tests' overrides: kAccumulate wherever the kernel can, the others never.
  cuda::set_decode_merge_mode(cuda::DecodeMergeMode::kAccumulate);
  EXPECT_TRUE(cuda::decode_accumulate_merge(true, 9, 2, 16, 128, 16, false, 4, 132));
  EXPECT_TRUE(cuda::decode_accumulate_merge(true, 8, 2, 4, 128, 8, false, 4, 108));
  EXPECT_FALSE(cuda::decode_accumulate_merge(true, 9, 2, 32, 128, 32, false, 4, 132));
  EXPECT_FALSE(cuda::decode_accumulate_merge(false, 9, 2, 4, 128, 8, true, 512, 132));
  EXPECT_FALSE(cuda::decode_accumulate_merge(false, 9, 1, 4, 128, 8, false, 512, 132));
  EXPECT_FALSE(cuda::decode_separate_merge(128, 32, 256));
  for (cuda::DecodeMergeMode mode :
       {cuda::DecodeMergeMode::kInKernel, cuda::DecodeMergeMode::kSeparate}) {
    cuda::set_decode_merge_mode(mode);
    EXPECT_FALSE(cuda::decode_accumulate_merge(false, 9, 32, 4, 128, 8, false, 256, 132));
  }
}

}  // namespace
}  // namespace attnkit::test
