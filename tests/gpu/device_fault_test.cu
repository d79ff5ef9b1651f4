// The device fault status word end to end on a GPU: a kernel records faults through the guards
// of src/cuda/common/device_fault.cuh, check_device_errors() reports the first one (op, argument,
// row, value, count) and clears the word, checked mode reports at once, and a capturing stream
// is refused by the check and skipped by checked mode.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>

#include "attnkit/device_errors.h"
#include "core/device_checks.h"
#include "cuda/common/device_fault.h"
#include "cuda/cuda_backend.h"
#include "gpu/gpu_util.h"

namespace attnkit::test {
namespace {

// Every thread checks one block id of `table`; ids outside [0, num_blocks) are faults.
__global__ void check_block_ids(cuda::FaultSite site, const int32_t* table, int32_t entries,
                                int32_t num_blocks, int32_t* visited) {
  const int32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= entries) return;
  if (cuda::guard_block_id(site, table[i], num_blocks, /*row=*/i / 4, /*column=*/i % 4)) {
    atomicAdd(visited, 1);
  }
}

struct FaultRun {
  int32_t visited = 0;
};

// Launches check_block_ids over `ids` on `stream` for a call of `op`.
FaultRun launch(const std::vector<int32_t>& ids, int32_t num_blocks, Op op,
                cudaStream_t stream = nullptr) {
  int32_t* d_ids = nullptr;
  int32_t* d_visited = nullptr;
  EXPECT_EQ(cudaMalloc(&d_ids, ids.size() * 4), cudaSuccess);
  EXPECT_EQ(cudaMalloc(&d_visited, 4), cudaSuccess);
  cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice);
  cudaMemset(d_visited, 0, 4);
  check_block_ids<<<1, 128, 0, stream>>>(cuda::fault_site(op), d_ids,
                                         static_cast<int32_t>(ids.size()), num_blocks, d_visited);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  FaultRun run;
  cudaStreamSynchronize(stream);
  cudaMemcpy(&run.visited, d_visited, 4, cudaMemcpyDeviceToHost);
  cudaFree(d_ids);
  cudaFree(d_visited);
  return run;
}

TEST(DeviceFaultWord, CheckReportsTheFirstFaultAndClearsIt) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  ASSERT_NO_THROW(check_device_errors());  // a clean word to start from
  // Row 1 (entries 4..7) holds block 10000 at column 2; row 2 holds -1 at column 0.
  const std::vector<int32_t> ids = {0, 1, 2, 3, 4, 5, 10000, 7, -1, 6, 5, 4};
  const FaultRun run = launch(ids, 8, Op::kDecode);
  EXPECT_EQ(run.visited, 10);  // the guarded accesses were skipped, the others ran
  try {
    check_device_errors();
    ADD_FAILURE() << "no fault reported";
  } catch (const DeviceFaultError& e) {
    const DeviceFault& f = e.fault();
    EXPECT_EQ(f.kind, static_cast<int32_t>(FaultKind::kBlockId));
    EXPECT_EQ(f.op, static_cast<int32_t>(Op::kDecode));
    EXPECT_EQ(f.arg, static_cast<int32_t>(FaultArg::kBlockTable));
    EXPECT_EQ(f.count, 2u);
    // Either fault may come first; both name the table, the row and the value.
    const bool first_is_10000 = f.value == 10000;
    EXPECT_EQ(f.row, first_is_10000 ? 1 : 2);
    EXPECT_EQ(f.index, first_is_10000 ? 2 : 0);
    EXPECT_EQ(f.bound, 8);
    EXPECT_NE(std::string(e.what()).find("decode: kv_cache.block_table: row "), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("2 faults recorded"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(check_device_errors());  // cleared
}

TEST(DeviceFaultWord, CheckedModeRaisesAtOnceOnTheCallsStream) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  cudaStream_t stream = nullptr;
  ATTNKIT_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  launch({3, 99}, 4, Op::kAppendKv, stream);
  EXPECT_THROW(detail::check_after_cuda_call("append_kv", stream), DeviceFaultError);
  EXPECT_NO_THROW(detail::check_after_cuda_call("append_kv", stream));
  launch({1, 2}, 4, Op::kAppendKv, stream);  // no fault
  EXPECT_NO_THROW(check_device_errors(stream));
  cudaStreamDestroy(stream);
}

TEST(DeviceFaultWord, CapturingStreamsAreRefusedByTheCheckAndSkippedByCheckedMode) {
  ATTNKIT_SKIP_WITHOUT_GPU();
  cudaStream_t stream = nullptr;
  ATTNKIT_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cuda::note_cuda_call();
  ATTNKIT_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  EXPECT_NO_THROW(detail::check_after_cuda_call("decode", stream));
  try {
    check_device_errors(stream);
    ADD_FAILURE() << "a capturing stream was checked";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("capturing a CUDA graph"), std::string::npos) << e.what();
  }
  cudaGraph_t graph = nullptr;
  ATTNKIT_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  if (graph != nullptr) cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace attnkit::test
