// The replay engine (tools/replay_engine.cc) on a tiny trace: its checks pass and can fail, every
// request finishes, and the generated tokens do not depend on how the work was scheduled or
// cached (prefix reuse, host tier, chunk sizes, page size), since the sampled tokens are hashes
// of bit-exact reference outputs.
#include <gtest/gtest.h>

#include <string>

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

}  // namespace
}  // namespace attnkit::tools
