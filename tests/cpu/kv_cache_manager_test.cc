// KvCacheManager scenarios: prefix-reuse hit rates, eviction order, host-tier round trips,
// exhaustion and bad arguments (state unchanged), fork + copy-on-write, sliding-window
// recycling, beam cache indirection and the exported views.
#include "attnkit/kv_cache_manager.h"

#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <random>
#include <string>

#include "common/test_util.h"
#include "kv_cache_test_util.h"

namespace attnkit::test {
namespace {

KvCacheManagerConfig base_config(int32_t T = 16, int64_t blocks = 64) {
  KvCacheManagerConfig c;
  c.num_layers = 2;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.tokens_per_block = T;
  c.dtype = DType::kBF16;
  c.max_tokens = blocks * T;
  c.max_seq_len = 1024;
  return c;
}

std::vector<int32_t> random_tokens(std::mt19937_64& rng, size_t n) {
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % 32000);
  return t;
}

std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

template <typename Call>
std::string error_of(Call call) {
  try {
    call();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(KvCacheManager, SystemPromptSharedByHundredRequests) {
  std::mt19937_64 rng(test_seed());
  KvCacheManager m(base_config(16, 2048));
  const std::vector<int32_t> system = random_tokens(rng, 64);  // 4 full blocks
  for (int r = 0; r < 100; ++r) {
    const auto prompt = concat(system, random_tokens(rng, 20));
    EXPECT_EQ(m.add(r, prompt), r == 0 ? 0 : 64) << "request " << r;
  }
  const KvCacheStats st = m.stats();
  EXPECT_EQ(st.hits, 99 * 4);
  EXPECT_EQ(st.misses, 4 + 100 * 1);  // the first system prompt, and each request's own block
  // The four system blocks are held once per request.
  const auto first = m.blocks(0);
  const KvCacheSnapshot snap = m.snapshot();
  for (int k = 0; k < 4; ++k) EXPECT_EQ(snap.ref_count[first[k]], 100);
  EXPECT_EQ(st.used_blocks, 4 + 100 * 2);
  // Reuse after release: release everything, the chain stays cached.
  for (int r = 0; r < 100; ++r) m.release(r);
  EXPECT_EQ(m.add(1000, concat(system, {1})), 64);
  m.check_invariants();
}

TEST(KvCacheManager, SaltSeparatesChainsAndLastTokenIsComputed) {
  std::mt19937_64 rng(test_seed());
  KvCacheManager m(base_config());
  const auto prompt = random_tokens(rng, 48);  // exactly 3 blocks
  EXPECT_EQ(m.add(1, prompt, /*salt=*/7), 0);
  EXPECT_EQ(m.add(2, prompt, 7), 32);  // at most prompt - 1 tokens: the last block is computed
  EXPECT_EQ(m.add(3, prompt, 8), 0);   // another salt shares nothing
  EXPECT_EQ(m.probe_prefix(concat(prompt, {1}), 7), 48);
  auto other = prompt;
  other[20] += 1;  // differs in block 1: only block 0 matches
  EXPECT_EQ(m.probe_prefix(other, 7), 16);
  m.check_invariants();
}

TEST(KvCacheManager, EvictionIsLruAmongUnreferencedBlocks) {
  std::mt19937_64 rng(test_seed());
  KvCacheManagerConfig c = base_config(8, 8);
  c.max_seq_len = 64;
  KvCacheManager m(c);
  const auto a = random_tokens(rng, 17), b = random_tokens(rng, 17);  // 2 full blocks + 1
  m.add(1, a);
  m.release(1);  // a's two full blocks: cached, oldest
  m.add(2, b);
  m.release(2);
  EXPECT_EQ(m.stats().cached_blocks, 4);
  // Needs 6 blocks: the 4 free ones and two evictions, both from a (older than b).
  m.add(3, random_tokens(rng, 41));
  EXPECT_EQ(m.stats().evictions, 2);
  EXPECT_EQ(m.probe_prefix(a), 0);
  EXPECT_EQ(m.probe_prefix(b), 16);
  // One more eviction takes b's leaf (block 1) and keeps its root block.
  m.append(3, random_tokens(rng, 8));
  EXPECT_EQ(m.probe_prefix(b), 8);
  m.check_invariants();
}

TEST(KvCacheManager, EvictionHonoursPriorities) {
  std::mt19937_64 rng(test_seed());
  KvCacheManagerConfig c = base_config(8, 8);
  c.max_seq_len = 64;
  KvCacheManager m(c);
  const auto high = random_tokens(rng, 17), low = random_tokens(rng, 17);
  m.add(1, high, 0, /*priority=*/5);
  m.release(1);  // older but more important
  m.add(2, low, 0, 0);
  m.release(2);
  m.add(3, random_tokens(rng, 41));  // two evictions: both from `low`
  EXPECT_EQ(m.probe_prefix(high), 16);
  EXPECT_EQ(m.probe_prefix(low), 0);
}

TEST(KvCacheManager, OffloadOnboardRoundTripPreservesBytes) {
  std::mt19937_64 rng(test_seed());
  KvCacheManagerConfig c = base_config(8, 6);
  c.max_seq_len = 64;
  KvCacheManager probe_manager(c);
  c.host_cache_bytes = 4 * probe_manager.block_bytes();
  KvCacheManager m(c);
  const auto a = random_tokens(rng, 17);
  m.add(1, a);
  const auto a_blocks = m.blocks(1);
  std::vector<std::vector<uint8_t>> original(2, std::vector<uint8_t>(m.block_bytes()));
  for (int k = 0; k < 2; ++k) {
    auto* dst = static_cast<uint8_t*>(m.pool_data()) + a_blocks[k] * m.block_bytes();
    for (auto& byte : original[k]) byte = static_cast<uint8_t>(rng());
    std::memcpy(dst, original[k].data(), original[k].size());
  }
  m.release(1);
  m.add(2, random_tokens(rng, 48));  // 6 blocks: evicts (offloads) both of a's blocks
  EXPECT_EQ(m.stats().offloads, 2);
  EXPECT_EQ(m.stats().host_cached_blocks, 2);
  // Scribble over the whole pool so that a stale block cannot pass for a copied one.
  std::memset(m.pool_data(), 0xAB, static_cast<size_t>(m.num_blocks() * m.block_bytes()));
  m.release(2);
  EXPECT_EQ(m.add(3, concat(a, {9})), 16);
  EXPECT_EQ(m.stats().onboards, 2);
  EXPECT_EQ(m.stats().hits, 2);
  const auto back = m.blocks(3);
  std::vector<uint8_t> got(m.block_bytes());
  for (int k = 0; k < 2; ++k) {
    m.read_block(back[k], got.data());
    EXPECT_EQ(got, original[k]) << "block " << k << " changed in the host round trip";
  }
  m.check_invariants();
}

TEST(KvCacheManager, ExhaustionIsAClearErrorAndChangesNothing) {
  std::mt19937_64 rng(test_seed());
  KvCacheManagerConfig c = base_config(8, 4);
  c.max_seq_len = 64;
  KvCacheManager m(c);
  m.add(1, random_tokens(rng, 20));  // 3 blocks
  const KvCacheSnapshot before = m.snapshot();
  const std::string add_error = error_of([&] { m.add(2, random_tokens(rng, 9)); });
  EXPECT_NE(add_error.find("pool exhausted"), std::string::npos) << add_error;
  EXPECT_NE(add_error.find("needs 2 new blocks but only 1 of 4"), std::string::npos) << add_error;
  const std::string append_error = error_of([&] { m.append(1, random_tokens(rng, 20)); });
  EXPECT_NE(append_error.find("pool exhausted"), std::string::npos) << append_error;
  EXPECT_FALSE(m.contains(2));
  EXPECT_EQ(m.length(1), 20);
  const KvCacheSnapshot after = m.snapshot();
  EXPECT_EQ(before.ref_count, after.ref_count);
  EXPECT_EQ(before.is_free, after.is_free);
  EXPECT_EQ(m.stats().misses, 2);       // only the successful add counted
  m.append(1, random_tokens(rng, 12));  // exactly fits (4 blocks)
  m.check_invariants();
}

TEST(KvCacheManager, BadArgumentsNameTheArgument) {
  KvCacheManager m(base_config());
  const std::vector<int32_t> p = {1, 2, 3};
  m.add(1, p);
  EXPECT_NE(error_of([&] { m.add(1, p); }).find("seq 1 is already in the cache"),
            std::string::npos);
  EXPECT_NE(error_of([&] { m.release(9); }).find("release: seq 9 is not in the cache"),
            std::string::npos);
  EXPECT_NE(error_of([&] { m.append(9, p); }).find("append: seq 9"), std::string::npos);
  EXPECT_NE(error_of([&] { m.fork(9, 10); }).find("fork: seq 9"), std::string::npos);
  EXPECT_NE(error_of([&] { m.fork(1, 1); }).find("dst seq 1"), std::string::npos);
  EXPECT_NE(error_of([&] { m.add(2, std::vector<int32_t>{}); }).find("empty"), std::string::npos);
  EXPECT_NE(error_of([&] { m.append(1, std::vector<int32_t>(1022, 0)); }).find("max_seq_len 1024"),
            std::string::npos);
  EXPECT_NE(error_of([&] { m.add(3, std::vector<int32_t>(1025, 0)); }).find("max_seq_len"),
            std::string::npos);
  EXPECT_NE(error_of([&] { m.layer_view(2, {}, {}); }).find("layer 2"), std::string::npos);
  EXPECT_EQ(m.length(1), 3);
  m.check_invariants();

  auto config_error = [](auto edit) {
    KvCacheManagerConfig c = base_config();
    edit(c);
    return error_of([&] { KvCacheManager bad(c); });
  };
  EXPECT_NE(config_error([](auto& c) { c.tokens_per_block = 12; }).find("tokens_per_block"),
            std::string::npos);
  EXPECT_NE(config_error([](auto& c) { c.dtype = DType::kF32; }).find("dtype"), std::string::npos);
  EXPECT_NE(config_error([](auto& c) { c.max_tokens = 0; }).find("max_tokens or max_bytes"),
            std::string::npos);
  EXPECT_NE(config_error([](auto& c) { c.max_bytes = 10, c.max_tokens = 0; }).find("no block"),
            std::string::npos);
  EXPECT_NE(config_error([](auto& c) {
              c.free_gpu_memory_fraction = 1.5;
            }).find("free_gpu_memory_fraction"),
            std::string::npos);
  EXPECT_NE(config_error([](auto& c) { c.sink_tokens = 4; }).find("sink_tokens"),
            std::string::npos);
  EXPECT_NE(config_error([](auto& c) { c.max_seq_len = 0; }).find("max_seq_len"),
            std::string::npos);
  EXPECT_NE(config_error([](auto& c) {
              c.layout = static_cast<KvCacheLayout>(2);
            }).find("KvCacheManagerConfig.layout"),
            std::string::npos);
}

TEST(KvCacheManager, SizingTakesTheSmallerLimit) {
  KvCacheManagerConfig c = base_config(16, 10);
  KvCacheManager probe(c);
  EXPECT_EQ(probe.num_blocks(), 10);
  EXPECT_EQ(probe.block_bytes(), 2 * 2 * 2 * 16 * 8 * 2);
  c.max_bytes = 7 * probe.block_bytes() + 5;
  EXPECT_EQ(KvCacheManager(c).num_blocks(), 7);
  c.max_tokens = 3 * 16 + 1;  // rounded up to 4 blocks
  EXPECT_EQ(KvCacheManager(c).num_blocks(), 4);
}

TEST(KvCacheManager, ForkSharesBlocksAndCopiesThePartialBlockOnWrite) {
  std::mt19937_64 rng(test_seed());
  KvCacheManager m(base_config(16, 32));
  const auto prompt = random_tokens(rng, 37);  // 2 full blocks + 5 tokens
  m.add(1, prompt);
  for (int l = 0; l < 2; ++l) {
    SlotAccess s(m, 1, l);
    for (int p = 0; p < 37; ++p) s.write(p, {prompt[p], p, l});
  }
  m.fork(1, 2);
  EXPECT_EQ(m.blocks(1), m.blocks(2));
  m.append(2, std::vector<int32_t>{111});
  const auto b1 = m.blocks(1), b2 = m.blocks(2);
  EXPECT_EQ(b1[0], b2[0]);
  EXPECT_EQ(b1[1], b2[1]);
  EXPECT_NE(b1[2], b2[2]);  // copied on write
  EXPECT_EQ(m.stats().cow_copies, 1);
  for (int l = 0; l < 2; ++l) {
    SlotAccess s2(m, 2, l);
    s2.write(37, {111, 37, l});
    SlotAccess s1(m, 1, l);
    for (int p = 0; p < 37; ++p) EXPECT_EQ(s2.read(p), (Stamp{prompt[p], p, l}));
    s1.write(37, {222, 37, l});  // seq 1 has no slot 37 yet: writes past its length
    EXPECT_EQ(s2.read(37), (Stamp{111, 37, l}));
  }
  m.append(1, std::vector<int32_t>{222});  // no longer shared: no copy
  EXPECT_EQ(m.stats().cow_copies, 1);
  m.release(1);
  m.release(2);
  m.check_invariants();
  EXPECT_EQ(m.stats().used_blocks, 0);
}

TEST(KvCacheManager, SlidingWindowRecyclesBlocksThatLeaveTheWindow) {
  std::mt19937_64 rng(test_seed());
  KvCacheManagerConfig c = base_config(8, 16);
  c.num_layers = 1;
  c.layer_windows = {16};  // W' = 24 slots = 3 blocks
  c.max_seq_len = 4096;
  KvCacheManager m(c);
  EXPECT_EQ(m.window_slots(0), 24);
  EXPECT_EQ(m.max_blocks_per_seq(), 3);
  const auto prompt = random_tokens(rng, 17);
  m.add(1, prompt);
  for (int i = 0; i < 300; ++i) {
    m.append(1, std::vector<int32_t>{static_cast<int32_t>(i)});
    ASSERT_LE(m.blocks(1).size(), 3u);
    m.check_invariants();
  }
  EXPECT_EQ(m.stats().used_blocks, 3);
  // The prompt's two full blocks left the window: copied on the first overwrite, they went back
  // to the pool and stay reusable.
  EXPECT_GE(m.stats().cow_copies, 2);
  EXPECT_EQ(m.probe_prefix(prompt), 16);
  const KvBlockTables t = m.block_tables(std::vector<SeqId>{1});
  const KvCacheView v = m.layer_view(0, t.table_view(), t.seq_lens_view());
  EXPECT_EQ(v.window_slots, 24);
  EXPECT_EQ(t.seq_lens[0], 317);
}

TEST(KvCacheManager, MixedFullAndWindowedLayersStayLinear) {
  KvCacheManagerConfig c = base_config(8, 64);
  c.layer_windows = {0, 16};
  KvCacheManager m(c);
  EXPECT_EQ(m.window_slots(0), 0);
  EXPECT_EQ(m.window_slots(1), 0);
  EXPECT_EQ(m.max_blocks_per_seq(), 1024 / 8);
}

TEST(KvCacheManager, ExportedViewsAddressOnePoolForAllLayers) {
  for (KvCacheLayout layout : {KvCacheLayout::kHND, KvCacheLayout::kNHD}) {
    SCOPED_TRACE(kv_layout_name(layout));
    KvCacheManagerConfig c = base_config(16, 8);
    c.num_layers = 3;
    c.layout = layout;
    KvCacheManager m(c);
    m.add(5, std::vector<int32_t>(20, 1));
    m.add(6, std::vector<int32_t>(3, 2));
    const KvBlockTables t = m.block_tables(std::vector<SeqId>{6, 5});
    ASSERT_EQ(t.max_blocks, 1024 / 16);
    EXPECT_EQ(t.seq_lens, (std::vector<int32_t>{3, 20}));
    EXPECT_EQ(t.table[0], m.blocks(6)[0]);
    EXPECT_EQ(t.table[1], -1);
    EXPECT_EQ(t.table[t.max_blocks + 1], m.blocks(5)[1]);
    EXPECT_EQ(t.table[t.max_blocks + 2], -1);
    const int64_t elt = 2, layer = 2 * 2 * 16 * 8 * elt;
    for (int l = 0; l < 3; ++l) {
      const KvCacheView v = m.layer_view(l, t.table_view(), t.seq_lens_view());
      EXPECT_EQ(static_cast<uint8_t*>(v.k_base), static_cast<uint8_t*>(m.pool_data()) + l * layer);
      EXPECT_EQ(static_cast<uint8_t*>(v.v_base), static_cast<uint8_t*>(v.k_base) + layer / 2);
      EXPECT_EQ(v.block_stride_bytes, 3 * layer);
      EXPECT_EQ(v.num_blocks, 8);
      EXPECT_EQ(v.num_rows(), 2);
      EXPECT_EQ(v.window_slots, 0);
      EXPECT_EQ(v.layout, layout);  // the pool's block order: the same block bytes either way
    }
  }
}

TEST(KvCacheManager, BeamReorderProducesCacheIndirection) {
  KvCacheManager m(base_config(16, 32));
  m.add(0, std::vector<int32_t>(5, 3));  // context: positions 0..4
  m.fork(0, 1);
  m.append(0, std::vector<int32_t>{10});  // position 5 written by each beam in its own row
  m.append(1, std::vector<int32_t>{11});
  EXPECT_NE(m.blocks(0)[0], m.blocks(1)[0]);  // the shared partial block was copied
  const std::vector<SeqId> beams = {0, 1};
  m.reorder_beams(beams, std::vector<int32_t>{1, 1});  // both continue beam 1
  m.append(0, std::vector<int32_t>{20});
  m.append(1, std::vector<int32_t>{21});
  const auto ind = m.cache_indirection(beams, 2, 8);
  // Beam 0 reads positions 0..5 from beam 1, position 6 (its own new token) from itself.
  EXPECT_EQ(ind, (std::vector<int32_t>{1, 1, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1}));
  EXPECT_NE(error_of([&] {
              m.reorder_beams(beams, std::vector<int32_t>{0, 2});
            }).find("parents"),
            std::string::npos);
  EXPECT_NE(error_of([&] { m.cache_indirection(beams, 2, 4); }).find("max_seq"), std::string::npos);
}

}  // namespace
}  // namespace attnkit::test
