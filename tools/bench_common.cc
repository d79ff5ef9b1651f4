#include "bench_common.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <ctime>
#include <sstream>

#include "attnkit/info.h"

namespace attnkit::tools {
namespace {

std::string format_number(double value, int decimals) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.*f", decimals, value);
  return text;
}

// A shape value as the table shows it: integers plain, booleans yes/no, strings raw.
std::string cell(const ordered_json& value) {
  if (value.is_null()) return "-";
  if (value.is_string()) return value.get<std::string>();
  if (value.is_boolean()) return value.get<bool>() ? "yes" : "no";
  if (value.is_number_float()) {
    const double v = value.get<double>();
    return format_number(v, std::fabs(v) >= 100 ? 1 : 3);
  }
  return value.dump();
}

std::string join(std::initializer_list<int64_t> values) {
  std::string text;
  for (int64_t v : values) text += (text.empty() ? "" : ", ") + std::to_string(v);
  return text;
}

// Keys of a JSON object across rows, in order of first appearance.
std::vector<std::string> union_keys(const std::vector<BenchRow>& rows,
                                    const ordered_json BenchRow::*field) {
  std::vector<std::string> keys;
  for (const BenchRow& row : rows) {
    for (const auto& item : (row.*field).items()) {
      if (std::find(keys.begin(), keys.end(), item.key()) == keys.end()) {
        keys.push_back(item.key());
      }
    }
  }
  return keys;
}

std::string escape_cell(std::string text) {
  // A '|' inside a cell would split the markdown column.
  for (size_t pos = text.find('|'); pos != std::string::npos; pos = text.find('|', pos + 2)) {
    text.replace(pos, 1, "\\|");
  }
  return text;
}

}  // namespace

const char* rate_key(RateUnit unit) { return unit == RateUnit::kTbps ? "tbps" : "tflops"; }
const char* rate_name(RateUnit unit) { return unit == RateUnit::kTbps ? "TB/s" : "TFLOP/s"; }

const char* ceiling_key(Ceiling ceiling) {
  switch (ceiling) {
    case Ceiling::kReadBandwidth:
      return "read_tbps";
    case Ceiling::kCopyBandwidth:
      return "copy_tbps";
    case Ceiling::kGemm:
      break;
  }
  return "gemm_bf16_tflops";
}

std::optional<double> ceiling_value(Ceiling ceiling, const Ceilings& ceilings) {
  switch (ceiling) {
    case Ceiling::kReadBandwidth:
      return ceilings.read_tbps;
    case Ceiling::kCopyBandwidth:
      return ceilings.copy_tbps;
    case Ceiling::kGemm:
      break;
  }
  return ceilings.gemm_bf16_tflops;
}

void set_measurement(BenchRow& row, Ceiling ceiling_kind, const Ceilings& ceilings, double time_ms,
                     double rate) {
  row.time_ms = time_ms;
  row.rate = rate;
  const std::optional<double> ceiling = ceiling_value(ceiling_kind, ceilings);
  row.pct_of_ceiling.reset();
  if (ceiling && *ceiling > 0) row.pct_of_ceiling = 100.0 * rate / *ceiling;
}

void set_failure(BenchRow& row, const std::string& error_message) {
  row.time_ms.reset();
  row.rate.reset();
  row.pct_of_ceiling.reset();
  // Dispatch says "<op>: backend 'fused' cannot serve this call: <reason>" (dispatch.cc).
  static const std::string kUnsupported = "cannot serve this call: ";
  const size_t pos = error_message.find(kUnsupported);
  row.note = pos == std::string::npos
                 ? "error: " + error_message
                 : "unsupported: " + error_message.substr(pos + kUnsupported.size());
}

int rotation_sets(size_t bytes_per_set, size_t l2_bytes, size_t max_bytes) {
  const size_t per_set = std::max<size_t>(bytes_per_set, 1);
  const size_t others = (4 * l2_bytes + per_set - 1) / per_set;
  const size_t by_memory = std::max<size_t>(max_bytes / per_set, 2);
  return static_cast<int>(std::clamp<size_t>(std::min(others + 1, by_memory), 2, 8));
}

std::string iso8601_utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  char text[32];
  std::strftime(text, sizeof(text), "%Y-%m-%dT%H:%M:%SZ", &utc);
  return text;
}

ordered_json report_to_json(const BenchReport& report) {
  auto optional_number = [](const std::optional<double>& v) {
    return v ? ordered_json(*v) : ordered_json(nullptr);
  };
  ordered_json json = ordered_json::object();
  json["tool"] = "attnkit bench";
  json["version"] = version();
  json["subcommand"] = report.subcommand;
  json["device"] = {
      {"name", report.device.name}, {"sms", report.device.sms}, {"cc", report.device.cc}};
  json["date"] = report.date;
  json["ceilings"] = {{"read_tbps", optional_number(report.ceilings.read_tbps)},
                      {"copy_tbps", optional_number(report.ceilings.copy_tbps)},
                      {"gemm_bf16_tflops", optional_number(report.ceilings.gemm_bf16_tflops)}};
  json["pct_of"] = ceiling_key(report.ceiling);
  ordered_json rows = ordered_json::array();
  for (const BenchRow& row : report.rows) {
    ordered_json r = ordered_json::object();
    r["impl"] = row.impl;
    r["backend"] = row.backend;
    r["label"] = row.label;
    for (const auto& item : row.shape.items()) r[item.key()] = item.value();
    r["time_ms"] = optional_number(row.time_ms);
    r[rate_key(report.unit)] = optional_number(row.rate);
    r["pct_of_ceiling"] = optional_number(row.pct_of_ceiling);
    for (const auto& item : row.extra.items()) r[item.key()] = item.value();
    if (!row.note.empty()) r["note"] = row.note;
    rows.push_back(std::move(r));
  }
  json["rows"] = std::move(rows);
  return json;
}

std::string format_table(const BenchReport& report) {
  std::ostringstream out;
  out << "attnkit bench " << report.subcommand << " (attnkit " << version() << ")\n";
  out << "device: " << report.device.name << " (" << report.device.sms << " SMs, cc "
      << report.device.cc << "), date: " << report.date << "\n";
  auto ceiling_text = [](const std::optional<double>& v, const char* unit, int decimals) {
    return v ? format_number(*v, decimals) + " " + unit : std::string("not measured");
  };
  out << "ceilings: read-only reduction " << ceiling_text(report.ceilings.read_tbps, "TB/s", 2)
      << ", D2D copy (read+write) " << ceiling_text(report.ceilings.copy_tbps, "TB/s", 2)
      << ", cuBLAS bf16 GEMM 8192^3 "
      << ceiling_text(report.ceilings.gemm_bf16_tflops, "TFLOP/s", 1) << "\n";
  static constexpr const char* kCeilingNames[] = {"read bandwidth", "copy bandwidth", "GEMM rate"};
  out << "% of ceiling: " << rate_name(report.unit) << " / "
      << kCeilingNames[static_cast<int>(report.ceiling)] << "\n\n";

  const std::vector<std::string> shape_keys = union_keys(report.rows, &BenchRow::shape);
  const std::vector<std::string> extra_keys = union_keys(report.rows, &BenchRow::extra);
  std::vector<std::string> header = {"label", "impl", "backend"};
  header.insert(header.end(), shape_keys.begin(), shape_keys.end());
  header.insert(header.end(), {"time (ms)", rate_name(report.unit), "% of ceiling"});
  header.insert(header.end(), extra_keys.begin(), extra_keys.end());
  header.push_back("note");
  out << "|";
  for (const std::string& h : header) out << " " << h << " |";
  out << "\n|";
  for (size_t i = 0; i < header.size(); ++i) out << "---|";
  out << "\n";
  const int rate_decimals = report.unit == RateUnit::kTbps ? 3 : 1;
  for (const BenchRow& row : report.rows) {
    std::vector<std::string> cells = {row.label, row.impl, row.backend};
    for (const std::string& key : shape_keys) {
      cells.push_back(row.shape.contains(key) ? cell(row.shape[key]) : "-");
    }
    cells.push_back(row.time_ms ? format_number(*row.time_ms, 4) : "-");
    cells.push_back(row.rate ? format_number(*row.rate, rate_decimals) : "-");
    cells.push_back(row.pct_of_ceiling ? format_number(*row.pct_of_ceiling, 1) + "%" : "-");
    for (const std::string& key : extra_keys) {
      cells.push_back(row.extra.contains(key) ? cell(row.extra[key]) : "-");
    }
    cells.push_back(row.note);
    out << "|";
    for (const std::string& c : cells) out << " " << escape_cell(c) << " |";
    out << "\n";
  }
  return out.str();
}

std::string row_summary(const std::string& subcommand, const BenchRow& row) {
  std::string text = subcommand;
  if (row.backend != "fused") text += " backend=" + row.backend;
  for (const auto& item : row.shape.items()) text += " " + item.key() + "=" + cell(item.value());
  return text;
}

JsonSink::JsonSink(const std::string& command, const std::string& target)
    : command_(command), target_(target) {
  if (target.empty()) {
    throw Error("bench " + command + ": --json: accepted a file name or '-' (stdout); got ''");
  }
  if (target == "-") return;
  file_ = std::fopen(target.c_str(), "w");
  if (file_ == nullptr) {
    throw Error("bench " + command + ": --json: cannot create '" + target +
                "': " + std::strerror(errno));
  }
}

JsonSink::~JsonSink() {
  if (file_ != nullptr) std::fclose(file_);
}

void JsonSink::write(const BenchReport& report) {
  const std::string text = report_to_json(report).dump(2) + "\n";
  FILE* stream = file_ != nullptr ? file_ : stdout;
  if (std::fwrite(text.data(), 1, text.size(), stream) != text.size() || std::fflush(stream) != 0) {
    throw Error("bench " + command_ + ": --json: writing '" + target_ + "' failed");
  }
}

Progress::Progress(FILE* stream, bool tty, int total) : stream_(stream), tty_(tty), total_(total) {}

void Progress::step(const std::string& text) {
  ++done_;
  message("[" + std::to_string(done_) + "/" + std::to_string(total_) + "] " + text);
}

void Progress::message(const std::string& text) {
  if (tty_) {
    // Rewrite the line in place; ESC[K clears what a longer previous line left behind.
    std::fprintf(stream_, "\r%s\x1b[K", text.c_str());
    line_open_ = true;
  } else {
    std::fprintf(stream_, "%s\n", text.c_str());
  }
  std::fflush(stream_);
}

void Progress::detail(const std::string& text) {
  if (tty_) return;
  std::fprintf(stream_, "      %s\n", text.c_str());
  std::fflush(stream_);
}

void Progress::finish() {
  if (tty_ && line_open_) {
    std::fprintf(stream_, "\r\x1b[K");
    std::fflush(stream_);
  }
  line_open_ = false;
}

bool stderr_is_tty() { return isatty(fileno(stderr)) != 0; }

void check_at_least(const std::string& command, const std::string& option, int64_t value,
                    int64_t min) {
  if (value < min) {
    throw Error("bench " + command + ": " + option + ": accepted an integer >= " +
                std::to_string(min) + "; got " + std::to_string(value));
  }
}

void check_one_of(const std::string& command, const std::string& option, int64_t value,
                  std::initializer_list<int64_t> accepted) {
  if (std::find(accepted.begin(), accepted.end(), value) == accepted.end()) {
    throw Error("bench " + command + ": " + option + ": accepted " + join(accepted) + "; got " +
                std::to_string(value));
  }
}

void check_finite_at_least(const std::string& command, const std::string& option, double value,
                           double min) {
  if (!std::isfinite(value) || value < min) {
    std::ostringstream text;
    text << "bench " << command << ": " << option << ": accepted a finite number >= " << min
         << "; got " << value;
    throw Error(text.str());
  }
}

DType parse_kv_dtype(const std::string& command, const std::string& option,
                     const std::string& value) {
  if (value == "bf16") return DType::kBF16;
  if (value == "fp8_e4m3" || value == "fp8") return DType::kFp8E4M3;
  if (value == "int8") return DType::kInt8;
  throw Error("bench " + command + ": " + option +
              ": accepted bf16, fp8_e4m3 (or fp8), int8; got '" + value + "'");
}

void check_head_dim(const std::string& command, int64_t value) {
  check_one_of(command, "--head-dim", value, {64, 80, 96, 128, 256});
}

void check_page(const std::string& command, const std::string& option, int64_t value) {
  check_one_of(command, option, value, {8, 16, 32, 64, 128});
}

void check_heads(const std::string& command, int64_t q_heads, int64_t kv_heads,
                 const std::string& q_option, const std::string& kv_option) {
  check_at_least(command, q_option, q_heads, 1);
  check_at_least(command, kv_option, kv_heads, 1);
  if (q_heads % kv_heads != 0) {
    throw Error("bench " + command + ": " + kv_option + ": accepted a divisor of " + q_option +
                " (" + std::to_string(q_heads) + "); got " + std::to_string(kv_heads));
  }
}

void check_iters(const std::string& command, int64_t iters) {
  // docs/bench.md: the median of at least 20 timed runs.
  check_at_least(command, "--iters", iters, 20);
}

void check_names(const std::string& command, const std::string& option,
                 const std::vector<std::string>& values, const std::vector<std::string>& accepted) {
  for (const std::string& value : values) {
    if (std::find(accepted.begin(), accepted.end(), value) != accepted.end()) continue;
    std::string list;
    for (const std::string& a : accepted) list += (list.empty() ? "" : ", ") + a;
    throw Error("bench " + command + ": " + option + ": accepted " + list + "; got '" + value +
                "'");
  }
}

}  // namespace attnkit::tools
