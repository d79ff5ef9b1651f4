// How the fused decode is launched (src/cuda/decode/decode_launch.cu): which grids are
// programmatic dependents of the previous kernel on the stream (PDL, sm_90+). The rule itself,
// and the launches as a captured CUDA graph records them: the edge from one decode kernel to the
// next is a programmatic dependency exactly when the second is a PDL launch.
#include "cuda/decode/decode_launch.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "common/test_util.h"
#include "gpu/gpu_util.h"

namespace attnkit::test {
namespace {

// A paged bf16 decode problem on the device: `rows` rows of `keys` keys, page 16, head_dim 128.
struct PagedDecode {
  int64_t rows = 0, hq = 0;
  HostTensor q, out, pool, table, lens;
  DeviceTensor d_q, d_out, d_pool, d_table, d_lens;
  AttentionSpec spec;
  DecodeArgs args;

  PagedDecode(int32_t num_rows, int32_t num_q_heads, int32_t hkv, int32_t keys, uint64_t salt)
      : rows(num_rows), hq(num_q_heads) {
    constexpr int32_t kPage = 16, kHeadDim = 128;
    std::mt19937_64 rng(test_seed() ^ salt);
    const int32_t blocks_per_row = (keys + kPage - 1) / kPage;
    const int32_t num_blocks = rows * blocks_per_row;
    q = HostTensor(DType::kBF16, {rows, hq, kHeadDim});
    q.fill_uniform(rng, -1.0f, 1.0f);
    out = HostTensor(DType::kBF16, {rows, hq, kHeadDim});
    out.fill(NAN);
    pool = HostTensor(DType::kBF16, {num_blocks, 2, hkv, kPage, kHeadDim});
    pool.fill_uniform(rng, -1.0f, 1.0f);
    table = HostTensor(DType::kInt32, {rows, blocks_per_row});
    lens = HostTensor(DType::kInt32, {rows});
    for (int32_t i = 0; i < num_blocks; ++i) table.data<int32_t>()[i] = num_blocks - 1 - i;
    for (int32_t r = 0; r < rows; ++r) lens.data<int32_t>()[r] = keys;
    d_q = DeviceTensor(q);
    d_out = DeviceTensor(out);
    d_pool = DeviceTensor(pool);
    d_table = DeviceTensor(table);
    d_lens = DeviceTensor(lens);

    spec.num_q_heads = hq;
    spec.num_kv_heads = hkv;
    spec.head_dim = kHeadDim;
    spec.backend = Backend::kFused;
    args.q = d_q;
    args.out = d_out;
    KvCacheView& cache = args.kv_cache;
    const int64_t half = int64_t{hkv} * kPage * kHeadDim * 2;
    cache.k_base = d_pool.data();
    cache.v_base = static_cast<uint8_t*>(d_pool.data()) + half;
    cache.block_stride_bytes = 2 * half;
    cache.num_blocks = num_blocks;
    cache.dtype = DType::kBF16;
    cache.device = Device::cuda(0);
    cache.num_kv_heads = hkv;
    cache.tokens_per_block = kPage;
    cache.head_dim = kHeadDim;
    cache.paged = true;
    cache.block_table = d_table;
    cache.seq_lens = d_lens;
  }
};

int device_major() {
  int major = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  return major;
}

TEST(DecodeLaunch, ProgrammaticLaunchRule) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  // sm_90+: split calls and grids of more than one wave; never a grid resident at once without
  // splits (bf16 32 x 32k: 256 CTAs in 264 slots; fp8 64 x 4k: 512 in 528).
  EXPECT_FALSE(cuda::decode_programmatic_launch(9, 1, 256, 264));
  EXPECT_FALSE(cuda::decode_programmatic_launch(9, 1, 512, 528));
  EXPECT_FALSE(cuda::decode_programmatic_launch(10, 1, 8, 264));
  EXPECT_TRUE(cuda::decode_programmatic_launch(9, 2, 512, 528));
  EXPECT_TRUE(cuda::decode_programmatic_launch(9, 32, 256, 264));
  EXPECT_TRUE(cuda::decode_programmatic_launch(9, 1, 512, 264));
  // Before sm_90 there is no programmatic launch.
  EXPECT_FALSE(cuda::decode_programmatic_launch(8, 32, 256, 264));
  EXPECT_FALSE(cuda::decode_programmatic_launch(8, 1, 512, 264));
}

// The dependency type of every edge that enters a kernel node whose grid has `grid_x` CTAs in x
// (the splits), as "type/port" strings.
std::vector<std::string> edges_into(cudaGraph_t graph, unsigned grid_x, int& entering) {
  entering = 0;
  std::vector<std::string> out;
  size_t count = 64;  // a few calls' nodes
  std::vector<cudaGraphNode_t> from(count), to(count);
  std::vector<cudaGraphEdgeData> data(count);
  if (cudaGraphGetEdges(graph, from.data(), to.data(), data.data(), &count) != cudaSuccess) {
    ADD_FAILURE() << "cudaGraphGetEdges failed";
    return out;
  }
  for (size_t i = 0; i < count; ++i) {
    cudaGraphNodeType from_type, to_type;
    if (cudaGraphNodeGetType(from[i], &from_type) != cudaSuccess ||
        cudaGraphNodeGetType(to[i], &to_type) != cudaSuccess) {
      continue;
    }
    if (from_type != cudaGraphNodeTypeKernel || to_type != cudaGraphNodeTypeKernel) continue;
    cudaKernelNodeParams params = {};
    if (cudaGraphKernelNodeGetParams(to[i], &params) != cudaSuccess) continue;
    if (params.gridDim.x != grid_x) continue;
    ++entering;
    out.push_back(std::to_string(data[i].type) + "/" + std::to_string(data[i].from_port));
  }
  return out;
}

// Captures `first` then `second` on one stream and returns the types of the kernel-to-kernel
// edges that enter the second call's kernel (grid x = second_grid_x).
std::vector<std::string> captured_edge(PagedDecode& a, const DecodeArgs& first, PagedDecode& b,
                                       const DecodeArgs& second, unsigned second_grid_x) {
  cudaStream_t stream = nullptr;
  EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  EXPECT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  decode(a.spec, first, stream);
  decode(b.spec, second, stream);
  cudaGraph_t graph = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  int entering = 0;
  std::vector<std::string> types = edges_into(graph, second_grid_x, entering);
  EXPECT_EQ(entering, 1) << "expected one kernel-to-kernel edge into the second call";
  // The captured calls run and write every output.
  cudaGraphExec_t exec = nullptr;
  EXPECT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  EXPECT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  HostTensor got(DType::kBF16, {b.rows, b.hq, 128});
  b.d_out.download(got);
  EXPECT_FALSE(any_nan(got.to_double())) << "unwritten (NaN) output elements";
  return types;
}

// Two decode calls captured back to back (split calls through a caller workspace, so that no
// memset node sits between the kernels): into a split call the edge is programmatic (sm_90+),
// into a one-wave call without splits it is an ordinary one, and into a grid of more than one
// wave without splits it is programmatic again.
TEST(DecodeLaunch, CapturedEdgesFollowTheRule) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  const bool pdl = device_major() >= 9;
  const std::string programmatic = std::to_string(cudaGraphDependencyTypeProgrammatic);
  const std::string ordinary = std::to_string(cudaGraphDependencyTypeDefault);
  auto type_of = [](const std::vector<std::string>& edges) {
    return edges.empty() ? std::string("none") : edges[0].substr(0, edges[0].find('/'));
  };
  PagedDecode small(4, 8, 2, 200, 11);
  DecodeWorkspace workspace(small.spec, 4, 8, Device::cuda(0));
  DecodeArgs unsplit = small.args, split = small.args;
  unsplit.num_splits = 1;
  split.num_splits = 4;
  split.workspace = &workspace;
  {
    SCOPED_TRACE("unsplit -> split");
    const auto edges = captured_edge(small, unsplit, small, split, 4);
    ASSERT_EQ(edges.size(), 1u);
    EXPECT_EQ(type_of(edges), pdl ? programmatic : ordinary) << "edge type/port " << edges[0];
  }
  {
    SCOPED_TRACE("split -> unsplit (8 CTAs)");
    const auto edges = captured_edge(small, split, small, unsplit, 1);
    ASSERT_EQ(edges.size(), 1u);
    EXPECT_EQ(type_of(edges), ordinary) << "edge type/port " << edges[0];
  }
  {
    // 8 KV heads x as many rows as SMs: 8 CTAs per SM, more than any decode kernel keeps
    // resident, without splits.
    int sms = 0;
    ATTNKIT_CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    PagedDecode wide(sms, 32, 8, 48, 12);
    DecodeArgs wide_args = wide.args;
    wide_args.num_splits = 1;
    SCOPED_TRACE("split -> unsplit (8 CTAs per SM)");
    const auto edges = captured_edge(small, split, wide, wide_args, 1);
    ASSERT_EQ(edges.size(), 1u);
    EXPECT_EQ(type_of(edges), pdl ? programmatic : ordinary) << "edge type/port " << edges[0];
  }
}

}  // namespace
}  // namespace attnkit::test
