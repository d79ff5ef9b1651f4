// PLACEHOLDER: the `attnkit check` subcommand.
#include "commands.h"

namespace attnkit::tools {
void register_check_command(CLI::App& app) { app.add_subcommand("check", "(not yet implemented)"); }
}  // namespace attnkit::tools
