// Fused decode launched as a programmatic dependent (PDL, sm_90+) of a kernel that rewrites the
// row's length and block table while the decode's CTAs are already resident. Those CTAs read both
// before griddepcontrol.wait to aim their L2 prefetch (decode_prefetch_before_wait); what they
// attend over must be what the previous kernel wrote, so no value read before the wait may be
// used after it.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "cuda/decode/decode_launch.h"
#include "gpu/decode_case_util.h"
#include "gpu/gpu_util.h"

namespace attnkit::test {
namespace {

// Lets the next kernel on the stream launch at once, sleeps, then copies the final block table
// and lengths over the stale ones: a programmatic dependent's CTAs read the stale values before
// griddepcontrol.wait and the final ones after it.
__global__ void rewrite_table_after_sleep(int32_t* table, const int32_t* final_table,
                                          int64_t entries, int32_t* lens, const int32_t* final_lens,
                                          int32_t rows, uint64_t sleep_ns) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
  uint64_t start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(start));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(now));
  } while (now - start < sleep_ns);
  for (int64_t i = threadIdx.x; i < entries; i += blockDim.x) table[i] = final_table[i];
  for (int32_t i = threadIdx.x; i < rows; i += blockDim.x) lens[i] = final_lens[i];
}

enum class Stale { kSame, kOtherBlocks, kOutsideThePool, kShorterRow, kOneKeyLonger };

const char* stale_name(Stale s) {
  switch (s) {
    case Stale::kSame:
      return "same values";
    case Stale::kOtherBlocks:
      return "other blocks";
    case Stale::kOutsideThePool:
      return "entries outside the pool";
    case Stale::kShorterRow:
      return "a shorter row";
    default:
      return "one key longer";
  }
}

// One row x 8 KV heads x 32 splits (256 CTAs, one resident wave): a programmatic launch that
// prefetches (decode_prefetch_keys; decode_prefetching_launches counts it). The stale table points
// at other blocks (some of them the pool's NaN-poisoned spares) or at ids outside the pool
// (negative and past its end), or the stale length moves the splits' ranges or only the last
// key: attending over any of them is wrong. The oracle is the final table's. Against a build whose
// prologue issued its first copies from the values read before the wait, with their check after it
// switched off, every stale case fails. ATTNKIT_TEST_SCALE=small: a row of 2049 keys (the same
// grid of 32 splits; the shorter stale row still 1000 keys short).
TEST(DecodeFused, ProgrammaticLaunchSeesTheTableThePreviousKernelWrote) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  int major = 0;
  ATTNKIT_CUDA_OK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  if (major < 9) GTEST_SKIP() << "programmatic dependent launch needs sm_90";
  cudaStream_t stream = nullptr;
  ATTNKIT_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // A caller workspace: a per-call one puts its allocation and memset between the two kernels, and
  // the decode would then depend on the memset, which waits for the writer to end.
  AttentionSpec sizing;
  sizing.num_q_heads = 32;
  sizing.num_kv_heads = 8;
  sizing.head_dim = 128;
  DecodeWorkspace ws(sizing, 1, 32, Device::cuda(0));
  uint64_t salt = 7100;
  // HND and NHD caches (an NHD CTA prefetches its share of the run's rows of every KV head).
  for (KvCacheLayout layout : kBothLayouts)
    for (DType kv : {DType::kBF16, DType::kFp8E4M3}) {
      for (int32_t page : {16, 32}) {
        for (Stale stale : {Stale::kSame, Stale::kOtherBlocks, Stale::kOutsideThePool,
                            Stale::kShorterRow, Stale::kOneKeyLonger}) {
          SCOPED_TRACE(std::string("stale: ") + stale_name(stale));
          DecodeCase c;
          c.layout = layout;
          c.kv_dtype = kv;
          c.hq = 32;
          c.hkv = 8;
          c.page = page;
          c.seq_lens = {at_test_scale(4001, 2049)};
          c.num_splits = 32;
          PreparedCase pc(c, salt++);
          pc.args.workspace = &ws;
          HostTensor stale_table = pc.h.block_table;
          HostTensor stale_lens = pc.h.seq_lens;
          const int64_t entries = stale_table.numel();
          int32_t* t = stale_table.data<int32_t>();
          for (int64_t i = 0; i < entries; ++i) {
            if (stale == Stale::kOtherBlocks) t[i] = (t[i] + 1) % pc.h.num_blocks;
            if (stale == Stale::kOutsideThePool) {
              t[i] = i % 2 == 0 ? -1 - static_cast<int32_t>(i)
                                : std::numeric_limits<int32_t>::max() - static_cast<int32_t>(i);
            }
          }
          if (stale == Stale::kShorterRow) stale_lens.data<int32_t>()[0] -= 1000;
          if (stale == Stale::kOneKeyLonger) stale_lens.data<int32_t>()[0] += 1;
          DeviceTensor final_table(pc.h.block_table), final_lens(pc.h.seq_lens);
          pc.d_table.upload(stale_table);
          pc.d_lens.upload(stale_lens);
          pc.poison(stream);
          rewrite_table_after_sleep<<<1, 32, 0, stream>>>(
              static_cast<int32_t*>(pc.d_table.data()),
              static_cast<const int32_t*>(final_table.data()), entries,
              static_cast<int32_t*>(pc.d_lens.data()),
              static_cast<const int32_t*>(final_lens.data()), 1, /*sleep_ns=*/200000);
          ATTNKIT_CUDA_OK(cudaGetLastError());
          const int64_t prefetched = cuda::decode_prefetching_launches();
          ASSERT_NO_THROW(decode(pc.spec, pc.args, stream));
          ATTNKIT_CUDA_OK(cudaStreamSynchronize(stream));
          EXPECT_EQ(cuda::decode_prefetching_launches(), prefetched + 1)
              << "the call did not read the table before griddepcontrol.wait";
          pc.check();
        }
      }
    }
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace attnkit::test
