// Subcommands of the attnkit program; each file registers its own on the CLI11 app.
#pragma once

#include <CLI/CLI.hpp>

namespace attnkit::tools {

// A command whose work is in its subcommands (attnkit, attnkit bench, attnkit config): given none,
// it prints its help (and exits 0) instead of an error.
inline void help_without_subcommand(CLI::App& app) {
  app.require_subcommand(0, 1);
  app.callback([&app] {
    if (app.get_subcommands().empty()) throw CLI::CallForHelp();
  });
}

void register_info_command(CLI::App& app);       // info_cmd.cc
void register_check_command(CLI::App& app);      // check_cmd.cc
void register_config_command(CLI::App& app);     // config_cmd.cc
void register_bench_command(CLI::App& app);      // bench_cmd.cc
void register_replay_command(CLI::App& app);     // replay_cmd.cc
void register_calibrate_command(CLI::App& app);  // calibrate_cmd.cc

// Benchmark subcommands under `attnkit bench` (CUDA builds measure; CPU-only builds explain).
void register_bench_decode(CLI::App& bench);   // bench_decode.cc
void register_bench_prefill(CLI::App& bench);  // bench_prefill.cc
void register_bench_append(CLI::App& bench);   // bench_append.cc

}  // namespace attnkit::tools
