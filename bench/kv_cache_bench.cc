// KvCacheManager throughput on the host: operations per second of add / append / release /
// fork with prefix reuse on, on a pool of 100,000 blocks (plain std::chrono, one thread).
//   build-X/bench/kv_cache_bench [num_requests]
// Workload: requests share one of 8 system prompts (256 tokens) and add 64 own tokens; up to
// 4,000 live requests (oldest released first); each step appends one token to 64 random live
// requests. A second phase uses unique prompts on a full pool so every add evicts.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <random>
#include <string>
#include <vector>

#include "attnkit/kv_cache_manager.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Timer {
  const char* name;
  int64_t count = 0;
  double seconds = 0.0;
  template <typename F>
  void time(F&& f) {
    const auto start = Clock::now();
    f();
    seconds += std::chrono::duration<double>(Clock::now() - start).count();
    ++count;
  }
  void print() const {
    std::printf("| %-34s | %9lld | %8.3f | %12.0f | %8.2f |\n", name, static_cast<long long>(count),
                seconds, count / seconds, 1e6 * seconds / count);
  }
};

std::vector<int32_t> random_tokens(std::mt19937_64& rng, size_t n) {
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % 128000);
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t num_requests = argc > 1 ? std::atoll(argv[1]) : 40000;
  attnkit::KvCacheManagerConfig config;
  config.num_layers = 1;
  config.num_kv_heads = 1;
  config.head_dim = 8;
  config.tokens_per_block = 16;
  config.dtype = attnkit::DType::kBF16;
  config.max_tokens = 100000LL * 16;
  config.max_seq_len = 4096;
  attnkit::KvCacheManager manager(config);
  std::mt19937_64 rng(12345);
  std::vector<std::vector<int32_t>> systems;
  for (int i = 0; i < 8; ++i) systems.push_back(random_tokens(rng, 256));

  Timer add{"add (256 shared + 64 own tokens)"}, append{"append (1 token)"}, release{"release"},
      fork{"fork"};
  std::deque<attnkit::SeqId> live;
  std::vector<attnkit::SeqId> live_index;
  attnkit::SeqId next = 0;
  int64_t cached_tokens = 0;
  for (int64_t r = 0; r < num_requests; ++r) {
    auto prompt = systems[rng() % systems.size()];
    const auto own = random_tokens(rng, 64);
    prompt.insert(prompt.end(), own.begin(), own.end());
    const attnkit::SeqId id = next++;
    add.time([&] { cached_tokens += manager.add(id, prompt); });
    live.push_back(id);
    if (r % 16 == 0) {
      const attnkit::SeqId child = next++;
      fork.time([&] { manager.fork(id, child); });
      live.push_back(child);
    }
    for (int k = 0; k < 64; ++k) {
      const attnkit::SeqId target = live[rng() % live.size()];
      const int32_t token = static_cast<int32_t>(rng() % 128000);
      append.time([&] { manager.append(target, std::span<const int32_t>(&token, 1)); });
    }
    while (live.size() > 4000) {
      const attnkit::SeqId old = live.front();
      live.pop_front();
      release.time([&] { manager.release(old); });
    }
  }
  const attnkit::KvCacheStats shared = manager.stats();
  while (!live.empty()) {
    const attnkit::SeqId old = live.front();
    live.pop_front();
    release.time([&] { manager.release(old); });
  }

  // Phase 2: unique 1,024-token prompts on a pool full of cached blocks: each add evicts 64.
  Timer evicting_add{"add (1024 unique tokens, evicts)"}, evicting_release{"release (64 blocks)"};
  for (int64_t r = 0; r < num_requests / 8; ++r) {
    const auto prompt = random_tokens(rng, 1024);
    const attnkit::SeqId id = next++;
    evicting_add.time([&] { manager.add(id, prompt); });
    evicting_release.time([&] { manager.release(id); });
  }
  manager.check_invariants();
  const attnkit::KvCacheStats st = manager.stats();

  std::printf("pool: %d blocks of %lld bytes (T = 16); %lld requests\n\n", manager.num_blocks(),
              static_cast<long long>(manager.block_bytes()), static_cast<long long>(num_requests));
  std::printf("| %-34s | %9s | %8s | %12s | %8s |\n", "operation", "count", "seconds", "ops/s",
              "us/op");
  std::printf("|%s|%s|%s|%s|%s|\n", std::string(36, '-').c_str(), std::string(11, '-').c_str(),
              std::string(10, '-').c_str(), std::string(14, '-').c_str(),
              std::string(10, '-').c_str());
  add.print();
  append.print();
  fork.print();
  release.print();
  evicting_add.print();
  evicting_release.print();
  std::printf("\nphase 1: hit rate %.3f (hits %lld, misses %lld), cached tokens %lld\n",
              static_cast<double>(shared.hits) / (shared.hits + shared.misses),
              static_cast<long long>(shared.hits), static_cast<long long>(shared.misses),
              static_cast<long long>(cached_tokens));
  std::printf("total: evictions %lld, cow copies %lld\n", static_cast<long long>(st.evictions),
              static_cast<long long>(st.cow_copies));
  return 0;
}
