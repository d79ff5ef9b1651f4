// The per-device fault status word and its host-side reading (include/attnkit/device_errors.h).
// The word is read only here: by check_device_errors() and by checked calls, each of which
// synchronizes its stream; nothing on the hot path waits for the device.
#include <atomic>
#include <mutex>

#include "cuda/common/cuda_status.h"
#include "cuda/common/device_fault.h"
#include "cuda/cuda_backend.h"

namespace attnkit::cuda {
namespace {

__device__ DeviceFault g_device_fault;

constexpr int kMaxDevices = 64;
std::atomic<bool> g_cuda_used{false};
std::mutex g_words_mutex;
std::atomic<DeviceFault*> g_words[kMaxDevices] = {};
// The op and row offset of the calling thread's innermost FaultOpScope; op -1: none open.
thread_local int32_t t_scope_op = -1;
thread_local int32_t t_scope_row_offset = 0;
// The current device of the calling thread's entry-point call (CudaCallScope); -1: none open.
thread_local int t_call_device = -1;

// The device whose work `stream` holds (the current device for the legacy stream).
int device_of(cudaStream_t stream, const char* what) {
  int device = 0;
#if CUDART_VERSION >= 12080
  if (stream != nullptr) {
    check_cuda(cudaStreamGetDevice(stream, &device), what);
    return device;
  }
#endif
  check_cuda(cudaGetDevice(&device), what);
  return device;
}

}  // namespace

DeviceFault* fault_word(int device) {
  ATTNKIT_CHECK(device >= 0 && device < kMaxDevices, "device fault word: cuda:", device,
                " is beyond the ", kMaxDevices, " devices attnkit tracks");
  g_cuda_used.store(true, std::memory_order_relaxed);
  // Every launch asks for the word: the common case is one atomic load.
  if (DeviceFault* word = g_words[device].load(std::memory_order_acquire)) return word;
  std::lock_guard<std::mutex> lock(g_words_mutex);
  if (DeviceFault* word = g_words[device].load(std::memory_order_relaxed)) return word;
  DeviceScope scope(device, "device fault word: cudaSetDevice");
  void* address = nullptr;
  check_cuda(cudaGetSymbolAddress(&address, g_device_fault),
             "device fault word: cudaGetSymbolAddress");
  g_words[device].store(static_cast<DeviceFault*>(address), std::memory_order_release);
  return static_cast<DeviceFault*>(address);
}

// cudaGetDevice is a query of the runtime's per-thread state, far cheaper than a launch, but a call
// launches several kernels (forward() three families, decode its grid and a merge) and each
// launch's host work also asks for the device (decode's plan, the shared-memory opt-in): the
// call scope reads it once and the word is a lookup in g_words. The device is not cached across
// calls (a thread-local device kept between calls would miss a cudaSetDevice of the caller).
CudaCallScope::CudaCallScope() : previous_device_(t_call_device) {
  note_cuda_call();
  int device = -1;
  // A failure is left to the first launch, whose current_device() reports it as before.
  if (cudaGetDevice(&device) != cudaSuccess) device = -1;
  t_call_device = device;
}

CudaCallScope::~CudaCallScope() { t_call_device = previous_device_; }

int current_device(const char* what) {
  if (t_call_device >= 0) return t_call_device;
  int device = 0;
  check_cuda(cudaGetDevice(&device), what);
  return device;
}

FaultSite fault_site(Op op) {
  DeviceFault* word = fault_word(current_device("device fault word: cudaGetDevice"));
  if (t_scope_op < 0) return {word, static_cast<int32_t>(op), 0};
  return {word, t_scope_op, t_scope_row_offset};
}

FaultOpScope::FaultOpScope(Op op, int32_t table_row_offset)
    : previous_op_(t_scope_op), previous_offset_(t_scope_row_offset) {
  t_scope_op = static_cast<int32_t>(op);
  t_scope_row_offset = table_row_offset;
}

FaultOpScope::~FaultOpScope() {
  t_scope_op = previous_op_;
  t_scope_row_offset = previous_offset_;
}

void note_cuda_call() { g_cuda_used.store(true, std::memory_order_relaxed); }

bool take_device_fault(Stream stream_arg, const char* what, bool capture_is_error,
                       DeviceFault* fault, int* device_out) {
  if (!g_cuda_used.load(std::memory_order_relaxed)) return false;
  const cudaStream_t stream = as_cuda_stream(stream_arg);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &capture), what);
  if (capture != cudaStreamCaptureStatusNone) {
    // Nothing has run yet: the captured kernels run when the graph is launched.
    ATTNKIT_CHECK(!capture_is_error, what,
                  ": the stream is capturing a CUDA graph, whose kernels have not run; check the "
                  "stream after launching the graph");
    return false;
  }
  const int device = device_of(stream, what);
  DeviceFault* word = fault_word(device);
  DeviceScope scope(device, what);
  // A kernel that crashed (outside the guards) leaves a sticky error: report it by name.
  const cudaError_t before = cudaStreamSynchronize(stream);
  if (before != cudaSuccess) {
    cudaGetLastError();
    detail::fail(what, ": the device reported ", cudaGetErrorName(before), " (",
                 cudaGetErrorString(before),
                 ") for work on this stream; after an error of this "
                 "kind the CUDA context is unusable");
  }
  DeviceFault host{};
  check_cuda(cudaMemcpyAsync(&host, word, sizeof(host), cudaMemcpyDeviceToHost, stream), what);
  check_cuda(cudaStreamSynchronize(stream), what);
  if (host.state == 0) return false;
  check_cuda(cudaMemsetAsync(word, 0, sizeof(DeviceFault), stream), what);
  check_cuda(cudaStreamSynchronize(stream), what);
  *fault = host;
  *device_out = device;
  return true;
}

}  // namespace attnkit::cuda
