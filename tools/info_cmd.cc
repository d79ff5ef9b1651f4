// PLACEHOLDER: the `attnkit info` subcommand.
#include "commands.h"

namespace attnkit::tools {
void register_info_command(CLI::App& app) { app.add_subcommand("info", "(not yet implemented)"); }
}  // namespace attnkit::tools
