// What every `attnkit bench` subcommand shares on the GPU: the common options (--iters, --json,
// --no-ceilings, --quick), the device check, the ceilings measured once per invocation, timing
// with CUDA events (warm-up, median of >= 20 samples), random device buffers rotated past the L2,
// progress and the final table / JSON. Host-only header: no CUDA types.
#pragma once

#include <CLI/CLI.hpp>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "attnkit/attention.h"
#include "bench_common.h"

namespace attnkit::tools {

// Subcommands (bench_cmd.cc registers them; decode, prefill and append are in commands.h).
void register_bench_dense(CLI::App& bench);  // bench_dense.cc

struct CommonBenchOptions {
  int iters = 20;
  std::string json_target;  // "-" = stdout; empty = no JSON
  CLI::Option* json_option = nullptr;
  bool no_ceilings = false;
  bool quick = false;
  bool json_requested() const { return json_option != nullptr && json_option->count() > 0; }
};
void add_common_options(CLI::App& cmd, CommonBenchOptions& options, int default_iters);

// A device allocation freed on scope exit.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();
  void* get() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// Random values valid for `dtype` (bf16/f16 in [-1, 1], fp8 codes never NaN, int8), never all
// zero; `seed` varies the content between buffers.
// `shift` (16-bit dtypes only) moves the range to [shift - 1, shift + 1].
void fill_random(const DeviceBuffer& buffer, DType dtype, uint64_t seed, float shift = 0.0f);
// `value` (bf16 / f16) in bytes [offset, offset + bytes) of the buffer.
void fill_constant(const DeviceBuffer& buffer, size_t offset, size_t bytes, DType dtype,
                   float value);
// A device copy of host data.
DeviceBuffer upload(const void* host, size_t bytes);

struct TimingPlan {
  int warmup = 3;            // untimed calls first
  int calls_per_sample = 0;  // calls between the two events; 0 = enough for about 1 ms
  bool cuda_graph = false;   // capture the calls of a sample in one CUDA graph
};

class BenchSession {
 public:
  // Checks the common options, that this build has CUDA and that a device is visible (throws
  // Error "bench <subcommand>: ..." otherwise), opens the JSON target, measures the ceilings.
  // With ATTNKIT_BENCH_DEVICE=cpu: the self-test mode (below) instead.
  BenchSession(std::string subcommand, RateUnit unit, Ceiling ceiling,
               const CommonBenchOptions& options, int planned_rows);
  ~BenchSession();
  BenchSession(const BenchSession&) = delete;
  BenchSession& operator=(const BenchSession&) = delete;

  // The self-test mode, ATTNKIT_BENCH_DEVICE=cpu in the environment: host buffers, the reference
  // backend, host timing, no ceilings. It runs every subcommand end to end on small shapes without
  // a GPU (tests/cpu/bench_cli_test.cc); its numbers are not GPU numbers.
  bool host_mode() const { return host_mode_; }
  // Where the rows' tensors live: cuda:0, or the CPU in the self-test mode.
  Device device() const { return host_mode_ ? Device::cpu() : Device::cuda(0); }
  // The backend a row runs: `wanted`, except the reference (vanilla) in the self-test mode.
  Backend backend(Backend wanted) const { return host_mode_ ? Backend::kVanilla : wanted; }

  const Ceilings& ceilings() const { return report_.ceilings; }
  size_t l2_bytes() const { return l2_bytes_; }
  Stream stream() const { return stream_; }

  // Median per-call milliseconds over --iters samples of `launch(call_index, stream)`; call_index
  // counts up so the launch can rotate its input sets.
  double time_ms(const std::function<void(int, Stream)>& launch, const TimingPlan& plan);

  // Median per-call milliseconds of the read ceiling's kernel (its fastest variant) reading
  // `bytes` of sets[call % sets.size()], timed as a row of 16 calls in a CUDA graph: the rate of
  // a kernel that only reads a row's bytes, launch gaps included. nullopt without measured
  // ceilings (--no-ceilings) and in the self-test mode.
  std::optional<double> time_read_ms(const std::vector<const void*>& sets, size_t bytes);

  // Median per-call milliseconds of a device-to-device copy of `bytes` (read bytes + write bytes),
  // rotated over buffers past the L2 like the kernels' inputs.
  double time_copy_ms(size_t bytes);

  // Shows progress, runs `measure` (which returns the rate for a per-call time, after setting
  // row.extra as it likes) and records the row. An attnkit::Error thrown by `measure` becomes
  // the row's note ("unsupported: <reason>" for what the backend cannot serve).
  struct Measurement {
    double time_ms = 0;
    double rate = 0;
  };
  void run_row(BenchRow row, const std::function<Measurement(BenchRow&)>& measure);

  // Prints the table (stdout) unless JSON goes to stdout, writes the JSON; throws when a row
  // failed with an error other than "unsupported".
  void finish();

 private:
  std::string subcommand_;
  BenchReport report_;
  std::unique_ptr<JsonSink> json_;
  Progress progress_;
  int iters_ = 20;
  size_t l2_bytes_ = 0;
  Stream stream_ = nullptr;
  int failed_ = 0;
  std::string timing_note_;  // set by time_ms for the row being measured
  bool host_mode_ = false;
  int read_variant_ = -1;  // the read ceiling's fastest kernel variant, once measured
};

}  // namespace attnkit::tools
