// KvCacheManagerConfig at the edges of its integer types and of the host's memory: every
// configuration that cannot be served throws attnkit::Error naming the field (never a crash,
// std::bad_alloc or a pool with negative geometry), and memory that is sized but not used yet is
// not committed up front.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <limits>
#include <string>

#include "attnkit/kv_cache_manager.h"

namespace attnkit::test {
namespace {

constexpr int32_t kInt32Max = std::numeric_limits<int32_t>::max();

KvCacheManagerConfig small_config() {
  KvCacheManagerConfig c;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.tokens_per_block = 16;
  c.dtype = DType::kBF16;
  c.max_tokens = 64 * 16;
  c.max_seq_len = 1024;
  return c;
}

// The message of the Error the constructor throws ("(no error)" when it succeeds); any other
// exception fails the test.
std::string construct_error(const KvCacheManagerConfig& c) {
  try {
    KvCacheManager m(c);
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected attnkit::Error, got " << typeid(e).name() << ": " << e.what();
    return e.what();
  }
  return "(no error)";
}

int64_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  statm >> size >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

TEST(KvCacheLimits, BlockBytesThatOverflowInt64AreRejected) {
  // 2 x 2^28 heads x 128 tokens x 2^28 dims x 1 byte = 2^64 bytes a layer: once a byte count
  // that wrapped to 0 and a division by it (SIGFPE).
  KvCacheManagerConfig c = small_config();
  c.num_kv_heads = 1 << 28;
  c.head_dim = 1 << 28;
  c.tokens_per_block = 128;
  c.dtype = DType::kInt8;
  c.max_bytes = int64_t{1} << 30;
  const std::string error = construct_error(c);
  EXPECT_NE(error.find("KvCacheManagerConfig: a block of num_layers x 2 x num_kv_heads x "
                       "tokens_per_block x head_dim"),
            std::string::npos)
      << error;
  EXPECT_NE(error.find("does not fit in int64"), std::string::npos) << error;
}

TEST(KvCacheLimits, WindowsAndSinksNearInt32MaxAreRejected) {
  KvCacheManagerConfig c = small_config();
  c.layer_windows = {kInt32Max};
  std::string error = construct_error(c);
  EXPECT_NE(error.find("KvCacheManagerConfig.layer_windows[0]: a window of 2147483647 tokens"),
            std::string::npos)
      << error;
  c.layer_windows = {64, kInt32Max - 20};
  error = construct_error(c);
  EXPECT_NE(error.find("KvCacheManagerConfig.layer_windows[1]:"), std::string::npos) << error;
  c.layer_windows = {64};
  c.sink_tokens = kInt32Max - 50;
  error = construct_error(c);
  EXPECT_NE(error.find("KvCacheManagerConfig.sink_tokens: sink_tokens + the cyclic slots"),
            std::string::npos)
      << error;
  // The largest accepted window still gives positive geometry.
  c.sink_tokens = 0;
  c.layer_windows = {kInt32Max - 2 * 16};
  KvCacheManager m(c);
  EXPECT_GT(m.window_slots(0), 0);
  EXPECT_GT(m.max_blocks_per_seq(), 0);
}

TEST(KvCacheLimits, PoolsLargerThanTheHostThrowErrorNotBadAlloc) {
  KvCacheManagerConfig c = small_config();
  c.max_tokens = 0;
  c.max_bytes = int64_t{1} << 40;  // 1 TiB of host memory (2^30 blocks of 1 KiB)
  std::string error = construct_error(c);
  EXPECT_NE(error.find("KvCacheManagerConfig.max_bytes: a cpu pool of"), std::string::npos)
      << error;
  EXPECT_NE(error.find("more than the host's memory"), std::string::npos) << error;

  // As many blocks as int32 block ids address: the bookkeeping alone is larger than the host.
  c.max_bytes = 0;
  c.num_kv_heads = 1;
  c.head_dim = 1;
  c.tokens_per_block = 8;
  c.dtype = DType::kInt8;
  c.max_tokens = int64_t{kInt32Max} * 8;
  error = construct_error(c);
  EXPECT_NE(error.find("KvCacheManagerConfig"), std::string::npos) << error;
  EXPECT_NE(error.find("more than the host's memory"), std::string::npos) << error;

  c = small_config();
  c.host_cache_bytes = int64_t{1} << 50;
  error = construct_error(c);
  EXPECT_NE(error.find("KvCacheManagerConfig.host_cache_bytes: a host tier of"), std::string::npos)
      << error;
}

TEST(KvCacheLimits, PoolAndHostTierAreNotCommittedUpFront) {
  // 1 GiB of pool and 1 GiB of host tier: pages are committed when blocks are first written.
  KvCacheManagerConfig c = small_config();
  c.max_tokens = 0;
  c.max_bytes = int64_t{1} << 30;
  c.host_cache_bytes = int64_t{1} << 30;
  const int64_t before = resident_bytes();
  KvCacheManager m(c);
  const int64_t grown = resident_bytes() - before;
  EXPECT_LT(grown, int64_t{256} << 20)
      << "constructing the manager committed " << (grown >> 20) << " MiB";
  EXPECT_EQ(m.stats().host_blocks, (int64_t{1} << 30) / m.block_bytes());
  // The pool reads as zeros where nothing was written.
  std::vector<uint8_t> block(static_cast<size_t>(m.block_bytes()), 0xff);
  m.read_block(m.num_blocks() - 1, block.data());
  for (uint8_t b : block) ASSERT_EQ(b, 0);
}

}  // namespace
}  // namespace attnkit::test
