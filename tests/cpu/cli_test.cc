// The attnkit program's surface: --version, help for a command given without its subcommand,
// `info --json` against the support queries it reports, `check --json` against its table, and
// one name ("reference") for the CPU backend in info, check and replay.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "attnkit/attnkit.h"
#include "common/test_util.h"

namespace attnkit {
namespace {

using json = nlohmann::json;

#ifdef ATTNKIT_PROGRAM
test::ProgramResult run(const std::string& args) {
  return test::run_program(ATTNKIT_PROGRAM, args);
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

TEST(Program, VersionNamesTheLibraryAndItsBuild) {
  const test::ProgramResult r = run("--version");
  EXPECT_EQ(r.status, 0) << r.err;
  const std::string build =
      built_with_cuda() ? "CUDA architectures " + cuda_architectures() : std::string("CPU only");
  EXPECT_EQ(r.out, std::string("attnkit ") + version() + " (" + build + ")\n");
  EXPECT_EQ(r.err, "");
}

TEST(Program, CommandWithoutSubcommandPrintsItsHelp) {
  struct Case {
    std::string command;
    std::vector<std::string> subcommands;
  };
  const std::vector<Case> cases = {{"", {"info", "check", "config", "bench", "replay"}},
                                   {"bench", {"decode", "prefill", "dense", "append"}},
                                   {"config", {"validate"}}};
  for (const Case& c : cases) {
    const test::ProgramResult bare = run(c.command);
    EXPECT_EQ(bare.status, 0) << c.command << ": " << bare.err;
    EXPECT_EQ(bare.err, "") << c.command;
    // The same text as --help, which lists the subcommands.
    const test::ProgramResult help = run(c.command + " --help");
    EXPECT_EQ(help.status, 0) << c.command;
    EXPECT_EQ(bare.out, help.out) << c.command;
    for (const std::string& sub : c.subcommands) {
      EXPECT_NE(bare.out.find("\n  " + sub), std::string::npos)
          << "'" << c.command << "' lists no " << sub << ":\n"
          << bare.out;
    }
  }
  // A subcommand that does not exist stays an error.
  const test::ProgramResult wrong = run("bench nonsense");
  EXPECT_NE(wrong.status, 0);
  EXPECT_NE(wrong.err.find("nonsense"), std::string::npos) << wrong.err;
}

template <typename Enum>
Enum by_name(const std::string& name, const char* (*name_of)(Enum), int count) {
  for (int i = 0; i < count; ++i) {
    if (name == name_of(static_cast<Enum>(i))) return static_cast<Enum>(i);
  }
  ADD_FAILURE() << "unknown name " << name;
  return static_cast<Enum>(0);
}

TEST(Program, InfoJsonIsTheSupportMatrixOfTheLibrary) {
  const test::ProgramResult r = run("info --json");
  ASSERT_EQ(r.status, 0) << r.err;
  const json j = json::parse(r.out);
  EXPECT_EQ(j.at("version"), version());
  EXPECT_EQ(j.at("cuda").at("built"), built_with_cuda());
  EXPECT_EQ(j.at("cuda").at("architectures"), cuda_architectures());
  EXPECT_EQ(j.at("devices").size(), cuda_devices().size());
  std::set<std::string> cpu_ops;
  std::set<int> head_dims;
  size_t cells = 0;
  for (const json& cell : j.at("support")) {
    ++cells;
    SupportQuery query;
    const std::string device = cell.at("device"), backend = cell.at("backend");
    if (device == "cpu") {
      EXPECT_EQ(backend, "reference") << cell.dump();
      query.device = Device::cpu();
      query.backend = Backend::kVanilla;
      cpu_ops.insert(cell.at("op").get<std::string>());
    } else {
      ASSERT_EQ(device.rfind("cuda:", 0), 0u) << cell.dump();
      query.device = Device::cuda(std::stoi(device.substr(5)));
      query.backend = by_name<Backend>(backend, backend_name, 3);
    }
    query.op = by_name<Op>(cell.at("op"), op_name, 6);
    query.q_dtype = by_name<DType>(cell.at("q_dtype"), dtype_name, 7);
    query.kv_dtype = by_name<DType>(cell.at("kv_dtype"), dtype_name, 7);
    query.head_dim = cell.at("head_dim");
    head_dims.insert(query.head_dim);
    const std::string reason = unsupported_reason(query);
    EXPECT_EQ(cell.at("served"), reason.empty()) << cell.dump();
    EXPECT_EQ(cell.value("reason", ""), reason) << cell.dump();
    const std::string kernel =
        query.backend == Backend::kFused && reason.empty() ? selected_kernel(query) : "";
    EXPECT_EQ(cell.value("kernel", ""), kernel) << cell.dump();
  }
  EXPECT_EQ(cpu_ops, (std::set<std::string>{"prefill", "decode", "append_kv", "forward", "dense"}));
  EXPECT_EQ(head_dims, (std::set<int>{64, 80, 96, 128, 256}));
  // One cell per head_dim of each row of the text form's matrices.
  const test::ProgramResult text = run("info");
  ASSERT_EQ(text.status, 0) << text.err;
  size_t rows = 0;
  bool in_cpu_matrix = false;
  for (const std::string& line : lines_of(text.out)) {
    if (line.rfind("support matrix on ", 0) == 0) {
      in_cpu_matrix = line.rfind("support matrix on cpu ", 0) == 0;
      continue;
    }
    if (line.rfind("backend ", 0) == 0 || line.find(" / ") == std::string::npos) continue;
    ++rows;
    if (in_cpu_matrix) EXPECT_EQ(line.rfind("reference ", 0), 0u) << line;
  }
  EXPECT_GT(rows, 0u);
  EXPECT_EQ(cells, rows * head_dims.size());
}

TEST(Program, CheckJsonReportsWhatItsTableReports) {
  const std::string seed = std::to_string(test::test_seed() % 1000000 + 1);
  const test::ProgramResult r = run("check --json --seed " + seed);
  const json j = json::parse(r.out);
  EXPECT_EQ(j.at("seed").get<uint64_t>(), std::stoull(seed));
  int failed = 0;
  std::vector<std::string> from_json;
  for (const json& check : j.at("checks")) {
    const std::string result = check.at("result"), backend = check.at("backend");
    if (backend.rfind("cuda:", 0) != 0) EXPECT_EQ(backend, "reference") << check.dump();
    failed += result == "FAIL" ? 1 : 0;
    if (result == "ok") EXPECT_LE(check.at("error"), check.at("tolerance")) << check.dump();
    if (result == "skip") EXPECT_EQ(check.at("note").get<std::string>().rfind("skipped", 0), 0u);
    from_json.push_back(check.at("case").get<std::string>() + " " + backend + " " + result);
  }
  EXPECT_EQ(j.at("failed"), failed);
  EXPECT_EQ(r.status, failed ? 1 : 0) << r.err;
  EXPECT_GT(from_json.size(), 0u);
  // The table of the same seed: one line per check, in the same order, with the same verdicts.
  const test::ProgramResult table = run("check --seed " + seed);
  EXPECT_EQ(table.status, r.status);
  // Columns: case (34 characters), backend (16), max |err|, tolerance, result.
  std::vector<std::string> from_table;
  auto trim = [](std::string text) {
    text.erase(text.find_last_not_of(' ') + 1);
    return text;
  };
  for (const std::string& line : lines_of(table.out)) {
    if (line.size() < 52) continue;
    std::istringstream rest(line.substr(52));
    std::string error, tolerance, result;
    if (!(rest >> error >> tolerance >> result)) continue;
    if (result == "FAIL:") result = "FAIL";
    if (result != "ok" && result != "FAIL" && result != "skip") continue;
    from_table.push_back(trim(line.substr(0, 34)) + " " + trim(line.substr(35, 16)) + " " + result);
  }
  EXPECT_EQ(from_table, from_json);
}

TEST(Program, ReplayNamesTheCpuBackendReference) {
  const test::ProgramResult ok = run(
      "replay --backend reference --requests 3 --layers 1 --max-output-len 9 --min-output-len 8 "
      "--system-prompt-len 16 --max-user-len 8 --json --quiet");
  ASSERT_EQ(ok.status, 0) << ok.err;
  const json j = json::parse(ok.out);
  EXPECT_EQ(j.at("backend"), "reference");
  EXPECT_EQ(j.at("device"), "cpu");
  // An explicit backend the CPU cannot run is an error naming both, not a quiet switch.
  for (const std::string backend : {"fused", "vanilla"}) {
    const test::ProgramResult r = run("replay --device cpu --backend " + backend);
    EXPECT_EQ(r.status, 1);
    EXPECT_NE(r.err.find("--backend " + backend + " needs a CUDA device"), std::string::npos)
        << r.err;
    EXPECT_EQ(r.out, "");
  }
  const test::ProgramResult on_gpu = run("replay --device cuda:0 --backend reference");
  EXPECT_EQ(on_gpu.status, 1);
  EXPECT_NE(on_gpu.err.find("--backend reference runs on the CPU, got --device cuda:0"),
            std::string::npos)
      << on_gpu.err;
  const test::ProgramResult bad = run("replay --backend cpu");
  EXPECT_EQ(bad.status, 1);
  EXPECT_NE(bad.err.find("auto, fused, vanilla (CUDA) or reference (the CPU), got 'cpu'"),
            std::string::npos)
      << bad.err;
}
#else
TEST(Program, VersionNamesTheLibraryAndItsBuild) {
  GTEST_SKIP() << "the attnkit program is not built (ATTNKIT_BUILD_TOOLS=OFF)";
}
#endif

}  // namespace
}  // namespace attnkit
