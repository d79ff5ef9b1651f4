// Fused GQA decode (src/cuda/decode) against an fp64 oracle written here: every head_dim, page
// size, GQA ratio, KV dtype (fp8 / int8 against the same quantization), split-KV forced and
// chosen by the heuristic, sliding window + sinks over a cyclic cache, ALiBi, soft-cap, beams,
// cross attention, split calls in flight on two streams and inside a CUDA graph, 8-bit caches on
// wide and narrow grids. Outputs and unused cache slots are poisoned with NaN so that unwritten
// outputs and out-of-range reads fail. Tolerance (docs/testing.md): max |out - ref64| <=
// 2 * max |naive_same_precision - ref64| + 1e-3.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "attnkit/attention.h"
#include "common/test_util.h"
#include "core/check.h"
#include "core/numerics.h"
#include "cuda/decode/decode_launch.h"
#include "gpu/decode_case_util.h"
#include "gpu/gpu_util.h"

namespace attnkit::test {
namespace {

TEST(DecodeFused, PagedEveryHeadDimPageSizeAndGroup) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed());
  const int dims[] = {64, 80, 96, 128, 256};
  const int pages[] = {8, 16, 32, 64, 128};
  const int groups[] = {1, 2, 4, 8, 16};
  uint64_t salt = 1;
  for (int i = 0; i < 5; ++i) {
    for (int j = 0; j < 5; ++j) {
      DecodeCase c;
      c.head_dim = dims[i];
      c.page = pages[j];
      c.hkv = 2;
      c.hq = c.hkv * groups[(i + j) % 5];
      c.dtype = c.kv_dtype = (i + j) % 2 ? DType::kF16 : DType::kBF16;
      c.seq_lens = lengths(rng, 5, c.page, 300);
      for (int splits : {1, 0}) {
        c.num_splits = splits;
        run_case_layouts(c, salt++);
      }
    }
  }
}

// An NHD cache gives the HND cache's output and LSE bit for bit (the same keys land in shared
// memory in the same order; only the copies' source addresses differ): every tile configuration
// (keys as rows with swizzled halves, 16 heads, two M blocks, the 8-bit 128-key tiles of two page
// runs and their 4-CTA kernel, head_dim 80's 10-chunk rows and 256's), contiguous, cyclic and beam
// caches, the warpgroup-MMA kernel on sm_90, with forced splits so that both take one kernel.
TEST(DecodeFused, NhdCacheGivesTheHndResultBitForBit) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::vector<DecodeCase> cases;
  auto add = [&](auto edit) {
    DecodeCase c;
    c.seq_lens = {1, 16, 17, 300, 1000};
    edit(c);
    cases.push_back(c);
  };
  add([](DecodeCase& c) { c.hq = 8, c.hkv = 2; });   // keys as rows, swizzled halves
  add([](DecodeCase& c) { c.hq = 32, c.hkv = 2; });  // 16 heads a group
  add([](DecodeCase& c) { c.hq = 32, c.hkv = 1; });  // two M blocks (or wgmma on sm_90)
  add([](DecodeCase& c) { c.hq = 64, c.hkv = 2, c.seq_lens.resize(12, 257); });  // wgmma grid
  add([](DecodeCase& c) { c.kv_dtype = DType::kFp8E4M3, c.page = 16; });         // two page runs
  add([](DecodeCase& c) { c.kv_dtype = DType::kInt8, c.seq_lens.resize(280, 500); });  // 4 CTAs
  add([](DecodeCase& c) { c.head_dim = 80, c.dtype = c.kv_dtype = DType::kF16; });
  add([](DecodeCase& c) { c.head_dim = 256, c.page = 64; });
  add([](DecodeCase& c) { c.head_dim = 96, c.kv_dtype = DType::kFp8E4M3; });
  add([](DecodeCase& c) { c.paged = false; });
  add([](DecodeCase& c) {
    c.cyclic = true;
    c.mask = {MaskKind::kSlidingWindow, 100, 4};
  });
  add([](DecodeCase& c) {
    c.beam_width = 2;
    c.seq_lens = {37, 37, 290, 290};
  });
  add([](DecodeCase& c) { c.alibi = true, c.softcap = 10.0, c.per_head_scale = true; });
  uint64_t salt = 9000;
  for (DecodeCase c : cases) {
    for (int splits : {1, 3}) {
      c.num_splits = splits;
      std::vector<std::unique_ptr<PreparedCase>> runs;
      for (KvCacheLayout layout : kBothLayouts) {
        c.layout = layout;
        runs.push_back(std::make_unique<PreparedCase>(c, salt));
      }
      ++salt;
      SCOPED_TRACE(c.str());
      std::vector<HostTensor> outs, lses;
      for (auto& run : runs) {
        ASSERT_NO_THROW(decode(run->spec, run->args, nullptr));
        ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
        run->check();
        outs.push_back(run->out);
        lses.push_back(run->lse);
        run->d_out.download(outs.back());
        run->d_lse.download(lses.back());
      }
      EXPECT_TRUE(outs[0].bytes() == outs[1].bytes()) << "out differs between HND and NHD";
      EXPECT_TRUE(lses[0].bytes() == lses[1].bytes()) << "lse differs between HND and NHD";
    }
  }
}

TEST(DecodeFused, ContiguousCache) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  DecodeCase c;
  c.paged = false;
  c.seq_lens = {1, 200, 77};
  for (int splits : {1, 3, 0}) {
    c.num_splits = splits;
    run_case_layouts(c, 100 + splits);
  }
}

TEST(DecodeFused, SplitKvForcedAndHeuristic) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  DecodeCase c;
  c.hq = 16;
  c.hkv = 2;
  c.page = 32;
  c.seq_lens = {3000, 1, 1777, 64};
  uint64_t salt = 200;
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    c.dtype = c.kv_dtype = dtype;
    for (int splits : {1, 2, 7, 40, 0}) {
      c.num_splits = splits;
      run_case_layouts(c, salt++);
    }
  }
}

TEST(DecodeFused, ManySplitsMostlyEmptyAndAlibiMqa) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  // 128 splits (the limit) over a few tiles: most splits are empty and the last CTA to arrive
  // (often an empty one) merges; then MQA with ALiBi and soft-cap through two M blocks.
  DecodeCase c;
  c.hq = 8;
  c.hkv = 2;
  c.seq_lens = {1, 65, 300, 2049};
  c.num_splits = 128;
  run_case(c, 250);
  c.dtype = c.kv_dtype = DType::kF16;
  c.num_splits = 200;  // clamped to the limit
  run_case(c, 251);
  DecodeCase mqa;
  mqa.hq = 32;
  mqa.hkv = 1;
  mqa.alibi = true;
  mqa.softcap = 5.0;
  mqa.q_range = 4.0f;
  mqa.seq_lens = {7, 700};
  for (int splits : {1, 3}) {
    mqa.num_splits = splits;
    run_case(mqa, 260 + splits);
  }
  mqa.kv_dtype = DType::kFp8E4M3;
  mqa.alibi = false;
  mqa.softcap = 0.0;
  mqa.q_range = 1.0f;
  mqa.num_splits = 4;
  run_case(mqa, 270);
}

// The last CTA stages every split's partials in shared memory at once when they fit (head_dim
// 128 bf16: 54 splits of 4 heads, 27 of 8), else in chunks of half that, double-buffered: split
// counts on both sides of the limit, 8-bit caches too (their kernels have other pipeline sizes),
// and 128 splits (many empty splits, one or many chunks). The longest row fills all 55 splits of
// one tile each (64 keys; 8-bit: 128).
TEST(DecodeFused, SplitMergeStagingBoundaries) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  uint64_t salt = 1500;
  for (DType kv : {DType::kBF16, DType::kFp8E4M3}) {
    for (int32_t hq : {8, 16}) {  // groups of 4 and 8 heads
      DecodeCase c;
      c.kv_dtype = kv;
      c.hq = hq;
      c.hkv = 2;
      c.page = 32;
      c.seq_lens = {1, 700, kv == DType::kBF16 ? 3500 : 7000};
      const std::vector<int32_t> splits =
          hq == 8 ? std::vector<int32_t>{53, 54, 55, 128} : std::vector<int32_t>{26, 27, 28, 128};
      for (int32_t s : splits) {
        c.num_splits = s;
        run_case(c, salt++);
      }
    }
  }
}

// Host logic only (no device call): runs without a GPU, so CI checks the split rules too.
TEST(DecodeSplitHeuristic, SplitsWhenCtasLeaveSmsIdle) {
  // batch 1 x 8 KV heads on 132 SMs with 2 CTAs each: many splits; batch 64: none.
  EXPECT_GT(cuda::decode_num_splits(8, 2, 132, 32768, 64), 16);
  EXPECT_EQ(cuda::decode_num_splits(512, 2, 132, 4096, 64), 1);
  // No split is left without a tile: 512 tiles over s splits of ceil(512 / s) tiles each.
  for (int64_t ctas : {1, 3, 8, 40}) {
    const int s = cuda::decode_num_splits(ctas, 2, 132, 32768, 64);
    const int tiles_per_split = (512 + s - 1) / s;
    EXPECT_EQ((512 + tiles_per_split - 1) / tiles_per_split, s) << "ctas=" << ctas;
  }
  // Short contexts cap the splits (at least four tiles each).
  EXPECT_EQ(cuda::decode_num_splits(8, 2, 132, 256, 64), 1);
  // Short splits keep two CTAs per SM (batch 1 x 8 KV heads: 32 splits at 8k, 16k and 32k keys;
  // 8-bit caches' 128-key tiles alike, capped at four tiles a split: 16 at 8k), batch 2: 16.
  EXPECT_EQ(cuda::decode_num_splits(8, 2, 132, 8192, 64), 32);
  EXPECT_EQ(cuda::decode_num_splits(8, 2, 132, 16384, 64), 32);
  EXPECT_EQ(cuda::decode_num_splits(8, 2, 132, 32768, 64), 32);
  EXPECT_EQ(cuda::decode_num_splits(8, 2, 132, 8192, 128), 16);
  EXPECT_EQ(cuda::decode_num_splits(8, 2, 132, 16384, 128), 32);
  EXPECT_EQ(cuda::decode_num_splits(8, 2, 132, 32768, 128), 32);
  EXPECT_EQ(cuda::decode_num_splits(16, 2, 132, 8192, 64), 16);
  EXPECT_EQ(cuda::decode_num_splits(16, 2, 132, 32768, 64), 16);
  // Kernels of one CTA per SM keep the fill rule.
  EXPECT_EQ(cuda::decode_num_splits(8, 1, 132, 8192, 64), 16);
  // The two-M-block kernel takes no split from one CTA per SM on 95% of the SMs (126 of 132), or
  // on 78% (103) when its CTAs read at most 4096 keys.
  EXPECT_TRUE(cuda::decode_two_m_block_covers_sms(128, 132, 32768));
  EXPECT_TRUE(cuda::decode_two_m_block_covers_sms(126, 132, 8192));
  EXPECT_FALSE(cuda::decode_two_m_block_covers_sms(125, 132, 8192));
  EXPECT_FALSE(cuda::decode_two_m_block_covers_sms(112, 132, 4097));
  EXPECT_TRUE(cuda::decode_two_m_block_covers_sms(112, 132, 4096));
  EXPECT_TRUE(cuda::decode_two_m_block_covers_sms(103, 132, 2048));
  EXPECT_FALSE(cuda::decode_two_m_block_covers_sms(102, 132, 2048));
  EXPECT_FALSE(cuda::decode_two_m_block_covers_sms(96, 132, 4096));
  // Its grids below that keep to one wave of 2 CTAs an SM: 96 CTAs take 2 splits (the fill rule:
  // 8, three waves), 48 take 5 (11) and 104 of 8k keys take 2 (the fill rule: 5); 64 take 4 as the
  // fill rule does, and 32 and 16 CTAs of short splits one CTA an SM (4 and 8) as well.
  EXPECT_EQ(cuda::decode_num_splits(96, 2, 132, 4096, 64), 8);
  EXPECT_EQ(cuda::decode_num_splits(96, 2, 132, 4096, 64, true), 2);
  EXPECT_EQ(cuda::decode_num_splits(48, 2, 132, 8192, 64), 11);
  EXPECT_EQ(cuda::decode_num_splits(48, 2, 132, 8192, 64, true), 5);
  EXPECT_EQ(cuda::decode_num_splits(104, 2, 132, 8192, 64), 5);
  EXPECT_EQ(cuda::decode_num_splits(104, 2, 132, 8192, 64, true), 2);
  EXPECT_EQ(cuda::decode_num_splits(64, 2, 132, 4096, 64, true), 4);
  EXPECT_EQ(cuda::decode_num_splits(32, 2, 132, 4096, 64, true), 4);
  EXPECT_EQ(cuda::decode_num_splits(16, 2, 132, 8192, 64, true), 8);
}

TEST(DecodeKernelChoiceRule, GroupsBeyondSixteenHeads) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  EXPECT_EQ(cuda::decode_heads_per_cta(4, false, 1, 132), 8);
  EXPECT_EQ(cuda::decode_heads_per_cta(12, true, 1000, 132), 16);
  // 16-bit caches: two M blocks once the grid has SMs / 16 CTAs (132: 9 rows x KV heads).
  EXPECT_EQ(cuda::decode_heads_per_cta(32, false, 64, 132), 32);
  EXPECT_EQ(cuda::decode_heads_per_cta(32, false, 9, 132), 32);
  EXPECT_EQ(cuda::decode_heads_per_cta(32, false, 8, 132), 8);
  EXPECT_EQ(cuda::decode_heads_per_cta(64, false, 1, 132), 8);
  // 8-bit caches: head blocks of 8 at every grid; their 32-head kernels are not built, and asking
  // for one raises rather than running another configuration.
  EXPECT_EQ(cuda::decode_heads_per_cta(32, true, 64, 132), 8);
  cuda::DecodeKernelChoice two_m_blocks;
  two_m_blocks.heads_per_cta = 32;
  const auto hnd = [&](DType q, DType kv) {
    return cuda::decode_kernel_info<128, false>(q, kv, two_m_blocks);
  };
  EXPECT_EQ(hnd(DType::kBF16, DType::kBF16).tile_n, 64);
  EXPECT_THROW(hnd(DType::kBF16, DType::kFp8E4M3), Error);
  EXPECT_THROW(hnd(DType::kF16, DType::kInt8), Error);
  // The NHD kernels (DecodeNhdTraits) have the same tiles and the same missing configurations.
  const auto nhd = [&](DType q, DType kv) {
    return cuda::decode_kernel_info<128, true>(q, kv, two_m_blocks);
  };
  EXPECT_EQ(nhd(DType::kBF16, DType::kBF16).tile_n, 64);
  EXPECT_THROW(nhd(DType::kBF16, DType::kFp8E4M3), Error);
}

TEST(DecodeFused, QuantizedKvAgainstQuantizedReference) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() + 7);
  uint64_t salt = 300;
  for (DType kv : {DType::kFp8E4M3, DType::kInt8}) {
    for (DType q : {DType::kBF16, DType::kF16}) {
      for (bool per_head : {false, true}) {
        for (int dim : {64, 128, 256}) {
          DecodeCase c;
          c.kv_dtype = kv;
          c.dtype = q;
          c.per_head_scale = per_head;
          c.head_dim = dim;
          c.hq = 16;
          c.hkv = 4;
          c.page = 32;
          c.seq_lens = lengths(rng, 4, c.page, 700);
          c.num_splits = (salt % 2) ? 1 : 3;
          run_case_layouts(c, salt++);
        }
      }
    }
  }
}

TEST(DecodeFused, SlidingWindowSinksCyclicCache) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  uint64_t salt = 400;
  for (bool cyclic : {true, false}) {
    for (int sinks : {0, 4}) {
      DecodeCase c;
      c.mask.kind = MaskKind::kSlidingWindow;
      c.mask.window = 100;
      c.mask.sink_tokens = sinks;
      c.cyclic = cyclic;
      c.page = 16;
      c.seq_lens = {1, 50, 101, 104, 500, 1234};
      for (int splits : {1, 3, 0}) {
        c.num_splits = splits;
        run_case_layouts(c, salt++);
      }
    }
  }
}

TEST(DecodeFused, AlibiAndSoftcap) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  uint64_t salt = 500;
  for (int variant = 0; variant < 3; ++variant) {
    DecodeCase c;
    c.alibi = variant != 1;
    c.softcap = variant >= 1 ? 5.0 : 0.0;
    c.q_range = 4.0f;
    c.hq = 12;
    c.hkv = 3;
    c.seq_lens = {1, 90, 333};
    for (int splits : {1, 2}) {
      c.num_splits = splits;
      run_case_layouts(c, salt++);
    }
  }
}

TEST(DecodeFused, BeamSearchIndirection) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  DecodeCase c;
  c.beam_width = 3;
  c.seq_lens = {45, 45, 45, 130, 130, 130};
  for (int splits : {1, 2}) {
    c.num_splits = splits;
    run_case_layouts(c, 600 + splits);
  }
}

TEST(DecodeFused, CrossAttentionStaticEncoderCache) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  DecodeCase c;
  c.mask.kind = MaskKind::kNone;
  c.seq_lens = {77, 77, 1500};
  c.hq = 16;
  c.hkv = 16;
  for (int splits : {1, 0}) {
    c.num_splits = splits;
    run_case_layouts(c, 700 + splits);
  }
}

TEST(DecodeFused, MqaAndGroupsBeyondSixteenHeads) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  uint64_t salt = 800;
  // Groups beyond 16 heads (decode_heads_per_cta): with 12 rows (12 or 24 rows x KV heads, at
  // least SMs / 16 on GPUs of up to 192 SMs) two M blocks per CTA (K/V read once), or on sm_90
  // with sm_90a code the warpgroup-MMA kernel (decode_wgmma_plan); 64 heads two head blocks of 32;
  // 40 / 2 = 20 and 48 / 2 = 24 leave the second M block partly empty. With 3 rows, head blocks of
  // 8 heads on the keys-as-rows kernel (the last one partly empty for 20 heads). 12 heads a group:
  // one 16-row block either way.
  for (auto [hq, hkv] :
       {std::pair{32, 1}, std::pair{12, 2}, std::pair{40, 2}, std::pair{48, 2}, std::pair{64, 1}}) {
    for (bool large_grid : {false, true}) {
      DecodeCase c;
      c.hq = hq;
      c.hkv = hkv;
      c.seq_lens = {1, 200, 513};
      if (large_grid) c.seq_lens = {1, 200, 513, 64, 65, 1000, 33, 300, 7, 128, 129, 2};
      for (int splits : {1, 0, 5}) {
        c.num_splits = splits;
        run_case_layouts(c, salt++);
      }
    }
  }
}

// The Hopper warpgroup-MMA kernel (decode_wgmma.cu) on an H100 / H200: groups of 16-80 heads (80:
// head blocks of 64 and 16), every page size and a contiguous cache (each group with half of
// them), both 16-bit dtypes, V scales
// per head, split means far from the row's (the partials stay f32), forced and heuristic splits
// (its partials merged by decode_merge.cu), rows whose keys end inside a tile or a page; then its
// 3-CTA build (a grid whose splits keep >= 1024 keys). Every call must have run the build the rule
// names; calls out of its scope (ALiBi, a window, an 8-bit cache) must not run it. With the V
// descriptor's two byte offsets exchanged every case fails (0.54-1.97 against bounds of
// ~0.006-0.012). ATTNKIT_TEST_SCALE=small: six (group, page) pairs (every group, every page and
// the contiguous cache, both dtypes, per-head V scales and far split means among them) of rows
// up to 800 keys (7 splits still of more than a tile), the 40-row grid's other rows up to 300
// keys next to its 4500-key row (the build rule reads the grid and the longest row only), the
// out-of-scope rows up to 300.
TEST(DecodeFused, HopperWarpgroupKernelForLargeGroups) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  int major = 0;
  ATTNKIT_CUDA_OK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  if (major != 9 || !cuda::decode_wgmma_compiled()) {
    GTEST_SKIP() << "the warpgroup-MMA decode kernel runs on sm_90 builds with sm_90a code";
  }
  const auto launches = [] {
    return std::pair{cuda::decode_wgmma_launches(2), cuda::decode_wgmma_launches(3)};
  };
  std::mt19937_64 rng(test_seed());
  uint64_t salt = 5000;
  const std::pair<int, int> groups[] = {{32, 2}, {32, 1}, {40, 2}, {64, 1}, {80, 1}};
  const int pages[] = {8, 16, 32, 64, 128, 0};
  for (int g = 0; g < 5; ++g) {
    for (int pi = 0; pi < 6; ++pi) {
      // Half of the (group, page) pairs, every group and every page among them: the fp64 oracle
      // on the host is most of the test's time (~50 s on an H200 with all 30 pairs).
      if (small_test_scale() ? !(pi == g || (g == 1 && pi == 5)) : (g + pi) % 2 != 0) continue;
      DecodeCase c;
      c.hq = groups[g].first;
      c.hkv = groups[g].second;
      c.paged = pages[pi] != 0;
      c.page = c.paged ? pages[pi] : 16;
      c.dtype = c.kv_dtype = (g + pi / 2) % 2 ? DType::kF16 : DType::kBF16;
      c.per_head_scale = pi % 3 == 1;
      c.v_scale_base = pi % 3 == 1 ? 1.0f : 0.0f;
      c.v_half_offset = pi % 3 == 2 ? 0.5f : 0.0f;
      // 12 rows (and more KV heads): the grid has SMs / 16 CTAs, the kernel's rule; short rows
      // keep the 2-CTA build.
      c.seq_lens = lengths(rng, 12, c.page, at_test_scale(1500, 800));
      c.seq_lens[4] = 63;
      c.seq_lens[5] = 64;
      c.seq_lens[6] = 65;
      for (int splits : {1, 2, 7, 0}) {
        c.num_splits = splits;
        for (KvCacheLayout layout : kBothLayouts) {  // the HND and the NHD kernel, same contents
          c.layout = layout;
          const auto before = launches();
          run_case(c, salt);
          EXPECT_EQ(launches(), std::pair(before.first + 1, before.second)) << c.str();
        }
        ++salt;
      }
    }
  }
  // GQA 32/2 over 40 rows of up to 4500 keys (80 CTAs): the heuristic's 4 splits and 4 forced
  // splits keep >= 1024 keys and fill more than 2 CTAs an SM on 132 SMs: the 3-CTA build; 1 split
  // does not fill them: the 2-CTA build.
  DecodeCase wide;
  wide.hq = 32;
  wide.hkv = 2;
  wide.page = 32;
  wide.seq_lens = lengths(rng, 40, 32, at_test_scale(4500, 300));
  wide.seq_lens[7] = 4500;
  int sm_count = 0;
  ATTNKIT_CUDA_OK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, 0));
  for (int splits : {0, 4, 1}) {
    wide.num_splits = splits;
    const cuda::DecodeWgmmaPlan plan = cuda::decode_wgmma_plan(16, 80, 80, sm_count, 4500, splits);
    ASSERT_TRUE(plan.use);
    const auto before = launches();
    run_case_layouts(wide, salt++);
    const auto after = launches();
    EXPECT_EQ(after.first - before.first, plan.ctas_per_sm == 2 ? 2 : 0) << wide.str();
    EXPECT_EQ(after.second - before.second, plan.ctas_per_sm == 3 ? 2 : 0) << wide.str();
    if (sm_count == 132) EXPECT_EQ(plan.ctas_per_sm, splits == 1 ? 2 : 3) << splits;
  }
  DecodeCase outside;
  outside.hq = 32;
  outside.hkv = 1;
  outside.seq_lens = lengths(rng, 12, 16, at_test_scale(700, 300));
  outside.alibi = true;
  DecodeCase window = outside;
  window.alibi = false;
  window.mask.kind = MaskKind::kSlidingWindow;
  window.mask.window = 100;
  DecodeCase fp8 = outside;
  fp8.alibi = false;
  fp8.kv_dtype = DType::kFp8E4M3;
  for (const DecodeCase& c : {outside, window, fp8}) {
    const auto before = launches();
    run_case_layouts(c, salt++);
    EXPECT_EQ(launches(), before) << c.str();
  }
}

// Which grids take the warpgroup-MMA kernel and which build (H200, 132 SMs; the rows the rule was
// measured on): MQA 32/1 (pair_ctas = rows) and GQA 32/2 (group 16: ctas = rows x 2). Host logic
// only: runs without a GPU.
TEST(DecodeSplitHeuristic, WarpgroupKernelGridsAndBuilds) {  // host logic: runs without a GPU
  const auto plan = [](int group, int64_t ctas, int64_t pair_ctas, int64_t keys, int forced = 0) {
    const cuda::DecodeWgmmaPlan p =
        cuda::decode_wgmma_plan(group, ctas, pair_ctas, 132, keys, forced);
    return std::tuple{p.use, p.use ? p.ctas_per_sm : 0, p.use ? p.num_splits : 0};
  };
  EXPECT_EQ(plan(32, 64, 64, 4096), std::tuple(true, 2, 4));     // 64 x 4k: 3 CTAs: 683 keys
  EXPECT_EQ(plan(32, 96, 96, 4096), std::tuple(true, 3, 4));     // 96 x 4k
  EXPECT_EQ(plan(32, 48, 48, 8192), std::tuple(true, 3, 8));     // 48 x 8k
  EXPECT_EQ(plan(32, 16, 16, 8192), std::tuple(true, 2, 16));    // 16 x 8k
  EXPECT_EQ(plan(32, 32, 32, 32768), std::tuple(true, 3, 12));   // 32 x 32k
  EXPECT_EQ(plan(32, 256, 256, 2048), std::tuple(true, 3, 1));   // 256 x 2k
  EXPECT_EQ(plan(32, 128, 128, 8192), std::tuple(true, 3, 3));   // 128 x 8k
  EXPECT_EQ(plan(32, 128, 128, 2048), std::tuple(false, 0, 0));  // 128 x 2k: the pair kernel
  EXPECT_EQ(plan(32, 200, 200, 2048), std::tuple(false, 0, 0));  // 200 x 2k
  EXPECT_EQ(plan(32, 64, 128, 4096), std::tuple(false, 0, 0));   // GQA 64/2 64 x 4k
  EXPECT_EQ(plan(16, 128, 128, 4096), std::tuple(true, 3, 3));   // GQA 32/2 64 x 4k
  EXPECT_EQ(plan(16, 16, 16, 8192), std::tuple(true, 2, 16));    // GQA 32/2 8 x 8k
  // Forced counts: the 3-CTA build only where they fill more than 2 CTAs an SM.
  EXPECT_EQ(plan(32, 64, 64, 4096, 4), std::tuple(true, 2, 4));
  EXPECT_EQ(plan(32, 96, 96, 4096, 4), std::tuple(true, 3, 4));
  // Whole tiles: 128 tiles over at most 24 splits is 6 tiles each, 22 splits.
  EXPECT_EQ(cuda::decode_wgmma_num_splits(16, 3, 132, 8192), 22);
  EXPECT_EQ(cuda::decode_wgmma_num_splits(64, 2, 132, 4096), 4);
  EXPECT_EQ(cuda::decode_wgmma_num_splits(1, 2, 132, 300), 1);
}

// The three split calls that the multi-stream tests keep in flight together: GQA 32/8 bf16 with
// forced splits, f16 GQA 16/2 split by the heuristic (a batch this small), and MQA 32/1 (two
// rows: four head blocks of 8 heads a row) with forced splits.
struct StreamCases {
  DecodeCase gqa, f16, mqa;
};
StreamCases stream_cases() {
  StreamCases c;
  c.gqa.hq = 32;
  c.gqa.hkv = 8;
  c.gqa.page = 32;
  c.gqa.seq_lens = {1, 77, 1000, 4097};
  c.gqa.num_splits = 7;
  c.f16 = c.gqa;
  c.f16.hq = 16;
  c.f16.hkv = 2;
  c.f16.dtype = c.f16.kv_dtype = DType::kF16;
  c.f16.seq_lens = {3001, 33, 65};
  c.f16.num_splits = 0;
  c.mqa = c.gqa;
  c.mqa.hkv = 1;
  c.mqa.seq_lens = {2000, 999};
  c.mqa.num_splits = 13;
  return c;
}

// Split-KV calls in flight together on two streams, and one captured in a CUDA graph and replayed
// between eager calls: each call's workspace and arrival counters must be its own. Context
// lengths are not multiples of the 64-key tile nor of the page, so every split's last tile is
// partial. ATTNKIT_TEST_SCALE=small: two rounds of each (the second reuses what the first left).
TEST(DecodeFused, SplitKvAcrossStreamsAndInsideGraphs) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  const StreamCases c = stream_cases();
  PreparedCase pa(c.gqa, 900), pb(c.f16, 901), pm(c.mqa, 902);
  cudaStream_t s1 = nullptr, s2 = nullptr;
  ATTNKIT_CUDA_OK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  ATTNKIT_CUDA_OK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  const int rounds = at_test_scale(3, 2);
  for (int round = 0; round < rounds; ++round) {
    pa.poison(s1);
    pb.poison(s2);
    pm.poison(s2);
    ASSERT_NO_THROW(decode(pa.spec, pa.args, s1));
    ASSERT_NO_THROW(decode(pb.spec, pb.args, s2));
    ASSERT_NO_THROW(decode(pm.spec, pm.args, s2));
    ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
    pa.check();
    pb.check();
    pm.check();
  }
  // Capture case a on s1, then replay it while eager split calls run on both streams.
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ATTNKIT_CUDA_OK(cudaStreamBeginCapture(s1, cudaStreamCaptureModeGlobal));
  ASSERT_NO_THROW(decode(pa.spec, pa.args, s1));
  ATTNKIT_CUDA_OK(cudaStreamEndCapture(s1, &graph));
  ATTNKIT_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int round = 0; round < rounds; ++round) {
    ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
    pa.poison(s1);
    pb.poison(s2);
    pm.poison(s1);
    ATTNKIT_CUDA_OK(cudaGraphLaunch(exec, s1));
    ASSERT_NO_THROW(decode(pb.spec, pb.args, s2));
    ASSERT_NO_THROW(decode(pm.spec, pm.args, s1));
    ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
    pa.check();
    pb.check();
    pm.check();
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s1);
  cudaStreamDestroy(s2);
}

// A captured split call must zero its arrival counters at every replay (the memset is a node of
// the graph, not a one-time host action): a count left over from the previous replay would leave
// the merge undone and the poisoned outputs in place. Two calls captured back to back (heuristic
// and forced splits), a third (MQA, two M blocks) on a stream forked into the capture, replayed
// four times with poisoned outputs, then the same calls eagerly. ATTNKIT_TEST_SCALE=small: two
// replays (the second finds the counters the first left).
TEST(DecodeFused, SplitCountersZeroedAtEveryGraphReplay) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  DecodeCase a;
  a.hq = 32;
  a.hkv = 8;
  a.page = 32;
  a.seq_lens = {4097, 1, 900};
  a.num_splits = 0;  // the heuristic splits three rows of eight KV heads
  DecodeCase b = a;
  b.hq = 16;
  b.hkv = 2;
  b.dtype = b.kv_dtype = DType::kF16;
  b.seq_lens = {3000, 65};
  b.num_splits = 9;
  DecodeCase m = a;
  m.hkv = 1;
  m.seq_lens = {2000, 999};
  m.num_splits = 5;
  PreparedCase pa(a, 980), pb(b, 981), pm(m, 982);
  cudaStream_t s1 = nullptr, s2 = nullptr;
  ATTNKIT_CUDA_OK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  ATTNKIT_CUDA_OK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  cudaEvent_t fork = nullptr, join = nullptr;
  ATTNKIT_CUDA_OK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  ATTNKIT_CUDA_OK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ATTNKIT_CUDA_OK(cudaStreamBeginCapture(s1, cudaStreamCaptureModeGlobal));
  ASSERT_NO_THROW(decode(pa.spec, pa.args, s1));
  ASSERT_NO_THROW(decode(pb.spec, pb.args, s1));
  ATTNKIT_CUDA_OK(cudaEventRecord(fork, s1));
  ATTNKIT_CUDA_OK(cudaStreamWaitEvent(s2, fork));
  ASSERT_NO_THROW(decode(pm.spec, pm.args, s2));
  ATTNKIT_CUDA_OK(cudaEventRecord(join, s2));
  ATTNKIT_CUDA_OK(cudaStreamWaitEvent(s1, join));
  ATTNKIT_CUDA_OK(cudaStreamEndCapture(s1, &graph));
  ATTNKIT_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < at_test_scale(4, 2); ++replay) {
    SCOPED_TRACE(detail::concat("replay ", replay));
    pa.poison(s1);
    pb.poison(s1);
    pm.poison(s1);
    ATTNKIT_CUDA_OK(cudaGraphLaunch(exec, s1));
    ATTNKIT_CUDA_OK(cudaStreamSynchronize(s1));
    pa.check();
    pb.check();
    pm.check();
  }
  pa.poison(s2);
  pb.poison(s2);
  pm.poison(s2);
  ASSERT_NO_THROW(decode(pa.spec, pa.args, s2));
  ASSERT_NO_THROW(decode(pb.spec, pb.args, s2));
  ASSERT_NO_THROW(decode(pm.spec, pm.args, s2));
  ATTNKIT_CUDA_OK(cudaStreamSynchronize(s2));
  pa.check();
  pb.check();
  pm.check();
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaEventDestroy(fork);
  cudaEventDestroy(join);
  cudaStreamDestroy(s1);
  cudaStreamDestroy(s2);
}

// The split workspace comes from the stream's pool, whose memory holds whatever earlier users
// left (fill patterns here, and the partials and counters of the first of two back-to-back calls):
// every call must write all of its outputs itself and not depend on it. ATTNKIT_TEST_SCALE=small:
// the rows of 4000 and 2500 keys have 2000 and 1250 (64 and 128 splits still leave splits empty).
TEST(DecodeFused, SplitWorkspaceFromADirtyPool) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  DecodeCase c;
  c.hq = 32;
  c.hkv = 8;
  c.page = 16;
  c.seq_lens = at_test_scale<std::vector<int32_t>>({4000, 1, 2500, 100}, {2000, 1, 1250, 100});
  PreparedCase pc(c, 950);
  cudaStream_t stream = nullptr;
  ATTNKIT_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (int pattern : {0xFF, 0x01, 0x00, 0x5A}) {
    for (int splits : {2, 9, 64, 128}) {
      // Leave the pattern in the pool's free memory, then let the call allocate from it.
      void* filler = nullptr;
      ATTNKIT_CUDA_OK(cudaMallocAsync(&filler, size_t{8} << 20, stream));
      ATTNKIT_CUDA_OK(cudaMemsetAsync(filler, pattern, size_t{8} << 20, stream));
      ATTNKIT_CUDA_OK(cudaFreeAsync(filler, stream));
      pc.args.num_splits = splits;
      pc.c.num_splits = splits;
      pc.poison(stream);
      ASSERT_NO_THROW(decode(pc.spec, pc.args, stream));
      // Again, likely over the first call's workspace and counters: it must write every
      // output itself.
      pc.poison(stream);
      ASSERT_NO_THROW(decode(pc.spec, pc.args, stream));
      ATTNKIT_CUDA_OK(cudaStreamSynchronize(stream));
      SCOPED_TRACE(detail::concat("pattern=", pattern));
      pc.check();
    }
  }
  cudaStreamDestroy(stream);
}

// 8-bit caches at head_dim 128 with groups of up to 8 heads run a 4-CTA-per-SM kernel when the
// grid fills four CTAs per SM (64 rows x 8 KV heads on a 132-SM H200) and the 6-stage 2-CTA
// kernel otherwise (4 rows, unsplit or split): both against the quantized reference.
TEST(DecodeFused, QuantizedKvWideAndNarrowGrids) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() + 11);
  uint64_t salt = 960;
  for (DType kv : {DType::kFp8E4M3, DType::kInt8}) {
    for (int rows : {64, 4}) {
      DecodeCase c;
      c.kv_dtype = kv;
      c.hq = 32;
      c.hkv = 8;
      c.page = 32;
      c.seq_lens = lengths(rng, rows, c.page, rows == 64 ? 200 : 3000);
      for (int splits : {1, 0}) {
        c.num_splits = splits;
        run_case_layouts(c, salt++);
      }
    }
  }
}

// 8-bit caches at head_dim 128, plain logits: when the heuristic's split count for the 4-CTA
// kernel fills it with splits of at least 4k keys, the call takes that count and that kernel. 16
// rows x 8 KV heads with max_seq_len 16400 (a row capacity; the rows themselves are short, which
// keeps the reference cheap): 4 splits and 512 CTAs, where 2 CTAs per SM would take 2 splits. Pages
// 16 (two linear runs a warp) and 32, against the quantized reference.
TEST(DecodeFused, QuantizedKvWideSplitsOfTheFourCtaKernel) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() ^ 1650);
  uint64_t salt = 1650;
  for (DType kv : {DType::kFp8E4M3, DType::kInt8}) {
    DecodeCase c;
    c.kv_dtype = kv;
    c.hq = 8;
    c.hkv = 8;
    c.page = kv == DType::kFp8E4M3 ? 16 : 32;
    c.seq_lens = lengths(rng, 16, c.page, 1200);
    c.max_seq_len = 16400;
    c.num_splits = 0;
    run_case_layouts(c, salt++);
  }
}

// 8-bit caches at head_dim 128 with groups of up to 8 heads (128-key tiles, 32 keys a warp) at
// every page size: rows around the 64- and 128-key boundaries on a narrow grid (unsplit and 3
// splits; the 2-CTA kernel) and on a wide one (8 rows x 8 KV heads x 8 forced splits: the 4-CTA
// kernel, some splits empty); both query dtypes, per-tensor and per-head scales, against the
// quantized reference. (PipelineTileAndPageBoundaries covers the heuristic split count.)
TEST(DecodeFused, QuantizedKvHeadDim128EveryPageSize) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  uint64_t salt = 1600;
  for (DType kv : {DType::kFp8E4M3, DType::kInt8}) {
    for (int32_t page : {8, 16, 32, 64, 128}) {
      DecodeCase c;
      c.kv_dtype = kv;
      c.dtype = page % 32 == 0 ? DType::kBF16 : DType::kF16;
      c.per_head_scale = page >= 32;
      c.hq = 16;
      c.hkv = 2;
      c.page = page;
      c.seq_lens = {1, 63, 127, 128, 129, 257, 383};
      for (int splits : {1, 3}) {
        c.num_splits = splits;
        run_case_layouts(c, salt++);
      }
      c.hq = 8;
      c.hkv = 8;
      c.per_head_scale = !c.per_head_scale;
      c.seq_lens = {1, 127, 128, 129, 300, 513, 640, 1025};
      c.num_splits = 8;
      run_case_layouts(c, salt++);
    }
  }
}

// The 8-bit kernels at head_dim 128 (128-key tiles, 32 keys a warp in two 16-key blocks) with
// every feature that reads key positions or leaves the plain paged path: ALiBi + soft-cap,
// sliding window + sinks over a cyclic cache, beams through cache_indirection, a contiguous cache.
TEST(DecodeFused, QuantizedKvHeadDim128Features) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  uint64_t salt = 1700;
  for (DType kv : {DType::kFp8E4M3, DType::kInt8}) {
    for (int feature = 0; feature < 4; ++feature) {
      DecodeCase c;
      c.kv_dtype = kv;
      c.hq = 8;
      c.hkv = 2;
      c.page = 16;
      c.seq_lens = {1, 129, 300, 531};
      if (feature == 0) {
        c.alibi = true;
        c.softcap = 5.0;
        c.q_range = 4.0f;
      } else if (feature == 1) {
        c.mask.kind = MaskKind::kSlidingWindow;
        c.mask.window = 200;
        c.mask.sink_tokens = 4;
        c.cyclic = true;
      } else if (feature == 2) {
        c.beam_width = 2;
        c.seq_lens = {150, 150, 290, 290};
      } else {
        c.paged = false;
      }
      for (int splits : {1, 3}) {
        c.num_splits = splits;
        run_case_layouts(c, salt++);
      }
    }
  }
}

// The K/V pipeline (halves of a tile in flight, refilled per warp) at every boundary a ring of
// pipeline units can get wrong: lengths just below, at and above multiples of the 64-key tile
// and of the page, a single key, more tiles than pipeline units, and splits whose last tile is
// partial; 16-bit and 8-bit caches, groups of 8 and 4 heads (keys as rows), head_dim 64 / 128 /
// 256.
TEST(DecodeFused, PipelineTileAndPageBoundaries) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  uint64_t salt = 1200;
  const std::vector<int32_t> boundary_lens{1,   15,  16,  17,  63,  64,  65,   127, 128,
                                           129, 191, 193, 447, 448, 449, 1000, 1023};
  for (DType kv : {DType::kBF16, DType::kFp8E4M3, DType::kInt8}) {
    for (int head_dim : {128, 64, 256}) {
      if (kv != DType::kBF16 && head_dim != 128) continue;
      DecodeCase c;
      c.kv_dtype = kv;
      c.head_dim = head_dim;
      c.hkv = 2;
      c.hq = head_dim == 64 ? 8 : 16;  // groups of 4 and 8 heads
      c.page = head_dim == 256 ? 64 : (kv == DType::kBF16 ? 16 : 32);
      c.seq_lens = boundary_lens;
      for (int splits : {1, 2, 5, 0}) {
        c.num_splits = splits;
        run_case_layouts(c, salt++);
      }
    }
  }
}

// The kernel reads the block-table entries of its first tiles before seq_len arrives, at the
// split start of a row of max_seq_len keys: rows whose start matches use them (entries past the
// row's end hold -1 and must not be used), rows whose start differs read the table again, and a
// max_seq_len beyond the table's columns must not read past them. Then a wide grid of short rows
// (bf16 and f16, groups of 4 heads, heuristic and forced splits).
TEST(DecodeFused, EarlyRampSplitGuessesAndWideShortGrids) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  uint64_t salt = 1400;
  for (int32_t page : {16, 32, 64}) {
    DecodeCase c;
    c.hq = 16;
    c.hkv = 2;
    c.page = page;
    c.seq_lens = {1000, 999, 1000, 65, 1, 513, 64};
    for (int32_t max_seq : {0, 1000, 2047}) {
      for (int splits : {1, 3, 7, 0}) {
        c.max_seq_len = max_seq;
        c.num_splits = splits;
        run_case_layouts(c, salt++);
      }
    }
  }
  std::mt19937_64 rng(test_seed() ^ 1401);
  for (DType dtype : {DType::kBF16, DType::kF16}) {
    DecodeCase c;
    c.dtype = c.kv_dtype = dtype;
    c.hq = 32;
    c.hkv = 8;
    c.page = 32;
    c.seq_lens = lengths(rng, 64, c.page, 300);
    for (int splits : {0, 2}) {
      c.num_splits = splits;
      run_case_layouts(c, salt++);
    }
  }
}

// Calls of 32 or more splits resident in one wave (decode_prefetch_keys) prefetch their first
// tiles to L2 before griddepcontrol.wait, from the row's length and block-table entries read
// before the previous kernel (here the outputs' poison) has finished: the prefetch is a hint, so
// the results are the reference's whatever the entries hold. Rows shorter than the max_seq_len
// hint (the early ramp's guess points past them), table entries past the rows' ends that lie
// outside the pool, groups of 4 and 8 heads, bf16 and fp8 caches, pages 16 to 64.
// ATTNKIT_TEST_SCALE=small: rows of about half the keys (2049; 1537 and 2048), the same 32 forced
// splits of the same grids (the prefetch rule reads the splits and the grid, not the lengths).
TEST(DecodeFused, PrefetchBeforeTheWaitOfManySplitCalls) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  uint64_t salt = 1450;
  for (DType kv : {DType::kBF16, DType::kFp8E4M3}) {
    for (int32_t page : {16, 32, 64}) {
      DecodeCase c;
      c.kv_dtype = kv;
      c.hq = 32;
      c.page = page;
      c.unused_entry = page == 32 ? -1 : std::numeric_limits<int32_t>::max() - page;
      // One row x 8 KV heads x 32 splits, two rows x 4 KV heads x 32 splits: 256 CTAs.
      for (int32_t hkv : {8, 4}) {
        c.hkv = hkv;
        c.seq_lens = hkv == 8 ? std::vector<int32_t>{at_test_scale(4001, 2049)}
                              : at_test_scale<std::vector<int32_t>>({3001, 4096}, {1537, 2048});
        for (int32_t max_seq : {0, 8191}) {
          c.max_seq_len = max_seq;
          c.num_splits = 32;
          run_case_layouts(c, salt++);
        }
      }
    }
  }
}

// Reads a DecodeWorkspace's arrival counters back (after the caller synchronized) and expects
// them all zero: the merging CTA of every split call resets its own.
// Cases that change rows, heads (groups of 4 / 8 / 32, f16), lengths and forced split counts
// 2..128 between calls through one workspace.
std::vector<DecodeCase> workspace_cases(std::mt19937_64& rng) {
  std::vector<DecodeCase> cases;
  uint64_t i = 0;
  for (int splits : {2, 3, 5, 8, 13, 31, 32, 64, 127, 128, 0}) {
    DecodeCase c;
    switch (i++ % 4) {
      case 0:
        c.hq = 32, c.hkv = 8, c.page = 32;
        break;
      case 1:
        c.hq = 16, c.hkv = 2, c.dtype = c.kv_dtype = DType::kF16;
        break;
      case 2:
        c.hq = 32, c.hkv = 1, c.page = 64;  // MQA: two M blocks per CTA
        break;
      default:
        c.hq = 8, c.hkv = 8;
        break;
    }
    c.seq_lens = lengths(rng, 1 + static_cast<int>(i % 3), c.page, 3000);
    c.seq_lens.back() = 2049;  // a partial last tile; beyond 33 splits some splits are empty
    c.num_splits = splits;
    cases.push_back(c);
  }
  return cases;
}

// Many split calls through one caller-owned workspace on one stream (no memset between them):
// each call's output is right and the counters read back as zero after every call.
TEST(DecodeWorkspace, ManySplitCallsThroughOneWorkspaceEager) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() ^ 1500);
  AttentionSpec sizing;
  sizing.num_q_heads = 32;
  sizing.num_kv_heads = 1;
  sizing.head_dim = 128;
  DecodeWorkspace ws(sizing, 4, DecodeWorkspace::kMaxSplits, Device::cuda(0));
  expect_counters_zero(ws);
  cudaStream_t stream = nullptr;
  ATTNKIT_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  uint64_t salt = 1500;
  for (const DecodeCase& c : workspace_cases(rng)) {
    PreparedCase pc(c, salt++);
    pc.args.workspace = &ws;
    // Two calls back to back: the second finds the counters the first one reset.
    for (int call = 0; call < 2; ++call) {
      SCOPED_TRACE(detail::concat("call ", call));
      pc.poison(stream);
      ASSERT_NO_THROW(decode(pc.spec, pc.args, stream));
      ATTNKIT_CUDA_OK(cudaStreamSynchronize(stream));
      pc.check();
      expect_counters_zero(ws);
    }
  }
  cudaStreamDestroy(stream);
}

// Split calls through one workspace captured into a CUDA graph (forced and heuristic splits,
// changing shapes), replayed several times with poisoned outputs, with eager calls through the
// same workspace on the same stream between the replays. ATTNKIT_TEST_SCALE=small: two replays.
TEST(DecodeWorkspace, CapturedGraphReplaysThroughOneWorkspace) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test_seed() ^ 1600);
  std::vector<DecodeCase> cases = workspace_cases(rng);
  cases.erase(cases.begin(), cases.begin() + 5);  // splits 31, 32, 64, 127, 128 and heuristic
  std::vector<std::unique_ptr<PreparedCase>> prepared;
  AttentionSpec sizing;
  sizing.num_q_heads = 32;
  sizing.num_kv_heads = 1;
  sizing.head_dim = 128;
  DecodeWorkspace ws(sizing, 4, DecodeWorkspace::kMaxSplits, Device::cuda(0));
  uint64_t salt = 1600;
  for (const DecodeCase& c : cases) {
    prepared.push_back(std::make_unique<PreparedCase>(c, salt++));
    prepared.back()->args.workspace = &ws;
  }
  cudaStream_t stream = nullptr;
  ATTNKIT_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  capture_decode_calls(prepared, stream, &graph, &exec);
  if (HasFatalFailure()) return;
  for (int replay = 0; replay < at_test_scale(3, 2); ++replay) {
    SCOPED_TRACE(detail::concat("replay ", replay));
    replay_and_check(prepared, exec, stream);
    expect_counters_zero(ws);
    // An eager call through the same workspace between replays.
    PreparedCase& eager = *prepared[static_cast<size_t>(replay) % prepared.size()];
    eager.poison(stream);
    ASSERT_NO_THROW(decode(eager.spec, eager.args, stream));
    ATTNKIT_CUDA_OK(cudaStreamSynchronize(stream));
    eager.check();
    expect_counters_zero(ws);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// Two streams, one workspace each, split calls in flight on both at once.
// ATTNKIT_TEST_SCALE=small: three rounds (the third re-zeroes one workspace between calls).
TEST(DecodeWorkspace, TwoStreamsTwoWorkspaces) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  const StreamCases c = stream_cases();
  PreparedCase pa(c.gqa, 1700), pb(c.f16, 1701), pm(c.mqa, 1702);
  AttentionSpec sizing;
  sizing.num_q_heads = 32;
  sizing.num_kv_heads = 8;
  sizing.head_dim = 128;
  DecodeWorkspace ws1(sizing, 4, 64, Device::cuda(0)), ws2(sizing, 4, 64, Device::cuda(0));
  pa.args.workspace = &ws1;
  pm.args.workspace = &ws1;
  pb.args.workspace = &ws2;
  cudaStream_t s1 = nullptr, s2 = nullptr;
  ATTNKIT_CUDA_OK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  ATTNKIT_CUDA_OK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  for (int round = 0; round < at_test_scale(4, 3); ++round) {
    SCOPED_TRACE(detail::concat("round ", round));
    pa.poison(s1);
    pm.poison(s1);
    pb.poison(s2);
    if (round == 2) ws2.reset(s2);  // stream-ordered re-zeroing between calls changes nothing
    for (int i = 0; i < 3; ++i) {   // several calls queued on each stream
      ASSERT_NO_THROW(decode(pa.spec, pa.args, s1));
      ASSERT_NO_THROW(decode(pb.spec, pb.args, s2));
      ASSERT_NO_THROW(decode(pm.spec, pm.args, s1));
    }
    ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
    pa.check();
    pb.check();
    pm.check();
    expect_counters_zero(ws1);
    expect_counters_zero(ws2);
  }
  cudaStreamDestroy(s1);
  cudaStreamDestroy(s2);
}

// A workspace too small for the call (rows, or rows x splits), or on another device than the
// tensors, is rejected naming `workspace`, with the outputs and the counters untouched.
TEST(DecodeWorkspace, RejectsTooSmallOrForeignWorkspace) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  DecodeCase c;
  c.hq = 32;
  c.hkv = 8;
  c.page = 32;
  c.seq_lens = {4000, 100, 7};
  c.num_splits = 9;
  PreparedCase pc(c, 1800);
  AttentionSpec sizing;
  sizing.num_q_heads = 32;
  sizing.num_kv_heads = 8;
  sizing.head_dim = 128;
  AttentionSpec one_head = sizing;  // counters for 2 rows x 1 head: 2 < 3 rows x 8 KV heads
  one_head.num_q_heads = one_head.num_kv_heads = 1;
  DecodeWorkspace few_rows(one_head, 2, 128, Device::cuda(0));
  DecodeWorkspace few_splits(sizing, 3, 8, Device::cuda(0));
  // Sized for f32 partial outputs and LSEs: 3 rows x 8 splits x 32 heads x (128 + 1) words.
  EXPECT_EQ(few_splits.partial_capacity(), 3 * 8 * 32 * 129);
  auto expect_rejected = [&](const DecodeArgs& args, const AttentionSpec& spec,
                             const std::string& needle) {
    try {
      decode(spec, args, nullptr);
      ADD_FAILURE() << "accepted: " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("workspace"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  // Zeroed words: few_rows holds 2 rows x 1 head x (128 + 6) = 268, enough for this call's 24
  // counters (3 rows x 8 KV heads) but not for the accumulating merge's sums (3 rows x 32 heads x
  // 129 + 24 x 5 = 12504 words); its partials do not fit either.
  pc.args.workspace = &few_rows;
  {
    struct RestoreMergeRule {
      ~RestoreMergeRule() { cuda::set_decode_merge_mode(cuda::DecodeMergeMode::kAuto); }
    } restore;
    cuda::set_decode_merge_mode(cuda::DecodeMergeMode::kAccumulate);
    expect_rejected(pc.args, pc.spec, "12504 zeroed words");
  }
  expect_rejected(pc.args, pc.spec, "9 splits");
  pc.args.workspace = &few_splits;
  expect_rejected(pc.args, pc.spec, "9 splits");
  // CPU tensors (the reference backend) with a workspace on cuda:0.
  {
    HostTensor cpu_out(c.dtype, {3, c.hq, c.head_dim});
    cpu_out.fill(NAN);
    DecodeArgs cpu = pc.args;
    cpu.q = pc.q.view();
    cpu.out = cpu_out.view();
    cpu.lse = TensorView();
    KvCacheView& cache = cpu.kv_cache;
    cache.k_base = pc.h.pool.view().data;
    cache.v_base = static_cast<uint8_t*>(cache.k_base) + cache.block_stride_bytes / 2;
    cache.device = Device::cpu();
    cache.block_table = pc.h.block_table.view();
    cache.seq_lens = pc.h.seq_lens.view();
    cache.k_scale = pc.h.k_scale.view();
    cache.v_scale = pc.h.v_scale.view();
    cpu.workspace = &few_splits;
    AttentionSpec cpu_spec = pc.spec;
    cpu_spec.backend = Backend::kAuto;
    expect_rejected(cpu, cpu_spec, "must be on the device of q");
    for (double x : cpu_out.to_double())
      ASSERT_TRUE(std::isnan(x)) << "output written by a rejected call";
    cpu.workspace = nullptr;  // the same call without it runs (the arguments are valid)
    EXPECT_NO_THROW(decode(cpu_spec, cpu, nullptr));
  }
  ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
  HostTensor got(c.dtype, {3, c.hq, c.head_dim});
  pc.d_out.download(got);
  for (double x : got.to_double())
    ASSERT_TRUE(std::isnan(x)) << "output written by a rejected call";
  expect_counters_zero(few_rows);
  expect_counters_zero(few_splits);
  // The same call with 8 splits fits.
  pc.c.num_splits = pc.args.num_splits = 8;
  pc.poison(nullptr);
  ASSERT_NO_THROW(decode(pc.spec, pc.args, nullptr));
  ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
  pc.check();
  expect_counters_zero(few_splits);
}

TEST(DecodeFused, RejectsUnsupportedCallsBeforeLaunch) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  // head_dim 48 is valid for the reference but has no fused kernel: backend=fused raises and
  // leaves the output untouched.
  DecodeCase c;
  c.head_dim = 48;
  c.seq_lens = {10};
  std::mt19937_64 rng(test_seed());
  const HostCache h = build_cache(c, rng);
  HostTensor q(c.dtype, {1, c.hq, c.head_dim});
  q.fill_uniform(rng, -1, 1);
  HostTensor out(c.dtype, {1, c.hq, c.head_dim});
  out.fill(NAN);
  DeviceTensor d_q(q), d_out(out), d_pool(h.pool), d_table(h.block_table), d_lens(h.seq_lens);
  AttentionSpec spec;
  spec.num_q_heads = c.hq;
  spec.num_kv_heads = c.hkv;
  spec.head_dim = c.head_dim;
  spec.backend = Backend::kFused;
  DecodeArgs args;
  args.q = d_q;
  args.out = d_out;
  args.kv_cache = paged_cache_view(d_pool.data(), c.kv_dtype, h.num_blocks, c.hkv,
                                   h.tokens_per_block, c.head_dim);
  args.kv_cache.block_table = d_table;
  args.kv_cache.seq_lens = d_lens;
  try {
    decode(spec, args, nullptr);
    ADD_FAILURE() << "backend=fused with head_dim 48 did not raise";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("head_dim"), std::string::npos) << e.what();
  }
  ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
  d_out.download(out);
  EXPECT_TRUE(any_nan(out.to_double()));
  for (double x : out.to_double())
    ASSERT_TRUE(std::isnan(x)) << "output written by a rejected call";
}

}  // namespace
}  // namespace attnkit::test
