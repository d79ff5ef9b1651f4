// libFuzzer target: AttentionConfig::from_json on arbitrary text. Every input gives a config or a
// clean attnkit::Error (any other exception, a crash or a sanitizer report is a finding). A
// config's resolved JSON must parse again to a config that resolves every role the same way, and
// resolve() must answer for every role and for names below it. An input "<json>\0<role>" also
// resolves <role>.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "attnkit/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  const std::string text = input.substr(0, nul);
  attnkit::AttentionConfig config;
  try {
    config = attnkit::AttentionConfig::from_json(text);
  } catch (const attnkit::Error&) {
    return 0;
  }
  const std::string resolved = config.resolved_json();
  const attnkit::AttentionConfig again = attnkit::AttentionConfig::from_json(resolved);
  if (again.resolved_json() != resolved) {
    std::fprintf(stderr, "config_fuzzer: resolved JSON does not round-trip:\n%s\n%s\n",
                 resolved.c_str(), again.resolved_json().c_str());
    std::abort();
  }
  for (const auto& [name, spec] : config.roles()) {
    config.resolve(name);
    config.resolve(name + ".below");
    config.apply(name, attnkit::AttentionSpec{});
  }
  if (nul != std::string::npos) {
    try {
      config.resolve(input.substr(nul + 1));
    } catch (const attnkit::Error&) {
    }
  }
  return 0;
}
