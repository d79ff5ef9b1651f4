// The replay engine (tools/replay_engine.cc) on a tiny trace: its checks pass and can fail, every
// request finishes, and the generated tokens do not depend on how the work was scheduled or
// cached (prefix reuse, host tier, chunk sizes, page size), since the sampled tokens are hashes
// of bit-exact reference outputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "attnkit/types.h"
#include "common/test_util.h"
#include "replay_engine.h"

namespace attnkit::tools {
namespace {

// Small heads and short prompts keep a whole trace under a second on one core.
ReplayOptions tiny_options() {
  ReplayOptions o;
  o.layers = 2;
  o.num_q_heads = 4;
  o.num_kv_heads = 2;
  o.head_dim = 64;
  o.seed = attnkit::test::test_seed();
  o.requests = 16;
  o.arrival_rate = 2.0;
  o.system_prompts = 4;
  o.system_prompt_len = 40;
  o.min_user_len = 1;
  o.max_user_len = 40;
  o.min_output_len = 1;
  o.max_output_len = 12;
  o.beam_fraction = 0.4;
  o.beam_width = 3;
  o.max_batch_tokens = 48;
  o.max_batch_requests = 8;
  o.tokens_per_block = 8;
  o.cache_tokens = 512;
  o.host_cache_mb = 0.25;
  o.check_every = 1;
  return o;
}

TEST(Replay, TinyTracePassesEveryCheck) {
  const ReplayOptions o = tiny_options();
  const ReplayResult r = run_replay(o);
  EXPECT_EQ(r.requests, o.requests);
  EXPECT_EQ(r.checks_failed, 0) << (r.failures.empty() ? "" : r.failures.front());
  EXPECT_GT(r.checks_passed, r.steps);  // every step, at least one sequence per batch
  EXPECT_EQ(r.max_check_error, 0.0);    // CPU: bit-exact
  EXPECT_GT(r.generated_tokens, 0);
  EXPECT_EQ(r.computed_prompt_tokens + r.reused_tokens, r.prompt_tokens);
  EXPECT_GT(r.cache.hits, 0);         // shared system prompts
  EXPECT_EQ(r.cache.used_blocks, 0);  // everything released
}

TEST(Replay, TokensDoNotDependOnSchedulingOrCaching) {
  const ReplayOptions base = tiny_options();
  const uint64_t digest = run_replay(base).trace_digest;
  for (int variant = 0; variant < 4; ++variant) {
    ReplayOptions o = base;
    o.check_every = 0;
    std::string what;
    switch (variant) {
      case 0:
        o.prefix_reuse = false;
        what = "prefix reuse off";
        break;
      case 1:
        o.max_batch_tokens = 16;  // more, smaller chunks
        what = "max_batch_tokens 16";
        break;
      case 2:
        o.tokens_per_block = 16;
        o.host_cache_mb = 0;
        what = "page 16, no host tier";
        break;
      case 3:
        o.cache_tokens = 320;  // more evictions, host-tier traffic
        o.max_batch_requests = 2;
        what = "small pool, 2 requests in flight";
        break;
    }
    const ReplayResult r = run_replay(o);
    EXPECT_EQ(r.requests, o.requests) << what;
    EXPECT_EQ(r.trace_digest, digest) << what;
  }
}

TEST(Replay, QuantizedCachePassesChecks) {
  for (DType dtype : {DType::kFp8E4M3, DType::kInt8}) {
    ReplayOptions o = tiny_options();
    o.requests = 6;
    o.kv_dtype = dtype;
    const ReplayResult r = run_replay(o);
    EXPECT_EQ(r.checks_failed, 0) << dtype_name(dtype);
    EXPECT_GT(r.checks_passed, 0) << dtype_name(dtype);
  }
}

TEST(Replay, CorruptedOutputFailsTheCheck) {
  ReplayOptions o = tiny_options();
  o.requests = 4;
  o.inject_fault = true;
  const ReplayResult r = run_replay(o);
  EXPECT_GT(r.checks_failed, 0);
  ASSERT_FALSE(r.failures.empty());
  EXPECT_NE(r.failures.front().find("bit-exact"), std::string::npos) << r.failures.front();
}

TEST(Replay, RejectsInconsistentOptions) {
  ReplayOptions o = tiny_options();
  o.cache_tokens = 64;  // smaller than the largest request
  try {
    run_replay(o);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--cache-tokens"), std::string::npos) << e.what();
  }
  o = tiny_options();
  o.max_batch_tokens = 4;  // below one page
  EXPECT_THROW(run_replay(o), Error);
  o = tiny_options();
  o.beam_fraction = 1.5;
  EXPECT_THROW(run_replay(o), Error);
}

TEST(Replay, SampledRowsAndCheckThreadsGiveTheSameVerdicts) {
  ReplayOptions o = tiny_options();
  const ReplayResult all_rows = run_replay(o);
  // A few rows of each chunk, each recomputed alone over the keys up to it: still bit-exact, and
  // one check per sequence as before.
  o.check_rows = 3;
  const ReplayResult sampled = run_replay(o);
  EXPECT_EQ(sampled.checks_failed, 0) << (sampled.failures.empty() ? "" : sampled.failures.front());
  EXPECT_EQ(sampled.checks_passed, all_rows.checks_passed);
  EXPECT_EQ(sampled.max_check_error, 0.0);
  EXPECT_EQ(sampled.trace_digest, all_rows.trace_digest);
  // The same checks on host threads beside the step loop.
  o.check_threads = 2;
  const ReplayResult pooled = run_replay(o);
  EXPECT_EQ(pooled.checks_passed, sampled.checks_passed);
  EXPECT_EQ(pooled.checks_failed, 0);
  EXPECT_EQ(pooled.trace_digest, all_rows.trace_digest);
  EXPECT_EQ(pooled.check_threads, 2);
  EXPECT_GT(pooled.check_cpu_seconds, 0.0);
  // And a corrupted element still fails there.
  o.requests = 4;
  o.inject_fault = true;
  const ReplayResult faulty = run_replay(o);
  EXPECT_GT(faulty.checks_failed, 0);
  ASSERT_FALSE(faulty.failures.empty());
  EXPECT_NE(faulty.failures.front().find("bit-exact"), std::string::npos);
}

TEST(Replay, ReportsForwardTimeAndTheTokenMixOfEveryStep) {
  const ReplayOptions o = tiny_options();
  const ReplayResult r = run_replay(o);
  ASSERT_EQ(static_cast<int64_t>(r.step_log.size()), r.steps);
  int64_t context = 0, generation = 0;
  double forward = 0;
  int64_t by_kind[3] = {0, 0, 0};
  for (const ReplayStep& step : r.step_log) {
    context += step.context_tokens;
    generation += step.generation_tokens;
    forward += step.forward_seconds;
    EXPECT_GT(step.context_tokens + step.generation_tokens, 0);
    EXPECT_LE(step.context_tokens + step.generation_tokens,
              o.max_batch_tokens + o.max_batch_requests * o.beam_width);
    ++by_kind[static_cast<int>(step_kind(step))];
  }
  EXPECT_EQ(context, r.computed_prompt_tokens);
  EXPECT_EQ(generation, r.decode_tokens);
  EXPECT_NEAR(forward, r.forward_seconds, 1e-9 * static_cast<double>(r.steps));
  EXPECT_NEAR(r.prefill_seconds + r.decode_seconds, r.forward_seconds, 1e-9 * r.forward_seconds);
  EXPECT_GT(r.forward_seconds, 0.0);
  EXPECT_GT(r.check_seconds, 0.0);  // inline checks, every step
  EXPECT_LE(r.forward_seconds + r.check_seconds, r.wall_seconds);
  // The tiny trace has prefill-only steps (the first), decode-only ones (the tail) and mixed ones.
  for (StepKind kind : {StepKind::kPrefill, StepKind::kDecode, StepKind::kMixed}) {
    const StepStats s = summarize_steps(r.step_log, &kind);
    EXPECT_EQ(s.steps, by_kind[static_cast<int>(kind)]) << step_kind_name(kind);
    EXPECT_GT(s.steps, 0) << step_kind_name(kind);
    EXPECT_LE(s.p50_seconds, s.p90_seconds);
    EXPECT_LE(s.p90_seconds, s.p99_seconds);
    EXPECT_LE(s.p99_seconds, s.max_seconds);
  }
  const StepStats all = summarize_steps(r.step_log);
  EXPECT_EQ(all.steps, r.steps);
  EXPECT_NEAR(all.mean_context_tokens * static_cast<double>(all.steps),
              static_cast<double>(r.computed_prompt_tokens), 1e-6 * static_cast<double>(context));
}

TEST(Replay, StepPercentilesAreNearestRank) {
  // Steps of 1..100 ms in a shuffled order, decode-only, plus mixed steps of 1 s.
  std::vector<ReplayStep> steps;
  std::mt19937_64 rng(attnkit::test::test_seed());
  std::vector<int> ms(100);
  for (int i = 0; i < 100; ++i) ms[i] = i + 1;
  std::shuffle(ms.begin(), ms.end(), rng);
  for (int m : ms) steps.push_back({0, 4, m * 1e-3});
  for (int i = 0; i < 10; ++i) steps.push_back({16, 2, 1.0});
  const StepKind decode = StepKind::kDecode, mixed = StepKind::kMixed, prefill = StepKind::kPrefill;
  const StepStats d = summarize_steps(steps, &decode);
  EXPECT_EQ(d.steps, 100);
  EXPECT_DOUBLE_EQ(d.p50_seconds, 50e-3);
  EXPECT_DOUBLE_EQ(d.p90_seconds, 90e-3);
  EXPECT_DOUBLE_EQ(d.p99_seconds, 99e-3);
  EXPECT_DOUBLE_EQ(d.max_seconds, 100e-3);
  EXPECT_DOUBLE_EQ(d.mean_generation_tokens, 4.0);
  EXPECT_DOUBLE_EQ(d.mean_context_tokens, 0.0);
  const StepStats m = summarize_steps(steps, &mixed);
  EXPECT_EQ(m.steps, 10);
  EXPECT_DOUBLE_EQ(m.p50_seconds, 1.0);
  EXPECT_DOUBLE_EQ(m.mean_context_tokens, 16.0);
  EXPECT_EQ(summarize_steps(steps, &prefill).steps, 0);
  const StepStats all = summarize_steps(steps);
  EXPECT_EQ(all.steps, 110);
  EXPECT_DOUBLE_EQ(all.p90_seconds, 99e-3);  // rank 99 of 110
  EXPECT_DOUBLE_EQ(all.p99_seconds, 1.0);
}

}  // namespace
}  // namespace attnkit::tools
