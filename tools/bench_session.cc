#include "bench_session.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <random>
#include <utility>

#include "attnkit/info.h"
#include "core/check.h"
#include "core/numerics.h"

#if defined(ATTNKIT_WITH_CUDA)
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include "read_ceiling.h"
#endif

namespace attnkit::tools {

void add_common_options(CLI::App& cmd, CommonBenchOptions& options, int default_iters) {
  options.iters = default_iters;
  cmd.add_option("--iters", options.iters,
                 "timed samples, the median is reported (>= 20; default " +
                     std::to_string(default_iters) + ")");
  options.json_option =
      cmd.add_option("--json", options.json_target,
                     "write the JSON report to FILE, or to stdout ('-', or no value) instead of "
                     "the table")
          ->expected(0, 1)
          ->default_str("-")
          ->type_name("FILE");
  cmd.add_flag("--no-ceilings", options.no_ceilings,
               "skip measuring the copy bandwidth and the GEMM rate (no % of ceiling)");
  cmd.add_flag("--quick", options.quick, "a few rows of the default grid");
}

#if defined(ATTNKIT_WITH_CUDA)
namespace {

void cuda_ok(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw Error(std::string("bench: ") + what + ": " + cudaGetErrorString(status));
  }
}

}  // namespace

#endif

namespace {

// The self-test mode (ATTNKIT_BENCH_DEVICE=cpu): buffers in host memory, the reference backend.
bool g_host_memory = false;

[[noreturn]] void no_cuda() { throw Error("bench: this attnkit was built without CUDA"); }

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

// One host pattern per element kind (and shift), generated once and uploaded at seed-dependent
// offsets.
const std::vector<uint8_t>& host_pattern(DType dtype, float shift) {
  constexpr size_t kPatternBytes = size_t{32} << 20;
  constexpr size_t kMargin = 8192;
  static std::map<std::pair<int, float>, std::vector<uint8_t>> patterns;
  const int kind = dtype == DType::kFp8E4M3 ? 1
                   : dtype == DType::kInt8  ? 2
                   : dtype == DType::kF16   ? 3
                                            : 0;
  std::vector<uint8_t>& bytes = patterns[{kind, shift}];
  if (bytes.empty()) {
    bytes.resize(kPatternBytes + kMargin);
    std::mt19937_64 rng(0x5eed + kind);
    std::uniform_real_distribution<float> value(-1.0f, 1.0f);
    if (kind == 0 || kind == 3) {
      auto* half = reinterpret_cast<uint16_t*>(bytes.data());
      for (size_t i = 0; i < bytes.size() / 2; ++i) {
        const float x = value(rng) + shift;
        half[i] = kind == 3 ? numerics::float_to_f16_bits(x) : numerics::float_to_bf16_bits(x);
      }
    } else if (kind == 1) {
      for (auto& b : bytes) b = numerics::float_to_fp8_e4m3_bits(value(rng) * 200.0f);
    } else {
      for (auto& b : bytes) b = static_cast<uint8_t>(numerics::float_to_int8_sat(value(rng) * 120));
    }
  }
  return bytes;
}

// Self-test buffers end at an inaccessible page: a call that runs past a buffer the benchmark
// sized too small faults at once (the program dies) instead of corrupting the heap unseen.
struct GuardedSpan {
  size_t offset;  // from the mapping's start to the buffer
  size_t mapped;  // bytes mapped, the guard page included
};
GuardedSpan guarded_span(size_t bytes) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t aligned = (bytes + 15) / 16 * 16;
  const size_t usable = (aligned + page - 1) / page * page;
  return {usable - aligned, usable + page};
}

void* raw_alloc(size_t bytes) {
  if (g_host_memory) {
    const GuardedSpan span = guarded_span(bytes);
    void* base =
        mmap(nullptr, span.mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) detail::fail("bench: cannot map ", bytes, " bytes of host memory");
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    mprotect(static_cast<uint8_t*>(base) + span.mapped - page, page, PROT_NONE);
    return static_cast<uint8_t*>(base) + span.offset;
  }
#if defined(ATTNKIT_WITH_CUDA)
  void* data = nullptr;
  cuda_ok(cudaMalloc(&data, bytes), "cudaMalloc");
  return data;
#else
  no_cuda();
#endif
}

void raw_free(void* data, size_t bytes) {
  if (g_host_memory) {
    const GuardedSpan span = guarded_span(bytes);
    munmap(static_cast<uint8_t*>(data) - span.offset, span.mapped);
    return;
  }
#if defined(ATTNKIT_WITH_CUDA)
  cudaFree(data);
#endif
}

void raw_upload(void* dst, const void* src, size_t bytes) {
  if (g_host_memory) {
    std::memcpy(dst, src, bytes);
    return;
  }
#if defined(ATTNKIT_WITH_CUDA)
  cuda_ok(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
#else
  no_cuda();
#endif
}

// A cudaMemcpy from pageable memory may return before its DMA lands, and the benchmarks run on a
// non-blocking stream that does not wait for the legacy stream.
void sync_uploads() {
#if defined(ATTNKIT_WITH_CUDA)
  if (!g_host_memory) cuda_ok(cudaDeviceSynchronize(), "upload");
#endif
}

}  // namespace

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  if (bytes > 0) data_ = raw_alloc(bytes);
}
DeviceBuffer::~DeviceBuffer() {
  if (data_ != nullptr) raw_free(data_, bytes_);
}

void fill_random(const DeviceBuffer& buffer, DType dtype, uint64_t seed, float shift) {
  const std::vector<uint8_t>& pattern = host_pattern(dtype, shift);
  const size_t chunk = pattern.size() - 8192;
  auto* dst = buffer.as<uint8_t>();
  for (size_t offset = 0, i = 0; offset < buffer.bytes(); offset += chunk, ++i) {
    // An even offset keeps 2-byte elements aligned; it differs per buffer and per chunk.
    const size_t start = 2 * ((seed * 2654435761u + i * 977) % 4096);
    raw_upload(dst + offset, pattern.data() + start, std::min(chunk, buffer.bytes() - offset));
  }
  sync_uploads();
}

void fill_constant(const DeviceBuffer& buffer, size_t offset, size_t bytes, DType dtype,
                   float value) {
  ATTNKIT_CHECK(dtype == DType::kBF16 || dtype == DType::kF16, "fill_constant: 16-bit dtypes only");
  ATTNKIT_CHECK(offset + bytes <= buffer.bytes(), "fill_constant: range outside the buffer");
  const uint16_t bits = dtype == DType::kF16 ? numerics::float_to_f16_bits(value)
                                             : numerics::float_to_bf16_bits(value);
  const std::vector<uint16_t> host(
      std::max<size_t>(1, std::min<size_t>(bytes / 2, size_t{8} << 20)), bits);
  for (size_t done = 0; done < bytes; done += host.size() * 2) {
    raw_upload(buffer.as<uint8_t>() + offset + done, host.data(),
               std::min(host.size() * 2, bytes - done));
  }
  sync_uploads();
}

DeviceBuffer upload(const void* host, size_t bytes) {
  DeviceBuffer buffer(bytes);
  raw_upload(buffer.get(), host, bytes);
  sync_uploads();
  return buffer;
}

#if defined(ATTNKIT_WITH_CUDA)
namespace {

// Median seconds of `op` on `stream` over 20 samples after 3 warm-up samples; a sample is
// kOpsPerSample back-to-back runs between two events, so that only the first run's enqueue shows
// in the time. nullopt as soon as `op` returns false.
std::optional<double> median_op_seconds(cudaStream_t stream, const std::function<bool()>& op) {
  constexpr int kOpsPerSample = 4;
  cudaEvent_t start, stop;
  cuda_ok(cudaEventCreate(&start), "cudaEventCreate");
  cuda_ok(cudaEventCreate(&stop), "cudaEventCreate");
  std::vector<double> seconds;
  bool ok = true;
  for (int i = 0; i < 23 && ok; ++i) {
    cuda_ok(cudaEventRecord(start, stream), "cudaEventRecord");
    for (int k = 0; k < kOpsPerSample && ok; ++k) ok = op();
    cuda_ok(cudaEventRecord(stop, stream), "cudaEventRecord");
    cuda_ok(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    cuda_ok(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    if (i >= 3) seconds.push_back(ms * 1e-3 / kOpsPerSample);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  if (!ok) return std::nullopt;
  return median(seconds);
}

// Bytes read per second by a reduction over 1 GiB (read_ceiling.cu), the fastest of its variants
// (stored in `fastest`), in TB/s: the ceiling of a kernel that only reads, such as decode.
double measure_read_tbps(cudaStream_t stream, int& fastest) {
  const size_t bytes = size_t{1} << 30;
  DeviceBuffer data(bytes), sink(sizeof(unsigned));
  cuda_ok(cudaMemsetAsync(data.get(), 0x3c, bytes, stream), "cudaMemset");
  double best = 0;
  for (int variant = 0; variant < kReadReductionVariants; ++variant) {
    const int blocks = read_reduction_blocks(variant);
    const std::optional<double> seconds = median_op_seconds(stream, [&] {
      cuda_ok(
          launch_read_reduction(variant, blocks, data.get(), bytes, sink.as<unsigned>(), stream),
          "read ceiling kernel");
      return true;
    });
    const double tbps = static_cast<double>(bytes) / *seconds * 1e-12;
    if (tbps > best) best = tbps, fastest = variant;
  }
  return best;
}

// (read + write) bytes per second of a 1 GiB device-to-device copy, in TB/s.
double measure_copy_tbps(cudaStream_t stream) {
  const size_t bytes = size_t{1} << 30;
  DeviceBuffer src(bytes), dst(bytes);
  cuda_ok(cudaMemsetAsync(src.get(), 0x3c, bytes, stream), "cudaMemset");
  const std::optional<double> seconds = median_op_seconds(stream, [&] {
    cuda_ok(cudaMemcpyAsync(dst.get(), src.get(), bytes, cudaMemcpyDeviceToDevice, stream),
            "cudaMemcpyAsync");
    return true;
  });
  return 2.0 * static_cast<double>(bytes) / *seconds * 1e-12;
}

// cuBLAS bf16 GEMM 8192^3 (fp32 accumulation) in TFLOP/s, through dlopen so that the program
// runs where cuBLAS is absent (the ceiling is then reported as not measured).
std::optional<double> measure_gemm_tflops(cudaStream_t stream) {
  void* lib = nullptr;
  for (const char* name : {"libcublas.so.13", "libcublas.so.12", "libcublas.so"}) {
    lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (lib != nullptr) break;
  }
  if (lib == nullptr) return std::nullopt;
  using CreateFn = cublasStatus_t (*)(cublasHandle_t*);
  using DestroyFn = cublasStatus_t (*)(cublasHandle_t);
  using SetStreamFn = cublasStatus_t (*)(cublasHandle_t, cudaStream_t);
  using GemmFn = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int,
                                    int, const void*, const void*, cudaDataType, int, const void*,
                                    cudaDataType, int, const void*, void*, cudaDataType, int,
                                    cublasComputeType_t, cublasGemmAlgo_t);
  auto create = reinterpret_cast<CreateFn>(dlsym(lib, "cublasCreate_v2"));
  auto destroy = reinterpret_cast<DestroyFn>(dlsym(lib, "cublasDestroy_v2"));
  auto set_stream = reinterpret_cast<SetStreamFn>(dlsym(lib, "cublasSetStream_v2"));
  auto gemm = reinterpret_cast<GemmFn>(dlsym(lib, "cublasGemmEx"));
  cublasHandle_t handle = nullptr;
  if (!create || !destroy || !set_stream || !gemm || create(&handle) != CUBLAS_STATUS_SUCCESS) {
    return std::nullopt;
  }
  set_stream(handle, stream);
  constexpr int n = 8192;
  const size_t bytes = size_t{2} * n * n;
  DeviceBuffer a(bytes), b(bytes), c(bytes);
  fill_random(a, DType::kBF16, 11);
  fill_random(b, DType::kBF16, 12);
  const float alpha = 1.f, beta = 0.f;
  const std::optional<double> seconds = median_op_seconds(stream, [&] {
    return gemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a.get(), CUDA_R_16BF, n, b.get(),
                CUDA_R_16BF, n, &beta, c.get(), CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS;
  });
  destroy(handle);
  if (!seconds) return std::nullopt;
  return 2.0 * n * n * static_cast<double>(n) / *seconds * 1e-12;
}

// A graph of `calls` launches, or nullptr when they cannot be captured (the error is cleared).
cudaGraphExec_t capture_graph(const std::function<void(int, Stream)>& launch, int calls,
                              cudaStream_t stream) {
  if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  bool launched = true;
  try {
    for (int i = 0; i < calls; ++i) launch(i, stream);
  } catch (const std::exception&) {
    launched = false;
  }
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
  cudaGraphExec_t exec = nullptr;
  if (!launched || ended != cudaSuccess || graph == nullptr ||
      cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) {
    exec = nullptr;
  }
  if (graph != nullptr) cudaGraphDestroy(graph);
  cudaGetLastError();
  return exec;
}

}  // namespace
#endif

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  std::swap(data_, other.data_);
  std::swap(bytes_, other.bytes_);
  return *this;
}

BenchSession::BenchSession(std::string subcommand, RateUnit unit, Ceiling ceiling,
                           const CommonBenchOptions& options, int planned_rows)
    : subcommand_(std::move(subcommand)),
      progress_(stderr, stderr_is_tty(), planned_rows),
      iters_(options.iters) {
  check_iters(subcommand_, options.iters);
  report_.subcommand = subcommand_;
  report_.unit = unit;
  report_.ceiling = ceiling;
  report_.date = iso8601_utc_now();
  const char* device_env = std::getenv("ATTNKIT_BENCH_DEVICE");
  if (device_env != nullptr && std::string(device_env) == "cpu") {
    host_mode_ = g_host_memory = true;
    report_.device = {"cpu (self-test: reference backend, host timing)", 0, "-"};
    progress_.message("self-test mode (ATTNKIT_BENCH_DEVICE=cpu): reference backend on the CPU");
    if (options.json_requested()) {
      json_ = std::make_unique<JsonSink>(subcommand_, options.json_target);
    }
    return;
  }
  if (!built_with_cuda()) {
    throw Error("bench " + subcommand_ +
                ": no CUDA backend: this attnkit was built without CUDA (configure with "
                "-DATTNKIT_WITH_CUDA=ON on a machine with nvcc)");
  }
  const std::vector<DeviceInfo> devices = cuda_devices();
  if (devices.empty()) {
    throw Error("bench " + subcommand_ +
                ": no CUDA device visible (the benchmarks time the GPU kernels; check "
                "nvidia-smi and CUDA_VISIBLE_DEVICES)");
  }
  report_.device.name = devices[0].name;
  report_.device.sms = devices[0].sm_count;
  report_.device.cc =
      std::to_string(devices[0].cc_major) + "." + std::to_string(devices[0].cc_minor);
  l2_bytes_ = devices[0].l2_bytes ? devices[0].l2_bytes : size_t{60} << 20;
  if (options.json_requested())
    json_ = std::make_unique<JsonSink>(subcommand_, options.json_target);
#if defined(ATTNKIT_WITH_CUDA)
  cudaStream_t stream = nullptr;
  cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  stream_ = stream;
  if (!options.no_ceilings) {
    progress_.message(
        "measuring the ceilings: read 1 GiB, D2D copy 1 GiB, cuBLAS bf16 GEMM 8192^3 ...");
    report_.ceilings.read_tbps = measure_read_tbps(stream, read_variant_);
    report_.ceilings.copy_tbps = measure_copy_tbps(stream);
    report_.ceilings.gemm_bf16_tflops = measure_gemm_tflops(stream);
  }
#endif
}

BenchSession::~BenchSession() {
#if defined(ATTNKIT_WITH_CUDA)
  if (stream_ != nullptr) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
#endif
}

double BenchSession::time_ms(const std::function<void(int, Stream)>& launch,
                             const TimingPlan& plan) {
  if (host_mode_) {
    int call = 0;
    for (int i = 0; i < plan.warmup; ++i) launch(call++, nullptr);
    std::vector<double> samples;
    for (int i = 0; i < iters_; ++i) {
      const auto start = std::chrono::steady_clock::now();
      launch(call++, nullptr);
      samples.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
              .count());
    }
    return median(samples);
  }
#if defined(ATTNKIT_WITH_CUDA)
  auto stream = static_cast<cudaStream_t>(stream_);
  int call = 0;
  for (int i = 0; i < plan.warmup; ++i) launch(call++, stream_);
  cuda_ok(cudaStreamSynchronize(stream), "warm-up");
  cudaEvent_t start, stop;
  cuda_ok(cudaEventCreate(&start), "cudaEventCreate");
  cuda_ok(cudaEventCreate(&stop), "cudaEventCreate");
  auto elapsed_ms = [&] {
    cuda_ok(cudaEventSynchronize(stop), "kernel");
    float ms = 0;
    cuda_ok(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    return static_cast<double>(ms);
  };
  int calls = plan.calls_per_sample;
  if (calls <= 0) {
    // Enough back-to-back calls per sample (~1 ms) that the host's launch cost overlaps.
    cuda_ok(cudaEventRecord(start, stream), "cudaEventRecord");
    launch(call++, stream_);
    cuda_ok(cudaEventRecord(stop, stream), "cudaEventRecord");
    const double one = std::max(elapsed_ms(), 1e-3);
    calls = static_cast<int>(std::clamp(std::ceil(1.0 / one), 1.0, 64.0));
  }
  cudaGraphExec_t graph_exec = nullptr;
  if (plan.cuda_graph) {
    graph_exec = capture_graph(launch, calls, stream);
    if (graph_exec != nullptr) {
      cuda_ok(cudaGraphLaunch(graph_exec, stream), "cudaGraphLaunch");
      cuda_ok(cudaStreamSynchronize(stream), "graph warm-up");
    } else {
      // Plain launches then; the row says so, since the host's launch cost may show.
      timing_note_ = "timed without a CUDA graph (the calls could not be captured)";
    }
  }
  // All samples are queued before the first is read, so the GPU does not idle between them
  // while the host catches up (the events of a sample bracket only its own calls).
  std::vector<cudaEvent_t> marks(iters_ + 1);
  for (cudaEvent_t& mark : marks) cuda_ok(cudaEventCreate(&mark), "cudaEventCreate");
  cuda_ok(cudaEventRecord(marks[0], stream), "cudaEventRecord");
  for (int i = 0; i < iters_; ++i) {
    if (graph_exec != nullptr) {
      cuda_ok(cudaGraphLaunch(graph_exec, stream), "cudaGraphLaunch");
    } else {
      for (int c = 0; c < calls; ++c) launch(call++, stream_);
    }
    cuda_ok(cudaEventRecord(marks[i + 1], stream), "cudaEventRecord");
  }
  cuda_ok(cudaEventSynchronize(marks[iters_]), "kernel");
  std::vector<double> per_call;
  for (int i = 0; i < iters_; ++i) {
    float ms = 0;
    cuda_ok(cudaEventElapsedTime(&ms, marks[i], marks[i + 1]), "cudaEventElapsedTime");
    per_call.push_back(ms / calls);
  }
  for (cudaEvent_t mark : marks) cudaEventDestroy(mark);
  if (graph_exec != nullptr) cudaGraphExecDestroy(graph_exec);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cuda_ok(cudaGetLastError(), "kernel launch");
  return median(per_call);
#else
  (void)launch;
  (void)plan;
  throw Error("bench: this attnkit was built without CUDA");
#endif
}

std::optional<double> BenchSession::time_read_ms(const std::vector<const void*>& sets,
                                                 size_t bytes) {
  if (host_mode_ || read_variant_ < 0 || sets.empty()) return std::nullopt;
#if defined(ATTNKIT_WITH_CUDA)
  const int blocks = read_reduction_blocks(read_variant_);
  const DeviceBuffer sink(sizeof(unsigned));
  // The row's timing note is the row's own, not this comparison's.
  const std::string row_note = timing_note_;
  const double ms = time_ms(
      [&](int call, Stream stream) {
        cuda_ok(
            launch_read_reduction(read_variant_, blocks, sets[call % sets.size()], bytes / 16 * 16,
                                  sink.as<unsigned>(), static_cast<cudaStream_t>(stream)),
            "read ceiling kernel");
      },
      {.calls_per_sample = 16, .cuda_graph = true});
  timing_note_ = row_note;
  return ms;
#else
  (void)bytes;
  return std::nullopt;
#endif
}

double BenchSession::time_copy_ms(size_t bytes) {
  const int sets = rotation_sets(2 * bytes, l2_bytes_);
  std::vector<DeviceBuffer> src, dst;
  for (int i = 0; i < sets; ++i) {
    src.emplace_back(bytes);
    dst.emplace_back(bytes);
    fill_random(src.back(), DType::kBF16, 50 + i);
  }
  return time_ms(
      [&](int call, Stream stream) {
        if (host_mode_) {
          std::memcpy(dst[call % sets].get(), src[call % sets].get(), bytes);
          return;
        }
#if defined(ATTNKIT_WITH_CUDA)
        cuda_ok(cudaMemcpyAsync(dst[call % sets].get(), src[call % sets].get(), bytes,
                                cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream)),
                "cudaMemcpyAsync");
#else
        (void)call;
        (void)stream;
#endif
      },
      {});
}

void BenchSession::run_row(BenchRow row, const std::function<Measurement(BenchRow&)>& measure) {
  if (host_mode_ && row.backend == "fused") row.backend = backend_name(backend(Backend::kFused));
  progress_.step(row_summary(subcommand_, row));
  timing_note_.clear();
  try {
    const Measurement m = measure(row);
    set_measurement(row, report_.ceiling, report_.ceilings, m.time_ms, m.rate);
    row.note = timing_note_;
    char text[160];
    std::snprintf(text, sizeof(text), "%.4f ms, %.3f %s", m.time_ms, m.rate,
                  rate_name(report_.unit));
    std::string line = text;
    if (row.pct_of_ceiling) {
      std::snprintf(text, sizeof(text), " (%.1f%% of ceiling)", *row.pct_of_ceiling);
      line += text;
    }
    progress_.detail(line);
  } catch (const std::exception& e) {
    // attnkit::Error from the library or the bench; anything else (bad_alloc) likewise.
    set_failure(row, e.what());
    progress_.detail(row.note);
    if (row.note.rfind("error: ", 0) == 0) ++failed_;
#if defined(ATTNKIT_WITH_CUDA)
    if (!host_mode_) {
      // Leave no half-finished work of the failed row behind for the next one.
      cudaStreamSynchronize(static_cast<cudaStream_t>(stream_));
      cudaGetLastError();
    }
#endif
  }
  report_.rows.push_back(std::move(row));
}

void BenchSession::finish() {
  progress_.finish();
  if (!json_ || !json_->to_stdout()) {
    std::fputs(format_table(report_).c_str(), stdout);
    std::fflush(stdout);
  }
  if (json_) json_->write(report_);
  if (failed_ > 0) {
    throw Error("bench " + subcommand_ + ": " + std::to_string(failed_) + " of " +
                std::to_string(report_.rows.size()) + " rows failed (see their note)");
  }
}

}  // namespace attnkit::tools
