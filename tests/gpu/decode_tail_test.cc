// Tail splits of the split-KV decode (decode_tail_splits, decode_split_range, the split-major
// grid): when the heuristic splits into splits of at least 16k keys, each (row, KV head, head
// block) item gets kDecodeTailSplits more splits over the last 1/8 of its tiles, dispatched after
// every big split. The rule's counts on the host; then calls whose max_seq_len hint makes the
// heuristic take tails (rows stay short: the oracle's cost and the host pool), against the fp64
// oracle of decode_case_util.h: the split count checked through the caller workspace's written
// partials, rows of different lengths (empty tail splits, rows shorter than one tile), every page
// size of the 8-bit head_dim 128 kernel (4-CTA grid) and its 2-CTA kernel (ALiBi + soft-cap),
// window + sinks, both workspaces, a workspace too small for the tails (no tails, no rejection),
// and a captured graph replayed with the workspace counters checked.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "attnkit/attention.h"
#include "cuda/decode/decode_launch.h"
#include "gpu/decode_case_util.h"
#include "gpu/gpu_util.h"

namespace attnkit::test {
namespace {

int sm_count() {
  int count = 0;
  EXPECT_EQ(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  return count > 1 ? count : 2;
}

// Groups of 4 heads over 2 KV heads, head_dim 128, page 32, sm_count / 2 rows: as many CTAs as
// SMs, so that the heuristic takes 2 splits (2 CTAs per SM; the 8-bit 4-CTA kernel: 4) and, with a
// max_seq_len hint of 32k (64k), splits of 16k keys and the tails. Rows repeat `lengths`.
DecodeCase tail_case(const std::vector<int32_t>& lengths, int32_t max_seq_len) {
  DecodeCase c;
  c.hq = 8;
  c.hkv = 2;
  c.page = 32;
  const int rows = sm_count() / 2;
  for (int r = 0; r < rows; ++r) c.seq_lens.push_back(lengths[r % lengths.size()]);
  c.max_seq_len = max_seq_len;
  return c;
}

std::unique_ptr<DecodeWorkspace> make_workspace(int64_t rows, int32_t max_splits) {
  AttentionSpec sizing;
  sizing.num_q_heads = 8;
  sizing.num_kv_heads = 1;
  sizing.head_dim = 128;
  return std::make_unique<DecodeWorkspace>(sizing, rows, max_splits, Device::cuda(0));
}

// Fills the workspace's partials with NaN (before a call) and counts the floats written (after).
void poison_partials(const DecodeWorkspace& ws) {
  ATTNKIT_CUDA_OK(cudaMemset(ws.partials(), 0xff, ws.partial_capacity() * sizeof(float)));
}
int64_t written_partials(const DecodeWorkspace& ws) {
  std::vector<float> host(static_cast<size_t>(ws.partial_capacity()));
  EXPECT_EQ(
      cudaMemcpy(host.data(), ws.partials(), host.size() * sizeof(float), cudaMemcpyDeviceToHost),
      cudaSuccess);
  int64_t written = 0;
  for (float x : host) written += !std::isnan(x);
  return written;
}

// Runs the case through the caller workspace `ws` (the partials of `splits` splits written, the
// counters zero after), then through the per-call workspace; outputs poisoned before each call.
void run_with_splits(const DecodeCase& c, uint64_t salt, DecodeWorkspace* ws, int32_t splits) {
  SCOPED_TRACE(c.str());
  PreparedCase pc(c, salt);
  for (DecodeWorkspace* w : {ws, static_cast<DecodeWorkspace*>(nullptr)}) {
    SCOPED_TRACE(w != nullptr ? "caller workspace" : "per-call workspace");
    pc.args.workspace = w;
    pc.poison(nullptr);
    if (w != nullptr) poison_partials(*w);
    ASSERT_NO_THROW(decode(pc.spec, pc.args, nullptr));
    ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
    pc.check();
    if (w != nullptr) {
      EXPECT_EQ(written_partials(*w), static_cast<int64_t>(splits) *
                                          static_cast<int64_t>(c.seq_lens.size()) * c.hq *
                                          (c.head_dim + 1))
          << "partials written: not " << splits << " splits";
      expect_counters_zero(*w);
    }
  }
}

// The splits the heuristic takes for tail_case(..., max_seq_len): its count at `ctas_per_sm`
// CTAs per SM plus the tails; skips the test on a device where the rule takes no tails there.
int32_t expected_splits(int ctas_per_sm, int64_t max_seq_len, int tile_n) {
  const int sms = sm_count();
  const int32_t base = cuda::decode_num_splits(sms / 2 * 2, ctas_per_sm, sms, max_seq_len, tile_n);
  return base + cuda::decode_tail_splits(base, max_seq_len);
}

TEST(DecodeTailHeuristic, TailsForSplitsOfAtLeast16kKeys) {
  using cuda::decode_tail_splits;
  EXPECT_EQ(decode_tail_splits(1, 1 << 20), 0);  // no split: the merge would be new
  EXPECT_EQ(decode_tail_splits(2, 32768), 4);
  EXPECT_EQ(decode_tail_splits(2, 32766), 0);
  EXPECT_EQ(decode_tail_splits(4, 65536), 4);
  EXPECT_EQ(decode_tail_splits(4, 32768), 0);  // fp8 16 x 32k: 4 splits of 8k
  EXPECT_EQ(decode_tail_splits(32, 32768), 0);
  EXPECT_EQ(decode_tail_splits(32, 1 << 19), 4);
  EXPECT_EQ(decode_tail_splits(124, 1 << 22), 4);
  EXPECT_EQ(decode_tail_splits(125, 1 << 22), 0);  // at most kDecodeMaxSplits splits
}

// bf16 rows of different lengths (one key, a tile, a tile and one key, up to 1500 keys): each row's
// own tiles are cut into 2 big splits and 4 tails (empty tails on the short rows), under a
// max_seq_len hint whose early-ramp guesses do not match.
TEST(DecodeTail, HeuristicTailsRowsOfDifferentLengths) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  const int32_t splits = expected_splits(2, 32768, 64);
  if (splits <= 2) GTEST_SKIP() << "the heuristic takes no tails for this shape on this device";
  const DecodeCase c = tail_case({1, 64, 65, 300, 1500, 777, 1023, 129}, 32768);
  auto ws = make_workspace(static_cast<int64_t>(c.seq_lens.size()), DecodeWorkspace::kMaxSplits);
  run_with_splits(c, 7000, ws.get(), splits);
  DecodeCase f16 = tail_case({1400, 3, 640}, 40000);
  f16.dtype = f16.kv_dtype = DType::kF16;
  run_with_splits(f16, 7001, ws.get(), expected_splits(2, 40000, 64));
}

// fp8 and int8 at head_dim 128 (128-key tiles) at every page size: 4 splits of 16k on the 4-CTA
// kernel plus the tails (1056 CTAs on the H200); and the 2-CTA kernel (ALiBi + soft-cap) with 2.
TEST(DecodeTail, HeuristicTailsQuantizedKvEveryPageSize) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  const int32_t splits = expected_splits(4, 65536, 128);
  if (splits <= 4) GTEST_SKIP() << "the heuristic takes no tails for this shape on this device";
  auto ws = make_workspace(sm_count() / 2, DecodeWorkspace::kMaxSplits);
  uint64_t salt = 7100;
  for (int32_t page : {8, 16, 32, 64, 128}) {
    for (DType kv : {DType::kFp8E4M3, DType::kInt8}) {
      DecodeCase c = tail_case({1, 127, 129, 700, 1100}, 65536);
      c.page = page;
      c.kv_dtype = kv;
      c.per_head_scale = kv == DType::kInt8;
      run_with_splits(c, salt++, ws.get(), splits);
    }
  }
  DecodeCase a = tail_case({900, 50, 333}, 32768);
  a.kv_dtype = DType::kFp8E4M3;
  a.alibi = true;
  a.softcap = 30.0;
  a.q_range = 4.0f;
  run_with_splits(a, salt++, ws.get(), expected_splits(2, 32768, 128));
}

// A sliding window with sinks: the heuristic counts the window's keys (W + S >= 32k: tails), the
// rows are shorter than the window.
TEST(DecodeTail, HeuristicTailsWindowSinks) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  const int32_t splits = expected_splits(2, 32772, 64);
  if (splits <= 2) GTEST_SKIP() << "the heuristic takes no tails for this shape on this device";
  DecodeCase w = tail_case({1200, 31, 700}, 40000);
  w.mask.kind = MaskKind::kSlidingWindow;
  w.mask.window = 32768;
  w.mask.sink_tokens = 4;
  auto ws = make_workspace(static_cast<int64_t>(w.seq_lens.size()), DecodeWorkspace::kMaxSplits);
  run_with_splits(w, 7200, ws.get(), splits);
  // A window that bounds the keys below 32k: no tails.
  DecodeCase narrow = w;
  narrow.mask.window = 20000;
  run_with_splits(narrow, 7201, ws.get(), expected_splits(2, 20004, 64));
}

// A caller workspace sized for the heuristic's own count holds no tails: the call runs without
// them (2 splits), never rejected for them.
TEST(DecodeTail, WorkspaceTooSmallForTheTails) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  if (expected_splits(2, 32768, 64) <= 2) GTEST_SKIP() << "no tails for this shape here";
  const DecodeCase c = tail_case({1000, 1, 64}, 32768);
  auto ws = make_workspace(static_cast<int64_t>(c.seq_lens.size()), 2);
  run_with_splits(c, 7250, ws.get(), 2);
}

// Tail-split calls captured in one graph (through the caller workspace and through per-call
// workspaces), replayed three times with the outputs poisoned before each replay and the
// workspace counters zero after each.
TEST(DecodeTail, CapturedGraphReplays) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  if (expected_splits(2, 32768, 64) <= 2) GTEST_SKIP() << "no tails for this shape here";
  const int64_t rows = sm_count() / 2;
  auto ws = make_workspace(rows, DecodeWorkspace::kMaxSplits);
  std::vector<std::unique_ptr<PreparedCase>> prepared;
  uint64_t salt = 7300;
  for (DType kv : {DType::kBF16, DType::kFp8E4M3}) {
    for (bool caller : {true, false}) {
      DecodeCase c = tail_case({1100, 90, 513}, kv == DType::kBF16 ? 32768 : 65536);
      c.kv_dtype = kv;
      prepared.push_back(std::make_unique<PreparedCase>(c, salt++));
      if (caller) prepared.back()->args.workspace = ws.get();
    }
  }
  cudaStream_t stream = nullptr;
  ATTNKIT_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  capture_decode_calls(prepared, stream, &graph, &exec);
  if (HasFatalFailure()) return;
  for (int replay = 0; replay < 3; ++replay) {
    SCOPED_TRACE(detail::concat("replay ", replay));
    replay_and_check(prepared, exec, stream);
    expect_counters_zero(*ws);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace attnkit::test
