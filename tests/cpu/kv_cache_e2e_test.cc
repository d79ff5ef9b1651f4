// End to end through the reference backend: KV reused from the prefix cache (in the pool or
// onboarded from the host tier), copied on write after a fork, or kept in a cyclic
// sliding-window cache gives bit-identical attention output to recomputing it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>

#include "attnkit/attention.h"
#include "attnkit/kv_cache_manager.h"
#include "common/test_util.h"

namespace attnkit::test {
namespace {

constexpr int32_t kHq = 4, kHkv = 2, kD = 32, kT = 16;

// Queries, cache and outputs are bf16 (an unquantized cache has the dtype of the queries).
// The "model": the fused QKV row of a token is a fixed function of (token id, position), so
// equal prefixes give equal KV, as in a real model.
struct TokenModel {
  uint64_t seed;
  float value(int32_t token, int64_t position, int64_t i) const {
    uint64_t x = seed ^ (static_cast<uint64_t>(token) * 0x9e3779b97f4a7c15ULL) ^
                 (static_cast<uint64_t>(position) << 32) ^ static_cast<uint64_t>(i) * 0x85ebca6b;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return static_cast<float>(static_cast<double>(x >> 11) / 9007199254740992.0 * 2.0 - 1.0);
  }
};

KvCacheManagerConfig e2e_config(int64_t blocks) {
  KvCacheManagerConfig c;
  c.num_layers = 1;
  c.num_kv_heads = kHkv;
  c.head_dim = kD;
  c.tokens_per_block = kT;
  c.dtype = DType::kBF16;
  c.max_tokens = blocks * kT;
  c.max_seq_len = 256;
  return c;
}

AttentionSpec causal_spec() {
  AttentionSpec spec;
  spec.num_q_heads = kHq;
  spec.num_kv_heads = kHkv;
  spec.head_dim = kD;
  spec.backend = Backend::kVanilla;
  return spec;
}

std::vector<float> as_floats(const HostTensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[i] = t.get(i);
  return v;
}

// Writes the KV of `tokens` at `positions` (block-table row rows[i]) and returns the rotated Q.
HostTensor write_kv(const AttentionSpec& spec, const TokenModel& model, const KvCacheView& view,
                    const std::vector<int32_t>& tokens, const std::vector<int32_t>& positions,
                    const std::vector<int32_t>& rows) {
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t width = (kHq + 2 * kHkv) * kD;
  HostTensor qkv(DType::kBF16, {n, width});
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t i = 0; i < width; ++i)
      qkv.set(t * width + i, model.value(tokens[t], positions[t], i));
  }
  HostTensor pos(DType::kInt32, {n}), row(DType::kInt32, {n});
  std::memcpy(pos.data<int32_t>(), positions.data(), n * 4);
  std::memcpy(row.data<int32_t>(), rows.data(), n * 4);
  HostTensor q_out(DType::kBF16, {n, kHq, kD});
  q_out.fill(NAN);
  AppendKvArgs a;
  a.qkv = qkv;
  a.positions = pos;
  a.row_of_token = row;
  a.kv_cache = view;
  a.q_out = q_out;
  append_kv(spec, a);
  return q_out;
}

// Computes tokens [from, size) of `seq` (whose cache holds [0, from)) and returns their output.
std::vector<float> prefill_seq(const AttentionSpec& spec, const TokenModel& model,
                               KvCacheManager& m, SeqId seq, const std::vector<int32_t>& tokens,
                               int64_t from) {
  const KvBlockTables t = m.block_tables(std::vector<SeqId>{seq});
  const KvCacheView view = m.layer_view(0, t.table_view(), t.seq_lens_view());
  const int32_t n = static_cast<int32_t>(tokens.size() - from);
  std::vector<int32_t> ids(tokens.begin() + from, tokens.end()), positions(n), rows(n, 0);
  for (int32_t i = 0; i < n; ++i) positions[i] = static_cast<int32_t>(from + i);
  HostTensor q = write_kv(spec, model, view, ids, positions, rows);
  HostTensor cu(DType::kInt32, {2});
  cu.data<int32_t>()[0] = 0;
  cu.data<int32_t>()[1] = n;
  HostTensor out(DType::kBF16, {n, kHq, kD});
  out.fill(NAN);
  PrefillArgs p;
  p.q = q;
  p.cu_seqlens_q = cu;
  p.kv_cache = &view;
  p.out = out;
  prefill(spec, p);
  return as_floats(out);
}

// Appends one token to every row and runs decode over the rows; returns [rows, Hq, D].
std::vector<float> decode_step(const AttentionSpec& spec, const TokenModel& model,
                               KvCacheManager& m, const std::vector<SeqId>& seqs,
                               const std::vector<int32_t>& next) {
  std::vector<int32_t> positions, rows;
  for (size_t r = 0; r < seqs.size(); ++r) {
    m.append(seqs[r], std::vector<int32_t>{next[r]});
    positions.push_back(static_cast<int32_t>(m.length(seqs[r]) - 1));
    rows.push_back(static_cast<int32_t>(r));
  }
  const KvBlockTables t = m.block_tables(seqs);
  const KvCacheView view = m.layer_view(0, t.table_view(), t.seq_lens_view());
  HostTensor q = write_kv(spec, model, view, next, positions, rows);
  HostTensor out(DType::kBF16, {static_cast<int64_t>(seqs.size()), kHq, kD});
  out.fill(NAN);
  DecodeArgs d;
  d.q = q;
  d.kv_cache = view;
  d.out = out;
  decode(spec, d);
  return as_floats(out);
}

bool bit_identical(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::vector<int32_t> random_tokens(std::mt19937_64& rng, size_t n) {
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % 32000);
  return t;
}

class KvCacheEndToEnd : public ::testing::TestWithParam<bool> {};

// GetParam(): the reused blocks went through the host tier (offload + onboard) first.
TEST_P(KvCacheEndToEnd, ReusedPrefixGivesBitIdenticalAttention) {
  const bool through_host = GetParam();
  std::mt19937_64 rng(test_seed());
  const TokenModel model{rng()};
  const AttentionSpec spec = causal_spec();
  KvCacheManagerConfig c = e2e_config(8);
  c.host_cache_bytes = through_host ? 8 * KvCacheManager(c).block_bytes() : 0;
  KvCacheManager m(c);
  const auto prompt = random_tokens(rng, 50);
  ASSERT_EQ(m.add(1, prompt), 0);
  prefill_seq(spec, model, m, 1, prompt, 0);
  m.release(1);
  if (through_host) {
    m.add(99, random_tokens(rng, 8 * kT));  // takes every block: the prefix goes to the host
    m.release(99);
    ASSERT_GE(m.stats().offloads, 3);
  }
  auto tokens = prompt;
  const auto suffix = random_tokens(rng, 13);
  tokens.insert(tokens.end(), suffix.begin(), suffix.end());
  ASSERT_EQ(m.add(2, tokens), 48);
  if (through_host) ASSERT_EQ(m.stats().onboards, 3);
  const std::vector<float> reused = prefill_seq(spec, model, m, 2, tokens, 48);

  KvCacheManagerConfig fresh_config = e2e_config(8);
  fresh_config.enable_prefix_reuse = false;
  KvCacheManager fresh(fresh_config);
  ASSERT_EQ(fresh.add(3, tokens), 0);
  const std::vector<float> full = prefill_seq(spec, model, fresh, 3, tokens, 0);
  const std::vector<float> tail(full.end() - reused.size(), full.end());
  EXPECT_TRUE(bit_identical(reused, tail));
  for (float x : reused) ASSERT_FALSE(std::isnan(x));
}

INSTANTIATE_TEST_SUITE_P(PoolAndHostTier, KvCacheEndToEnd, ::testing::Bool());

TEST(KvCacheEndToEndFork, CopyOnWriteGivesTheSameDecodeAsSeparateSequences) {
  std::mt19937_64 rng(test_seed());
  const TokenModel model{rng()};
  const AttentionSpec spec = causal_spec();
  KvCacheManager shared(e2e_config(32));
  KvCacheManagerConfig separate_config = e2e_config(32);
  separate_config.enable_prefix_reuse = false;  // nothing shared: the yardstick
  KvCacheManager separate(separate_config);
  const auto prompt = random_tokens(rng, 21);
  shared.add(1, prompt);
  prefill_seq(spec, model, shared, 1, prompt, 0);
  shared.fork(1, 2);
  for (SeqId s : {1, 2}) {
    separate.add(s, prompt);
    prefill_seq(spec, model, separate, s, prompt, 0);
  }
  for (int step = 0; step < 20; ++step) {  // crosses the block boundary at 32
    const std::vector<int32_t> next = random_tokens(rng, 2);
    const auto a = decode_step(spec, model, shared, {1, 2}, next);
    const auto b = decode_step(spec, model, separate, {1, 2}, next);
    ASSERT_TRUE(bit_identical(a, b)) << "step " << step;
  }
  EXPECT_GE(shared.stats().cow_copies, 1);
  EXPECT_LT(shared.stats().used_blocks, separate.stats().used_blocks);
}

// A pool of NHD blocks and one of HND blocks, driven alike (a prompt, a second request reusing
// its prefix after a trip through the host tier, forks that copy on write, decode steps across a
// block boundary): every output is bit-identical.
TEST(KvCacheEndToEndLayout, NhdPoolGivesTheAttentionOfAnHndPool) {
  std::mt19937_64 rng(test_seed());
  const TokenModel model{rng()};
  const AttentionSpec spec = causal_spec();
  std::vector<std::unique_ptr<KvCacheManager>> pools;
  for (KvCacheLayout layout : {KvCacheLayout::kHND, KvCacheLayout::kNHD}) {
    KvCacheManagerConfig c = e2e_config(8);
    c.layout = layout;
    c.host_cache_bytes = 8 * KvCacheManager(c).block_bytes();
    pools.push_back(std::make_unique<KvCacheManager>(c));
  }
  const auto prompt = random_tokens(rng, 40);
  const auto other = random_tokens(rng, 8 * kT);
  auto tokens = prompt;
  const auto suffix = random_tokens(rng, 7);
  tokens.insert(tokens.end(), suffix.begin(), suffix.end());
  std::vector<std::vector<float>> outputs[2];
  for (int i = 0; i < 2; ++i) {
    KvCacheManager& m = *pools[i];
    m.add(1, prompt);
    outputs[i].push_back(prefill_seq(spec, model, m, 1, prompt, 0));
    m.release(1);
    m.add(99, other);  // every block: the prompt's go to the host tier
    m.release(99);
    EXPECT_EQ(m.add(2, tokens), 32);
    EXPECT_GE(m.stats().onboards, 2);
    outputs[i].push_back(prefill_seq(spec, model, m, 2, tokens, 32));
    m.fork(2, 3);
    for (int step = 0; step < 20; ++step) {  // 47 + 20 tokens cross the block boundary at 48
      const std::vector<int32_t> next = {static_cast<int32_t>(step),
                                         static_cast<int32_t>(7 * step)};
      outputs[i].push_back(decode_step(spec, model, m, {2, 3}, next));
    }
    EXPECT_GE(m.stats().cow_copies, 1);
    m.check_invariants();
  }
  // The same blocks hold the same K and V, in their own order: HND [Hkv, T, D], NHD [T, Hkv, D].
  const std::vector<int32_t> blocks = pools[0]->blocks(2);
  ASSERT_EQ(blocks, pools[1]->blocks(2));
  const int64_t bytes = pools[0]->block_bytes();
  std::vector<uint16_t> hnd(static_cast<size_t>(bytes / 2)), nhd(hnd.size());
  const int64_t length = pools[0]->length(2);
  for (size_t j = 0; j < blocks.size(); ++j) {
    const int32_t b = blocks[j];
    pools[0]->read_block(b, hnd.data());
    pools[1]->read_block(b, nhd.data());
    for (int kv = 0; kv < 2; ++kv) {
      for (int h = 0; h < kHkv; ++h) {
        for (int t = 0; t < kT && static_cast<int64_t>(j) * kT + t < length; ++t) {
          for (int e = 0; e < kD; ++e) {
            ASSERT_EQ(hnd[((kv * kHkv + h) * kT + t) * kD + e],
                      nhd[((kv * kT + t) * kHkv + h) * kD + e])
                << "block " << b << " kv " << kv << " head " << h << " slot " << t;
          }
        }
      }
    }
  }
  ASSERT_EQ(outputs[0].size(), outputs[1].size());
  for (size_t i = 0; i < outputs[0].size(); ++i) {
    for (float x : outputs[1][i]) ASSERT_FALSE(std::isnan(x)) << "call " << i;
    EXPECT_TRUE(bit_identical(outputs[0][i], outputs[1][i])) << "call " << i;
  }
}

TEST(KvCacheEndToEndWindow, CyclicCacheMatchesLinearCacheWithWindowMask) {
  std::mt19937_64 rng(test_seed());
  const TokenModel model{rng()};
  AttentionSpec spec = causal_spec();
  spec.mask.kind = MaskKind::kSlidingWindow;
  spec.mask.window = 20;
  spec.mask.sink_tokens = 2;
  KvCacheManagerConfig cyclic_config = e2e_config(8);
  cyclic_config.layer_windows = {20};
  cyclic_config.sink_tokens = 2;
  KvCacheManager cyclic(cyclic_config);
  KvCacheManager linear(e2e_config(32));
  const auto prompt = random_tokens(rng, 10);
  cyclic.add(1, prompt);
  linear.add(1, prompt);
  ASSERT_TRUE(bit_identical(prefill_seq(spec, model, cyclic, 1, prompt, 0),
                            prefill_seq(spec, model, linear, 1, prompt, 0)));
  for (int step = 0; step < 100; ++step) {
    const std::vector<int32_t> next = random_tokens(rng, 1);
    ASSERT_TRUE(bit_identical(decode_step(spec, model, cyclic, {1}, next),
                              decode_step(spec, model, linear, {1}, next)))
        << "step " << step;
    ASSERT_LE(cyclic.blocks(1).size(), 4u);  // ceil((2 + 48) / 16)
  }
}

// Beam search: rows that read earlier positions through the exported cache_indirection give the
// same decode as sequences holding each beam's gathered history.
TEST(KvCacheEndToEndBeams, IndirectionEqualsGatheredHistories) {
  std::mt19937_64 rng(test_seed());
  const TokenModel model{rng()};
  const AttentionSpec spec = causal_spec();
  KvCacheManager m(e2e_config(32));
  const auto prompt = random_tokens(rng, 20);
  m.add(0, prompt);
  prefill_seq(spec, model, m, 0, prompt, 0);
  m.fork(0, 1);
  const std::vector<SeqId> beams = {0, 1};
  std::vector<std::vector<int32_t>> history = {prompt, prompt};
  constexpr int32_t kMaxSeq = 64;
  for (int step = 0; step < 12; ++step) {
    const std::vector<int32_t> next = random_tokens(rng, 2);
    std::vector<int32_t> positions, rows = {0, 1};
    for (int b = 0; b < 2; ++b) {
      m.append(beams[b], std::vector<int32_t>{next[b]});
      positions.push_back(static_cast<int32_t>(m.length(beams[b]) - 1));
    }
    const KvBlockTables t = m.block_tables(beams);
    const KvCacheView view = m.layer_view(0, t.table_view(), t.seq_lens_view());
    HostTensor q = write_kv(spec, model, view, next, positions, rows);
    const std::vector<int32_t> ind = m.cache_indirection(beams, 2, kMaxSeq);
    HostTensor ind_tensor(DType::kInt32, {1, 2, kMaxSeq});
    std::memcpy(ind_tensor.data<int32_t>(), ind.data(), ind.size() * sizeof(int32_t));
    HostTensor out(DType::kBF16, {2, kHq, kD});
    out.fill(NAN);
    DecodeArgs d;
    d.q = q;
    d.kv_cache = view;
    d.beam_width = 2;
    d.cache_indirection = ind_tensor;
    d.out = out;
    decode(spec, d);

    KvCacheManagerConfig gathered_config = e2e_config(32);
    gathered_config.enable_prefix_reuse = false;
    KvCacheManager gathered(gathered_config);
    for (int b = 0; b < 2; ++b) {
      gathered.add(b, history[b]);
      prefill_seq(spec, model, gathered, b, history[b], 0);
    }
    ASSERT_TRUE(bit_identical(as_floats(out), decode_step(spec, model, gathered, {0, 1}, next)))
        << "step " << step;
    for (int b = 0; b < 2; ++b) history[b].push_back(next[b]);
    const std::vector<int32_t> parents = {static_cast<int32_t>(rng() % 2),
                                          static_cast<int32_t>(rng() % 2)};
    m.reorder_beams(beams, parents);
    history = {history[parents[0]], history[parents[1]]};
  }
}

}  // namespace
}  // namespace attnkit::test
