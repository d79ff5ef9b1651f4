// PLACEHOLDER: replaced by the JSON configuration parser.
#include "attnkit/config.h"

#include "core/check.h"

namespace attnkit {
AttentionConfig AttentionConfig::from_json(const std::string&) { detail::fail("todo"); }
AttentionConfig AttentionConfig::from_file(const std::string&) { detail::fail("todo"); }
RoleSpec AttentionConfig::resolve(const std::string&) const { return default_; }
AttentionSpec AttentionConfig::apply(const std::string&, AttentionSpec spec) const { return spec; }
std::string AttentionConfig::resolved_json() const { return "{}"; }
}  // namespace attnkit
