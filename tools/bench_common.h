// The parts of `attnkit bench` that need no GPU: result rows, the markdown table, the JSON report
// (schema in docs/bench.md), the progress line and option validation. The CPU tests link this
// file (tests/cpu/bench_cli_test.cc); CUDA timing lives in bench_session.h.
#pragma once

#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "attnkit/types.h"

namespace attnkit::tools {

using ordered_json = nlohmann::ordered_json;

enum class RateUnit : uint8_t { kTbps, kTflops };
// What "% of ceiling" divides by: decode reads the cache (read-only reduction bandwidth), append
// reads and writes (copy bandwidth), prefill and dense compute (the bf16 GEMM rate).
enum class Ceiling : uint8_t { kReadBandwidth, kCopyBandwidth, kGemm };

struct BenchRow {
  std::string label;  // what distinguishes the row in its grid, e.g. "fp8_e4m3 64x4k"
  std::string impl = "attnkit";
  std::string backend = "fused";
  ordered_json shape = ordered_json::object();  // every shape field, in display order
  std::optional<double> time_ms;                // median per call
  std::optional<double> rate;                   // TB/s or TFLOP/s (the report's unit)
  std::optional<double> pct_of_ceiling;
  ordered_json extra = ordered_json::object();  // subcommand-specific numbers
  std::string note;                             // "unsupported: ...", "error: ..." or ""
};

struct Ceilings {
  std::optional<double> read_tbps;         // read-only reduction, bytes read / time
  std::optional<double> copy_tbps;         // D2D copy, (read + write) bytes / time
  std::optional<double> gemm_bf16_tflops;  // cuBLAS bf16 GEMM 8192^3
};

struct BenchDevice {
  std::string name;
  int sms = 0;
  std::string cc;  // "9.0"
};

struct BenchReport {
  std::string subcommand;  // decode, prefill, dense, append
  RateUnit unit = RateUnit::kTbps;
  Ceiling ceiling = Ceiling::kReadBandwidth;
  BenchDevice device;
  std::string date;  // ISO-8601 UTC
  Ceilings ceilings;
  std::vector<BenchRow> rows;
};

const char* rate_key(RateUnit unit);       // "tbps" / "tflops"
const char* rate_name(RateUnit unit);      // "TB/s" / "TFLOP/s"
const char* ceiling_key(Ceiling ceiling);  // its key in the JSON ceilings: "read_tbps", ...
std::optional<double> ceiling_value(Ceiling ceiling, const Ceilings& ceilings);
// Fills time_ms, rate and pct_of_ceiling (rate against `ceiling`) of a measured row.
void set_measurement(BenchRow& row, Ceiling ceiling, const Ceilings& ceilings, double time_ms,
                     double rate);
// A row that the selected backend does not run: no numbers, the reason in the note.
void set_failure(BenchRow& row, const std::string& error_message);

// How many input sets to rotate over so that a set is never still in the L2 when it comes back:
// the others cover >= 4x the L2; at least 2 sets, at most 8 and at most `max_bytes` in all.
int rotation_sets(size_t bytes_per_set, size_t l2_bytes, size_t max_bytes = size_t{24} << 30);

std::string iso8601_utc_now();
ordered_json report_to_json(const BenchReport& report);
std::string format_table(const BenchReport& report);
// "decode batch=64 context=4096 ..." (the progress line and error messages).
std::string row_summary(const std::string& subcommand, const BenchRow& row);

// Where --json goes: "-" is stdout, anything else a file opened before the run starts, so that a
// bad path fails before minutes of measuring.
class JsonSink {
 public:
  // Throws Error naming --json when the file cannot be created.
  JsonSink(const std::string& command, const std::string& target);
  JsonSink(const JsonSink&) = delete;
  JsonSink& operator=(const JsonSink&) = delete;
  ~JsonSink();
  void write(const BenchReport& report);
  bool to_stdout() const { return file_ == nullptr; }

 private:
  std::string command_;
  std::string target_;
  FILE* file_ = nullptr;
};

// "[3/12] decode batch=64 ..." on `stream`: one carriage-return line rewritten in place on a TTY,
// one plain line per step otherwise.
class Progress {
 public:
  Progress(FILE* stream, bool tty, int total);
  void step(const std::string& text);     // advances the counter
  void message(const std::string& text);  // a line without a counter (e.g. the ceilings)
  // A row's result: a plain line for logs; nothing on a TTY (the table follows at the end).
  void detail(const std::string& text);
  void finish();  // ends the TTY line

 private:
  FILE* stream_;
  bool tty_;
  int total_;
  int done_ = 0;
  bool line_open_ = false;
};
bool stderr_is_tty();

// Option validation: each throws Error "bench <command>: <option>: accepted ...; got ...".
void check_at_least(const std::string& command, const std::string& option, int64_t value,
                    int64_t min);
void check_one_of(const std::string& command, const std::string& option, int64_t value,
                  std::initializer_list<int64_t> accepted);
void check_finite_at_least(const std::string& command, const std::string& option, double value,
                           double min);
// bf16, fp8_e4m3 (alias fp8) or int8.
DType parse_kv_dtype(const std::string& command, const std::string& option,
                     const std::string& value);
// The head_dims the kernels are built for: 64, 80, 96, 128, 256.
void check_head_dim(const std::string& command, int64_t value);
// Tokens per block: 8, 16, 32, 64, 128.
void check_page(const std::string& command, const std::string& option, int64_t value);
void check_heads(const std::string& command, int64_t q_heads, int64_t kv_heads,
                 const std::string& q_option, const std::string& kv_option);
void check_iters(const std::string& command, int64_t iters);
// Names each value that is not in `accepted`.
void check_names(const std::string& command, const std::string& option,
                 const std::vector<std::string>& values, const std::vector<std::string>& accepted);

}  // namespace attnkit::tools
