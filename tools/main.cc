// The attnkit program: info, check, config validate (bench and replay arrive with their issues).
#include <CLI/CLI.hpp>
#include <cstdio>

#include "attnkit/attnkit.h"

int main(int argc, char** argv) {
  CLI::App app{"attnkit: attention kernels for LLM and diffusion inference"};
  app.require_subcommand(1);
  auto* info = app.add_subcommand("info", "version, build options, devices, support matrix");
  CLI11_PARSE(app, argc, argv);
  if (info->parsed()) {
    std::printf("attnkit %s (CUDA backend: %s)\n", attnkit::version(),
                attnkit::built_with_cuda() ? "yes" : "no");
  }
  return 0;
}
