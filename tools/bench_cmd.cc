// `attnkit bench <kernel>`: each kernel family registers its own benchmark subcommand; they share
// the options, timing, ceilings and report of bench_session.h (docs/bench.md).
#include "bench_session.h"
#include "commands.h"

namespace attnkit::tools {

void register_bench_command(CLI::App& app) {
  CLI::App* bench = app.add_subcommand(
      "bench", "benchmark a kernel family on the GPU (table of TB/s or TFLOP/s, --json)");
  help_without_subcommand(*bench);
  register_bench_decode(*bench);
  register_bench_prefill(*bench);
  register_bench_dense(*bench);
  register_bench_append(*bench);
}

}  // namespace attnkit::tools
