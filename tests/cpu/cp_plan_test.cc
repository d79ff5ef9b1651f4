// Context parallelism, host logic: the zig-zag plan, the ring schedule (every (q, k) pair
// computed exactly once, masked blocks skipped, load balance), the decode shard layout and the
// in-process transport.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attnkit/context_parallel.h"
#include "common/cp_test_util.h"
#include "common/test_util.h"

namespace attnkit::test {
namespace {

using cp::BlockKind;
using cp::ZigzagPlan;

constexpr int32_t kWorldSizes[] = {1, 2, 3, 4, 8};

// Random lengths with the awkward ones always present: 0, 1, shorter than 2R, not a multiple.
std::vector<int32_t> random_lengths(std::mt19937_64& rng, int32_t count, int32_t longest) {
  std::uniform_int_distribution<int32_t> len(0, longest);
  std::vector<int32_t> lengths{0, 1, 5, longest};
  while (static_cast<int32_t>(lengths.size()) < count) lengths.push_back(len(rng));
  std::shuffle(lengths.begin(), lengths.end(), rng);
  return lengths;
}

TEST(CpPlan, EveryTokenOnOneRankInChunkOrder) {
  std::mt19937_64 rng(test_seed());
  const std::vector<int32_t> cu = cu_seqlens_of(random_lengths(rng, 9, 97));
  for (const int32_t world : kWorldSizes) {
    SCOPED_TRACE("world " + std::to_string(world));
    const ZigzagPlan plan(cu, world);
    std::vector<int32_t> seen(static_cast<size_t>(cu.back()), 0);
    int64_t total = 0;
    for (int32_t r = 0; r < world; ++r) {
      const std::vector<int32_t> rows = plan.global_rows(r);
      ASSERT_EQ(static_cast<int64_t>(rows.size()), plan.local_tokens(r));
      total += plan.local_tokens(r);
      for (const int32_t g : rows) ++seen[g];
      // The local layout: slot 0 then slot 1, each the chunk of every sequence in batch order.
      for (int32_t slot = 0; slot < plan.num_slots(); ++slot) {
        const int32_t chunk = plan.chunk_of(r, slot);
        EXPECT_EQ(chunk, slot == 0 ? r : 2 * world - 1 - r);
        const std::vector<int32_t> slot_cu = plan.slot_cu_seqlens(r, slot);
        ASSERT_EQ(slot_cu.size(), cu.size());
        EXPECT_EQ(slot_cu.back(), plan.slot_tokens(r, slot));
        int32_t longest = 0;
        for (int32_t s = 0; s < plan.num_sequences(); ++s) {
          const int32_t n = slot_cu[s + 1] - slot_cu[s];
          longest = std::max(longest, n);
          EXPECT_EQ(n, plan.chunk_length(s, chunk));
          for (int32_t i = 0; i < n; ++i) {
            EXPECT_EQ(rows[plan.slot_offset(r, slot) + slot_cu[s] + i],
                      cu[s] + plan.chunk_begin(s, chunk) + i);
          }
        }
        EXPECT_EQ(longest, plan.slot_max_seqlen(r, slot));
      }
    }
    EXPECT_EQ(total, plan.total_tokens());
    EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int32_t c) { return c == 1; }));
    // Chunks tile each sequence, their lengths within one of each other.
    for (int32_t s = 0; s < plan.num_sequences(); ++s) {
      int64_t lo = INT64_MAX, hi = 0, next = 0;
      for (int32_t c = 0; c < plan.num_chunks(); ++c) {
        EXPECT_EQ(plan.chunk_begin(s, c), next);
        next += plan.chunk_length(s, c);
        lo = std::min(lo, plan.chunk_length(s, c));
        hi = std::max(hi, plan.chunk_length(s, c));
      }
      EXPECT_EQ(next, cu[s + 1] - cu[s]);
      EXPECT_LE(hi - lo, 1);
    }
  }
}

TEST(CpPlan, WorldSizeOneKeepsTheGlobalLayout) {
  const std::vector<int32_t> cu = cu_seqlens_of({3, 0, 17, 1});
  const ZigzagPlan plan(cu, 1);
  EXPECT_EQ(plan.num_slots(), 1);
  std::vector<int32_t> identity(static_cast<size_t>(cu.back()));
  std::iota(identity.begin(), identity.end(), 0);
  EXPECT_EQ(plan.global_rows(0), identity);
  EXPECT_EQ(plan.slot_cu_seqlens(0, 0), cu);
}

TEST(CpPlan, RejectsBadInput) {
  const std::vector<int32_t> good = cu_seqlens_of({4, 4});
  const auto expect_error = [](const auto& make, const std::string& needle) {
    try {
      make();
      ADD_FAILURE() << "expected an error mentioning " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([&] { ZigzagPlan(good, 0); }, "world_size");
  expect_error([] { ZigzagPlan(std::vector<int32_t>{}, 2); }, "cu_seqlens");
  expect_error([] { ZigzagPlan(std::vector<int32_t>{1, 4}, 2); }, "cu_seqlens");
  expect_error([] { ZigzagPlan(std::vector<int32_t>{0, 4, 3}, 2); }, "non-decreasing");
  expect_error([] { cp::ring_schedule(2, 2, true); }, "rank");
  expect_error([] { cp::ring_schedule(0, 0, true); }, "world_size");
  expect_error([&] { ZigzagPlan(good, 2).chunk_of(0, 2); }, "slot");
}

// The schedules of all ranks, played over a plan: every (query, key) pair the mask allows is
// computed exactly once and no other pair is; the K/V shard a rank holds at step t + 1 is the one
// its left neighbour held at step t (what the ring delivers).
TEST(CpSchedule, EveryAllowedPairExactlyOnce) {
  std::mt19937_64 rng(test_seed());
  const std::vector<int32_t> lengths = random_lengths(rng, 6, 41);
  const std::vector<int32_t> cu = cu_seqlens_of(lengths);
  for (const int32_t world : kWorldSizes) {
    for (const bool causal : {true, false}) {
      SCOPED_TRACE("world " + std::to_string(world) + (causal ? " causal" : " none"));
      const ZigzagPlan plan(cu, world);
      std::vector<std::vector<int32_t>> count(lengths.size());
      for (size_t s = 0; s < lengths.size(); ++s) {
        count[s].assign(static_cast<size_t>(lengths[s]) * lengths[s], 0);
      }
      std::vector<std::vector<cp::RingStep>> schedules;
      for (int32_t r = 0; r < world; ++r) schedules.push_back(cp::ring_schedule(world, r, causal));
      for (int32_t r = 0; r < world; ++r) {
        const auto& steps = schedules[r];
        ASSERT_EQ(static_cast<int32_t>(steps.size()), world);
        EXPECT_EQ(steps[0].kv_rank, r);
        for (int32_t t = 0; t + 1 < world; ++t) {
          EXPECT_EQ(steps[t + 1].kv_rank, schedules[(r + world - 1) % world][t].kv_rank);
        }
        for (const cp::RingStep& step : steps) {
          for (const cp::RingBlock& b : step.blocks) {
            EXPECT_EQ(b.q_chunk, plan.chunk_of(r, b.q_slot));
            EXPECT_EQ(b.kv_chunk, plan.chunk_of(step.kv_rank, b.kv_slot));
            EXPECT_EQ(b.kind == BlockKind::kCausalDiagonal, causal && b.q_chunk == b.kv_chunk);
            for (size_t s = 0; s < lengths.size(); ++s) {
              const int32_t seq = static_cast<int32_t>(s);
              const int64_t q0 = plan.chunk_begin(seq, b.q_chunk);
              const int64_t k0 = plan.chunk_begin(seq, b.kv_chunk);
              for (int64_t i = q0; i < q0 + plan.chunk_length(seq, b.q_chunk); ++i) {
                for (int64_t j = k0; j < k0 + plan.chunk_length(seq, b.kv_chunk); ++j) {
                  const bool attended = b.kind == BlockKind::kFull || j <= i;
                  if (attended) ++count[s][i * lengths[s] + j];
                }
              }
            }
          }
        }
      }
      for (size_t s = 0; s < lengths.size(); ++s) {
        for (int64_t i = 0; i < lengths[s]; ++i) {
          for (int64_t j = 0; j < lengths[s]; ++j) {
            const int32_t expected = !causal || j <= i ? 1 : 0;
            ASSERT_EQ(count[s][i * lengths[s] + j], expected)
                << "sequence " << s << " query " << i << " key " << j;
          }
        }
      }
    }
  }
}

// Zig-zag balance: the attended (q, k) pairs of the ranks differ by less than 2 R c for each
// sequence (c the longest chunk), within one chunk pair (c^2) once chunks are long (c >= 2R),
// and every rank computes the same number of chunk pairs at every step (a causal diagonal
// counting one half).
TEST(CpSchedule, ZigzagBalancesCausalWork) {
  std::mt19937_64 rng(test_seed());
  const std::vector<int32_t> lengths = random_lengths(rng, 8, 300);
  const std::vector<int32_t> cu = cu_seqlens_of(lengths);
  for (const int32_t world : kWorldSizes) {
    SCOPED_TRACE("world " + std::to_string(world));
    const ZigzagPlan plan(cu, world);
    for (size_t s = 0; s < lengths.size(); ++s) {
      const int32_t seq = static_cast<int32_t>(s);
      int64_t chunk = 0;
      for (int32_t c = 0; c < plan.num_chunks(); ++c) {
        chunk = std::max(chunk, plan.chunk_length(seq, c));
      }
      std::vector<int64_t> work;
      for (int32_t r = 0; r < world; ++r) {
        int64_t pairs = 0;
        for (const cp::RingStep& step : cp::ring_schedule(world, r, true)) {
          for (const cp::RingBlock& b : step.blocks) {
            const int64_t nq = plan.chunk_length(seq, b.q_chunk);
            const int64_t nk = plan.chunk_length(seq, b.kv_chunk);
            pairs += b.kind == BlockKind::kFull ? nq * nk : nq * (nq + 1) / 2;
          }
        }
        work.push_back(pairs);
      }
      // Chunk lengths differ by one token, which shifts a rank's work by at most a row of keys
      // per chunk: under 2 R c pairs, less than one chunk pair (c^2) once c >= 2R.
      const auto [lo, hi] = std::minmax_element(work.begin(), work.end());
      EXPECT_LT(*hi - *lo, std::max<int64_t>(2 * world * chunk, 1))
          << "sequence of " << lengths[s] << " tokens";
      if (chunk >= 2 * world) {
        EXPECT_LE(*hi - *lo, chunk * chunk) << "sequence of " << lengths[s] << " tokens";
      }
    }
    for (int32_t r = 0; r < world; ++r) {
      for (const cp::RingStep& step : cp::ring_schedule(world, r, true)) {
        double units = 0;
        for (const cp::RingBlock& b : step.blocks) {
          units += b.kind == BlockKind::kFull ? 1.0 : 0.5;
        }
        EXPECT_DOUBLE_EQ(units, world == 1 ? 0.5 : 2.0) << "rank " << r;
      }
    }
  }
}

TEST(CpDecodeLayout, BlocksRoundRobinAndLocalPositionsDense) {
  for (const int32_t world : kWorldSizes) {
    for (const int32_t t : {1, 8, 16}) {
      const cp::DecodeShardLayout layout{world, t};
      for (const int64_t length : {int64_t{0}, int64_t{1}, int64_t{t}, int64_t{5 * t + 3},
                                   int64_t{world * t * 3 + t - 1}}) {
        std::vector<std::vector<int64_t>> local(static_cast<size_t>(world));
        for (int64_t p = 0; p < length; ++p) {
          const int32_t r = layout.rank_of_position(p);
          EXPECT_EQ(r, (p / t) % world);
          local[r].push_back(layout.local_position(p));
        }
        int64_t longest = 0;
        for (int32_t r = 0; r < world; ++r) {
          // A rank's positions are 0 .. local_length - 1 in global order.
          ASSERT_EQ(static_cast<int64_t>(local[r].size()), layout.local_length(r, length));
          for (size_t i = 0; i < local[r].size(); ++i) EXPECT_EQ(local[r][i], int64_t(i));
          longest = std::max(longest, layout.local_length(r, length));
          EXPECT_LE(layout.local_length(r, length), layout.local_length(0, length));
        }
        EXPECT_LE(longest, (length + world - 1) / world + t);
      }
      std::vector<int32_t> tokens(50);
      std::iota(tokens.begin(), tokens.end(), 1000);
      std::vector<int32_t> joined;
      for (int32_t r = 0; r < world; ++r) {
        const std::vector<int32_t> mine = layout.local_tokens(r, 7, tokens);
        for (size_t i = 0; i < mine.size(); ++i) {
          EXPECT_EQ(layout.rank_of_position(7 + mine[i] - 1000), r);
        }
        joined.insert(joined.end(), mine.begin(), mine.end());
      }
      std::sort(joined.begin(), joined.end());
      EXPECT_EQ(joined, tokens);
    }
  }
  EXPECT_THROW((cp::DecodeShardLayout{0, 16}.validate()), Error);
  EXPECT_THROW((cp::DecodeShardLayout{2, 0}.validate()), Error);
}

// The in-process transport: uneven ring transfers arrive from the left neighbour, all_gather
// concatenates in rank order, repeated calls reuse the group, and mismatched sizes throw on every
// rank.
TEST(CpInProcess, RingExchangeAndAllGather) {
  for (const int32_t world : kWorldSizes) {
    SCOPED_TRACE("world " + std::to_string(world));
    const std::vector<Device> devices(static_cast<size_t>(world), Device::cpu());
    auto group = cp::make_in_process_group(devices, 60.0);
    run_ranks(world, [&](int32_t r) {
      cp::Communicator& comm = *group[r];
      EXPECT_EQ(comm.rank(), r);
      EXPECT_EQ(comm.world_size(), world);
      EXPECT_EQ(comm.comm_stream(), nullptr);
      for (int round = 0; round < 3; ++round) {
        // Rank q sends q + 1 + round values of q * 100 + i.
        const auto values_of = [&](int32_t q) {
          std::vector<int32_t> v(static_cast<size_t>(q + 1 + round));
          for (size_t i = 0; i < v.size(); ++i) v[i] = q * 100 + static_cast<int32_t>(i) + round;
          return v;
        };
        const std::vector<int32_t> mine = values_of(r);
        const int32_t left = (r + world - 1) % world;
        std::vector<int32_t> in(values_of(left).size(), -1);
        const cp::RingTransfer transfer{mine.data(), static_cast<int64_t>(mine.size() * 4),
                                        in.data(), static_cast<int64_t>(in.size() * 4)};
        comm.ring_exchange({&transfer, 1}, nullptr);
        EXPECT_EQ(in, values_of(left)) << "round " << round;
        const int32_t value = r * 7 + round;
        std::vector<int32_t> all(static_cast<size_t>(world), -1);
        comm.all_gather(&value, all.data(), 4, nullptr);
        for (int32_t q = 0; q < world; ++q) EXPECT_EQ(all[q], q * 7 + round);
      }
    });
    // A send that its receiver does not expect: every rank throws.
    std::vector<int> threw(static_cast<size_t>(world), 0);
    run_ranks(world, [&](int32_t r) {
      std::vector<uint8_t> out(8), in(8);
      const cp::RingTransfer transfer{out.data(), r == 0 ? 8 : 4, in.data(), 4};
      try {
        group[r]->ring_exchange({&transfer, 1}, nullptr);
      } catch (const Error& e) {
        threw[r] = std::string(e.what()).find("ring_exchange") != std::string::npos;
      }
    });
    EXPECT_TRUE(std::all_of(threw.begin(), threw.end(), [](int t) { return t == 1; }));
  }
}

TEST(CpInProcess, ARankLeftAloneTimesOut) {
  const std::vector<Device> devices(2, Device::cpu());
  auto group = cp::make_in_process_group(devices, 0.2);
  int32_t value = 1, all[2];
  try {
    group[0]->all_gather(&value, all, 4, nullptr);
    ADD_FAILURE() << "rank 0 returned without rank 1";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("waited"), std::string::npos) << e.what();
  }
  // The group is unusable afterwards.
  EXPECT_THROW(group[1]->all_gather(&value, all, 4, nullptr), Error);
  EXPECT_THROW(cp::make_in_process_group({}, 1.0), Error);
  const std::vector<Device> mixed{Device::cpu(), Device::cuda(0)};
  EXPECT_THROW(cp::make_in_process_group(mixed, 1.0), Error);
}

TEST(CpNccl, UnavailableWithoutNcclRaises) {
  if (cp::nccl_available()) GTEST_SKIP() << "NCCL is available: covered by the gpu tests";
  EXPECT_THROW(cp::nccl_unique_id(), Error);
  EXPECT_THROW(cp::make_nccl_communicator(cp::NcclUniqueId{}, 0, 1, 0), Error);
}

}  // namespace
}  // namespace attnkit::test
