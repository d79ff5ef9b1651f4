// `attnkit bench <kernel>`: each kernel family registers its own benchmark subcommand.
#include "commands.h"

namespace attnkit::tools {

void register_bench_command(CLI::App& app) {
  CLI::App* bench = app.add_subcommand("bench", "benchmark a kernel family on the GPU");
  bench->require_subcommand(1);
  register_bench_decode(*bench);
  register_bench_prefill(*bench);
  register_bench_append(*bench);
}

}  // namespace attnkit::tools
