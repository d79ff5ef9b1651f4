// PLACEHOLDER: the `attnkit config` subcommand.
#include "commands.h"

namespace attnkit::tools {
void register_config_command(CLI::App& app) {
  app.add_subcommand("config", "(not yet implemented)");
}
}  // namespace attnkit::tools
