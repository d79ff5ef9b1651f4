// Model-based randomized test of KvCacheManager: 100,000 random operations (add with shared
// prefixes and salts, append, fork, release, and invalid calls) checked after every step
// against a simple model (sequence -> tokens) and the structural invariants, with the KV slots
// stamped and read back so that every reuse, copy-on-write, offload and onboard is verified.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <random>
#include <string>
#include <thread>

#include "attnkit/kv_cache_manager.h"
#include "common/test_util.h"
#include "kv_cache_test_util.h"

namespace attnkit::test {
namespace {

struct ModelSeq {
  std::vector<int32_t> tokens;
  int32_t salt = 0;
};

bool same_snapshot(const KvCacheSnapshot& a, const KvCacheSnapshot& b) {
  if (a.ref_count != b.ref_count || a.is_free != b.is_free || a.is_cached != b.is_cached) {
    return false;
  }
  auto key = [](const KvCacheSnapshot& s) {
    std::map<SeqId, std::pair<int64_t, std::vector<int32_t>>> m;
    for (const auto& q : s.sequences) m[q.id] = {q.length, q.blocks};
    return m;
  };
  return key(a) == key(b);
}

bool same_counters(const KvCacheStats& a, const KvCacheStats& b) {
  return a.hits == b.hits && a.misses == b.misses && a.evictions == b.evictions &&
         a.offloads == b.offloads && a.onboards == b.onboards && a.cow_copies == b.cow_copies &&
         a.free_blocks == b.free_blocks && a.cached_blocks == b.cached_blocks;
}

class ModelRun {
 public:
  ModelRun(const KvCacheManagerConfig& config, uint64_t seed)
      : config_(config), manager_(config), rng_(seed) {
    const int32_t T = config.tokens_per_block;
    bool cyclic = !config.layer_windows.empty();
    for (int32_t w : config.layer_windows) cyclic = cyclic && w > 0;
    int32_t max_slots = 0;
    for (int32_t l = 0; l < config.num_layers; ++l) {
      const int32_t w = cyclic ? config.layer_windows[l % config.layer_windows.size()] : 0;
      // W' = W rounded up to whole blocks plus one block (docs/semantics.md).
      slots_.push_back(w ? ((w + T - 1) / T + 1) * T : 0);
      max_slots = std::max(max_slots, slots_.back());
    }
    cyclic_entries_ = cyclic ? (config.sink_tokens + max_slots + T - 1) / T : 0;
    for (int f = 0; f < 4; ++f) {
      std::vector<int32_t> family(48);
      for (auto& t : family) t = static_cast<int32_t>(rng_() % 50000);
      families_.push_back(family);
    }
  }

  KvCacheManager& manager() { return manager_; }

  int64_t expected_entries(int64_t length) const {
    const int64_t T = config_.tokens_per_block;
    const int64_t n = (length + T - 1) / T;
    return cyclic_entries_ ? std::min<int64_t>(n, cyclic_entries_) : n;
  }

  std::vector<int32_t> random_prompt() {
    const auto& family = families_[rng_() % families_.size()];
    std::vector<int32_t> prompt(family.begin(), family.begin() + rng_() % (family.size() + 1));
    const int tail = static_cast<int>(rng_() % 24);
    for (int i = 0; i < tail; ++i) prompt.push_back(static_cast<int32_t>(rng_() % 50000));
    if (prompt.empty()) prompt.push_back(7);
    return prompt;
  }

  // The engine's part: write the KV stamps of positions [from, length) of every layer.
  void write(SeqId id, int64_t from) {
    const ModelSeq& s = model_.at(id);
    for (int32_t l = 0; l < config_.num_layers; ++l) {
      SlotAccess slots(manager_, id, l);
      for (int64_t p = from; p < static_cast<int64_t>(s.tokens.size()); ++p) {
        slots.write(p, {s.tokens[p], static_cast<int32_t>(p), s.salt});
      }
    }
  }

  // Every position a layer still holds reads back the stamp of that sequence's token.
  void verify_content(SeqId id, int64_t upto = -1) {
    const ModelSeq& s = model_.at(id);
    const int64_t length = upto >= 0 ? upto : static_cast<int64_t>(s.tokens.size());
    for (int32_t l = 0; l < config_.num_layers; ++l) {
      SlotAccess slots(manager_, id, l);
      for (int64_t p = 0; p < length; ++p) {
        const bool held = slots_[l] == 0 || p < config_.sink_tokens ||
                          p >= static_cast<int64_t>(s.tokens.size()) - slots_[l];
        if (!held) continue;
        const Stamp want{s.tokens[p], static_cast<int32_t>(p), s.salt};
        const Stamp got = slots.read(p);
        ASSERT_EQ(got, want) << "seq " << id << " layer " << l << " position " << p
                             << " reads token " << got.token << " at " << got.position << " salt "
                             << got.salt;
      }
    }
  }

  void verify_structure() {
    manager_.check_invariants();
    const KvCacheSnapshot snap = manager_.snapshot();
    const int32_t num_blocks = manager_.num_blocks();
    ASSERT_EQ(snap.sequences.size(), model_.size());
    std::vector<int32_t> holders(num_blocks, 0);
    for (const auto& q : snap.sequences) {
      auto it = model_.find(q.id);
      ASSERT_NE(it, model_.end()) << "manager holds seq " << q.id << " the model does not";
      ASSERT_EQ(q.length, static_cast<int64_t>(it->second.tokens.size())) << "seq " << q.id;
      ASSERT_EQ(static_cast<int64_t>(q.blocks.size()), expected_entries(q.length));
      for (int32_t b : q.blocks) {
        ASSERT_TRUE(b >= 0 && b < num_blocks);
        ++holders[b];
      }
    }
    int64_t free_count = 0, cached = 0, used = 0;
    for (int32_t b = 0; b < num_blocks; ++b) {
      ASSERT_EQ(snap.ref_count[b], holders[b]) << "block " << b;
      ASSERT_FALSE(snap.is_free[b] && holders[b] > 0) << "block " << b << " free and referenced";
      ASSERT_FALSE(snap.is_free[b] && snap.is_cached[b]) << "block " << b;
      free_count += snap.is_free[b];
      cached += !snap.is_free[b] && holders[b] == 0;
      used += holders[b] > 0;
      // An unreferenced block that is not free must be reusable (registered), else it leaked.
      ASSERT_TRUE(snap.is_free[b] || holders[b] > 0 || snap.is_cached[b]) << "block " << b;
    }
    ASSERT_EQ(free_count + cached + used, num_blocks);
    const KvCacheStats st = manager_.stats();
    ASSERT_EQ(st.free_blocks, free_count);
    ASSERT_EQ(st.cached_blocks, cached);
    ASSERT_EQ(st.used_blocks, used);
  }

  // Runs `call`, which must throw an Error containing `expected`, and checks that nothing
  // changed.
  template <typename Call>
  void expect_rejected(Call call, const std::string& expected) {
    const KvCacheSnapshot before = manager_.snapshot();
    const KvCacheStats stats_before = manager_.stats();
    try {
      call();
      FAIL() << "expected an Error containing '" << expected << "'";
    } catch (const Error& e) {
      ASSERT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
    ASSERT_TRUE(same_snapshot(before, manager_.snapshot())) << "a rejected call changed state";
    ASSERT_TRUE(same_counters(stats_before, manager_.stats()));
  }

  SeqId random_live() {
    auto it = model_.begin();
    std::advance(it, rng_() % model_.size());
    return it->first;
  }

  void step(int64_t i, size_t max_live) {
    const int op = static_cast<int>(rng_() % 100);
    const int32_t T = config_.tokens_per_block;
    if (op < 25 && model_.size() < max_live) {
      const SeqId id = next_id_++;
      ModelSeq s{random_prompt(), static_cast<int32_t>(rng_() % 2)};
      const KvCacheStats st = manager_.stats();
      const KvCacheSnapshot before = manager_.snapshot();
      try {
        const int64_t cached = manager_.add(id, s.tokens, s.salt, static_cast<int32_t>(rng_() % 2));
        ASSERT_EQ(cached % T, 0);
        ASSERT_LE(cached, static_cast<int64_t>(s.tokens.size()) - 1);
        model_[id] = s;
        verify_content(id, cached);  // reused KV must be this prompt's
        write(id, cached);
        verify_content(id);
      } catch (const Error& e) {
        ASSERT_NE(std::string(e.what()).find("pool exhausted"), std::string::npos) << e.what();
        ASSERT_LT(st.free_blocks + st.cached_blocks,
                  expected_entries(static_cast<int64_t>(s.tokens.size())))
            << "add rejected although enough blocks were free or evictable";
        ASSERT_TRUE(same_snapshot(before, manager_.snapshot()));
        ++exhausted_;
      }
    } else if (op < 60 && !model_.empty()) {
      const SeqId id = random_live();
      ModelSeq& s = model_.at(id);
      const int64_t len = static_cast<int64_t>(s.tokens.size());
      std::vector<int32_t> tokens(1 + rng_() % (rng_() % 4 == 0 ? 3 * T : 3));
      for (auto& t : tokens) t = static_cast<int32_t>(rng_() % 50000);
      const int64_t new_len = len + static_cast<int64_t>(tokens.size());
      if (new_len > config_.max_seq_len) {
        expect_rejected([&] { manager_.append(id, tokens); }, "max_seq_len");
        // Long-lived sequences end (as they would at max_seq_len).
        manager_.release(id);
        model_.erase(id);
        return;
      }
      const KvCacheStats st = manager_.stats();
      const KvCacheSnapshot before = manager_.snapshot();
      try {
        manager_.append(id, tokens);
        s.tokens.insert(s.tokens.end(), tokens.begin(), tokens.end());
        write(id, len);
        verify_content(id);
      } catch (const Error& e) {
        ASSERT_NE(std::string(e.what()).find("pool exhausted"), std::string::npos) << e.what();
        ASSERT_LT(st.free_blocks + st.cached_blocks, expected_entries(new_len))
            << "append rejected although enough blocks were free or evictable";
        ASSERT_TRUE(same_snapshot(before, manager_.snapshot()));
        ++exhausted_;
      }
    } else if (op < 70 && !model_.empty() && model_.size() < max_live) {
      const SeqId src = random_live();
      const SeqId dst = next_id_++;
      manager_.fork(src, dst);
      model_[dst] = model_.at(src);
      verify_content(dst);
    } else if (op < 92 && !model_.empty()) {
      const SeqId id = random_live();
      manager_.release(id);
      model_.erase(id);
    } else if (!model_.empty()) {
      const SeqId live = random_live();
      const std::vector<int32_t> one = {1};
      switch (rng_() % 5) {
        case 0:
          expect_rejected([&] { manager_.add(live, one); }, "already in the cache");
          break;
        case 1:
          expect_rejected([&] { manager_.append(next_id_ + 1000, one); }, "not in the cache");
          break;
        case 2:
          expect_rejected([&] { manager_.release(next_id_ + 1000); }, "not in the cache");
          break;
        case 3:
          expect_rejected([&] { manager_.fork(live, live); }, "already in the cache");
          break;
        default:
          expect_rejected([&] { manager_.fork(-5, next_id_); }, "not in the cache");
          break;
      }
    }
    if (i % 64 == 0) {
      for (const auto& [id, s] : model_) verify_content(id);
    }
    verify_structure();
  }

  void run(int64_t steps, size_t max_live) {
    for (int64_t i = 0; i < steps; ++i) {
      step(i, max_live);
      if (::testing::Test::HasFatalFailure()) {
        ADD_FAILURE() << "at step " << i;
        return;
      }
    }
    while (!model_.empty()) {
      const SeqId id = model_.begin()->first;
      manager_.release(id);
      model_.erase(id);
    }
    verify_structure();
    const KvCacheStats st = manager_.stats();
    EXPECT_EQ(st.used_blocks, 0);
    EXPECT_EQ(st.free_blocks + st.cached_blocks, st.num_blocks) << "blocks leaked";
  }

  int64_t exhausted() const { return exhausted_; }

 private:
  KvCacheManagerConfig config_;
  KvCacheManager manager_;
  std::mt19937_64 rng_;
  std::vector<int32_t> slots_;
  int64_t cyclic_entries_ = 0;
  std::vector<std::vector<int32_t>> families_;
  std::map<SeqId, ModelSeq> model_;
  SeqId next_id_ = 0;
  int64_t exhausted_ = 0;
};

KvCacheManagerConfig small_config() {
  KvCacheManagerConfig c;
  c.num_layers = 2;
  c.num_kv_heads = 1;
  c.head_dim = 8;  // 16 bytes of bf16 per slot: room for a Stamp
  c.tokens_per_block = 8;
  c.dtype = DType::kBF16;
  c.max_tokens = 48 * 8;
  c.max_seq_len = 96;
  c.host_cache_bytes = 0;
  return c;
}

TEST(KvCacheModel, RandomOpsLinearWithHostTier) {
  KvCacheManagerConfig c = small_config();
  c.host_cache_bytes = 24 * (2 * 2 * 1 * 8 * 8 * 2);  // 24 blocks
  ModelRun run(c, test_seed());
  const auto start = std::chrono::steady_clock::now();
  run.run(100000, 10);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const KvCacheStats st = run.manager().stats();
  std::printf(
      "100000 ops in %.2f s: hits %lld misses %lld evictions %lld offloads %lld "
      "onboards %lld cow %lld exhausted %lld\n",
      seconds, static_cast<long long>(st.hits), static_cast<long long>(st.misses),
      static_cast<long long>(st.evictions), static_cast<long long>(st.offloads),
      static_cast<long long>(st.onboards), static_cast<long long>(st.cow_copies),
      static_cast<long long>(run.exhausted()));
  // The random mix must reach every mechanism, else the test proves little.
  EXPECT_GT(st.hits, 0);
  EXPECT_GT(st.evictions, 0);
  EXPECT_GT(st.offloads, 0);
  EXPECT_GT(st.onboards, 0);
  EXPECT_GT(st.cow_copies, 0);
  EXPECT_GT(run.exhausted(), 0);
}

TEST(KvCacheModel, RandomOpsCyclicWindowsWithSinks) {
  KvCacheManagerConfig c = small_config();
  c.layer_windows = {16, 40};  // W' = 24 and 48 slots
  c.sink_tokens = 3;
  c.max_seq_len = 200;
  c.max_tokens = 40 * 8;
  ModelRun run(c, test_seed() + 1);
  run.run(50000, 8);
  const KvCacheStats st = run.manager().stats();
  EXPECT_GT(st.hits, 0);
  EXPECT_GT(st.cow_copies, 0);
}

// The threading contract (every call takes the manager's mutex): four threads add, append, fork
// and release their own sequences over shared prefixes at the same time.
TEST(KvCacheModel, ConcurrentCallsKeepInvariants) {
  KvCacheManagerConfig c = small_config();
  c.max_tokens = 800 * 8;  // 4 threads x 15 sequences x 12 blocks fit
  KvCacheManager manager(c);
  const uint64_t seed = test_seed();
  std::vector<std::thread> threads;
  std::atomic<int> errors{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(seed + t);
      std::vector<SeqId> mine;
      const std::vector<int32_t> shared(32, 5);
      for (int i = 0; i < 3000; ++i) {
        const int op = static_cast<int>(rng() % 4);
        try {
          if (mine.size() >= 15) {
            manager.release(mine.back());
            mine.pop_back();
          } else if (op == 0 || mine.empty()) {
            const SeqId id = t * 1000000 + i;
            std::vector<int32_t> prompt(shared.begin(), shared.begin() + rng() % 33);
            prompt.push_back(static_cast<int32_t>(rng() % 100));
            manager.add(id, prompt);
            mine.push_back(id);
          } else if (op == 1) {
            const SeqId id = mine[rng() % mine.size()];
            if (manager.length(id) < c.max_seq_len - 2) {
              manager.append(id, std::vector<int32_t>{static_cast<int32_t>(rng() % 100)});
            }
          } else if (op == 2 && mine.size() < 20) {
            const SeqId dst = t * 1000000 + 500000 + i;
            manager.fork(mine[rng() % mine.size()], dst);
            mine.push_back(dst);
          } else {
            const size_t k = rng() % mine.size();
            manager.release(mine[k]);
            mine.erase(mine.begin() + k);
          }
        } catch (const Error&) {
          ++errors;
        }
      }
      for (SeqId id : mine) manager.release(id);
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(errors.load(), 0);
  manager.check_invariants();
  const KvCacheStats st = manager.stats();
  EXPECT_EQ(st.used_blocks, 0);
  EXPECT_EQ(st.free_blocks + st.cached_blocks, st.num_blocks);
  EXPECT_GT(st.hits, 0);
}

}  // namespace
}  // namespace attnkit::test
