// How the fused decode is launched (src/cuda/decode/decode_launch.cu): which grids are
// programmatic dependents of the previous kernel on the stream (PDL, sm_90+).
#include "cuda/decode/decode_launch.h"

#include <gtest/gtest.h>

#include "gpu/gpu_util.h"

namespace attnkit::test {
namespace {

TEST(DecodeLaunch, ProgrammaticLaunchRule) {
  ATTNKIT_SKIP_WITHOUT_GPU();
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

}  // namespace
}  // namespace attnkit::test
