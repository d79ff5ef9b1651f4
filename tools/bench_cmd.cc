// PLACEHOLDER: the `attnkit bench` subcommand.
#include "commands.h"

namespace attnkit::tools {
void register_bench_command(CLI::App& app) { app.add_subcommand("bench", "(not yet implemented)"); }
}  // namespace attnkit::tools
