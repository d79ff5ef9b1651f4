// PLACEHOLDER: `attnkit bench prefill`.
#include "commands.h"

namespace attnkit::tools {
void register_bench_prefill(CLI::App& bench) {
  bench.add_subcommand("prefill", "(not yet implemented)");
}
}  // namespace attnkit::tools
