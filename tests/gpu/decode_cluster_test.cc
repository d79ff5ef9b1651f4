// The cluster reduction of split-KV decode (sm_90+: clusters of up to 16 consecutive splits of
// one (row, KV head) merge their partials through distributed shared memory; one cluster per
// (row, KV head) writes the output itself, more write one partial per cluster for the last CTA's
// merge) against the fp64 oracle of decode_case_util.h. Split counts are forced (multiples of the
// cluster size and not, whose padded splits are empty), with empty splits, rows of different
// lengths, groups of 4 / 8 / 16 / 32 heads, 8-bit caches, window + sinks, ALiBi and soft-cap,
// through a caller DecodeWorkspace and without, and in a captured graph replayed several times.
// On devices below compute capability 9.0 the same calls run the global merge and must pass too.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "attnkit/attention.h"
#include "gpu/decode_case_util.h"
#include "gpu/gpu_util.h"

namespace attnkit::test {
namespace {

// GQA 32/8, head_dim 128, page 32: the shape of the batch-1 long-context target (groups of 4).
DecodeCase llama_case(std::vector<int32_t> seq_lens, int32_t splits) {
  DecodeCase c;
  c.hq = 32;
  c.hkv = 8;
  c.page = 32;
  c.seq_lens = std::move(seq_lens);
  c.num_splits = splits;
  return c;
}

// Runs the case through the caller workspace `ws` twice (the second call finds the counters the
// first one reset), then once through the per-call workspace; outputs poisoned before each call.
void run_both_workspaces(const DecodeCase& c, uint64_t salt, DecodeWorkspace* ws) {
  SCOPED_TRACE(c.str());
  PreparedCase pc(c, salt);
  for (int call = 0; call < 3; ++call) {
    SCOPED_TRACE(call < 2 ? "caller workspace" : "per-call workspace");
    pc.args.workspace = call < 2 ? ws : nullptr;
    pc.poison(nullptr);
    ASSERT_NO_THROW(decode(pc.spec, pc.args, nullptr));
    ATTNKIT_CUDA_OK(cudaDeviceSynchronize());
    pc.check();
  }
}

std::unique_ptr<DecodeWorkspace> make_workspace(int32_t hq, int64_t rows) {
  AttentionSpec sizing;
  sizing.num_q_heads = hq;
  sizing.num_kv_heads = 1;
  sizing.head_dim = 256;
  return std::make_unique<DecodeWorkspace>(sizing, rows, DecodeWorkspace::kMaxSplits,
                                           Device::cuda(0));
}

// Split counts that are multiples of 2, 4, 8, 16 (one cluster per KV head up to 16, then 2-4
// clusters) and counts that are not (3, 5, 7, 12, 20, 24, 31: the grid is padded with empty
// splits), batch 1 at 32k and 5k keys, through a caller workspace and without.
TEST(DecodeCluster, ForcedSplitCountsBatchOne) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  auto ws = make_workspace(32, 1);
  uint64_t salt = 3000;
  for (int32_t splits : {16, 32, 20, 0}) {
    run_both_workspaces(llama_case({32768}, splits), salt++, ws.get());
  }
  for (int32_t splits : {2, 4, 8, 16, 32, 64, 3, 5, 7, 12, 20, 24, 31, 0}) {
    run_both_workspaces(llama_case({5001}, splits), salt++, ws.get());
  }
}

// Empty splits: contexts shorter than splits x tile (1 key, one tile, a tile and one key, a
// few tiles) so that most CTAs of a cluster, or whole clusters, have no key.
TEST(DecodeCluster, EmptySplitsAndShortRows) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  auto ws = make_workspace(32, 4);
  uint64_t salt = 3100;
  for (int32_t splits : {16, 32, 8, 6}) {
    for (const std::vector<int32_t>& lens :
         std::vector<std::vector<int32_t>>{{1}, {64}, {65}, {300}, {1, 64, 65, 300}}) {
      const DecodeCase c = llama_case(lens, splits);
      run_both_workspaces(c, salt++, ws.get());
    }
  }
}

// Batches of rows of different lengths (2 and 4 rows of long contexts: one cluster of 16 or 8
// splits per (row, KV head) under the heuristic), forced counts as well.
TEST(DecodeCluster, RowsOfDifferentLengths) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  auto ws = make_workspace(32, 4);
  uint64_t salt = 3200;
  for (int32_t splits : {0, 16, 8, 4, 10}) {
    for (const std::vector<int32_t>& lens : std::vector<std::vector<int32_t>>{
             {20000, 7000}, {9000, 1, 4097, 12000}, {6000, 6000, 6000, 6000}}) {
      const DecodeCase c = llama_case(lens, splits);
      run_both_workspaces(c, salt++, ws.get());
    }
  }
}

// Groups of 4 and 8 heads (the keys-as-rows kernel), 16 (one 16-row M block) and 32 (MQA: two M
// blocks, 8 warps), f16 and bf16, head_dim 64 / 128 / 256; groups of 64 heads take two head
// blocks per KV head and keep the global merge.
TEST(DecodeCluster, GroupSizesAndHeadDims) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  auto ws = make_workspace(64, 3);
  uint64_t salt = 3300;
  struct Shape {
    int32_t hq, hkv, head_dim;
    DType dtype;
  };
  for (const Shape& s : {Shape{32, 8, 128, DType::kBF16}, Shape{64, 8, 128, DType::kF16},
                         Shape{32, 2, 128, DType::kBF16}, Shape{32, 1, 128, DType::kF16},
                         Shape{64, 1, 128, DType::kBF16}, Shape{16, 4, 64, DType::kBF16},
                         Shape{16, 2, 256, DType::kF16}}) {
    for (int32_t splits : {0, 16, 7}) {
      DecodeCase c;
      c.hq = s.hq;
      c.hkv = s.hkv;
      c.head_dim = s.head_dim;
      c.dtype = c.kv_dtype = s.dtype;
      c.page = 32;
      c.seq_lens = {6000, 333, 4096};
      c.num_splits = splits;
      run_both_workspaces(c, salt++, ws.get());
    }
  }
}

// 8-bit caches (per-tensor and per-head scales, against the same quantization), sliding window
// with sinks over a cyclic cache, ALiBi and soft-cap, all through split clusters.
TEST(DecodeCluster, QuantizedWindowAlibiSoftcap) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  auto ws = make_workspace(32, 2);
  uint64_t salt = 3400;
  for (int32_t splits : {0, 16, 32, 12}) {
    for (DType kv : {DType::kFp8E4M3, DType::kInt8}) {
      DecodeCase c = llama_case({16384, 3000}, splits);
      c.kv_dtype = kv;
      c.per_head_scale = splits % 2 == 0;
      run_both_workspaces(c, salt++, ws.get());
    }
    DecodeCase w = llama_case({12000, 700}, splits);
    w.mask.kind = MaskKind::kSlidingWindow;
    w.mask.window = 4000;
    w.mask.sink_tokens = 4;
    w.cyclic = true;
    run_both_workspaces(w, salt++, ws.get());
    DecodeCase a = llama_case({12000, 50}, splits);
    a.alibi = true;
    a.softcap = 30.0;
    a.q_range = 4.0f;
    run_both_workspaces(a, salt++, ws.get());
  }
}

// Split calls captured in one graph (one cluster per KV head, several clusters, padded counts;
// through the caller workspace and through per-call workspaces), replayed four times with the
// outputs poisoned before each replay, the workspace counters zero after each.
TEST(DecodeCluster, CapturedGraphReplays) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  auto ws = make_workspace(32, 2);
  std::vector<std::unique_ptr<PreparedCase>> prepared;
  uint64_t salt = 3500;
  for (int32_t splits : {0, 16, 32, 20}) {
    for (bool caller : {true, false}) {
      prepared.push_back(std::make_unique<PreparedCase>(llama_case({12000, 3000}, splits), salt++));
      if (caller) prepared.back()->args.workspace = ws.get();
    }
  }
  cudaStream_t stream = nullptr;
  ATTNKIT_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ATTNKIT_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (auto& pc : prepared) ASSERT_NO_THROW(decode(pc->spec, pc->args, stream));
  ATTNKIT_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  ATTNKIT_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 4; ++replay) {
    SCOPED_TRACE(detail::concat("replay ", replay));
    for (auto& pc : prepared) pc->poison(stream);
    ATTNKIT_CUDA_OK(cudaGraphLaunch(exec, stream));
    ATTNKIT_CUDA_OK(cudaStreamSynchronize(stream));
    for (auto& pc : prepared) pc->check();
    std::vector<int32_t> counters(static_cast<size_t>(ws->counter_capacity()));
    ATTNKIT_CUDA_OK(cudaMemcpy(counters.data(), ws->counters(), counters.size() * sizeof(int32_t),
                               cudaMemcpyDeviceToHost));
    for (int32_t x : counters) ASSERT_EQ(x, 0) << "arrival counter left non-zero";
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace attnkit::test
