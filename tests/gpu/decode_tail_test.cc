// Tail splits of the split-KV decode (decode_split_range, the split-major grid): each (row, KV
// head, head block) gets big splits over the first part of its tiles and small tail splits over
// the rest, dispatched after every big split. Against the fp64 oracle of decode_case_util.h: rows
// of different lengths (shorter than a big split, empty tail splits), every page size of the
// 8-bit head_dim 128 kernel (2- and 4-CTA), bf16 / f16 / fp8 / int8, window + sinks, ALiBi and
// soft-cap, both workspaces, a mismatching early-ramp guess, and a captured graph replayed with the
// workspace counters checked.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "gpu/decode_case_util.h"
#include "gpu/gpu_util.h"

namespace attnkit::test {
namespace {

// EXPERIMENT (round 1): tail splits are selected by ATTNKIT_EXP_TAIL="E,N[,B]" (N tail splits over
// the last E/64 of each row's tiles after B big splits) for heuristic calls.
class ScopedTail {
 public:
  explicit ScopedTail(const std::string& config) { setenv("ATTNKIT_EXP_TAIL", config.c_str(), 1); }
  ~ScopedTail() { unsetenv("ATTNKIT_EXP_TAIL"); }
  ScopedTail(const ScopedTail&) = delete;
  ScopedTail& operator=(const ScopedTail&) = delete;
};

const std::vector<std::string> kTailConfigs = {"8,1", "16,2", "8,3,2", "4,5,3", "32,7,1"};

DecodeCase gqa4_case(std::vector<int32_t> seq_lens, int32_t hkv = 2) {
  DecodeCase c;
  c.hq = 4 * hkv;
  c.hkv = hkv;
  c.page = 32;
  c.seq_lens = std::move(seq_lens);
  return c;
}

std::unique_ptr<DecodeWorkspace> make_workspace(int32_t hq, int64_t rows) {
  AttentionSpec sizing;
  sizing.num_q_heads = hq;
  sizing.num_kv_heads = 1;
  sizing.head_dim = 256;
  return std::make_unique<DecodeWorkspace>(sizing, rows, DecodeWorkspace::kMaxSplits,
                                           Device::cuda(0));
}

// Runs the case through the caller workspace `ws` (counters checked after), then through the
// per-call workspace; outputs poisoned before each call.
void run_both_workspaces(const DecodeCase& c, uint64_t salt, DecodeWorkspace* ws) {
  SCOPED_TRACE(c.str());
  PreparedCase pc(c, salt);
  for (DecodeWorkspace* w : {ws, static_cast<DecodeWorkspace*>(nullptr)}) {
    SCOPED_TRACE(w != nullptr ? "caller workspace" : "per-call workspace");
    pc.args.workspace = w;
    pc.poison(nullptr);
    ASSERT_NO_THROW(decode(pc.spec, pc.args, nullptr));
    ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
    pc.check();
    if (w != nullptr) expect_counters_zero(*w);
  }
}

// Rows of different lengths: one key, one tile, a tile and a key, rows shorter than one big split
// (their tail splits and some big splits are empty) and longer rows whose tiles do not divide.
TEST(DecodeTail, RowsOfDifferentLengths) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  auto ws = make_workspace(8, 6);
  uint64_t salt = 7000;
  for (const std::string& config : kTailConfigs) {
    SCOPED_TRACE("tail " + config);
    ScopedTail tail(config);
    run_both_workspaces(gqa4_case({1, 64, 65, 300, 4100, 2049}), salt++, ws.get());
  }
}

// The 8-bit head_dim 128 kernel (128-key tiles) at every page size, fp8 and int8: a narrow grid
// (the 2-CTA kernel), and at three of them 4 rows x 32 KV heads with 4 big splits (640 or 768
// CTAs: the 4-CTA kernel).
TEST(DecodeTail, QuantizedKvEveryPageSize) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  auto ws = make_workspace(128, 4);
  uint64_t salt = 7100;
  for (int32_t page : {8, 16, 32, 64, 128}) {
    for (DType kv : {DType::kFp8E4M3, DType::kInt8}) {
      DecodeCase c = gqa4_case({1, 127, 129, 1500}, 2);
      c.page = page;
      c.kv_dtype = kv;
      c.per_head_scale = kv == DType::kInt8;
      {
        ScopedTail tail("8,3");
        run_both_workspaces(c, salt++, ws.get());
      }
      // The wide grid at three page sizes (its oracle is the test's cost).
      if ((page == 16 && kv == DType::kFp8E4M3) || (page == 32 && kv == DType::kInt8) ||
          (page == 128 && kv == DType::kFp8E4M3)) {
        DecodeCase wide = gqa4_case({600, 300, 129, 520}, 32);
        wide.page = page;
        wide.kv_dtype = kv;
        ScopedTail tail(page == 32 ? "8,2,4" : "16,1,4");
        run_both_workspaces(wide, salt++, ws.get());
      }
    }
  }
}

// bf16 and f16 queries, sliding window with sinks over a cyclic cache, ALiBi with soft-cap, and an
// early-ramp guess that does not match (max_seq_len past the longest row).
TEST(DecodeTail, WindowSinksAlibiSoftcapAndGuesses) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  auto ws = make_workspace(8, 3);
  uint64_t salt = 7200;
  for (const std::string& config : {std::string("8,2"), std::string("16,3,2")}) {
    SCOPED_TRACE("tail " + config);
    ScopedTail tail(config);
    DecodeCase w = gqa4_case({3000, 700, 1});
    w.mask.kind = MaskKind::kSlidingWindow;
    w.mask.window = 1000;
    w.mask.sink_tokens = 4;
    w.cyclic = true;
    run_both_workspaces(w, salt++, ws.get());
    DecodeCase a = gqa4_case({2500, 50, 999});
    a.alibi = true;
    a.softcap = 30.0;
    a.q_range = 4.0f;
    a.dtype = a.kv_dtype = DType::kF16;
    run_both_workspaces(a, salt++, ws.get());
    DecodeCase g = gqa4_case({2049, 1000, 64});
    g.max_seq_len = 4000;
    run_both_workspaces(g, salt++, ws.get());
    DecodeCase f = gqa4_case({2049, 1000, 64});
    f.kv_dtype = DType::kFp8E4M3;
    f.max_seq_len = 2050;
    run_both_workspaces(f, salt++, ws.get());
  }
}

// Tail-split calls captured in one graph (through the caller workspace and through per-call
// workspaces), replayed three times with the outputs poisoned before each replay and the
// workspace counters zero after each.
TEST(DecodeTail, CapturedGraphReplays) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  auto ws = make_workspace(8, 2);
  std::vector<std::unique_ptr<PreparedCase>> prepared;
  cudaStream_t stream = nullptr;
  ATTNKIT_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  {
    ScopedTail tail("8,3");
    uint64_t salt = 7300;
    for (DType kv : {DType::kBF16, DType::kFp8E4M3}) {
      for (bool caller : {true, false}) {
        DecodeCase c = gqa4_case({2100, 900});
        c.kv_dtype = kv;
        prepared.push_back(std::make_unique<PreparedCase>(c, salt++));
        if (caller) prepared.back()->args.workspace = ws.get();
      }
    }
    capture_decode_calls(prepared, stream, &graph, &exec);
  }
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
