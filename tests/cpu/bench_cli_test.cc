// `attnkit bench` without a GPU: the JSON report (schema of docs/bench.md), the markdown table,
// the progress line, option validation, and the program's clean refusal without a CUDA device.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "attnkit/info.h"
#include "bench_common.h"
#include "common/test_util.h"

namespace attnkit::tools {
namespace {

using nlohmann::json;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// A report with random shapes and numbers; every third row failed (unsupported or error).
BenchReport random_report(std::mt19937_64& rng, RateUnit unit, Ceiling ceiling,
                          bool with_ceilings) {
  std::uniform_real_distribution<double> u(0.01, 2.0);
  BenchReport r;
  r.subcommand = unit == RateUnit::kTbps ? "decode" : "dense";
  r.unit = unit;
  r.ceiling = ceiling;
  r.device = {"NVIDIA Test GPU", 1 + static_cast<int>(rng() % 200), "9.0"};
  r.date = iso8601_utc_now();
  if (with_ceilings) r.ceilings = {u(rng) * 4, u(rng) * 4, u(rng) * 800};
  const int rows = 2 + static_cast<int>(rng() % 6);
  for (int i = 0; i < rows; ++i) {
    BenchRow row;
    row.label = "row " + std::to_string(i);
    row.backend = i % 2 ? "fused" : "vanilla";
    row.shape = {{"batch", 1 + static_cast<int>(rng() % 256)},
                 {"context", 1 + static_cast<int>(rng() % 65536)},
                 {"kv_dtype", i % 2 ? "bf16" : "int8"},
                 {"causal", i % 2 == 0}};
    if (i % 3 == 2) {
      set_failure(row, i % 2 ? "dense: backend 'fused' cannot serve this call: quant (SAGE): no"
                             : "bench: cudaMalloc: out of memory");
    } else {
      set_measurement(row, ceiling, r.ceilings, u(rng), u(rng) * 100);
      if (i % 2) row.extra["kv_mb"] = u(rng) * 1000;
    }
    r.rows.push_back(row);
  }
  return r;
}

TEST(BenchReport, JsonRoundTripHasTheSchema) {
  const uint64_t seed = test::test_seed();
  std::mt19937_64 rng(seed);
  // The pairs the subcommands use: decode, append, prefill / dense.
  const std::pair<RateUnit, Ceiling> kinds[] = {{RateUnit::kTbps, Ceiling::kReadBandwidth},
                                                {RateUnit::kTbps, Ceiling::kCopyBandwidth},
                                                {RateUnit::kTflops, Ceiling::kGemm}};
  for (const auto& [unit, ceiling_kind] : kinds) {
    for (bool with_ceilings : {true, false}) {
      const BenchReport report = random_report(rng, unit, ceiling_kind, with_ceilings);
      const std::string text = report_to_json(report).dump(2);
      const json j = json::parse(text);
      // The documented key order, read back with an order-keeping parser.
      std::vector<std::string> keys;
      const ordered_json ordered = ordered_json::parse(text);
      for (const auto& item : ordered.items()) keys.push_back(item.key());
      EXPECT_EQ(keys, (std::vector<std::string>{"tool", "version", "subcommand", "device", "date",
                                                "ceilings", "pct_of", "rows"}));
      EXPECT_EQ(j["tool"], "attnkit bench");
      EXPECT_EQ(j["version"], version());
      EXPECT_EQ(j["subcommand"], report.subcommand);
      EXPECT_EQ(j["device"],
                json({{"name", "NVIDIA Test GPU"}, {"sms", report.device.sms}, {"cc", "9.0"}}));
      EXPECT_EQ(j["date"], report.date);
      ASSERT_TRUE(j["ceilings"].contains("read_tbps"));
      ASSERT_TRUE(j["ceilings"].contains("copy_tbps"));
      ASSERT_TRUE(j["ceilings"].contains("gemm_bf16_tflops"));
      const char* expected_pct_of = ceiling_kind == Ceiling::kReadBandwidth   ? "read_tbps"
                                    : ceiling_kind == Ceiling::kCopyBandwidth ? "copy_tbps"
                                                                              : "gemm_bf16_tflops";
      EXPECT_EQ(j["pct_of"], expected_pct_of);
      if (with_ceilings) {
        EXPECT_DOUBLE_EQ(j["ceilings"]["read_tbps"].get<double>(), *report.ceilings.read_tbps);
        EXPECT_DOUBLE_EQ(j["ceilings"]["copy_tbps"].get<double>(), *report.ceilings.copy_tbps);
        EXPECT_DOUBLE_EQ(j["ceilings"]["gemm_bf16_tflops"].get<double>(),
                         *report.ceilings.gemm_bf16_tflops);
      } else {
        EXPECT_TRUE(j["ceilings"]["read_tbps"].is_null());
        EXPECT_TRUE(j["ceilings"]["copy_tbps"].is_null());
        EXPECT_TRUE(j["ceilings"]["gemm_bf16_tflops"].is_null());
      }
      const char* rate = unit == RateUnit::kTbps ? "tbps" : "tflops";
      const char* other_rate = unit == RateUnit::kTbps ? "tflops" : "tbps";
      const double ceiling = j["ceilings"][expected_pct_of].is_null()
                                 ? 0
                                 : j["ceilings"][expected_pct_of].get<double>();
      ASSERT_EQ(j["rows"].size(), report.rows.size());
      for (size_t i = 0; i < report.rows.size(); ++i) {
        const json& row = j["rows"][i];
        const BenchRow& src = report.rows[i];
        SCOPED_TRACE("seed " + std::to_string(seed) + " row " + std::to_string(i));
        EXPECT_EQ(row["impl"], "attnkit");
        EXPECT_EQ(row["backend"], src.backend);
        EXPECT_EQ(row["label"], src.label);
        for (const char* key : {"batch", "context", "kv_dtype", "causal"}) {
          EXPECT_EQ(row[key], json::parse(src.shape[key].dump())) << key;
        }
        EXPECT_FALSE(row.contains(other_rate));
        ASSERT_TRUE(row.contains("time_ms") && row.contains(rate) &&
                    row.contains("pct_of_ceiling"));
        if (src.note.empty()) {
          EXPECT_FALSE(row.contains("note"));
          EXPECT_DOUBLE_EQ(row["time_ms"].get<double>(), *src.time_ms);
          EXPECT_DOUBLE_EQ(row[rate].get<double>(), *src.rate);
          if (with_ceilings) {
            EXPECT_NEAR(row["pct_of_ceiling"].get<double>(), 100.0 * *src.rate / ceiling, 1e-9);
          } else {
            EXPECT_TRUE(row["pct_of_ceiling"].is_null());
          }
          if (src.extra.contains("kv_mb")) {
            EXPECT_DOUBLE_EQ(row["kv_mb"].get<double>(), src.extra["kv_mb"].get<double>());
          }
        } else {
          EXPECT_EQ(row["note"], src.note);
          EXPECT_TRUE(row["time_ms"].is_null());
          EXPECT_TRUE(row[rate].is_null());
          EXPECT_TRUE(row["pct_of_ceiling"].is_null());
        }
      }
    }
  }
}

TEST(BenchReport, FailuresSayUnsupportedWithTheDispatchReason) {
  BenchRow row;
  // Each kind of row against its own ceiling (read, copy, GEMM).
  const Ceilings ceilings{4.0, 2.0, 500.0};
  set_measurement(row, Ceiling::kReadBandwidth, ceilings, 1.0, 3.0);
  EXPECT_DOUBLE_EQ(*row.pct_of_ceiling, 75.0);
  set_measurement(row, Ceiling::kCopyBandwidth, ceilings, 1.0, 3.0);
  EXPECT_DOUBLE_EQ(*row.pct_of_ceiling, 150.0);
  set_measurement(row, Ceiling::kGemm, ceilings, 2.0, 250.0);
  EXPECT_DOUBLE_EQ(*row.pct_of_ceiling, 50.0);
  set_failure(row, "dense: backend 'fused' cannot serve this call: skip_softmax: not yet");
  EXPECT_EQ(row.note, "unsupported: skip_softmax: not yet");
  EXPECT_FALSE(row.time_ms || row.rate || row.pct_of_ceiling);
  set_failure(row, "bench: cudaMalloc: out of memory");
  EXPECT_EQ(row.note, "error: bench: cudaMalloc: out of memory");
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// Cells of a markdown row, honouring escaped '|'.
std::vector<std::string> cells_of(const std::string& line) {
  std::vector<std::string> cells;
  std::string cell;
  for (size_t i = 1; i < line.size(); ++i) {
    if (line[i] == '\\' && i + 1 < line.size() && line[i + 1] == '|') {
      cell += '|';
      ++i;
    } else if (line[i] == '|') {
      cells.push_back(cell.substr(
          cell.find_first_not_of(' ') == std::string::npos ? 0 : cell.find_first_not_of(' ')));
      while (!cells.back().empty() && cells.back().back() == ' ') cells.back().pop_back();
      cell.clear();
    } else {
      cell += line[i];
    }
  }
  return cells;
}

TEST(BenchTable, MarkdownRowsWithEveryColumn) {
  std::mt19937_64 rng(test::test_seed());
  BenchReport report = random_report(rng, RateUnit::kTbps, Ceiling::kReadBandwidth, true);
  report.rows[0].note = "a | b";
  const std::string text = format_table(report);
  EXPECT_NE(text.find("% of ceiling: TB/s / read bandwidth"), std::string::npos) << text;
  const std::vector<std::string> lines = lines_of(text);
  EXPECT_NE(text.find("device: NVIDIA Test GPU (" + std::to_string(report.device.sms) +
                      " SMs, cc 9.0), date: " + report.date),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("TB/s"), std::string::npos);
  size_t header = 0;
  while (header < lines.size() && lines[header].rfind("| label |", 0) != 0) ++header;
  ASSERT_LT(header + 2 + report.rows.size(), lines.size() + 1) << text;
  const std::vector<std::string> columns = cells_of(lines[header]);
  EXPECT_EQ(columns, (std::vector<std::string>{"label", "impl", "backend", "batch", "context",
                                               "kv_dtype", "causal", "time (ms)", "TB/s",
                                               "% of ceiling", "kv_mb", "note"}));
  for (size_t i = 0; i < report.rows.size(); ++i) {
    const std::vector<std::string> cells = cells_of(lines[header + 2 + i]);
    const BenchRow& row = report.rows[i];
    ASSERT_EQ(cells.size(), columns.size()) << lines[header + 2 + i];
    EXPECT_EQ(cells[0], row.label);
    EXPECT_EQ(cells[3], std::to_string(row.shape["batch"].get<int>()));
    EXPECT_EQ(cells[6], row.shape["causal"].get<bool>() ? "yes" : "no");
    EXPECT_EQ(cells.back(), row.note);
    if (row.rate) {
      EXPECT_NEAR(std::stod(cells[7]), *row.time_ms, 1e-4);
      EXPECT_NEAR(std::stod(cells[8]), *row.rate, 1e-3);
      EXPECT_NEAR(std::stod(cells[9]), *row.pct_of_ceiling, 0.05);
      EXPECT_EQ(cells[9].back(), '%');
    } else {
      EXPECT_EQ(cells[7], "-");
      EXPECT_EQ(cells[8], "-");
      EXPECT_EQ(cells[9], "-");
    }
  }
  report.ceilings = {};
  EXPECT_NE(format_table(report).find("not measured"), std::string::npos);
}

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::filesystem::path temp_path(const std::string& tag) {
  return std::filesystem::temp_directory_path() /
         ("attnkit_bench_test_" + std::to_string(::getpid()) + "_" + tag);
}

TEST(BenchJsonSink, WritesTheFileAndRejectsABadPath) {
  std::mt19937_64 rng(test::test_seed());
  const BenchReport report = random_report(rng, RateUnit::kTflops, Ceiling::kGemm, true);
  const auto path = temp_path("out.json");
  {
    JsonSink sink("dense", path.string());
    EXPECT_FALSE(sink.to_stdout());
    sink.write(report);
  }
  EXPECT_EQ(json::parse(read_file(path)), json::parse(report_to_json(report).dump()));
  std::filesystem::remove(path);
  const std::string bad = (temp_path("missing_dir") / "x.json").string();
  const std::string message = error_of([&] { JsonSink sink("dense", bad); });
  EXPECT_NE(message.find("bench dense: --json: cannot create '" + bad + "'"), std::string::npos)
      << message;
  EXPECT_TRUE(JsonSink("decode", "-").to_stdout());
}

std::string progress_output(bool tty) {
  char* buffer = nullptr;
  size_t size = 0;
  FILE* stream = open_memstream(&buffer, &size);
  Progress progress(stream, tty, 3);
  progress.message("measuring");
  progress.step("decode batch=64");
  progress.detail("0.1 ms");
  progress.step("decode batch=128");
  progress.finish();
  std::fclose(stream);
  std::string text(buffer, size);
  std::free(buffer);
  return text;
}

TEST(BenchProgress, PlainLinesOrOneRewrittenTtyLine) {
  EXPECT_EQ(progress_output(false),
            "measuring\n[1/3] decode batch=64\n      0.1 ms\n[2/3] decode batch=128\n");
  const std::string tty = progress_output(true);
  EXPECT_EQ(tty.find('\n'), std::string::npos) << tty;
  EXPECT_NE(tty.find("\r[2/3] decode batch=128\x1b[K"), std::string::npos);
  EXPECT_EQ(tty.substr(tty.size() - 4), "\r\x1b[K");
}

TEST(BenchOptions, ValidationNamesTheOptionAndWhatIsAccepted) {
  std::mt19937_64 rng(test::test_seed());
  const int bad_page = 9 + static_cast<int>(rng() % 6);  // 9..14: never a valid page
  EXPECT_EQ(error_of([&] { check_page("decode", "--page", bad_page); }),
            "bench decode: --page: accepted 8, 16, 32, 64, 128; got " + std::to_string(bad_page));
  EXPECT_EQ(error_of([] { check_page("decode", "--page", 64); }), "");
  EXPECT_EQ(error_of([] { check_head_dim("prefill", 100); }),
            "bench prefill: --head-dim: accepted 64, 80, 96, 128, 256; got 100");
  EXPECT_EQ(error_of([] { check_iters("dense", 19); }),
            "bench dense: --iters: accepted an integer >= 20; got 19");
  EXPECT_EQ(error_of([] { check_iters("dense", 20); }), "");
  EXPECT_EQ(error_of([] { parse_kv_dtype("decode", "--kv-dtype", "fp16"); }),
            "bench decode: --kv-dtype: accepted bf16, fp8_e4m3 (or fp8), int8; got 'fp16'");
  EXPECT_EQ(parse_kv_dtype("decode", "--kv-dtype", "fp8"), DType::kFp8E4M3);
  EXPECT_EQ(error_of([] { check_heads("append", 32, 6, "--q-heads", "--kv-heads"); }),
            "bench append: --kv-heads: accepted a divisor of --q-heads (32); got 6");
  EXPECT_NE(error_of([] { check_finite_at_least("dense", "--skip-threshold", NAN, 0); }), "");
  EXPECT_NE(error_of([] { check_finite_at_least("dense", "--skip-threshold", -1, 0); }), "");
  EXPECT_EQ(error_of([] {
              check_names("dense", "--variants", {"default", "sage"}, {"default"});
            }),
            "bench dense: --variants: accepted default; got 'sage'");
}

TEST(BenchRotation, OtherSetsCoverTheL2) {
  std::mt19937_64 rng(test::test_seed());
  const size_t l2 = size_t{60} << 20;
  for (int i = 0; i < 200; ++i) {
    const size_t bytes = 1 + rng() % (size_t{8} << 30);
    const int sets = rotation_sets(bytes, l2);
    EXPECT_GE(sets, 2);
    EXPECT_LE(sets, 8);
    if (sets < 8 && sets * bytes <= (size_t{24} << 30) / 2) {
      EXPECT_GE((sets - 1) * bytes, 4 * l2) << bytes;
    }
  }
  EXPECT_EQ(rotation_sets(size_t{20} << 30, l2), 2);  // the memory cap, but never one set
}

TEST(BenchReport, DateIsIso8601Utc) {
  EXPECT_TRUE(
      std::regex_match(iso8601_utc_now(), std::regex(R"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)")));
}

#ifdef ATTNKIT_PROGRAM
struct RunResult {
  int status = -1;
  std::string out, err;
};

RunResult run_program(const std::string& args, const std::string& env = "") {
  const auto out_path = temp_path("stdout"), err_path = temp_path("stderr");
  const std::string command = env + (env.empty() ? "" : " ") + "'" + ATTNKIT_PROGRAM + "' " + args +
                              " >'" + out_path.string() + "' 2>'" + err_path.string() + "'";
  const int raw = std::system(command.c_str());
  RunResult result;
  result.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  result.out = read_file(out_path);
  result.err = read_file(err_path);
  std::filesystem::remove(out_path);
  std::filesystem::remove(err_path);
  return result;
}

TEST(BenchCommand, RejectsInvalidOptionsBeforeTouchingTheGpu) {
  struct Case {
    std::string args, expected;
  };
  const std::vector<Case> cases = {
      {"bench decode --page 12", "bench decode: --page: accepted 8, 16, 32, 64, 128; got 12"},
      {"bench decode --kv-dtype f16", "--kv-dtype: accepted bf16, fp8_e4m3 (or fp8), int8"},
      {"bench decode --iters 5", "bench decode: --iters: accepted an integer >= 20; got 5"},
      {"bench decode --q-heads 32 --kv-heads 6", "--kv-heads: accepted a divisor of --q-heads"},
      {"bench decode --batch 0", "bench decode: --batch: accepted an integer >= 1; got 0"},
      {"bench decode --split-workspace none",
       "bench decode: --split-workspace: accepted caller, per-call; got 'none'"},
      {"bench decode --merge last",
       "bench decode: --merge: accepted auto, in-kernel, separate, accumulate; got 'last'"},
      {"bench prefill --head-dim 100", "--head-dim: accepted 64, 80, 96, 128, 256; got 100"},
      {"bench prefill --seqlen 1024 --kv-dtype int8", "--kv-dtype int8: accepted only with --page"},
      {"bench prefill --page 3", "bench prefill: --page: accepted 0, 8, 16, 32, 64, 128; got 3"},
      {"bench prefill --seqlen 1024 --dtype fp8",
       "bench prefill: --dtype: accepted bf16, f16, fp8_e4m3; got"},
      {"bench prefill --seqlen 1024 --page 16 --dtype f16",
       "--dtype f16: accepted only with --page 0"},
      {"bench prefill --dtype f16", "--dtype f16: accepted only with --seqlen"},
      {"bench dense --variants default,sage", "--variants: accepted default, skip_softmax"},
      {"bench dense --skip-threshold -1", "--skip-threshold: accepted a finite number >= 0"},
      {"bench dense --timestep 2", "--timestep: accepted a number in [0, 1]"},
      {"bench dense --config '{\"default\": {\"backend\": \"turbo\"}}'", "bench dense: --config:"},
      {"bench append --tokens 0", "bench append: --tokens: accepted an integer >= 1; got 0"},
      {"bench append --kv-dtype int4", "--kv-dtype: accepted bf16, fp8_e4m3 (or fp8), int8"},
  };
  for (const Case& c : cases) {
    const RunResult r = run_program(c.args);
    EXPECT_EQ(r.status, 1) << c.args << "\n" << r.err;
    EXPECT_NE(r.err.find(c.expected), std::string::npos) << c.args << "\n" << r.err;
    EXPECT_EQ(r.err.find("terminate"), std::string::npos) << r.err;
  }
}

TEST(BenchCommand, ListsTheFourSubcommands) {
  const RunResult r = run_program("bench --help");
  EXPECT_EQ(r.status, 0) << r.err;
  for (const char* sub : {"decode", "prefill", "dense", "append"}) {
    EXPECT_NE(r.out.find(sub), std::string::npos) << sub << "\n" << r.out;
  }
}

// The self-test mode runs each subcommand end to end (options, tensors, the entry point, the
// report) on the reference backend: every row measured, none failed, the schema of docs/bench.md.
json run_self_test(const std::string& args, size_t expected_rows) {
  const auto json_path = temp_path("selftest.json");
  const RunResult r = run_program("bench " + args + " --json '" + json_path.string() + "'",
                                  "ATTNKIT_BENCH_DEVICE=cpu");
  EXPECT_EQ(r.status, 0) << args << "\n" << r.err;
  EXPECT_NE(r.out.find("| label | impl | backend |"), std::string::npos) << r.out;
  EXPECT_NE(
      r.err.find("[" + std::to_string(expected_rows) + "/" + std::to_string(expected_rows) + "] "),
      std::string::npos)
      << r.err;
  json report = json::object();
  if (std::filesystem::exists(json_path)) report = json::parse(read_file(json_path));
  std::filesystem::remove(json_path);
  EXPECT_EQ(report.value("rows", json::array()).size(), expected_rows) << args;
  const std::string rate =
      report.value("subcommand", "") == "prefill" || report.value("subcommand", "") == "dense"
          ? "tflops"
          : "tbps";
  for (const json& row : report.value("rows", json::array())) {
    EXPECT_FALSE(row.contains("note")) << args << "\n" << row.dump();
    EXPECT_EQ(row.value("backend", ""), "vanilla") << row.dump();
    EXPECT_GT(row.value("time_ms", 0.0), 0.0) << row.dump();
    EXPECT_GT(row.value(rate, 0.0), 0.0) << row.dump();
    EXPECT_TRUE(row["pct_of_ceiling"].is_null());
  }
  return report;
}

TEST(BenchCommand, SelfTestRunsEverySubcommandOnTheReference) {
  std::mt19937_64 rng(test::test_seed());
  const int context = 17 + static_cast<int>(rng() % 200);
  const char* kv = std::vector<const char*>{"bf16", "fp8_e4m3", "int8"}[rng() % 3];
  json r = run_self_test("decode --batch 2 3 --context " + std::to_string(context) +
                             " --q-heads 4 --kv-heads 2 --head-dim 64 --page 16 --kv-dtype " + kv,
                         2);
  EXPECT_EQ(r["rows"][1]["batch"], 3);
  EXPECT_EQ(r["rows"][1]["kv_dtype"], kv);
  EXPECT_EQ(r["rows"][1]["merge"], "auto");
  EXPECT_EQ(r["rows"][1]["batch_invariant"], false);
  // KV bytes that must be read: 2 (K, V) x batch x context x kv_heads x D x element size.
  const double element = std::string(kv) == "bf16" ? 2 : 1;
  EXPECT_NEAR(r["rows"][1]["kv_mb"].get<double>(), 2 * 3 * context * 2 * 64 * element * 1e-6, 1e-9);
  r = run_self_test("decode --batch 2 --context " + std::to_string(context) +
                        " --q-heads 4 --kv-heads 2 --head-dim 64 --page 16 --batch-invariant",
                    1);
  EXPECT_EQ(r["rows"][0]["batch_invariant"], true);
  const int seqlen = 16 + static_cast<int>(rng() % 64);
  run_self_test("prefill --seqlen " + std::to_string(seqlen) +
                    " --batch 2 --heads 4 --kv-heads 2 --head-dim 64 --causal",
                1);
  run_self_test("prefill --seqlen " + std::to_string(seqlen) +
                    " --batch 2 --heads 4 --kv-heads 1 --head-dim 64 --page 16 --kv-dtype " + kv,
                1);
  run_self_test("append --tokens " + std::to_string(seqlen) +
                    " --q-heads 4 --kv-heads 2 --head-dim 64 --page 16",
                3);
  r = run_self_test("dense --seqlen " + std::to_string(seqlen) + " --heads 2 --head-dim 64", 5);
  EXPECT_EQ(r["rows"][4]["variant"], "vanilla");
}

// A paged row whose seqlen is not a multiple of the page: the pool holds whole pages (it was sized
// from the tokens, and the last page of each sequence ran past it: a heap overflow that the
// sanitized build of this test reports).
TEST(BenchCommand, PagedPrefillPoolHoldsWholePages) {
  run_self_test(
      "prefill --seqlen 62 --batch 2 --heads 4 --kv-heads 1 --head-dim 64 --page 16 "
      "--kv-dtype bf16",
      1);
}

// A forced split merge is a knob of the fused kernels: a row on the reference says so and fails.
TEST(BenchCommand, ForcedMergeNeedsTheFusedBackend) {
  for (const char* merge : {"in-kernel", "separate", "accumulate"}) {
    const RunResult r = run_program(
        std::string("bench decode --batch 1 --context 40 --q-heads 4 --kv-heads 2 --head-dim 64 "
                    "--merge ") +
            merge,
        "ATTNKIT_BENCH_DEVICE=cpu");
    EXPECT_EQ(r.status, 1) << r.err;
    EXPECT_NE((r.out + r.err)
                  .find(std::string("--merge ") + merge +
                        " needs the fused backend (this row runs vanilla)"),
              std::string::npos)
        << r.out << r.err;
  }
}

TEST(BenchCommand, DenseHotKeysGiveSkipSoftmaxItsTiles) {
  // Hot keys lead every query by about sqrt(D) logits: every key tile without one falls below
  // ln(0.01) and is skipped; the tiles holding a hot key are not.
  std::mt19937_64 rng(test::test_seed());
  const int seqlen = 300 + static_cast<int>(rng() % 340);
  const double hot = 0.05 + 0.1 * static_cast<double>(rng() % 6);
  std::ostringstream args;
  args << "dense --seqlen " << seqlen << " --heads 1 --head-dim 128 --variants skip_softmax"
       << " --hot-keys " << hot;
  const json r = run_self_test(args.str(), 1);
  // The hot keys: the first half at the sequence's start, the rest at its end.
  const int hot_tokens = static_cast<int>(hot * seqlen);
  const int hot_front = (hot_tokens + 1) / 2, hot_back = hot_tokens - hot_front;
  const int key_tiles = (seqlen + 127) / 128;
  int hot_tiles = 0;
  for (int t = 0; t < key_tiles; ++t) {
    const int lo = 128 * t, hi = std::min(seqlen, 128 * (t + 1));
    hot_tiles += (lo < hot_front) || (hi > seqlen - hot_back && hot_back > 0);
  }
  EXPECT_NEAR(r["rows"][0]["tiles_skipped_fraction"].get<double>(),
              static_cast<double>(key_tiles - hot_tiles) / key_tiles, 1e-12)
      << args.str();
}

TEST(BenchCommand, SaysNoCudaDeviceAndWritesNothing) {
  if (built_with_cuda() && !cuda_devices().empty()) {
    GTEST_SKIP() << "a CUDA device is visible: the GPU round runs the benchmarks themselves";
  }
  const auto json_path = temp_path("nocuda.json");
  for (const char* sub : {"decode", "prefill", "dense", "append"}) {
    const RunResult r =
        run_program(std::string("bench ") + sub + " --quick --json '" + json_path.string() + "'");
    EXPECT_EQ(r.status, 1) << sub << "\n" << r.err;
    EXPECT_NE(r.err.find(std::string("error: bench ") + sub + ": no CUDA"), std::string::npos)
        << r.err;
    EXPECT_EQ(r.out, "");
    EXPECT_FALSE(std::filesystem::exists(json_path));
  }
}
#endif

}  // namespace
}  // namespace attnkit::tools
