// `attnkit config validate <json text | @file | ->`: parses an AttentionConfig and prints the
// resolved spec of "default" and of every role as JSON (docs/configuration.md). An invalid
// config throws attnkit::Error, which main() prints before exiting with status 1.
#include <cstdio>
#include <iostream>
#include <iterator>
#include <memory>
#include <string>

#include "attnkit/config.h"
#include "attnkit/types.h"
#include "commands.h"

namespace attnkit::tools {
namespace {

AttentionConfig load_config(const std::string& source) {
  if (source == "-") {
    const std::string text{std::istreambuf_iterator<char>(std::cin),
                           std::istreambuf_iterator<char>()};
    return AttentionConfig::from_json(text);
  }
  if (!source.empty() && source.front() == '@') return AttentionConfig::from_file(source.substr(1));
  try {
    return AttentionConfig::from_json(source);
  } catch (const Error& e) {
    // A bare path is the most likely mistake when the text is not JSON at all.
    const bool not_json = std::string(e.what()).rfind("config: invalid JSON", 0) == 0;
    const size_t first = source.find_first_not_of(" \t\r\n");
    if (not_json && first != std::string::npos && source[first] != '{') {
      throw Error(std::string(e.what()) + " (to read a file, write @" + source + ")");
    }
    throw;
  }
}

}  // namespace

void register_config_command(CLI::App& app) {
  CLI::App* config = app.add_subcommand("config", "Attention configuration (JSON) tools");
  help_without_subcommand(*config);
  CLI::App* validate = config->add_subcommand(
      "validate",
      "Validate an AttentionConfig and print the resolved spec of default and of every role");
  auto source = std::make_shared<std::string>();
  validate
      ->add_option("config", *source,
                   "JSON text, @path of a JSON file, or - to read standard input")
      ->required();
  validate->callback([source] {
    const AttentionConfig parsed = load_config(*source);
    std::printf("%s\n", parsed.resolved_json().c_str());
  });
}

}  // namespace attnkit::tools
