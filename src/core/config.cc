// AttentionConfig: strict JSON parsing, role flattening and resolution (docs/configuration.md,
// docs/configuration.md). Every rejection names the key path, the value and what is accepted.
#include "attnkit/config.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "core/check.h"

namespace attnkit {
namespace {

using nlohmann::json;

constexpr std::initializer_list<const char*> kTopKeys = {"default", "per_role"};
constexpr std::initializer_list<const char*> kSpecKeys = {"backend", "skip_softmax", "quant"};
constexpr std::initializer_list<const char*> kSkipKeys = {"threshold", "target_sparsity",
                                                          "calibration", "disabled_until_timestep"};
constexpr std::initializer_list<const char*> kCalibrationKeys = {"a", "b"};
constexpr std::initializer_list<const char*> kQuantKeys = {"dtype_qk", "q_block_size",
                                                           "k_block_size"};

constexpr const char* kRoleObjectAccepted = "backend, skip_softmax, quant, or a nested role object";
constexpr const char* kRoleNameAccepted =
    "non-empty names separated by '.' (e.g. \"self.video\"), none of whose parts is backend, "
    "skip_softmax or quant";
constexpr const char* kBlockSizeAccepted = "1, 4 or 16 (integers: the block sizes with a kernel)";

// Limits that keep parsing and resolution linear in the input: a role name has at most
// kMaxRoleParts dot-separated parts (nested or dotted), and JSON nests at most kMaxJsonDepth
// objects and arrays (the role parts plus config, per_role, skip_softmax and calibration).
constexpr size_t kMaxRoleParts = 16;
constexpr size_t kMaxJsonDepth = kMaxRoleParts + 4;

std::string join_keys(std::initializer_list<const char*> keys) {
  std::string out;
  for (const char* key : keys) {
    if (!out.empty()) out += ", ";
    out += key;
  }
  return out;
}

bool is_one_of(const std::string& key, std::initializer_list<const char*> keys) {
  for (const char* k : keys) {
    if (key == k) return true;
  }
  return false;
}

// "per_role.self.video"; a key that itself contains a dot is bracketed (per_role["self.video"])
// so that the two spellings of a role are told apart in messages.
std::string child_path(const std::string& path, const std::string& key) {
  if (key.find('.') != std::string::npos) return path + "[\"" + key + "\"]";
  return path.empty() ? key : path + "." + key;
}

std::string truncated(std::string text) {
  constexpr size_t kMaxChars = 60;
  if (text.size() > kMaxChars) text = text.substr(0, kMaxChars) + "...";
  return text;
}

// The value as it appears in a message: JSON text, with the type spelled out where a bare
// value could be mistaken for the right type (a boolean for a number, an object for a role).
std::string describe(const json& value) {
  switch (value.type()) {
    case json::value_t::boolean:
      return value.dump() + " (a boolean)";
    case json::value_t::null:
      return "null";
    case json::value_t::string:
      return truncated(value.dump());
    case json::value_t::object:
      return "an object " + truncated(value.dump());
    case json::value_t::array:
      return "an array " + truncated(value.dump());
    case json::value_t::number_float:
      if (!std::isfinite(value.get<double>())) return "a non-finite number";
      return value.dump();
    default:
      return value.dump();
  }
}

[[noreturn]] void fail_at(const std::string& path, const std::string& problem,
                          const std::string& accepted) {
  detail::fail(path, ": ", problem, "; accepted: ", accepted);
}

[[noreturn]] void fail_value(const std::string& path, const json& value,
                             const std::string& accepted) {
  fail_at(path, "got " + describe(value), accepted);
}

void require_object(const json& value, const std::string& path, const std::string& accepted) {
  if (!value.is_object()) fail_value(path, value, accepted);
}

void check_keys(const json& object, const std::string& path,
                std::initializer_list<const char*> accepted) {
  for (const auto& [key, value] : object.items()) {
    if (!is_one_of(key, accepted)) {
      fail_at(path, "unknown key \"" + key + "\"", join_keys(accepted));
    }
  }
}

// A finite number; the caller checks the range (JSON has no NaN, and the parser rejects numbers
// outside the double range, but a check here keeps the contract local).
double read_number(const json& value, const std::string& path, const std::string& accepted) {
  if (!value.is_number()) fail_value(path, value, accepted);
  const double number = value.get<double>();
  if (!std::isfinite(number)) fail_value(path, value, accepted);
  return number;
}

// Role names: dot-separated non-empty parts, at most kMaxRoleParts of them; spec keys are
// reserved so that a nested role object can never be confused with a setting.
void check_role_name(const std::string& name, const std::string& path) {
  const size_t parts = static_cast<size_t>(std::count(name.begin(), name.end(), '.')) + 1;
  if (parts > kMaxRoleParts) {
    fail_at(path, "role name \"" + truncated(name) + "\" has " + std::to_string(parts) + " parts",
            "at most " + std::to_string(kMaxRoleParts) +
                " dot-separated parts, counting the parts of the enclosing roles");
  }
  size_t start = 0;
  while (true) {
    const size_t dot = name.find('.', start);
    const std::string part = name.substr(start, dot == std::string::npos ? dot : dot - start);
    if (part.empty()) {
      fail_at(path, "role name \"" + name + "\" has an empty part", kRoleNameAccepted);
    }
    if (is_one_of(part, kSpecKeys)) {
      fail_at(path, "role name \"" + name + "\" uses the reserved word \"" + part + "\"",
              kRoleNameAccepted);
    }
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
}

Backend parse_backend(const json& value, const std::string& path) {
  constexpr const char* kAccepted = "\"auto\", \"fused\" or \"vanilla\"";
  if (!value.is_string()) fail_value(path, value, kAccepted);
  const std::string& name = value.get_ref<const std::string&>();
  if (name == "auto") return Backend::kAuto;
  if (name == "fused") return Backend::kFused;
  if (name == "vanilla") return Backend::kVanilla;
  fail_value(path, value, kAccepted);
}

SkipSoftmaxSpec parse_skip_softmax(const json& value, const std::string& path) {
  const std::string exactly_one =
      "exactly one of threshold (lambda >= 0) or target_sparsity (in [0, 1], with calibration)";
  require_object(value, path, "an object with " + exactly_one);
  check_keys(value, path, kSkipKeys);
  SkipSoftmaxSpec skip;
  if (value.contains("threshold")) {
    const std::string at = child_path(path, "threshold");
    const double threshold = read_number(value["threshold"], at, "a finite number >= 0");
    if (threshold < 0.0) fail_value(at, value["threshold"], "a finite number >= 0");
    skip.threshold = threshold;
  }
  if (value.contains("target_sparsity")) {
    const std::string at = child_path(path, "target_sparsity");
    const char* accepted = "a number in [0, 1]";
    const double sparsity = read_number(value["target_sparsity"], at, accepted);
    if (sparsity < 0.0 || sparsity > 1.0) fail_value(at, value["target_sparsity"], accepted);
    skip.target_sparsity = sparsity;
  }
  if (value.contains("calibration")) {
    const std::string at = child_path(path, "calibration");
    const json& curve = value["calibration"];
    const char* accepted = "an object {\"a\": number > 0, \"b\": number}";
    require_object(curve, at, accepted);
    check_keys(curve, at, kCalibrationKeys);
    for (const char* key : kCalibrationKeys) {
      if (!curve.contains(key)) fail_at(at, std::string("missing key \"") + key + "\"", accepted);
    }
    const double a = read_number(curve["a"], child_path(at, "a"), "a finite number > 0");
    if (a <= 0.0) fail_value(child_path(at, "a"), curve["a"], "a finite number > 0");
    skip.calibration_a = a;
    skip.calibration_b = read_number(curve["b"], child_path(at, "b"), "a finite number");
  }
  if (value.contains("disabled_until_timestep")) {
    const std::string at = child_path(path, "disabled_until_timestep");
    const char* accepted = "a number in [0, 1] (0 = always active)";
    const double until = read_number(value["disabled_until_timestep"], at, accepted);
    if (until < 0.0 || until > 1.0) fail_value(at, value["disabled_until_timestep"], accepted);
    skip.disabled_until_timestep = until;
  }
  if (skip.threshold && skip.target_sparsity) {
    fail_at(path, "threshold and target_sparsity are both given", exactly_one);
  }
  if (!skip.threshold && !skip.target_sparsity) {
    fail_at(path, "neither threshold nor target_sparsity is given", exactly_one);
  }
  if (skip.target_sparsity && !skip.calibration_a) {
    fail_at(path, "target_sparsity is given without a calibration curve",
            "target_sparsity together with \"calibration\": {\"a\": number > 0, \"b\": number}");
  }
  if (skip.threshold && skip.calibration_a) {
    fail_at(path, "calibration is given without target_sparsity",
            "calibration only together with target_sparsity");
  }
  return skip;
}

int32_t parse_block_size(const json& value, const std::string& path) {
  if (!value.is_number_integer()) fail_value(path, value, kBlockSizeAccepted);
  // Unsigned first: 18446744073709551615 would wrap to -1 as an int64.
  const bool fits = !value.is_number_unsigned() || value.get<uint64_t>() <= 16;
  const int64_t size = fits ? value.get<int64_t>() : 0;
  const bool known = size == 1 || size == 4 || size == 16;
  if (!known) fail_value(path, value, kBlockSizeAccepted);
  return static_cast<int32_t>(size);
}

SageQuantSpec parse_quant(const json& value, const std::string& path) {
  require_object(value, path, "an object with keys " + join_keys(kQuantKeys));
  check_keys(value, path, kQuantKeys);
  SageQuantSpec quant;
  if (value.contains("dtype_qk")) {
    const std::string at = child_path(path, "dtype_qk");
    const json& dtype = value["dtype_qk"];
    constexpr const char* kAccepted = "\"int8\" or \"fp8_e4m3\"";
    if (!dtype.is_string()) fail_value(at, dtype, kAccepted);
    if (dtype == "int8") {
      quant.dtype_qk = DType::kInt8;
    } else if (dtype == "fp8_e4m3") {
      quant.dtype_qk = DType::kFp8E4M3;
    } else {
      fail_value(at, dtype, kAccepted);
    }
  }
  if (value.contains("q_block_size")) {
    quant.q_block_size = parse_block_size(value["q_block_size"], child_path(path, "q_block_size"));
  }
  if (value.contains("k_block_size")) {
    quant.k_block_size = parse_block_size(value["k_block_size"], child_path(path, "k_block_size"));
  }
  return quant;
}

// Parses one spec key into `spec`; false when `key` is not a spec key.
bool parse_spec_key(const std::string& key, const json& value, const std::string& path,
                    RoleSpec& spec) {
  if (key == "backend") {
    spec.backend = parse_backend(value, path);
  } else if (key == "skip_softmax") {
    spec.skip_softmax = parse_skip_softmax(value, path);
  } else if (key == "quant") {
    spec.quant = parse_quant(value, path);
  } else {
    return false;
  }
  return true;
}

RoleSpec parse_default(const json& value) {
  require_object(value, "default", "an object with keys " + join_keys(kSpecKeys));
  check_keys(value, "default", kSpecKeys);
  RoleSpec spec;
  for (const auto& [key, item] : value.items()) parse_spec_key(key, item, "default." + key, spec);
  return spec;
}

// Flattens a role object (spec keys plus nested role objects) into `roles`; `defined_at` records
// where each dotted name was defined so that a second spelling of it is reported with both.
void parse_role(const json& object, const std::string& path, const std::string& name,
                std::map<std::string, RoleSpec>& roles,
                std::map<std::string, std::string>& defined_at) {
  RoleSpec spec;
  for (const auto& [key, value] : object.items()) {
    const std::string at = child_path(path, key);
    if (parse_spec_key(key, value, at, spec)) continue;
    if (!value.is_object()) {
      std::string problem = "unknown key \"" + key + "\"";
      // {"skip_sofmax": {"threshold": 1}} parses as a nested role; point at the likely typo.
      if (is_one_of(key, kSkipKeys) || is_one_of(key, kQuantKeys)) {
        problem += " (a skip_softmax or quant key: is the role name \"" +
                   name.substr(name.rfind('.') + 1) + "\" a misspelling?)";
      }
      fail_at(path, problem, kRoleObjectAccepted);
    }
    check_role_name(key, path);
    check_role_name(name + "." + key, path);
    parse_role(value, at, name + "." + key, roles, defined_at);
  }
  const auto [it, inserted] = defined_at.emplace(name, path);
  if (!inserted) {
    fail_at(path, "role \"" + name + "\" is already defined at " + it->second,
            "one definition per role (a dotted key \"a.b\" and a nested {\"a\": {\"b\": ...}} "
            "name the same role)");
  }
  roles.emplace(name, spec);
}

std::string join_frames(const std::vector<std::string>& keys, size_t count) {
  std::string path;
  for (size_t i = 0; i < count && i < keys.size(); ++i) path = child_path(path, keys[i]);
  return path.empty() ? "config" : path;
}

// nlohmann keeps the last of two equal keys; a config must not silently drop one, so the parser
// callback tracks the keys of every open object. It also gives the key path of a number that
// overflows a double (1e400), which the parser itself reports without a path.
json parse_strict(const std::string& text) {
  struct Frame {
    std::set<std::string> keys;
    std::string key;  // the key whose value is being parsed, "[]" inside an array
  };
  std::vector<Frame> frames;
  auto current_path = [&frames](size_t depth) {
    std::vector<std::string> keys;
    for (const Frame& f : frames) keys.push_back(f.key);
    return join_frames(keys, depth);
  };
  auto callback = [&](int depth, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        // Deeper documents are no config; refusing them early keeps every later step (the
        // recursive role flattening, messages that print a value) within a small stack.
        if (static_cast<size_t>(depth) >= kMaxJsonDepth) {
          fail_at(
              current_path(frames.size()),
              "objects and arrays nested deeper than " + std::to_string(kMaxJsonDepth) + " levels",
              "at most " + std::to_string(kMaxJsonDepth) + " levels (" +
                  std::to_string(kMaxRoleParts) + " levels of nested roles)");
        }
        frames.push_back({{}, event == json::parse_event_t::array_start ? "[]" : ""});
        break;
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        if (!frames.empty()) frames.pop_back();
        break;
      case json::parse_event_t::key: {
        Frame& frame = frames.back();
        const std::string& key = parsed.get_ref<const std::string&>();
        if (!frame.keys.insert(key).second) {
          fail_at(current_path(frames.size() - 1), "duplicate key \"" + key + "\"",
                  "each key once per object");
        }
        frame.key = key;
        break;
      }
      case json::parse_event_t::value:
        break;
    }
    return true;
  };
  try {
    return json::parse(text, callback);
  } catch (const json::out_of_range& e) {
    // Numbers beyond the double range (id 406) are the only out_of_range the parser raises.
    std::string what = e.what();
    const size_t bracket = what.find("] ");
    if (bracket != std::string::npos) what = what.substr(bracket + 2);
    fail_at(current_path(frames.size()), what, "finite numbers (within the double range)");
  } catch (const json::exception& e) {
    std::string what = e.what();
    const size_t bracket = what.find("] ");
    if (bracket != std::string::npos) what = what.substr(bracket + 2);
    fail_at("config", "invalid JSON (" + what + ")",
            "a JSON object {\"default\": ..., \"per_role\": ...}");
  }
}

json skip_softmax_json(const SkipSoftmaxSpec& skip) {
  json out = json::object();
  if (skip.threshold) out["threshold"] = *skip.threshold;
  if (skip.target_sparsity) {
    out["target_sparsity"] = *skip.target_sparsity;
    out["calibration"] = {{"a", skip.calibration_a.value_or(0.0)},
                          {"b", skip.calibration_b.value_or(0.0)}};
  }
  out["disabled_until_timestep"] = skip.disabled_until_timestep;
  return out;
}

json role_spec_json(const RoleSpec& spec) {
  json out = json::object();
  out["backend"] = backend_name(spec.backend.value_or(Backend::kAuto));
  if (spec.skip_softmax) out["skip_softmax"] = skip_softmax_json(*spec.skip_softmax);
  if (spec.quant) {
    out["quant"] = {{"dtype_qk", dtype_name(spec.quant->dtype_qk)},
                    {"q_block_size", spec.quant->q_block_size},
                    {"k_block_size", spec.quant->k_block_size}};
  }
  return out;
}

// Fills the fields of `out` that are still unset from `from` (field by field inheritance).
void inherit(RoleSpec& out, const RoleSpec& from) {
  if (!out.backend) out.backend = from.backend;
  if (!out.skip_softmax) out.skip_softmax = from.skip_softmax;
  if (!out.quant) out.quant = from.quant;
}

}  // namespace

AttentionConfig AttentionConfig::from_json(const std::string& json_text) {
  const json root = parse_strict(json_text);
  const std::string top_accepted = "an object with keys " + join_keys(kTopKeys);
  require_object(root, "config", top_accepted);
  check_keys(root, "config", kTopKeys);
  AttentionConfig config;
  if (root.contains("default")) config.default_ = parse_default(root["default"]);
  if (root.contains("per_role")) {
    const json& per_role = root["per_role"];
    require_object(per_role, "per_role", "an object of role name -> role object");
    std::map<std::string, std::string> defined_at;
    for (const auto& [name, value] : per_role.items()) {
      check_role_name(name, "per_role");
      const std::string at = child_path("per_role", name);
      require_object(value, at,
                     "a role object with keys backend, skip_softmax, quant and/or nested roles");
      parse_role(value, at, name, config.roles_, defined_at);
    }
  }
  return config;
}

AttentionConfig AttentionConfig::from_file(const std::string& path) {
  const std::string where = "config file \"" + path + "\"";
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    fail_at(where, "is a directory", "a readable JSON file");
  }
  std::ifstream file(path, std::ios::binary);
  if (!file)
    fail_at(where, std::string("cannot be opened (") + std::strerror(errno) + ")",
            "a readable JSON file");
  std::ostringstream text;
  text << file.rdbuf();
  if (file.bad()) fail_at(where, "cannot be read", "a readable JSON file");
  try {
    return from_json(text.str());
  } catch (const Error& e) {
    detail::fail(where, ": ", e.what());
  }
}

RoleSpec AttentionConfig::resolve(const std::string& role) const {
  check_role_name(role, "role");
  RoleSpec out;
  // "a.b.c": the exact role, then its categories "a.b" and "a", then the default.
  std::string name = role;
  while (true) {
    const auto it = roles_.find(name);
    if (it != roles_.end()) inherit(out, it->second);
    const size_t dot = name.rfind('.');
    if (dot == std::string::npos) break;
    name.resize(dot);
  }
  inherit(out, default_);
  if (!out.backend) out.backend = Backend::kAuto;
  return out;
}

AttentionSpec AttentionConfig::apply(const std::string& role, AttentionSpec spec) const {
  const RoleSpec resolved = resolve(role);
  spec.backend = *resolved.backend;
  spec.skip_softmax = resolved.skip_softmax;
  spec.quant = resolved.quant;
  return spec;
}

std::string AttentionConfig::resolved_json() const {
  json out = json::object();
  RoleSpec resolved_default = default_;
  if (!resolved_default.backend) resolved_default.backend = Backend::kAuto;
  out["default"] = role_spec_json(resolved_default);
  json per_role = json::object();
  for (const auto& [name, spec] : roles_) per_role[name] = role_spec_json(resolve(name));
  out["per_role"] = std::move(per_role);
  return out.dump(2);
}

}  // namespace attnkit
