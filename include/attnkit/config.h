// AttentionConfig: per-role backend and diffusion options parsed from JSON (docs/configuration.md).
//
//   {"default": <spec>, "per_role": {"<role>": <spec or nested roles>, ...}}
//   <spec> = {"backend": "auto" | "fused" | "vanilla",
//             "skip_softmax": {"threshold": x} |
//                             {"target_sparsity": s, "calibration": {"a": a, "b": b}},
//                             (+ optional "disabled_until_timestep": d),
//             "quant": {"dtype_qk": "int8" | "fp8_e4m3", "q_block_size": 1|4|16,
//                       "k_block_size": 1|4|16}}
//
// A role object may mix spec keys and nested roles: {"self": {"backend": "fused", "video":
// {...}}} defines "self" and "self.video". Resolution of a role "a.b.c": the exact role, then its
// categories "a.b" and "a" (each inherits field by field), then "default", then auto.
#pragma once

#include <map>
#include <optional>
#include <string>

#include "attnkit/spec.h"

namespace attnkit {

// One role's settings; unset fields inherit from the next level of the resolution order.
struct RoleSpec {
  std::optional<Backend> backend;
  std::optional<SkipSoftmaxSpec> skip_softmax;
  std::optional<SageQuantSpec> quant;
};

class AttentionConfig {
 public:
  AttentionConfig() = default;
  // Parses and validates; throws Error naming the key path, the value and what is accepted.
  static AttentionConfig from_json(const std::string& json_text);
  static AttentionConfig from_file(const std::string& path);

  // The fully resolved settings for `role` (missing fields: backend auto, no skip, no quant).
  RoleSpec resolve(const std::string& role) const;
  // Applies the resolved settings of `role` to an AttentionSpec (backend, skip_softmax, quant).
  AttentionSpec apply(const std::string& role, AttentionSpec spec) const;

  const RoleSpec& default_spec() const { return default_; }
  // Flattened roles ("self", "self.video", ...) as written in the JSON.
  const std::map<std::string, RoleSpec>& roles() const { return roles_; }

  // The resolved specs of "default" and every role, as JSON text.
  std::string resolved_json() const;

 private:
  RoleSpec default_;
  std::map<std::string, RoleSpec> roles_;
};

}  // namespace attnkit
