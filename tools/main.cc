// The attnkit program: info, check, config validate, bench, replay, calibrate.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <string>

#include "attnkit/attnkit.h"
#include "commands.h"

int main(int argc, char** argv) {
  CLI::App app{"attnkit: attention kernels for LLM and diffusion inference"};
  const std::string build = attnkit::built_with_cuda()
                                ? "CUDA architectures " + attnkit::cuda_architectures()
                                : std::string("CPU only");
  app.set_version_flag("--version",
                       std::string("attnkit ") + attnkit::version() + " (" + build + ")");
  attnkit::tools::help_without_subcommand(app);
  attnkit::tools::register_info_command(app);
  attnkit::tools::register_check_command(app);
  attnkit::tools::register_config_command(app);
  attnkit::tools::register_bench_command(app);
  attnkit::tools::register_replay_command(app);
  attnkit::tools::register_calibrate_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const attnkit::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
