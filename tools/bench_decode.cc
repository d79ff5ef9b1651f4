// PLACEHOLDER: `attnkit bench decode`.
#include "commands.h"

namespace attnkit::tools {
void register_bench_decode(CLI::App& bench) {
  bench.add_subcommand("decode", "(not yet implemented)");
}
}  // namespace attnkit::tools
