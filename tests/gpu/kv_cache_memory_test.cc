// The CUDA pool of KvCacheManager: free-memory sizing, copy-on-write on the device, and the
// pinned host tier (offload / onboard byte-exact).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "attnkit/kv_cache_manager.h"
#include "gpu/gpu_util.h"

namespace attnkit {
namespace {

KvCacheManagerConfig gpu_config() {
  KvCacheManagerConfig c;
  c.num_layers = 2;
  c.num_kv_heads = 2;
  c.head_dim = 64;
  c.tokens_per_block = 16;
  c.device = Device::cuda(0);
  c.max_seq_len = 256;
  c.free_gpu_memory_fraction = 0.001;
  return c;
}

TEST(KvCacheGpu, SizesFromFreeMemoryAndTakesTheSmallerLimit) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  KvCacheManagerConfig c = gpu_config();
  {
    KvCacheManager by_fraction(c);
    EXPECT_GT(by_fraction.num_blocks(), 100);
  }
  c.max_tokens = 6 * 16;  // smaller than the fraction: wins
  KvCacheManager by_tokens(c);
  EXPECT_EQ(by_tokens.num_blocks(), 6);
}

TEST(KvCacheGpu, CopyOnWriteAndHostTierPreserveBytes) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  KvCacheManagerConfig c = gpu_config();
  c.max_tokens = 6 * 16;
  const int64_t block_bytes = KvCacheManager(c).block_bytes();
  c.host_cache_bytes = 4 * block_bytes;
  KvCacheManager m(c);
  std::mt19937_64 rng(test::test_seed());
  std::vector<int32_t> prompt(33);
  for (int32_t& t : prompt) t = static_cast<int32_t>(rng() % 1000);
  m.add(1, prompt);
  const std::vector<int32_t> blocks = m.blocks(1);
  std::vector<std::vector<uint8_t>> original(3, std::vector<uint8_t>(block_bytes));
  for (int k = 0; k < 3; ++k) {
    for (uint8_t& b : original[k]) b = static_cast<uint8_t>(rng());
    ATTNKIT_CUDA_OK(cudaMemcpy(static_cast<uint8_t*>(m.pool_data()) + blocks[k] * block_bytes,
                               original[k].data(), block_bytes, cudaMemcpyHostToDevice));
  }
  m.fork(1, 2);
  m.append(2, std::vector<int32_t>{5});  // copy-on-write of the partial last block, on the device
  const std::vector<int32_t> forked = m.blocks(2);
  ASSERT_NE(forked[2], blocks[2]);
  EXPECT_EQ(m.stats().cow_copies, 1);
  std::vector<uint8_t> got(block_bytes);
  m.read_block(forked[2], got.data());
  EXPECT_EQ(got, original[2]);
  m.release(2);
  m.release(1);

  std::vector<int32_t> other(96);
  for (int32_t& t : other) t = 2000 + static_cast<int32_t>(rng() % 1000);
  m.add(3, other);  // evicts the first prompt's two full blocks to the host tier
  EXPECT_EQ(m.stats().offloads, 2);
  ATTNKIT_CUDA_OK(cudaMemset(m.pool_data(), 0xAB, m.num_blocks() * block_bytes));
  m.release(3);
  std::vector<int32_t> again = prompt;
  again.push_back(9);
  EXPECT_EQ(m.add(4, again), 32);  // both full blocks come back from the host
  EXPECT_EQ(m.stats().onboards, 2);
  const std::vector<int32_t> back = m.blocks(4);
  for (int k = 0; k < 2; ++k) {
    m.read_block(back[k], got.data());
    EXPECT_EQ(got, original[k]) << "block " << k;
  }
  m.check_invariants();
}

TEST(KvCacheGpu, RejectsAMissingDevice) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  KvCacheManagerConfig c = gpu_config();
  c.device = Device::cuda(97);
  EXPECT_THROW(KvCacheManager bad(c), Error);
}

}  // namespace
}  // namespace attnkit
