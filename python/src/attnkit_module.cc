// The nanobind extension `attnkit._attnkit`: converts DLPack / buffer-protocol arrays to
// attnkit::TensorView and calls the C++ entry points. Everything user-facing (defaults, output
// allocation, docstrings) lives in python/attnkit/__init__.py; this layer only converts and
// calls, so every rejection comes from the C++ validation with its message, renamed into the
// Python arguments' words (python_names.h). Arrays arrive as plain objects and are converted
// here, so that a wrong type, a read-only output or a value outside the C++ type raises
// attnkit.Error naming the argument, never nanobind's signature listing or std::bad_cast. While
// a call runs on the CPU the GIL is released and the reference polls Ctrl-C (interrupt_check).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "attnkit/attnkit.h"
#include "python_names.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace attnkit::python {
namespace {

// The Python exception types, set once at import.
PyObject* g_error_type = nullptr;
PyObject* g_device_fault_type = nullptr;

[[noreturn]] void fail(const std::string& message) { throw Error(message); }

// "a str ('abc')", "an int (3)": the type and a short repr of a rejected Python value.
std::string describe(nb::handle value) {
  std::string text = nb::cast<std::string>(nb::str(nb::repr(value)));
  if (text.size() > 60) text = text.substr(0, 57) + "...";
  const std::string kind = nb::cast<std::string>(nb::inst_name(value));
  const bool vowel = !kind.empty() && std::string("aeiouAEIOU").find(kind[0]) != std::string::npos;
  return (vowel ? "an " : "a ") + kind + " (" + text + ")";
}

// A str argument of a function bound directly (AttentionConfig).
std::string str_arg(nb::handle value, const std::string& name) {
  if (!nb::isinstance<nb::str>(value)) fail(name + ": expected a str, got " + describe(value));
  return nb::cast<std::string>(value);
}

// A file path: a str or an os.PathLike (pathlib.Path).
std::string path_arg(nb::handle value, const std::string& name) {
  PyObject* fs_path = PyOS_FSPath(value.ptr());
  if (fs_path == nullptr) {
    PyErr_Clear();
    fail(name + ": expected a str or os.PathLike path, got " + describe(value));
  }
  const nb::object path = nb::steal(fs_path);
  if (nb::isinstance<nb::bytes>(path)) {
    return std::string(PyBytes_AsString(path.ptr()), PyBytes_Size(path.ptr()));
  }
  return nb::cast<std::string>(path);
}

// Raises `what` as the Python exception `type` with the C++ names replaced by those of
// `function`'s arguments (python_names.h).
[[noreturn]] void raise_renamed(PyObject* type, PyFunction function, const char* what, bool nhd) {
  const std::string message =
      to_python_names(what, renames_of(function_of_message(what, function), nhd));
  PyErr_SetString(type, message.c_str());
  throw nb::python_error();
}

// Runs `call`; its attnkit::Error is raised as attnkit.Error (DeviceFaultError as
// attnkit.DeviceFaultError) in `function`'s argument names (nhd: those of an NHD cache's arrays).
// Interrupted passes through to its own translator (KeyboardInterrupt, or what the signal handler
// raised).
template <typename Call>
auto in_python_names(PyFunction function, Call&& call, bool nhd = false) -> decltype(call()) {
  try {
    return call();
  } catch (const Interrupted&) {
    throw;
  } catch (const DeviceFaultError& e) {
    raise_renamed(g_device_fault_type, function, e.what(), nhd);
  } catch (const Error& e) {
    raise_renamed(g_error_type, function, e.what(), nhd);
  }
}

// Whether a kv_cache dict names the NHD layout (for the message renames; cache_from_dict checks
// the value).
bool names_nhd(const nb::dict& kv_cache) {
  if (!kv_cache.contains("layout")) return false;
  std::string layout;
  return nb::try_cast(kv_cache["layout"], layout) && layout == "NHD";
}

// "float64", "uint32", "bool", ...: a DLPack dtype as the array libraries name it.
std::string dlpack_dtype_str(const nb::dlpack::dtype& t) {
  using Code = nb::dlpack::dtype_code;
  const std::string bits = std::to_string(t.bits);
  switch (static_cast<Code>(t.code)) {
    case Code::Int:
      return "int" + bits;
    case Code::UInt:
      return "uint" + bits;
    case Code::Float:
      return "float" + bits;
    case Code::Bfloat:
      return "bfloat" + bits;
    case Code::Complex:
      return "complex" + bits;
    case Code::Bool:
      return "bool";
    default:
      return "DLPack code " + std::to_string(t.code) + " with " + bits + " bits";
  }
}

// The attnkit dtype of a DLPack dtype. `raw_as`: the dtype that raw unsigned storage of the same
// width stands for (uint8 holding fp8_e4m3, uint16 holding bf16), for libraries without them.
DType map_dtype(const nb::dlpack::dtype& t, const std::string& name, std::optional<DType> raw_as) {
  using Code = nb::dlpack::dtype_code;
  const auto code = static_cast<Code>(t.code);
  if (t.lanes != 1) fail(name + ": vector (lanes > 1) dtypes are not accepted");
  if (raw_as && (code == Code::UInt || code == Code::Int) && t.bits == 8 * dtype_size(*raw_as)) {
    return *raw_as;
  }
  if (code == Code::Float && t.bits == 32) return DType::kF32;
  if (code == Code::Float && t.bits == 16) return DType::kF16;
  if (code == Code::Bfloat && t.bits == 16) return DType::kBF16;
  if (code == Code::Float8_E4M3FN && t.bits == 8) return DType::kFp8E4M3;
  if (code == Code::Int && t.bits == 8) return DType::kInt8;
  if (code == Code::Int && t.bits == 32) return DType::kInt32;
  if (code == Code::Int && t.bits == 64) return DType::kInt64;
  fail(name + ": unsupported dtype " + dlpack_dtype_str(t) +
       "; accepted: float32, float16, bfloat16, float8_e4m3fn, int8, int32, int64 (and uint8 / "
       "uint16 storage for fp8_e4m3 / bf16 caches with kv_dtype=)");
}

Device map_device(int device_type, int device_id, const std::string& name) {
  if (device_type == nb::device::cpu::value) return Device::cpu();
  if (device_type == nb::device::cuda::value) return Device::cuda(device_id);
  fail(name + ": unsupported device (DLPack device type " + std::to_string(device_type) +
       "); accepted: cpu and cuda");
}

// Inputs may be read-only (a NumPy array from np.broadcast_to, a JAX array); outputs must not.
enum class Access { kInput, kOutput };

template <typename Array>
TensorView to_view(const Array& a, const std::string& name, std::optional<DType> raw_as) {
  if (a.ndim() > static_cast<size_t>(TensorView::kMaxDims)) {
    fail(name + ": at most " + std::to_string(TensorView::kMaxDims) + " dimensions, got " +
         std::to_string(a.ndim()));
  }
  TensorView view;
  view.data = const_cast<void*>(static_cast<const void*>(a.data()));
  view.dtype = map_dtype(a.dtype(), name, raw_as);
  view.device = map_device(a.device_type(), a.device_id(), name);
  view.ndim = static_cast<int>(a.ndim());
  bool empty = false;
  for (int d = 0; d < view.ndim; ++d) {
    view.shape[d] = static_cast<int64_t>(a.shape(d));
    view.strides[d] = a.stride(d);  // nanobind strides are in elements, as TensorView's
    empty = empty || view.shape[d] == 0;
  }
  // A zero-size array addresses no element, so its strides mean nothing (NumPy exports them as
  // 0): it gets the row-major ones, and an empty batch passes the layout checks as in C++.
  if (empty) {
    int64_t stride = 1;
    for (int d = view.ndim - 1; d >= 0; --d) {
      view.strides[d] = stride;
      stride *= std::max<int64_t>(view.shape[d], 1);
    }
  }
  return view;
}

// The TensorView of an array argument: anything nanobind imports as an ndarray (DLPack or the
// buffer protocol), writable for outputs. Anything else raises naming the argument.
TensorView array_view(nb::handle value, const std::string& name, Access access,
                      std::optional<DType> raw_as = {}) {
  // attnkit computes no gradients: with autograd recording, a tensor that requires grad is
  // refused (whatever the framework's DLPack export allows; torch 2.11 exports one) rather than
  // silently cut from the graph. Under torch.no_grad() (inference, and inside torch custom ops)
  // it is read as any other tensor.
  if (nb::hasattr(value, "requires_grad") && nb::bool_(value.attr("requires_grad")) &&
      nb::bool_(nb::module_::import_("torch").attr("is_grad_enabled")())) {
    fail(name +
         ": a tensor that requires grad while autograd records; attnkit computes no gradients: "
         "pass tensor.detach(), or call under torch.no_grad()");
  }
  nb::ndarray<> writable;
  if (access == Access::kOutput && nb::try_cast(value, writable, /*convert=*/false)) {
    return to_view(writable, name, raw_as);
  }
  nb::ndarray<nb::ro> readable;
  if (nb::try_cast(value, readable, /*convert=*/false)) {
    if (access == Access::kOutput) {
      fail(name + ": must be a writable array; got a read-only " +
           nb::cast<std::string>(nb::inst_name(value)) +
           " (pass an array the call may write, e.g. numpy.empty or torch.empty)");
    }
    return to_view(readable, name, raw_as);
  }
  fail(name +
       ": expected an array (a DLPack or buffer-protocol tensor: torch, numpy, cupy, "
       "jax, ...), got " +
       describe(value));
}

// An optional array argument: None gives the undefined view.
TensorView opt_array_view(nb::handle value, const std::string& name, Access access) {
  return value.is_none() ? TensorView{} : array_view(value, name, access);
}

// ---- spec --------------------------------------------------------------------------------------

// What a value of each C++ type must be, for the messages of get().
template <typename T>
std::string accepted_values() {
  if constexpr (std::is_same_v<T, bool>) {
    return "True or False";
  } else if constexpr (std::is_integral_v<T>) {
    return "an integer in [" + std::to_string(std::numeric_limits<T>::min()) + ", " +
           std::to_string(std::numeric_limits<T>::max()) + "]";
  } else if constexpr (std::is_floating_point_v<T>) {
    return "a number";
  } else if constexpr (std::is_same_v<T, std::string>) {
    return "a str";
  } else if constexpr (std::is_same_v<T, std::vector<float>>) {
    return "a sequence of numbers";
  } else {
    static_assert(std::is_same_v<T, std::vector<int32_t>>);
    return "a sequence of integers in int32 range";
  }
}

// The value of `key` converted to T; absent or None gives `fallback`. `name` is the Python
// argument the key holds. A value of another type or out of T's range raises naming it (never
// std::bad_cast or a wrapped integer).
template <typename T>
T get(const nb::dict& d, const char* key, T fallback, const std::string& name) {
  if (!d.contains(key) || d[key].is_none()) return fallback;
  const nb::object value = d[key];
  T out{};
  // Booleans are integers to Python: an integer argument takes none.
  const bool bool_as_number = !std::is_same_v<T, bool> && PyBool_Check(value.ptr());
  if (bool_as_number || !nb::try_cast(value, out)) {
    fail(name + ": expected " + accepted_values<T>() + ", got " + describe(value));
  }
  return out;
}
template <typename T>
T get(const nb::dict& d, const char* key, T fallback) {
  return get<T>(d, key, fallback, key);
}

std::optional<double> get_opt(const nb::dict& d, const char* key, const std::string& name) {
  if (!d.contains(key) || d[key].is_none()) return std::nullopt;
  return get<double>(d, key, 0.0, name);
}

// A dict-valued key (skip_softmax, quant, calibration): None gives nullopt.
std::optional<nb::dict> get_dict(const nb::dict& d, const char* key, const std::string& name,
                                 const std::string& accepted) {
  if (!d.contains(key) || d[key].is_none()) return std::nullopt;
  const nb::object value = d[key];
  if (!nb::isinstance<nb::dict>(value)) {
    fail(name + ": expected " + accepted + ", got " + describe(value));
  }
  return nb::borrow<nb::dict>(value);
}

// One string option to its enum; the error lists the accepted names as "'a', 'b' or 'c'".
template <typename E>
E parse_choice(const std::string& name, const std::string& got,
               std::initializer_list<std::pair<const char*, E>> choices) {
  std::string accepted;
  size_t i = 0;
  for (const auto& [choice, value] : choices) {
    if (got == choice) return value;
    accepted += (i == 0 ? "" : i + 1 == choices.size() ? " or " : ", ");
    accepted += std::string("'") + choice + "'";
    ++i;
  }
  fail(name + ": expected " + accepted + ", got '" + got + "'");
}

// The string option `key` (Python argument `name`) to its enum.
template <typename E>
E get_choice(const nb::dict& d, const char* key, const char* fallback, const std::string& name,
             std::initializer_list<std::pair<const char*, E>> choices) {
  return parse_choice<E>(name, get<std::string>(d, key, fallback, name), choices);
}

void check_keys(const nb::dict& d, const std::string& what, std::initializer_list<const char*> ok) {
  std::string list;
  for (const char* name : ok) list += list.empty() ? name : std::string(", ") + name;
  for (auto [key, value] : d) {
    std::string k;
    if (!nb::try_cast(key, k)) fail(what + ": keys must be str, got " + describe(key));
    bool known = false;
    for (const char* name : ok) known = known || k == name;
    if (!known) fail(what + ": unknown key '" + k + "' (accepted: " + list + ")");
  }
}

// The skip-softmax dict: the keys of the JSON config's skip_softmax object
// (docs/configuration.md), with the calibration curve as {"a": a, "b": b}.
SkipSoftmaxSpec parse_skip(const nb::dict& d) {
  check_keys(d, "skip_softmax",
             {"threshold", "target_sparsity", "calibration", "disabled_until_timestep"});
  SkipSoftmaxSpec s;
  s.threshold = get_opt(d, "threshold", "skip_softmax[\"threshold\"]");
  s.target_sparsity = get_opt(d, "target_sparsity", "skip_softmax[\"target_sparsity\"]");
  const std::string curve_name = "skip_softmax[\"calibration\"]";
  if (const auto curve = get_dict(d, "calibration", curve_name, "a dict {\"a\": a, \"b\": b}")) {
    check_keys(*curve, curve_name, {"a", "b"});
    s.calibration_a = get_opt(*curve, "a", curve_name + "[\"a\"]");
    s.calibration_b = get_opt(*curve, "b", curve_name + "[\"b\"]");
    if (!s.calibration_a || !s.calibration_b) {
      fail(curve_name + ": needs both \"a\" and \"b\" (a: number > 0, b: number)");
    }
  }
  s.disabled_until_timestep =
      get<double>(d, "disabled_until_timestep", 0.0, "skip_softmax[\"disabled_until_timestep\"]");
  return s;
}

SageQuantSpec parse_quant(const nb::dict& d) {
  check_keys(d, "quant", {"dtype_qk", "q_block_size", "k_block_size"});
  SageQuantSpec q;
  q.dtype_qk = get_choice<DType>(d, "dtype_qk", "int8", "quant[\"dtype_qk\"]",
                                 {{"int8", DType::kInt8}, {"fp8_e4m3", DType::kFp8E4M3}});
  q.q_block_size = get<int32_t>(d, "q_block_size", 1, "quant[\"q_block_size\"]");
  q.k_block_size = get<int32_t>(d, "k_block_size", 16, "quant[\"k_block_size\"]");
  return q;
}

AttentionSpec spec_from_dict(const nb::dict& d) {
  check_keys(d, "spec", {"num_q_heads",
                         "num_kv_heads",
                         "head_dim",
                         "softmax_scale",
                         "mask",
                         "window",
                         "sink_tokens",
                         "alibi",
                         "alibi_slopes",
                         "softcap",
                         "backend",
                         "kernel",
                         "rope_style",
                         "rotary_dim",
                         "rope_base",
                         "rope_scaling",
                         "rope_factor",
                         "low_freq_factor",
                         "high_freq_factor",
                         "original_max_position",
                         "skip_softmax",
                         "quant"});
  AttentionSpec s;
  s.num_q_heads = get<int32_t>(d, "num_q_heads", 0);
  s.num_kv_heads = get<int32_t>(d, "num_kv_heads", 0);
  s.head_dim = get<int32_t>(d, "head_dim", 0);
  s.softmax_scale = get<double>(d, "softmax_scale", 0.0);
  s.mask.kind = get_choice<MaskKind>(d, "mask", "causal", "mask",
                                     {{"none", MaskKind::kNone},
                                      {"causal", MaskKind::kCausal},
                                      {"sliding_window", MaskKind::kSlidingWindow}});
  s.mask.window = get<int32_t>(d, "window", 0);
  s.mask.sink_tokens = get<int32_t>(d, "sink_tokens", 0);
  s.alibi = get<bool>(d, "alibi", false);
  s.alibi_slopes = get<std::vector<float>>(d, "alibi_slopes", {}, "alibi");
  s.logit_softcap = get<double>(d, "softcap", 0.0);
  s.backend = get_choice<Backend>(
      d, "backend", "auto", "backend",
      {{"auto", Backend::kAuto}, {"fused", Backend::kFused}, {"vanilla", Backend::kVanilla}});
  s.fused_kernel = get_choice<FusedKernel>(d, "kernel", "auto", "kernel",
                                           {{"auto", FusedKernel::kAuto},
                                            {"portable", FusedKernel::kPortable},
                                            {"hopper", FusedKernel::kHopper}});
  s.rope.style = get_choice<RopeStyle>(
      d, "rope_style", "none", "rope",
      {{"none", RopeStyle::kNone}, {"gpt_neox", RopeStyle::kGptNeox}, {"gptj", RopeStyle::kGptJ}});
  s.rope.rotary_dim = get<int32_t>(d, "rotary_dim", 0);
  s.rope.base = get<double>(d, "rope_base", 10000.0);
  s.rope.scaling = get_choice<RopeScaling>(d, "rope_scaling", "none", "rope_scaling",
                                           {{"none", RopeScaling::kNone},
                                            {"linear", RopeScaling::kLinear},
                                            {"llama3", RopeScaling::kLlama3}});
  s.rope.factor = get<double>(d, "rope_factor", 1.0);
  s.rope.low_freq_factor = get<double>(d, "low_freq_factor", 1.0);
  s.rope.high_freq_factor = get<double>(d, "high_freq_factor", 4.0);
  s.rope.original_max_position = get<int32_t>(d, "original_max_position", 8192);
  const char* skip_accepted =
      "None or a dict with threshold or target_sparsity + calibration {\"a\", \"b\"}, "
      "disabled_until_timestep";
  if (const auto skip = get_dict(d, "skip_softmax", "skip_softmax", skip_accepted)) {
    s.skip_softmax = parse_skip(*skip);
  }
  const char* quant_accepted =
      "None or a dict with dtype_qk ('int8' or 'fp8_e4m3'), q_block_size, k_block_size";
  if (const auto quant = get_dict(d, "quant", "quant", quant_accepted)) {
    s.quant = parse_quant(*quant);
  }
  return s;
}

nb::dict role_to_dict(const RoleSpec& r) {
  nb::dict out;
  out["backend"] = backend_name(r.backend.value_or(Backend::kAuto));
  if (r.skip_softmax) {
    nb::dict s;
    const SkipSoftmaxSpec& k = *r.skip_softmax;
    if (k.threshold) s["threshold"] = *k.threshold;
    if (k.target_sparsity) s["target_sparsity"] = *k.target_sparsity;
    if (k.calibration_a && k.calibration_b) {
      nb::dict curve;
      curve["a"] = *k.calibration_a;
      curve["b"] = *k.calibration_b;
      s["calibration"] = curve;
    }
    s["disabled_until_timestep"] = k.disabled_until_timestep;
    out["skip_softmax"] = s;
  } else {
    out["skip_softmax"] = nb::none();
  }
  if (r.quant) {
    nb::dict q;
    q["dtype_qk"] = dtype_name(r.quant->dtype_qk);
    q["q_block_size"] = r.quant->q_block_size;
    q["k_block_size"] = r.quant->k_block_size;
    out["quant"] = q;
  } else {
    out["quant"] = nb::none();
  }
  return out;
}

// ---- KV cache -----------------------------------------------------------------------------------

// A cache described by K and V arrays [num_blocks, Hkv, T, D] (layout "HND") or [num_blocks, T,
// Hkv, D] ("NHD"), each block contiguous; the block stride, the same for K and V, is free so that
// slices of one [num_blocks, 2, <block>] or [num_blocks, L, 2, <block>] pool work), seq_lens int32
// [rows], an optional block_table (absent: a contiguous cache, row r in block r) and optional
// float32 scales. Names are the C++ ones (kv_cache.k, kv_cache.seq_lens, ...); python_names.h
// renames them for decode() and for the NHD dims.
KvCacheView cache_from_dict(const nb::dict& d, bool need_seq_lens) {
  check_keys(d, "kv_cache",
             {"k", "v", "seq_lens", "block_table", "k_scale", "v_scale", "window_slots",
              "sink_tokens", "kv_dtype", "layout"});
  if (!d.contains("k") || !d.contains("v")) fail("kv_cache: needs the K and V arrays");
  const KvCacheLayout layout =
      get_choice<KvCacheLayout>(d, "layout", "HND", "kv_cache.layout",
                                {{"HND", KvCacheLayout::kHND}, {"NHD", KvCacheLayout::kNHD}});
  const bool nhd = layout == KvCacheLayout::kNHD;
  // Dims of the block's token and head extents in the arrays.
  const int token_dim = nhd ? 1 : 2, head_dim_index = nhd ? 2 : 1;
  const char* dims_text = nhd ? "[num_blocks, T, Hkv, D]" : "[num_blocks, Hkv, T, D]";
  std::optional<DType> raw_as;
  if (d.contains("kv_dtype") && !d["kv_dtype"].is_none()) {
    raw_as = get_choice<DType>(d, "kv_dtype", "", "kv_dtype",
                               {{"bf16", DType::kBF16},
                                {"f16", DType::kF16},
                                {"fp8_e4m3", DType::kFp8E4M3},
                                {"int8", DType::kInt8}});
  }
  const TensorView k = array_view(d["k"], "kv_cache.k", Access::kInput, raw_as);
  const TensorView v = array_view(d["v"], "kv_cache.v", Access::kInput, raw_as);
  for (const auto* t : {&k, &v}) {
    const std::string name = t == &k ? "kv_cache.k" : "kv_cache.v";
    if (t->ndim != 4) {
      fail(name + ": expected 4 dimensions " + dims_text + ", got shape " + t->shape_str());
    }
    const bool block_contiguous = t->strides[3] == 1 && t->strides[2] == t->shape[3] &&
                                  t->strides[1] == t->shape[2] * t->shape[3];
    if (!block_contiguous) {
      fail(name + ": each block " + (nhd ? "[T, Hkv, D]" : "[Hkv, T, D]") +
           " must be contiguous (strides " + (nhd ? "[*, Hkv*D, D, 1]" : "[*, T*D, D, 1]") +
           "); got shape " + t->shape_str());
    }
  }
  if (k.dtype != v.dtype || k.device != v.device) {
    fail(std::string("kv_cache.v: must have the dtype and device of kv_cache.k (") +
         dtype_name(k.dtype) + ", " + k.device.str() + "), got " + dtype_name(v.dtype) + ", " +
         v.device.str());
  }
  for (int dim = 0; dim < 4; ++dim) {
    if (k.shape[dim] != v.shape[dim]) {
      fail("kv_cache.v: must have the shape of kv_cache.k " + k.shape_str() + ", got " +
           v.shape_str());
    }
  }
  if (k.shape[0] > 1 && k.strides[0] != v.strides[0]) {
    fail("kv_cache.v: must have the block stride of kv_cache.k (" + std::to_string(k.strides[0]) +
         " elements), got " + std::to_string(v.strides[0]));
  }
  // The view's geometry is int32: larger extents are an error, never truncated.
  const char* dims[4] = {"num_blocks", nhd ? "T" : "Hkv", nhd ? "Hkv" : "T", "D"};
  for (int dim = 0; dim < 4; ++dim) {
    if (k.shape[dim] > INT32_MAX) {
      fail(std::string("kv_cache.k: ") + dims[dim] + " = " + std::to_string(k.shape[dim]) +
           " is more than int32 holds (shape " + k.shape_str() + ")");
    }
  }
  KvCacheView c;
  c.k_base = k.data;
  c.v_base = v.data;
  c.dtype = k.dtype;
  c.device = k.device;
  c.num_blocks = static_cast<int32_t>(k.shape[0]);
  c.layout = layout;
  c.num_kv_heads = static_cast<int32_t>(k.shape[head_dim_index]);
  c.tokens_per_block = static_cast<int32_t>(k.shape[token_dim]);
  c.head_dim = static_cast<int32_t>(k.shape[3]);
  const int64_t block_elems = k.shape[1] * k.shape[2] * k.shape[3];
  c.block_stride_bytes =
      static_cast<int64_t>(dtype_size(k.dtype)) * (k.shape[0] > 1 ? k.strides[0] : block_elems);
  auto array = [&](const char* key) -> TensorView {
    if (!d.contains(key)) return {};
    return opt_array_view(d[key], std::string("kv_cache.") + key, Access::kInput);
  };
  c.block_table = array("block_table");
  c.paged = c.block_table.defined();
  c.seq_lens = array("seq_lens");
  if (need_seq_lens && !c.seq_lens.defined()) fail("kv_cache.seq_lens: required (int32 [rows])");
  c.k_scale = array("k_scale");
  c.v_scale = array("v_scale");
  c.window_slots = get<int32_t>(d, "window_slots", 0, "kv_cache.window_slots");
  c.sink_tokens = get<int32_t>(d, "sink_tokens", 0, "kv_cache.sink_tokens");
  return c;
}

Stream to_stream(uintptr_t stream) { return reinterpret_cast<Stream>(stream); }

// "cpu", "cuda" or "cuda:N" (the names Device::str() writes).
Device parse_device_name(const std::string& name) {
  if (name == "cpu") return Device::cpu();
  if (name == "cuda") return Device::cuda(0);
  if (name.rfind("cuda:", 0) == 0 && name.size() > 5 &&
      name.find_first_not_of("0123456789", 5) == std::string::npos && name.size() < 15) {
    return Device::cuda(std::stoi(name.substr(5)));
  }
  fail("device: expected 'cpu', 'cuda' or 'cuda:N', got '" + name + "'");
}

// ---- entry points ------------------------------------------------------------------------------
// Array arguments are nb::handle (converted by array_view) and every call runs through
// in_python_names; the scalars arrive checked and converted by python/attnkit.

void py_prefill(const nb::dict& spec_dict, nb::handle q, nb::handle cu_seqlens_q, nb::handle out,
                nb::handle k, nb::handle v, nb::handle cu_seqlens_kv,
                const std::optional<nb::dict>& kv_cache, nb::handle lse, int32_t max_seqlen_q,
                int32_t max_seqlen_kv, double timestep, int32_t block_m, int32_t block_n,
                nb::handle skip_stats, bool checked, uintptr_t stream) {
  const PyFunction names = kv_cache ? PyFunction::kPrefillPaged : PyFunction::kPrefill;
  in_python_names(
      names,
      [&] {
        const AttentionSpec spec = spec_from_dict(spec_dict);
        PrefillArgs args;
        args.q = array_view(q, "q", Access::kInput);
        args.cu_seqlens_q = array_view(cu_seqlens_q, "cu_seqlens_q", Access::kInput);
        args.out = array_view(out, "out", Access::kOutput);
        args.k = opt_array_view(k, "k", Access::kInput);
        args.v = opt_array_view(v, "v", Access::kInput);
        args.cu_seqlens_kv = opt_array_view(cu_seqlens_kv, "cu_seqlens_kv", Access::kInput);
        args.lse = opt_array_view(lse, "lse", Access::kOutput);
        args.skip_stats = opt_array_view(skip_stats, "skip_stats", Access::kOutput);
        args.max_seqlen_q = max_seqlen_q;
        args.max_seqlen_kv = max_seqlen_kv;
        args.timestep = timestep;
        args.block_m = block_m;
        args.block_n = block_n;
        args.checked = checked;
        KvCacheView cache;
        if (kv_cache) {
          cache = cache_from_dict(*kv_cache, true);
          args.kv_cache = &cache;
        }
        nb::gil_scoped_release release;
        prefill(spec, args, to_stream(stream));
      },
      kv_cache && names_nhd(*kv_cache));
}

void py_decode(const nb::dict& spec_dict, nb::handle q, const nb::dict& kv_cache, nb::handle out,
               nb::handle lse, int32_t beam_width, nb::handle cache_indirection, int32_t num_splits,
               int32_t max_seq_len, DecodeWorkspace* workspace, bool deterministic,
               bool batch_invariant, bool checked, uintptr_t stream) {
  in_python_names(
      PyFunction::kDecode,
      [&] {
        const AttentionSpec spec = spec_from_dict(spec_dict);
        DecodeArgs args;
        args.q = array_view(q, "q", Access::kInput);
        args.kv_cache = cache_from_dict(kv_cache, true);
        args.out = array_view(out, "out", Access::kOutput);
        args.lse = opt_array_view(lse, "lse", Access::kOutput);
        args.beam_width = beam_width;
        args.cache_indirection =
            opt_array_view(cache_indirection, "cache_indirection", Access::kInput);
        args.num_splits = num_splits;
        args.max_seq_len = max_seq_len;
        args.workspace = workspace;
        args.deterministic = deterministic;
        args.batch_invariant = batch_invariant;
        args.checked = checked;
        nb::gil_scoped_release release;
        decode(spec, args, to_stream(stream));
      },
      names_nhd(kv_cache));
}

void py_append_kv(const nb::dict& spec_dict, const nb::dict& kv_cache, nb::handle positions,
                  nb::handle row_of_token, nb::handle q_out, nb::handle qkv, nb::handle q,
                  nb::handle k, nb::handle v, nb::handle qkv_bias, bool checked, uintptr_t stream) {
  in_python_names(
      PyFunction::kAppendKv,
      [&] {
        const AttentionSpec spec = spec_from_dict(spec_dict);
        AppendKvArgs args;
        args.checked = checked;
        args.kv_cache = cache_from_dict(kv_cache, false);
        args.positions = array_view(positions, "positions", Access::kInput);
        args.row_of_token = array_view(row_of_token, "row_of_token", Access::kInput);
        args.q_out = array_view(q_out, "q_out", Access::kOutput);
        args.qkv = opt_array_view(qkv, "qkv", Access::kInput);
        args.q = opt_array_view(q, "q", Access::kInput);
        args.k = opt_array_view(k, "k", Access::kInput);
        args.v = opt_array_view(v, "v", Access::kInput);
        args.qkv_bias = opt_array_view(qkv_bias, "qkv_bias", Access::kInput);
        nb::gil_scoped_release release;
        append_kv(spec, args, to_stream(stream));
      },
      names_nhd(kv_cache));
}

void py_forward(const nb::dict& spec_dict, nb::handle qkv, const nb::dict& kv_cache,
                nb::handle cu_seqlens_q, nb::handle past_lens, int32_t num_context, nb::handle out,
                int32_t beam_width, nb::handle qkv_bias, nb::handle cache_indirection,
                nb::handle lse, nb::handle workspace, int32_t num_splits,
                DecodeWorkspace* decode_workspace, bool deterministic, bool batch_invariant,
                bool checked, uintptr_t stream) {
  in_python_names(
      PyFunction::kForward,
      [&] {
        const AttentionSpec spec = spec_from_dict(spec_dict);
        ForwardArgs args;
        args.checked = checked;
        args.qkv = array_view(qkv, "qkv", Access::kInput);
        args.kv_cache = cache_from_dict(kv_cache, true);
        args.cu_seqlens_q = array_view(cu_seqlens_q, "cu_seqlens_q", Access::kInput);
        args.past_lens = array_view(past_lens, "past_lens", Access::kInput);
        args.num_context = num_context;
        args.out = array_view(out, "out", Access::kOutput);
        args.beam_width = beam_width;
        args.qkv_bias = opt_array_view(qkv_bias, "qkv_bias", Access::kInput);
        args.cache_indirection =
            opt_array_view(cache_indirection, "cache_indirection", Access::kInput);
        args.lse = opt_array_view(lse, "lse", Access::kOutput);
        args.workspace = opt_array_view(workspace, "workspace", Access::kOutput);
        args.num_splits = num_splits;
        args.decode_workspace = decode_workspace;
        args.deterministic = deterministic;
        args.batch_invariant = batch_invariant;
        nb::gil_scoped_release release;
        forward(spec, args, to_stream(stream));
      },
      names_nhd(kv_cache));
}

// stats: fill the returned dict (on CUDA, a call that skips tiles then synchronizes its stream);
// skip_stats: an int64 [2] tensor the counts are written to in stream order.
nb::object py_dense(const nb::dict& spec_dict, nb::handle q, nb::handle k, nb::handle v,
                    nb::handle out, nb::handle lse, double timestep, int32_t block_m,
                    int32_t block_n, bool stats, nb::handle skip_stats, bool checked,
                    uintptr_t stream) {
  return in_python_names(PyFunction::kDense, [&]() -> nb::object {
    const AttentionSpec spec = spec_from_dict(spec_dict);
    DenseArgs args;
    args.checked = checked;
    args.q = array_view(q, "q", Access::kInput);
    args.k = array_view(k, "k", Access::kInput);
    args.v = array_view(v, "v", Access::kInput);
    args.out = array_view(out, "out", Access::kOutput);
    args.lse = opt_array_view(lse, "lse", Access::kOutput);
    args.skip_stats = opt_array_view(skip_stats, "skip_stats", Access::kOutput);
    args.timestep = timestep;
    args.block_m = block_m;
    args.block_n = block_n;
    DenseStats counts;
    if (stats) args.stats = &counts;
    {
      nb::gil_scoped_release release;
      dense(spec, args, to_stream(stream));
    }
    if (!stats) return nb::none();
    nb::dict d;
    d["tiles_total"] = counts.tiles_total;
    d["tiles_skipped"] = counts.tiles_skipped;
    d["skipped_fraction"] = counts.skipped_fraction();
    d["block_m"] = counts.block_m;
    d["block_n"] = counts.block_n;
    return d;
  });
}

void py_merge_states(nb::handle out_a, nb::handle lse_a, nb::handle out_b, nb::handle lse_b,
                     nb::handle out, nb::handle lse, bool checked, uintptr_t stream) {
  in_python_names(PyFunction::kMergeStates, [&] {
    MergeStatesArgs args;
    args.checked = checked;
    args.out_a = array_view(out_a, "out_a", Access::kInput);
    args.lse_a = array_view(lse_a, "lse_a", Access::kInput);
    args.out_b = array_view(out_b, "out_b", Access::kInput);
    args.lse_b = array_view(lse_b, "lse_b", Access::kInput);
    args.out = array_view(out, "out", Access::kOutput);
    args.lse = opt_array_view(lse, "lse", Access::kOutput);
    nb::gil_scoped_release release;
    merge_states(args, to_stream(stream));
  });
}

nb::dict py_info() {
  nb::dict d;
  d["version"] = version();
  d["cuda"] = built_with_cuda();
  d["cuda_architectures"] = cuda_architectures();
  nb::list devices;
  for (const DeviceInfo& dev : cuda_devices()) {
    nb::dict e;
    e["ordinal"] = dev.ordinal;
    e["name"] = dev.name;
    e["compute_capability"] = nb::make_tuple(dev.cc_major, dev.cc_minor);
    e["sm_count"] = dev.sm_count;
    e["total_memory"] = dev.total_memory;
    e["l2_bytes"] = dev.l2_bytes;
    devices.append(e);
  }
  d["devices"] = devices;
  return d;
}

// ---- errors and Ctrl-C
// ---------------------------------------------------------------------------

// The exception a signal handler raised while a CPU call ran (KeyboardInterrupt for Ctrl-C), kept
// from the poll that saw it until the Interrupted it caused reaches Python. Only the main thread
// runs signal handlers, so only its calls poll.
unsigned long g_main_thread = 0;
#if PY_VERSION_HEX >= 0x030C0000
PyObject* g_pending_signal_exception = nullptr;
void keep_pending_exception() {
  Py_XDECREF(g_pending_signal_exception);
  g_pending_signal_exception = PyErr_GetRaisedException();
}
bool restore_pending_exception() {
  if (g_pending_signal_exception == nullptr) return false;
  PyErr_SetRaisedException(g_pending_signal_exception);  // steals the reference
  g_pending_signal_exception = nullptr;
  return true;
}
#else
PyObject* g_pending_signal_exception[3] = {nullptr, nullptr, nullptr};
void keep_pending_exception() {
  for (PyObject*& o : g_pending_signal_exception) Py_CLEAR(o);
  PyErr_Fetch(&g_pending_signal_exception[0], &g_pending_signal_exception[1],
              &g_pending_signal_exception[2]);
}
bool restore_pending_exception() {
  if (g_pending_signal_exception[0] == nullptr) return false;
  PyErr_Restore(g_pending_signal_exception[0], g_pending_signal_exception[1],
                g_pending_signal_exception[2]);  // steals the references
  g_pending_signal_exception[0] = g_pending_signal_exception[1] = nullptr;
  g_pending_signal_exception[2] = nullptr;
  return true;
}
#endif

// The interrupt check (include/attnkit/interrupt.h) of calls from Python: runs the signal
// handlers of pending signals; one that raises stops the call. The call released the GIL, so the
// check takes it for the moment of PyErr_CheckSignals (the reference polls every 20 ms at most).
bool python_signal_raised() {
  if (PyThread_get_thread_ident() != g_main_thread) return false;
  nb::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() == 0) return false;
  keep_pending_exception();
  return true;
}

// attnkit::Error from any binding function, in the Python names: the message's leading
// "op: " (or KvCacheManager...) picks the table. Entry points that know more (the spec messages
// name no op) rename first, through in_python_names.
void translate_exception(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const Interrupted& e) {
    if (!restore_pending_exception()) PyErr_SetString(PyExc_KeyboardInterrupt, e.what());
  } catch (const DeviceFaultError& e) {
    PyErr_SetString(
        g_device_fault_type,
        to_python_names(e.what(), renames_of(function_of_message(e.what(), PyFunction::kOther)))
            .c_str());
  } catch (const Error& e) {
    PyErr_SetString(
        g_error_type,
        to_python_names(e.what(), renames_of(function_of_message(e.what(), PyFunction::kOther)))
            .c_str());
  }
}

// ---- KvCacheManager ----------------------------------------------------------------------------

KvCacheManagerConfig manager_config(const nb::dict& d) {
  check_keys(
      d, "KvCache",
      {"num_layers", "num_kv_heads", "head_dim", "tokens_per_block", "dtype", "device",
       "max_tokens", "max_bytes", "free_gpu_memory_fraction", "host_cache_bytes", "max_seq_len",
       "layer_windows", "sink_tokens", "enable_prefix_reuse", "stream", "layout"});
  KvCacheManagerConfig c;
  c.num_layers = get<int32_t>(d, "num_layers", 1);
  c.num_kv_heads = get<int32_t>(d, "num_kv_heads", 0);
  c.head_dim = get<int32_t>(d, "head_dim", 0);
  c.tokens_per_block = get<int32_t>(d, "tokens_per_block", 16);
  c.dtype = get_choice<DType>(d, "dtype", "f16", "dtype",
                              {{"f16", DType::kF16},
                               {"bf16", DType::kBF16},
                               {"fp8_e4m3", DType::kFp8E4M3},
                               {"int8", DType::kInt8}});
  c.device = parse_device_name(get<std::string>(d, "device", "cpu"));
  c.layout = get_choice<KvCacheLayout>(
      d, "layout", "HND", "layout", {{"HND", KvCacheLayout::kHND}, {"NHD", KvCacheLayout::kNHD}});
  c.max_tokens = get<int64_t>(d, "max_tokens", 0);
  c.max_bytes = get<int64_t>(d, "max_bytes", 0);
  c.free_gpu_memory_fraction = get<double>(d, "free_gpu_memory_fraction", 0.9);
  c.host_cache_bytes = get<int64_t>(d, "host_cache_bytes", 0);
  c.max_seq_len = get<int32_t>(d, "max_seq_len", 0);
  c.layer_windows = get<std::vector<int32_t>>(d, "layer_windows", {});
  c.sink_tokens = get<int32_t>(d, "sink_tokens", 0);
  c.enable_prefix_reuse = get<bool>(d, "enable_prefix_reuse", true);
  c.stream = reinterpret_cast<void*>(get<uintptr_t>(d, "stream", 0));
  return c;
}

struct PyKvCacheManager {
  KvCacheManagerConfig config;
  std::unique_ptr<KvCacheManager> manager;
  explicit PyKvCacheManager(const nb::dict& d)
      : config(manager_config(d)), manager(std::make_unique<KvCacheManager>(config)) {}
};

nb::dict stats_to_dict(const KvCacheStats& s) {
  nb::dict d;
  d["hits"] = s.hits;
  d["misses"] = s.misses;
  d["evictions"] = s.evictions;
  d["offloads"] = s.offloads;
  d["onboards"] = s.onboards;
  d["cow_copies"] = s.cow_copies;
  d["num_blocks"] = s.num_blocks;
  d["free_blocks"] = s.free_blocks;
  d["cached_blocks"] = s.cached_blocks;
  d["used_blocks"] = s.used_blocks;
  d["host_blocks"] = s.host_blocks;
  d["host_cached_blocks"] = s.host_cached_blocks;
  return d;
}

// The pool as [num_blocks, L, 2, Hkv, T, D] (HND) or [num_blocks, L, 2, T, Hkv, D] (NHD). NumPy
// has no bf16 / fp8: those pools come back as
// uint16 / uint8 storage (pass kv_dtype= to the entry points). CUDA pools come back as a DLPack
// capable array (torch.from_dlpack / cupy.from_dlpack).
nb::object pool_array(PyKvCacheManager& self, nb::handle owner) {
  const KvCacheManagerConfig& c = self.config;
  const bool nhd = c.layout == KvCacheLayout::kNHD;
  const size_t heads = static_cast<size_t>(c.num_kv_heads);
  const size_t tokens = static_cast<size_t>(c.tokens_per_block);
  const size_t shape[6] = {static_cast<size_t>(self.manager->num_blocks()),
                           static_cast<size_t>(c.num_layers),
                           2,
                           nhd ? tokens : heads,
                           nhd ? heads : tokens,
                           static_cast<size_t>(c.head_dim)};
  nb::dlpack::dtype dt;
  dt.bits = static_cast<uint8_t>(8 * dtype_size(c.dtype));
  dt.lanes = 1;
  const bool cpu = c.device.is_cpu();
  switch (c.dtype) {
    case DType::kF16:
      dt.code = static_cast<uint8_t>(nb::dlpack::dtype_code::Float);
      break;
    case DType::kBF16:
      dt.code =
          static_cast<uint8_t>(cpu ? nb::dlpack::dtype_code::UInt : nb::dlpack::dtype_code::Bfloat);
      break;
    case DType::kFp8E4M3:
      dt.code = static_cast<uint8_t>(cpu ? nb::dlpack::dtype_code::UInt
                                         : nb::dlpack::dtype_code::Float8_E4M3FN);
      break;
    default:
      dt.code = static_cast<uint8_t>(nb::dlpack::dtype_code::Int);
      break;
  }
  void* data = self.manager->pool_data();
  if (cpu) {
    return nb::cast(
        nb::ndarray<nb::numpy>(data, 6, shape, owner, nullptr, dt, nb::device::cpu::value, 0),
        nb::rv_policy::reference);
  }
  return nb::cast(
      nb::ndarray<>(data, 6, shape, owner, nullptr, dt, nb::device::cuda::value, c.device.index),
      nb::rv_policy::reference);
}

std::vector<SeqId> to_ids(const std::vector<int64_t>& v) { return {v.begin(), v.end()}; }

template <typename T>
nb::ndarray<nb::numpy, T> numpy_copy(const std::vector<T>& values,
                                     std::initializer_list<size_t> shape) {
  auto* data = new std::vector<T>(values);
  nb::capsule owner(data, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  const std::vector<size_t> dims(shape);
  return nb::ndarray<nb::numpy, T>(data->data(), dims.size(), dims.data(), owner);
}

void bind_manager(nb::module_& m) {
  nb::class_<PyKvCacheManager>(m, "KvCacheManager")
      .def(nb::init<const nb::dict&>(), "config"_a)
      .def(
          "add",
          [](PyKvCacheManager& s, SeqId seq, const std::vector<int32_t>& prompt, uint64_t salt,
             int32_t priority) { return s.manager->add(seq, prompt, salt, priority); },
          "seq"_a, "prompt"_a, "salt"_a = 0, "priority"_a = 0)
      .def(
          "append",
          [](PyKvCacheManager& s, SeqId seq, const std::vector<int32_t>& tokens) {
            s.manager->append(seq, tokens);
          },
          "seq"_a, "tokens"_a)
      .def(
          "fork", [](PyKvCacheManager& s, SeqId src, SeqId dst) { s.manager->fork(src, dst); },
          "src"_a, "dst"_a)
      .def(
          "release", [](PyKvCacheManager& s, SeqId seq) { s.manager->release(seq); }, "seq"_a)
      .def(
          "reorder_beams",
          [](PyKvCacheManager& s, const std::vector<int64_t>& beams,
             const std::vector<int32_t>& parents) {
            s.manager->reorder_beams(to_ids(beams), parents);
          },
          "beams"_a, "parents"_a)
      .def(
          "contains", [](PyKvCacheManager& s, SeqId seq) { return s.manager->contains(seq); },
          "seq"_a)
      .def(
          "length", [](PyKvCacheManager& s, SeqId seq) { return s.manager->length(seq); }, "seq"_a)
      .def(
          "blocks", [](PyKvCacheManager& s, SeqId seq) { return s.manager->blocks(seq); }, "seq"_a)
      .def(
          "probe_prefix",
          [](PyKvCacheManager& s, const std::vector<int32_t>& prompt, uint64_t salt) {
            return s.manager->probe_prefix(prompt, salt);
          },
          "prompt"_a, "salt"_a = 0)
      .def("stats", [](PyKvCacheManager& s) { return stats_to_dict(s.manager->stats()); })
      .def("num_blocks", [](PyKvCacheManager& s) { return s.manager->num_blocks(); })
      .def("block_bytes", [](PyKvCacheManager& s) { return s.manager->block_bytes(); })
      .def("max_blocks_per_seq",
           [](PyKvCacheManager& s) { return s.manager->max_blocks_per_seq(); })
      .def(
          "window_slots",
          [](PyKvCacheManager& s, int32_t layer) { return s.manager->window_slots(layer); },
          "layer"_a)
      .def("check_invariants", [](PyKvCacheManager& s) { s.manager->check_invariants(); })
      .def("is_cuda", [](PyKvCacheManager& s) { return s.config.device.is_cuda(); })
      .def("dtype", [](PyKvCacheManager& s) { return std::string(dtype_name(s.config.dtype)); })
      .def("pool",
           [](nb::handle self) { return pool_array(nb::cast<PyKvCacheManager&>(self), self); })
      .def(
          "block_tables",
          [](PyKvCacheManager& s, const std::vector<int64_t>& rows) {
            const KvBlockTables t = s.manager->block_tables(to_ids(rows));
            return nb::make_tuple(numpy_copy(t.table, {static_cast<size_t>(t.num_rows),
                                                       static_cast<size_t>(t.max_blocks)}),
                                  numpy_copy(t.seq_lens, {static_cast<size_t>(t.num_rows)}));
          },
          "rows"_a)
      .def(
          "cache_indirection",
          [](PyKvCacheManager& s, const std::vector<int64_t>& beams, int32_t beam_width,
             int32_t max_seq) {
            if (beam_width < 1 || beams.size() % beam_width != 0) {
              fail("beam_width: must be >= 1 and divide the number of beams (" +
                   std::to_string(beams.size()) + "), got " + std::to_string(beam_width));
            }
            return numpy_copy(s.manager->cache_indirection(to_ids(beams), beam_width, max_seq),
                              {beams.size() / beam_width, static_cast<size_t>(beam_width),
                               static_cast<size_t>(max_seq)});
          },
          "beams"_a, "beam_width"_a, "max_seq"_a);
}

// ---- context parallelism (attnkit.cp, docs/context_parallel.md) -------------------------------

// A communicator of one rank, whichever transport made it.
struct PyCommunicator {
  std::unique_ptr<cp::Communicator> comm;
  std::string transport;  // "nccl", "in_process" or "torch"
};

// A uint8 torch tensor over `bytes` bytes at `data` on `device`, sharing the memory (no copy, no
// owner: the driver keeps the buffer alive until the transfer is complete in stream order); None
// for an empty transfer.
nb::object byte_tensor(const void* data, int64_t bytes, const Device& device) {
  if (bytes <= 0) return nb::none();
  const size_t shape[1] = {static_cast<size_t>(bytes)};
  const int device_type = device.is_cpu() ? nb::device::cpu::value : nb::device::cuda::value;
  return nb::cast(nb::ndarray<nb::pytorch>(const_cast<void*>(data), 1, shape, nb::handle(), nullptr,
                                           nb::dtype<uint8_t>(), device_type,
                                           device.is_cpu() ? 0 : device.index),
                  nb::rv_policy::reference);
}

// The torch.distributed transport: each collective calls a method of a Python object
// (attnkit.cp's _TorchTransport) with the buffers as uint8 torch tensors over the driver's
// memory and the stream as an integer, with the GIL taken for the call (the entry point released
// it). That object enqueues its sends / receives on the stream (CUDA) or completes them (CPU)
// before it returns, as the Communicator contract asks.
class PythonCommunicator final : public cp::Communicator {
 public:
  PythonCommunicator(nb::object transport, int32_t rank, int32_t world_size, Device device,
                     Stream comm_stream)
      : transport_(std::move(transport)),
        rank_(rank),
        world_size_(world_size),
        device_(device),
        comm_stream_(comm_stream) {}

  int32_t rank() const override { return rank_; }
  int32_t world_size() const override { return world_size_; }
  Device device() const override { return device_; }
  Stream comm_stream() const override { return comm_stream_; }

  void ring_exchange(std::span<const cp::RingTransfer> transfers, Stream stream) override {
    call("ring_exchange", [&] {
      nb::list pairs;
      for (const cp::RingTransfer& t : transfers) {
        pairs.append(nb::make_tuple(byte_tensor(t.send, t.send_bytes, device_),
                                    byte_tensor(t.recv, t.recv_bytes, device_)));
      }
      transport_.attr("ring_exchange")(pairs, reinterpret_cast<uintptr_t>(stream));
    });
  }

  void all_gather(const void* send, void* recv, int64_t bytes, Stream stream) override {
    call("all_gather", [&] {
      transport_.attr("all_gather")(byte_tensor(send, bytes, device_),
                                    byte_tensor(recv, bytes * world_size_, device_),
                                    reinterpret_cast<uintptr_t>(stream));
    });
  }

 private:
  // The transport's own exception (a torch.distributed timeout, a peer that left) reaches the
  // caller unchanged: kept as the pending exception while Interrupted unwinds the driver, whose
  // translator restores it, as for an exception of a signal handler.
  template <typename Call>
  void call(const char* what, Call&& body) {
    nb::gil_scoped_acquire gil;
    try {
      body();
    } catch (nb::python_error& e) {
      e.restore();
      keep_pending_exception();
      throw Interrupted(std::string("comm: the torch.distributed ") + what + " raised");
    }
  }

  nb::object transport_;
  int32_t rank_, world_size_;
  Device device_;
  Stream comm_stream_;
};

cp::Communicator* comm_of(PyCommunicator* comm) { return comm ? comm->comm.get() : nullptr; }

void py_ring_prefill(const nb::dict& spec_dict, const cp::ZigzagPlan& plan, nb::handle q,
                     nb::handle k, nb::handle v, nb::handle out, nb::handle lse,
                     PyCommunicator* comm, bool checked, uintptr_t stream) {
  in_python_names(PyFunction::kRingPrefill, [&] {
    const AttentionSpec spec = spec_from_dict(spec_dict);
    cp::RingPrefillArgs args;
    args.q = array_view(q, "q", Access::kInput);
    args.k = array_view(k, "k", Access::kInput);
    args.v = array_view(v, "v", Access::kInput);
    args.out = array_view(out, "out", Access::kOutput);
    args.lse = opt_array_view(lse, "lse", Access::kOutput);
    args.checked = checked;
    cp::Options options;
    options.comm = comm_of(comm);
    nb::gil_scoped_release release;
    cp::ring_prefill(spec, plan, args, options, to_stream(stream));
  });
}

void py_sharded_decode(const nb::dict& spec_dict, nb::handle q, const nb::dict& kv_cache,
                       nb::handle out, nb::handle lse, PyCommunicator* comm, int32_t num_splits,
                       int32_t max_seq_len, DecodeWorkspace* workspace, bool deterministic,
                       bool batch_invariant, bool checked, uintptr_t stream) {
  in_python_names(PyFunction::kShardedDecode, [&] {
    const AttentionSpec spec = spec_from_dict(spec_dict);
    DecodeArgs args;
    args.q = array_view(q, "q", Access::kInput);
    args.kv_cache = cache_from_dict(kv_cache, true);
    args.out = array_view(out, "out", Access::kOutput);
    args.lse = opt_array_view(lse, "lse", Access::kOutput);
    args.num_splits = num_splits;
    args.max_seq_len = max_seq_len;
    args.workspace = workspace;
    args.deterministic = deterministic;
    args.batch_invariant = batch_invariant;
    args.checked = checked;
    cp::Options options;
    options.comm = comm_of(comm);
    nb::gil_scoped_release release;
    cp::sharded_decode(spec, args, options, to_stream(stream));
  });
}

// One rank's ShardedKvCache over the KvCacheManager of an attnkit.KvCache (kept alive by it).
struct PyShardedKvCache {
  cp::ShardedKvCache shard;
  PyShardedKvCache(PyKvCacheManager& cache, const cp::DecodeShardLayout& layout, int32_t rank)
      : shard(*cache.manager, layout, rank) {}
};

void bind_cp(nb::module_& m) {
  nb::class_<PyCommunicator>(
      m, "Communicator",
      "One rank of a context-parallel group (C++ cp::Communicator), made by "
      "attnkit.cp.from_process_group, nccl_communicator or in_process_group and passed as comm= "
      "to attnkit.cp.ring_prefill / sharded_decode. rank, world_size, device ('cpu' or 'cuda:N': "
      "where the rank's tensors live), transport ('nccl', 'torch' or 'in_process') and "
      "comm_stream (its communication stream as an integer, 0 for CPU ranks). Every call that "
      "communicates is a collective: every rank of the group makes it, in the same order.")
      .def_prop_ro("rank", [](const PyCommunicator& c) { return c.comm->rank(); })
      .def_prop_ro("world_size", [](const PyCommunicator& c) { return c.comm->world_size(); })
      .def_prop_ro("device", [](const PyCommunicator& c) { return c.comm->device().str(); })
      .def_prop_ro("transport", [](const PyCommunicator& c) { return c.transport; })
      .def_prop_ro("comm_stream", [](const PyCommunicator& c) {
        return reinterpret_cast<uintptr_t>(c.comm->comm_stream());
      });

  m.def("cp_nccl_available", &cp::nccl_available);
  m.def("cp_nccl_unique_id", [] {
    const cp::NcclUniqueId id = in_python_names(PyFunction::kCommunicator, [] {
      nb::gil_scoped_release release;
      return cp::nccl_unique_id();
    });
    return nb::bytes(id.bytes.data(), id.bytes.size());
  });
  m.def(
      "cp_nccl_communicator",
      [](nb::handle unique_id, int32_t rank, int32_t world_size, const std::string& device) {
        return in_python_names(PyFunction::kCommunicator, [&] {
          if (!nb::isinstance<nb::bytes>(unique_id)) {
            fail("unique_id: expected bytes (from attnkit.cp.nccl_unique_id()), got " +
                 describe(unique_id));
          }
          const nb::bytes bytes = nb::borrow<nb::bytes>(unique_id);
          cp::NcclUniqueId id;
          if (bytes.size() != id.bytes.size()) {
            fail("unique_id: expected the " + std::to_string(id.bytes.size()) +
                 " bytes of attnkit.cp.nccl_unique_id(), got " + std::to_string(bytes.size()));
          }
          std::memcpy(id.bytes.data(), bytes.c_str(), id.bytes.size());
          const Device dev = parse_device_name(device);
          if (!dev.is_cuda()) fail("device: an NCCL communicator needs a CUDA device, got 'cpu'");
          PyCommunicator c;
          c.transport = "nccl";
          {
            nb::gil_scoped_release release;  // a collective: waits for the other ranks
            c.comm = cp::make_nccl_communicator(id, rank, world_size, dev.index);
          }
          return c;
        });
      },
      "unique_id"_a, "rank"_a, "world_size"_a, "device"_a);
  m.def(
      "cp_in_process_group",
      [](const std::vector<std::string>& devices, double timeout_seconds) {
        return in_python_names(PyFunction::kCommunicator, [&] {
          std::vector<Device> parsed;
          for (const std::string& d : devices) parsed.push_back(parse_device_name(d));
          auto group = cp::make_in_process_group(parsed, timeout_seconds);
          nb::list out;
          for (auto& comm : group) {
            out.append(
                nb::cast(PyCommunicator{std::move(comm), "in_process"}, nb::rv_policy::move));
          }
          return out;
        });
      },
      "devices"_a, "timeout_seconds"_a);
  m.def(
      "cp_python_communicator",
      [](nb::object transport, int32_t rank, int32_t world_size, const std::string& device,
         uintptr_t comm_stream) {
        return in_python_names(PyFunction::kCommunicator, [&] {
          if (world_size < 1 || rank < 0 || rank >= world_size) {
            fail("group: rank " + std::to_string(rank) + " of a group of " +
                 std::to_string(world_size));
          }
          return PyCommunicator{
              std::make_unique<PythonCommunicator>(std::move(transport), rank, world_size,
                                                   parse_device_name(device),
                                                   reinterpret_cast<Stream>(comm_stream)),
              "torch"};
        });
      },
      "transport"_a, "rank"_a, "world_size"_a, "device"_a, "comm_stream"_a);

  nb::class_<cp::ZigzagPlan>(m, "ZigzagPlan")
      .def(
          "__init__",
          [](cp::ZigzagPlan* self, const std::vector<int32_t>& cu_seqlens, int32_t world_size) {
            in_python_names(PyFunction::kOther,
                            [&] { new (self) cp::ZigzagPlan(cu_seqlens, world_size); });
          },
          "cu_seqlens"_a, "world_size"_a)
      .def_prop_ro("world_size", &cp::ZigzagPlan::world_size)
      .def_prop_ro("num_sequences", &cp::ZigzagPlan::num_sequences)
      .def_prop_ro("total_tokens", &cp::ZigzagPlan::total_tokens)
      .def_prop_ro("cu_seqlens", [](const cp::ZigzagPlan& p) { return p.cu_seqlens(); })
      .def("local_tokens", &cp::ZigzagPlan::local_tokens, "rank"_a)
      .def("max_local_tokens", &cp::ZigzagPlan::max_local_tokens)
      .def(
          "global_rows",
          [](const cp::ZigzagPlan& p, int32_t rank) {
            const std::vector<int32_t> rows = p.global_rows(rank);
            return numpy_copy(rows, {rows.size()});
          },
          "rank"_a);

  nb::class_<cp::DecodeShardLayout>(m, "DecodeShardLayout")
      .def(
          "__init__",
          [](cp::DecodeShardLayout* self, int32_t world_size, int32_t tokens_per_block) {
            in_python_names(PyFunction::kOther, [&] {
              const cp::DecodeShardLayout layout{world_size, tokens_per_block};
              layout.validate();
              new (self) cp::DecodeShardLayout(layout);
            });
          },
          "world_size"_a, "tokens_per_block"_a)
      .def_ro("world_size", &cp::DecodeShardLayout::world_size)
      .def_ro("tokens_per_block", &cp::DecodeShardLayout::tokens_per_block)
      .def("rank_of_position", &cp::DecodeShardLayout::rank_of_position, "position"_a)
      .def("local_position", &cp::DecodeShardLayout::local_position, "position"_a)
      .def("local_length", &cp::DecodeShardLayout::local_length, "rank"_a, "length"_a)
      .def(
          "local_tokens",
          [](const cp::DecodeShardLayout& l, int32_t rank, int64_t begin,
             const std::vector<int32_t>& tokens) { return l.local_tokens(rank, begin, tokens); },
          "rank"_a, "begin"_a, "tokens"_a);

  nb::class_<PyShardedKvCache>(m, "ShardedKvCache")
      .def(
          "__init__",
          [](PyShardedKvCache* self, PyKvCacheManager& cache, const cp::DecodeShardLayout& layout,
             int32_t rank) {
            in_python_names(PyFunction::kOther,
                            [&] { new (self) PyShardedKvCache(cache, layout, rank); });
          },
          "cache"_a, "layout"_a, "rank"_a, nb::keep_alive<1, 2>())
      .def(
          "extend",
          [](PyShardedKvCache& s, SeqId seq, const std::vector<int32_t>& tokens) {
            s.shard.extend(seq, tokens);
          },
          "seq"_a, "tokens"_a)
      .def(
          "release", [](PyShardedKvCache& s, SeqId seq) { s.shard.release(seq); }, "seq"_a)
      .def(
          "length", [](const PyShardedKvCache& s, SeqId seq) { return s.shard.length(seq); },
          "seq"_a)
      .def(
          "local_length",
          [](const PyShardedKvCache& s, SeqId seq) { return s.shard.local_length(seq); }, "seq"_a)
      .def(
          "block_tables",
          [](const PyShardedKvCache& s, const std::vector<int64_t>& rows) {
            const KvBlockTables t = s.shard.block_tables(to_ids(rows));
            return nb::make_tuple(numpy_copy(t.table, {static_cast<size_t>(t.num_rows),
                                                       static_cast<size_t>(t.max_blocks)}),
                                  numpy_copy(t.seq_lens, {static_cast<size_t>(t.num_rows)}));
          },
          "rows"_a);

  const auto none = nb::none();
  m.def("cp_ring_prefill", &py_ring_prefill, "spec"_a, "plan"_a, "q"_a, "k"_a, "v"_a, "out"_a,
        "lse"_a = none, "comm"_a.none() = none, "checked"_a = false, "stream"_a = 0);
  m.def("cp_sharded_decode", &py_sharded_decode, "spec"_a, "q"_a, "kv_cache"_a, "out"_a,
        "lse"_a = none, "comm"_a.none() = none, "num_splits"_a = 0, "max_seq_len"_a = 0,
        "workspace"_a.none() = none, "deterministic"_a = true, "batch_invariant"_a = false,
        "checked"_a = false, "stream"_a = 0);
}

}  // namespace
}  // namespace attnkit::python

NB_MODULE(_attnkit, m) {
  using namespace attnkit::python;
  m.doc() = "attnkit C++ bindings (use the `attnkit` package, not this module directly)";
  const nb::exception<attnkit::Error> error(m, "Error", PyExc_ValueError);
  const nb::exception<attnkit::DeviceFaultError> device_fault(m, "DeviceFaultError", error.ptr());
  g_error_type = error.ptr();
  g_device_fault_type = device_fault.ptr();
  // Tried before the two above (translators are tried newest first): renames the messages.
  nb::register_exception_translator(&translate_exception);
  g_main_thread = nb::cast<unsigned long>(
      nb::module_::import_("threading").attr("main_thread")().attr("ident"));
  attnkit::set_interrupt_check(&python_signal_raised);

  nb::class_<attnkit::DecodeWorkspace>(
      m, "DecodeWorkspace",
      "Caller-owned split-KV workspace for decode / forward on one stream (C++ DecodeWorkspace).")
      .def(
          "__init__",
          [](attnkit::DecodeWorkspace* self, const nb::dict& spec, int64_t max_rows,
             int32_t max_splits, const std::string& device) {
            in_python_names(PyFunction::kDecodeWorkspace, [&] {
              new (self) attnkit::DecodeWorkspace(spec_from_dict(spec), max_rows, max_splits,
                                                  parse_device_name(device));
            });
          },
          "spec"_a, "max_rows"_a, "max_splits"_a, "device"_a)
      .def_prop_ro("bytes", &attnkit::DecodeWorkspace::bytes)
      .def_prop_ro("device", [](const attnkit::DecodeWorkspace& w) { return w.device().str(); })
      .def(
          "reset",
          [](attnkit::DecodeWorkspace& w, uintptr_t stream) { w.reset(to_stream(stream)); },
          "stream"_a = 0, "Enqueues a zeroing of the arrival counters on `stream`.");

  const auto none = nb::none();
  m.def("prefill", &py_prefill, "spec"_a, "q"_a, "cu_seqlens_q"_a, "out"_a, "k"_a = none,
        "v"_a = none, "cu_seqlens_kv"_a = none, "kv_cache"_a.none() = none, "lse"_a = none,
        "max_seqlen_q"_a = 0, "max_seqlen_kv"_a = 0, "timestep"_a = 0.0, "block_m"_a = 128,
        "block_n"_a = 128, "skip_stats"_a = none, "checked"_a = false, "stream"_a = 0);
  m.def("decode", &py_decode, "spec"_a, "q"_a, "kv_cache"_a, "out"_a, "lse"_a = none,
        "beam_width"_a = 1, "cache_indirection"_a = none, "num_splits"_a = 0, "max_seq_len"_a = 0,
        "workspace"_a.none() = none, "deterministic"_a = true, "batch_invariant"_a = false,
        "checked"_a = false, "stream"_a = 0);
  m.def("append_kv", &py_append_kv, "spec"_a, "kv_cache"_a, "positions"_a, "row_of_token"_a,
        "q_out"_a, "qkv"_a = none, "q"_a = none, "k"_a = none, "v"_a = none, "qkv_bias"_a = none,
        "checked"_a = false, "stream"_a = 0);
  m.def("forward", &py_forward, "spec"_a, "qkv"_a, "kv_cache"_a, "cu_seqlens_q"_a, "past_lens"_a,
        "num_context"_a, "out"_a, "beam_width"_a = 1, "qkv_bias"_a = none,
        "cache_indirection"_a = none, "lse"_a = none, "workspace"_a = none, "num_splits"_a = 0,
        "decode_workspace"_a.none() = none, "deterministic"_a = true, "batch_invariant"_a = false,
        "checked"_a = false, "stream"_a = 0);
  m.def("dense", &py_dense, "spec"_a, "q"_a, "k"_a, "v"_a, "out"_a, "lse"_a = none,
        "timestep"_a = 0.0, "block_m"_a = 128, "block_n"_a = 128, "stats"_a = true,
        "skip_stats"_a = none, "checked"_a = false, "stream"_a = 0);
  m.def("merge_states", &py_merge_states, "out_a"_a, "lse_a"_a, "out_b"_a, "lse_b"_a, "out"_a,
        "lse"_a = none, "checked"_a = false, "stream"_a = 0);
  m.def("info", &py_info);
  m.def(
      "check_device_errors",
      [](uintptr_t stream) {
        nb::gil_scoped_release release;
        attnkit::check_device_errors(to_stream(stream));
      },
      "stream"_a = 0,
      "Synchronizes `stream` and raises DeviceFaultError for the first device fault recorded on "
      "its device since the last check (clearing it); see docs/safety.md.");

  m.def("default_alibi_slopes", &attnkit::default_alibi_slopes, "num_heads"_a);

  nb::class_<attnkit::AttentionConfig>(
      m, "AttentionConfig",
      "Per-role backend / skip-softmax / SAGE settings parsed from JSON (docs/configuration.md).")
      .def(nb::init<>(), "An empty config: every role resolves to backend 'auto'.")
      .def_static(
          "from_json",
          [](nb::handle text) {
            return attnkit::AttentionConfig::from_json(str_arg(text, "text"));
          },
          "text"_a, "Parses and validates JSON text; raises Error naming the key path.")
      .def_static(
          "from_file",
          [](nb::handle path) {
            return attnkit::AttentionConfig::from_file(path_arg(path, "path"));
          },
          "path"_a, "Parses and validates a JSON file; raises Error naming the key path.")
      .def(
          "resolve",
          [](const attnkit::AttentionConfig& c, nb::handle role) {
            return role_to_dict(c.resolve(str_arg(role, "role")));
          },
          "role"_a,
          "The settings of `role` (exact role, then its categories, then default): a dict with "
          "backend (str), skip_softmax (dict or None), quant (dict or None).")
      .def("resolved_json", &attnkit::AttentionConfig::resolved_json,
           "The resolved settings of default and every role, as JSON text.")
      .def(
          "roles",
          [](const attnkit::AttentionConfig& c) {
            std::vector<std::string> names;
            for (const auto& [name, spec] : c.roles()) names.push_back(name);
            return names;
          },
          "The roles written in the JSON, flattened to dotted names.");
  bind_manager(m);
  bind_cp(m);
}
