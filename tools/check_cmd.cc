// `attnkit check`: a randomized self-test of every backend present against the reference.
//
// Each case builds fresh random inputs, runs the CPU reference, and compares:
//  - on the CPU, the reference against an independent brute-force fp64 attention (prefill) and
//    against its own equivalences (decode == last prefill row, paged == packed,
//    merge_states(halves) == whole);
//  - on each CUDA device, the vanilla and fused backends against the CPU reference.
// Prints a table (--json: one JSON document); exits non-zero on any mismatch.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "attnkit/attnkit.h"
#include "check_support.h"
#include "commands.h"

namespace attnkit::tools {

namespace {

struct Row {
  std::string name;
  std::string backend;
  double error = 0;
  double tolerance = 0;
  std::string note;  // "skipped: ..." or an error message
  bool skipped() const { return note.rfind("skipped", 0) == 0; }
  bool pass() const { return skipped() || (note.empty() && error <= tolerance); }
  const char* result() const { return skipped() ? "skip" : pass() ? "ok" : "FAIL"; }
};

// Output tolerance for a dtype: a few units of its rounding at the output's magnitude.
double tolerance_for(DType dtype, const std::vector<double>& ref) {
  double peak = 1.0;
  for (double x : ref) peak = std::max(peak, std::fabs(x));
  const double eps = dtype == DType::kF32 ? 1e-6 : dtype == DType::kF16 ? 1.0 / 2048 : 1.0 / 256;
  return 4 * eps * peak + 1e-3;
}

Row compare(const Case& c, const Target& target, const std::vector<double>& ref) {
  Row row{c.name, target.label()};
  try {
    const std::vector<double> got = target.device.is_cpu() ? c.cpu_oracle() : c.run(target);
    row.error = max_abs_diff(got, ref);
    row.tolerance = tolerance_for(c.dtype, ref);
  } catch (const Error& e) {
    const std::string what = e.what();
    // An explicit backend that cannot serve the call raises: report it as not applicable.
    if (what.find("cannot serve") != std::string::npos) {
      row.note = "skipped: " + what;
    } else {
      row.note = what;
    }
  }
  return row;
}

std::vector<Row> run_cases(uint64_t seed) {
  std::vector<Target> targets = {Target{Device::cpu(), Backend::kVanilla}};
  for (const DeviceInfo& d : cuda_devices()) {
    targets.push_back(Target{Device::cuda(d.ordinal), Backend::kVanilla});
    targets.push_back(Target{Device::cuda(d.ordinal), Backend::kFused});
  }
  std::vector<Row> rows;
  for (const Case& c : make_cases(seed)) {
    std::vector<double> ref;
    try {
      ref = c.run(Target{Device::cpu(), Backend::kVanilla});
    } catch (const Error& e) {
      rows.push_back(Row{c.name, "reference", 0, 0, e.what()});
      continue;
    }
    for (const Target& target : targets) rows.push_back(compare(c, target, ref));
  }
  return rows;
}

void print_table(uint64_t seed, const std::vector<Row>& rows, bool verbose) {
  std::printf("attnkit check (seed %llu)\n", static_cast<unsigned long long>(seed));
  int failures = 0;
  std::printf("%-34s %-16s %-11s %-11s %s\n", "case", "backend", "max |err|", "tolerance",
              "result");
  for (const Row& r : rows) {
    failures += r.pass() ? 0 : 1;
    if (!r.note.empty()) {
      std::printf("%-34s %-16s %-11s %-11s %s%s\n", r.name.c_str(), r.backend.c_str(), "-", "-",
                  r.skipped() ? "skip" : "FAIL: ", r.skipped() && !verbose ? "" : r.note.c_str());
    } else {
      std::printf("%-34s %-16s %-11.3g %-11.3g %s\n", r.name.c_str(), r.backend.c_str(), r.error,
                  r.tolerance, r.result());
    }
  }
  std::printf("%zu checks, %d failed\n", rows.size(), failures);
}

// {"seed", "checks": [{"case", "backend", "result": "ok" | "FAIL" | "skip", "error"?,
// "tolerance"?, "note"?}], "failed"}: error and tolerance where the check compared outputs, note
// where it was skipped or raised.
void print_json(uint64_t seed, const std::vector<Row>& rows) {
  nlohmann::json j;
  j["seed"] = seed;
  j["checks"] = nlohmann::json::array();
  int failures = 0;
  for (const Row& r : rows) {
    failures += r.pass() ? 0 : 1;
    nlohmann::json check = {{"case", r.name}, {"backend", r.backend}, {"result", r.result()}};
    if (r.note.empty()) {
      check["error"] = r.error;
      check["tolerance"] = r.tolerance;
    } else {
      check["note"] = r.note;
    }
    j["checks"].push_back(check);
  }
  j["failed"] = failures;
  std::printf("%s\n", j.dump(2).c_str());
}

int run_check(uint64_t seed, bool verbose, bool json) {
  const std::vector<Row> rows = run_cases(seed);
  if (json) {
    print_json(seed, rows);
  } else {
    print_table(seed, rows, verbose);
  }
  return std::all_of(rows.begin(), rows.end(), [](const Row& r) { return r.pass(); }) ? 0 : 1;
}

}  // namespace

void register_check_command(CLI::App& app) {
  CLI::App* check = app.add_subcommand(
      "check", "randomized self-test of every backend present against the reference");
  static uint64_t seed = 0;
  static bool verbose = false;
  static bool json = false;
  check->add_option("--seed", seed, "random seed (default: a fresh one)");
  check->add_flag("-v,--verbose", verbose, "print why skipped checks were skipped");
  check->add_flag("--json", json, "print the results as one JSON document on stdout");
  check->callback([] {
    if (seed == 0) seed = std::random_device{}();
    const int rc = run_check(seed, verbose, json);
    if (rc) throw CLI::RuntimeError(rc);
  });
}

}  // namespace attnkit::tools
