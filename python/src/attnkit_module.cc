// The nanobind extension `attnkit._attnkit`: converts DLPack / buffer-protocol arrays to
// attnkit::TensorView and calls the C++ entry points. Everything user-facing (defaults, output
// allocation, docstrings) lives in python/attnkit/__init__.py; this layer only converts and
// calls, so every rejection comes from the C++ validation with its message.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "attnkit/attnkit.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace attnkit::python {
namespace {

// Inputs may be read-only (a NumPy array from np.broadcast_to, a JAX array); outputs must not.
using InArray = nb::ndarray<nb::ro>;
using OutArray = nb::ndarray<>;

[[noreturn]] void fail(const std::string& message) { throw Error(message); }

DType parse_dtype_name(const std::string& name, const std::string& what) {
  for (DType d : {DType::kF32, DType::kF16, DType::kBF16, DType::kFp8E4M3, DType::kInt8,
                  DType::kInt32, DType::kInt64}) {
    if (name == dtype_name(d)) return d;
  }
  fail(what + ": unknown dtype '" + name +
       "' (accepted: f32, f16, bf16, fp8_e4m3, int8, int32, int64)");
}

std::string dlpack_dtype_str(const nb::dlpack::dtype& t) {
  return "DLPack code " + std::to_string(t.code) + " with " + std::to_string(t.bits) + " bits";
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
  fail(name + ": unsupported dtype (" + dlpack_dtype_str(t) +
       "); accepted: float32, float16, bfloat16, float8_e4m3fn, int8, int32, int64 (and uint8 / "
       "uint16 storage for fp8_e4m3 / bf16 caches with kv_dtype=)");
}

Device map_device(int device_type, int device_id, const std::string& name) {
  if (device_type == nb::device::cpu::value) return Device::cpu();
  if (device_type == nb::device::cuda::value) return Device::cuda(device_id);
  fail(name + ": unsupported device (DLPack device type " + std::to_string(device_type) +
       "); accepted: cpu and cuda");
}

template <typename Array>
TensorView to_view(const Array& a, const std::string& name, std::optional<DType> raw_as = {}) {
  if (a.ndim() > static_cast<size_t>(TensorView::kMaxDims)) {
    fail(name + ": at most " + std::to_string(TensorView::kMaxDims) + " dimensions, got " +
         std::to_string(a.ndim()));
  }
  TensorView view;
  view.data = const_cast<void*>(static_cast<const void*>(a.data()));
  view.dtype = map_dtype(a.dtype(), name, raw_as);
  view.device = map_device(a.device_type(), a.device_id(), name);
  view.ndim = static_cast<int>(a.ndim());
  for (int d = 0; d < view.ndim; ++d) {
    view.shape[d] = static_cast<int64_t>(a.shape(d));
    view.strides[d] = a.stride(d);  // nanobind strides are in elements, as TensorView's
  }
  return view;
}

template <typename Array>
TensorView opt_view(const std::optional<Array>& a, const std::string& name) {
  return a ? to_view(*a, name) : TensorView{};
}

// ---- spec --------------------------------------------------------------------------------------

template <typename T>
T get(const nb::dict& d, const char* key, T fallback) {
  return d.contains(key) && !d[key].is_none() ? nb::cast<T>(d[key]) : fallback;
}

std::optional<double> get_opt(const nb::dict& d, const char* key) {
  if (!d.contains(key) || d[key].is_none()) return std::nullopt;
  return nb::cast<double>(d[key]);
}

// One string option to its enum; the error lists the accepted names as "'a', 'b' or 'c'".
template <typename E>
E parse_choice(const char* key, const std::string& got,
               std::initializer_list<std::pair<const char*, E>> choices) {
  std::string accepted;
  size_t i = 0;
  for (const auto& [name, value] : choices) {
    if (got == name) return value;
    accepted += (i == 0 ? "" : i + 1 == choices.size() ? " or " : ", ");
    accepted += std::string("'") + name + "'";
    ++i;
  }
  fail(std::string(key) + ": expected " + accepted + ", got '" + got + "'");
}

Backend parse_backend(const std::string& s) {
  return parse_choice<Backend>(
      "backend", s,
      {{"auto", Backend::kAuto}, {"fused", Backend::kFused}, {"vanilla", Backend::kVanilla}});
}

void check_keys(const nb::dict& d, const std::string& what, std::initializer_list<const char*> ok) {
  for (auto [key, value] : d) {
    const std::string k = nb::cast<std::string>(key);
    bool known = false;
    std::string list;
    for (const char* name : ok) {
      known = known || k == name;
      list += list.empty() ? name : std::string(", ") + name;
    }
    if (!known) fail(what + ": unknown key '" + k + "' (accepted: " + list + ")");
  }
}

SkipSoftmaxSpec parse_skip(const nb::dict& d) {
  check_keys(d, "skip_softmax",
             {"threshold", "target_sparsity", "calibration_a", "calibration_b",
              "disabled_until_timestep"});
  SkipSoftmaxSpec s;
  s.threshold = get_opt(d, "threshold");
  s.target_sparsity = get_opt(d, "target_sparsity");
  s.calibration_a = get_opt(d, "calibration_a");
  s.calibration_b = get_opt(d, "calibration_b");
  s.disabled_until_timestep = get<double>(d, "disabled_until_timestep", 0.0);
  return s;
}

SageQuantSpec parse_quant(const nb::dict& d) {
  check_keys(d, "quant", {"dtype_qk", "q_block_size", "k_block_size"});
  SageQuantSpec q;
  q.dtype_qk = parse_dtype_name(get<std::string>(d, "dtype_qk", "int8"), "quant.dtype_qk");
  q.q_block_size = get<int32_t>(d, "q_block_size", 1);
  q.k_block_size = get<int32_t>(d, "k_block_size", 16);
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
  s.mask.kind = parse_choice<MaskKind>("mask", get<std::string>(d, "mask", "causal"),
                                       {{"none", MaskKind::kNone},
                                        {"causal", MaskKind::kCausal},
                                        {"sliding_window", MaskKind::kSlidingWindow}});
  s.mask.window = get<int32_t>(d, "window", 0);
  s.mask.sink_tokens = get<int32_t>(d, "sink_tokens", 0);
  s.alibi = get<bool>(d, "alibi", false);
  s.alibi_slopes = get<std::vector<float>>(d, "alibi_slopes", {});
  s.logit_softcap = get<double>(d, "softcap", 0.0);
  s.backend = parse_backend(get<std::string>(d, "backend", "auto"));
  s.fused_kernel = parse_choice<FusedKernel>("kernel", get<std::string>(d, "kernel", "auto"),
                                             {{"auto", FusedKernel::kAuto},
                                              {"portable", FusedKernel::kPortable},
                                              {"hopper", FusedKernel::kHopper}});
  s.rope.style = parse_choice<RopeStyle>(
      "rope_style", get<std::string>(d, "rope_style", "none"),
      {{"none", RopeStyle::kNone}, {"gpt_neox", RopeStyle::kGptNeox}, {"gptj", RopeStyle::kGptJ}});
  s.rope.rotary_dim = get<int32_t>(d, "rotary_dim", 0);
  s.rope.base = get<double>(d, "rope_base", 10000.0);
  s.rope.scaling =
      parse_choice<RopeScaling>("rope_scaling", get<std::string>(d, "rope_scaling", "none"),
                                {{"none", RopeScaling::kNone},
                                 {"linear", RopeScaling::kLinear},
                                 {"llama3", RopeScaling::kLlama3}});
  s.rope.factor = get<double>(d, "rope_factor", 1.0);
  s.rope.low_freq_factor = get<double>(d, "low_freq_factor", 1.0);
  s.rope.high_freq_factor = get<double>(d, "high_freq_factor", 4.0);
  s.rope.original_max_position = get<int32_t>(d, "original_max_position", 8192);
  if (d.contains("skip_softmax") && !d["skip_softmax"].is_none()) {
    s.skip_softmax = parse_skip(nb::cast<nb::dict>(d["skip_softmax"]));
  }
  if (d.contains("quant") && !d["quant"].is_none()) {
    s.quant = parse_quant(nb::cast<nb::dict>(d["quant"]));
  }
  return s;
}

nb::dict role_to_dict(const RoleSpec& r) {
  nb::dict out;
  out["backend"] = backend_name(r.backend.value_or(Backend::kAuto));
  if (r.skip_softmax) {
    nb::dict s;
    const SkipSoftmaxSpec& k = *r.skip_softmax;
    auto put = [&](const char* key, const std::optional<double>& v) {
      if (v) s[key] = *v;
    };
    put("threshold", k.threshold);
    put("target_sparsity", k.target_sparsity);
    put("calibration_a", k.calibration_a);
    put("calibration_b", k.calibration_b);
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

// A cache described by K and V arrays [num_blocks, Hkv, T, D] (each block contiguous; the block
// stride, the same for K and V, is free so that slices of one [num_blocks, 2, Hkv, T, D] or
// [num_blocks, L, 2, Hkv, T, D] pool work), seq_lens int32 [rows], an optional block_table
// (absent: a contiguous cache, row r in block r) and optional float32 scales.
KvCacheView cache_from_dict(const nb::dict& d, bool need_seq_lens) {
  check_keys(d, "kv_cache",
             {"k", "v", "seq_lens", "block_table", "k_scale", "v_scale", "window_slots",
              "sink_tokens", "kv_dtype"});
  if (!d.contains("k") || !d.contains("v")) fail("kv_cache: needs the K and V arrays");
  std::optional<DType> raw_as;
  if (d.contains("kv_dtype") && !d["kv_dtype"].is_none()) {
    raw_as = parse_dtype_name(nb::cast<std::string>(d["kv_dtype"]), "kv_dtype");
  }
  const TensorView k = to_view(nb::cast<InArray>(d["k"], false), "k_cache", raw_as);
  const TensorView v = to_view(nb::cast<InArray>(d["v"], false), "v_cache", raw_as);
  for (const auto* t : {&k, &v}) {
    const char* name = t == &k ? "k_cache" : "v_cache";
    if (t->ndim != 4) {
      fail(std::string(name) + ": expected 4 dimensions [num_blocks, Hkv, T, D], got shape " +
           t->shape_str());
    }
    const bool block_contiguous = t->strides[3] == 1 && t->strides[2] == t->shape[3] &&
                                  t->strides[1] == t->shape[2] * t->shape[3];
    if (!block_contiguous) {
      fail(std::string(name) +
           ": each block [Hkv, T, D] must be contiguous (strides [*, T*D, D, 1]); got shape " +
           t->shape_str());
    }
  }
  if (k.dtype != v.dtype || k.device != v.device) {
    fail(std::string("v_cache: must have the dtype and device of k_cache (") + dtype_name(k.dtype) +
         ", " + k.device.str() + "), got " + dtype_name(v.dtype) + ", " + v.device.str());
  }
  for (int dim = 0; dim < 4; ++dim) {
    if (k.shape[dim] != v.shape[dim]) {
      fail("v_cache: must have the shape of k_cache " + k.shape_str() + ", got " + v.shape_str());
    }
  }
  if (k.shape[0] > 1 && k.strides[0] != v.strides[0]) {
    fail("v_cache: must have the block stride of k_cache (" + std::to_string(k.strides[0]) +
         " elements), got " + std::to_string(v.strides[0]));
  }
  // The view's geometry is int32: larger extents are an error, never truncated.
  const char* dims[4] = {"num_blocks", "Hkv", "T", "D"};
  for (int dim = 0; dim < 4; ++dim) {
    if (k.shape[dim] > INT32_MAX) {
      fail(std::string("k_cache: ") + dims[dim] + " = " + std::to_string(k.shape[dim]) +
           " is more than int32 holds (shape " + k.shape_str() + ")");
    }
  }
  KvCacheView c;
  c.k_base = k.data;
  c.v_base = v.data;
  c.dtype = k.dtype;
  c.device = k.device;
  c.num_blocks = static_cast<int32_t>(k.shape[0]);
  c.num_kv_heads = static_cast<int32_t>(k.shape[1]);
  c.tokens_per_block = static_cast<int32_t>(k.shape[2]);
  c.head_dim = static_cast<int32_t>(k.shape[3]);
  const int64_t block_elems = k.shape[1] * k.shape[2] * k.shape[3];
  c.block_stride_bytes =
      static_cast<int64_t>(dtype_size(k.dtype)) * (k.shape[0] > 1 ? k.strides[0] : block_elems);
  auto array = [&](const char* key, const char* name) -> TensorView {
    if (!d.contains(key) || d[key].is_none()) return {};
    return to_view(nb::cast<InArray>(d[key], false), name);
  };
  c.block_table = array("block_table", "block_table");
  c.paged = c.block_table.defined();
  c.seq_lens = array("seq_lens", "seq_lens");
  if (need_seq_lens && !c.seq_lens.defined()) fail("seq_lens: required (int32 [rows])");
  c.k_scale = array("k_scale", "k_scale");
  c.v_scale = array("v_scale", "v_scale");
  c.window_slots = get<int32_t>(d, "window_slots", 0);
  c.sink_tokens = get<int32_t>(d, "sink_tokens", 0);
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

void py_prefill(const nb::dict& spec_dict, const InArray& q, const InArray& cu_seqlens_q,
                const OutArray& out, const std::optional<InArray>& k,
                const std::optional<InArray>& v, const std::optional<InArray>& cu_seqlens_kv,
                const std::optional<nb::dict>& kv_cache, const std::optional<OutArray>& lse,
                int32_t max_seqlen_q, int32_t max_seqlen_kv, double timestep, int32_t block_m,
                int32_t block_n, const std::optional<OutArray>& skip_stats, bool checked,
                uintptr_t stream) {
  const AttentionSpec spec = spec_from_dict(spec_dict);
  PrefillArgs args;
  args.timestep = timestep;
  args.block_m = block_m;
  args.block_n = block_n;
  args.skip_stats = opt_view(skip_stats, "skip_stats");
  args.q = to_view(q, "q");
  args.cu_seqlens_q = to_view(cu_seqlens_q, "cu_seqlens_q");
  args.out = to_view(out, "out");
  args.k = opt_view(k, "k");
  args.v = opt_view(v, "v");
  args.cu_seqlens_kv = opt_view(cu_seqlens_kv, "cu_seqlens_kv");
  args.lse = opt_view(lse, "lse");
  args.max_seqlen_q = max_seqlen_q;
  args.max_seqlen_kv = max_seqlen_kv;
  args.checked = checked;
  KvCacheView cache;
  if (kv_cache) {
    cache = cache_from_dict(*kv_cache, true);
    args.kv_cache = &cache;
  }
  nb::gil_scoped_release release;
  prefill(spec, args, to_stream(stream));
}

void py_decode(const nb::dict& spec_dict, const InArray& q, const nb::dict& kv_cache,
               const OutArray& out, const std::optional<OutArray>& lse, int32_t beam_width,
               const std::optional<InArray>& cache_indirection, int32_t num_splits,
               int32_t max_seq_len, DecodeWorkspace* workspace, bool deterministic,
               bool batch_invariant, bool checked, uintptr_t stream) {
  const AttentionSpec spec = spec_from_dict(spec_dict);
  DecodeArgs args;
  args.q = to_view(q, "q");
  args.kv_cache = cache_from_dict(kv_cache, true);
  args.out = to_view(out, "out");
  args.lse = opt_view(lse, "lse");
  args.beam_width = beam_width;
  args.cache_indirection = opt_view(cache_indirection, "cache_indirection");
  args.num_splits = num_splits;
  args.max_seq_len = max_seq_len;
  args.workspace = workspace;
  args.deterministic = deterministic;
  args.batch_invariant = batch_invariant;
  args.checked = checked;
  nb::gil_scoped_release release;
  decode(spec, args, to_stream(stream));
}

void py_append_kv(const nb::dict& spec_dict, const nb::dict& kv_cache, const InArray& positions,
                  const InArray& row_of_token, const OutArray& q_out,
                  const std::optional<InArray>& qkv, const std::optional<InArray>& q,
                  const std::optional<InArray>& k, const std::optional<InArray>& v,
                  const std::optional<InArray>& qkv_bias, bool checked, uintptr_t stream) {
  const AttentionSpec spec = spec_from_dict(spec_dict);
  AppendKvArgs args;
  args.checked = checked;
  args.kv_cache = cache_from_dict(kv_cache, false);
  args.positions = to_view(positions, "positions");
  args.row_of_token = to_view(row_of_token, "row_of_token");
  args.q_out = to_view(q_out, "q_out");
  args.qkv = opt_view(qkv, "qkv");
  args.q = opt_view(q, "q");
  args.k = opt_view(k, "k");
  args.v = opt_view(v, "v");
  args.qkv_bias = opt_view(qkv_bias, "qkv_bias");
  nb::gil_scoped_release release;
  append_kv(spec, args, to_stream(stream));
}

void py_forward(const nb::dict& spec_dict, const InArray& qkv, const nb::dict& kv_cache,
                const InArray& cu_seqlens_q, const InArray& past_lens, int32_t num_context,
                const OutArray& out, int32_t beam_width, const std::optional<InArray>& qkv_bias,
                const std::optional<InArray>& cache_indirection, const std::optional<OutArray>& lse,
                const std::optional<OutArray>& workspace, int32_t num_splits,
                DecodeWorkspace* decode_workspace, bool deterministic, bool batch_invariant,
                bool checked, uintptr_t stream) {
  const AttentionSpec spec = spec_from_dict(spec_dict);
  ForwardArgs args;
  args.checked = checked;
  args.qkv = to_view(qkv, "qkv");
  args.kv_cache = cache_from_dict(kv_cache, true);
  args.cu_seqlens_q = to_view(cu_seqlens_q, "cu_seqlens_q");
  args.past_lens = to_view(past_lens, "past_lens");
  args.num_context = num_context;
  args.out = to_view(out, "out");
  args.beam_width = beam_width;
  args.qkv_bias = opt_view(qkv_bias, "qkv_bias");
  args.cache_indirection = opt_view(cache_indirection, "cache_indirection");
  args.lse = opt_view(lse, "lse");
  args.workspace = opt_view(workspace, "workspace");
  args.num_splits = num_splits;
  args.decode_workspace = decode_workspace;
  args.deterministic = deterministic;
  args.batch_invariant = batch_invariant;
  nb::gil_scoped_release release;
  forward(spec, args, to_stream(stream));
}

// stats: fill the returned dict (on CUDA, a call that skips tiles then synchronizes its stream);
// skip_stats: an int64 [2] tensor the counts are written to in stream order.
nb::object py_dense(const nb::dict& spec_dict, const InArray& q, const InArray& k, const InArray& v,
                    const OutArray& out, const std::optional<OutArray>& lse, double timestep,
                    int32_t block_m, int32_t block_n, bool stats,
                    const std::optional<OutArray>& skip_stats, bool checked, uintptr_t stream) {
  const AttentionSpec spec = spec_from_dict(spec_dict);
  DenseArgs args;
  args.checked = checked;
  args.q = to_view(q, "q");
  args.k = to_view(k, "k");
  args.v = to_view(v, "v");
  args.out = to_view(out, "out");
  args.lse = opt_view(lse, "lse");
  args.skip_stats = opt_view(skip_stats, "skip_stats");
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
}

void py_merge_states(const InArray& out_a, const InArray& lse_a, const InArray& out_b,
                     const InArray& lse_b, const OutArray& out, const std::optional<OutArray>& lse,
                     bool checked, uintptr_t stream) {
  MergeStatesArgs args;
  args.checked = checked;
  args.out_a = to_view(out_a, "out_a");
  args.lse_a = to_view(lse_a, "lse_a");
  args.out_b = to_view(out_b, "out_b");
  args.lse_b = to_view(lse_b, "lse_b");
  args.out = to_view(out, "out");
  args.lse = opt_view(lse, "lse");
  nb::gil_scoped_release release;
  merge_states(args, to_stream(stream));
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

// ---- KvCacheManager ----------------------------------------------------------------------------

KvCacheManagerConfig manager_config(const nb::dict& d) {
  check_keys(d, "KvCache",
             {"num_layers", "num_kv_heads", "head_dim", "tokens_per_block", "dtype", "device",
              "max_tokens", "max_bytes", "free_gpu_memory_fraction", "host_cache_bytes",
              "max_seq_len", "layer_windows", "sink_tokens", "enable_prefix_reuse", "stream"});
  KvCacheManagerConfig c;
  c.num_layers = get<int32_t>(d, "num_layers", 1);
  c.num_kv_heads = get<int32_t>(d, "num_kv_heads", 0);
  c.head_dim = get<int32_t>(d, "head_dim", 0);
  c.tokens_per_block = get<int32_t>(d, "tokens_per_block", 16);
  c.dtype = parse_dtype_name(get<std::string>(d, "dtype", "f16"), "dtype");
  c.device = parse_device_name(get<std::string>(d, "device", "cpu"));
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

// The pool as [num_blocks, L, 2, Hkv, T, D]. NumPy has no bf16 / fp8: those pools come back as
// uint16 / uint8 storage (pass kv_dtype= to the entry points). CUDA pools come back as a DLPack
// capable array (torch.from_dlpack / cupy.from_dlpack).
nb::object pool_array(PyKvCacheManager& self, nb::handle owner) {
  const KvCacheManagerConfig& c = self.config;
  const size_t shape[6] = {static_cast<size_t>(self.manager->num_blocks()),
                           static_cast<size_t>(c.num_layers),
                           2,
                           static_cast<size_t>(c.num_kv_heads),
                           static_cast<size_t>(c.tokens_per_block),
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

}  // namespace
}  // namespace attnkit::python

NB_MODULE(_attnkit, m) {
  using namespace attnkit::python;
  m.doc() = "attnkit C++ bindings (use the `attnkit` package, not this module directly)";
  // Translators are tried newest first: the subclass is registered after its base.
  const nb::exception<attnkit::Error> error(m, "Error", PyExc_ValueError);
  nb::exception<attnkit::DeviceFaultError>(m, "DeviceFaultError", error.ptr());

  nb::class_<attnkit::DecodeWorkspace>(
      m, "DecodeWorkspace",
      "Caller-owned split-KV workspace for decode / forward on one stream (C++ DecodeWorkspace).")
      .def(
          "__init__",
          [](attnkit::DecodeWorkspace* self, const nb::dict& spec, int64_t max_rows,
             int32_t max_splits, const std::string& device) {
            new (self) attnkit::DecodeWorkspace(spec_from_dict(spec), max_rows, max_splits,
                                                parse_device_name(device));
          },
          "spec"_a, "max_rows"_a, "max_splits"_a, "device"_a)
      .def_prop_ro("bytes", &attnkit::DecodeWorkspace::bytes)
      .def_prop_ro("device", [](const attnkit::DecodeWorkspace& w) { return w.device().str(); })
      .def(
          "reset",
          [](attnkit::DecodeWorkspace& w, uintptr_t stream) { w.reset(to_stream(stream)); },
          "stream"_a = 0, "Enqueues a zeroing of the arrival counters on `stream`.");

  m.def("prefill", &py_prefill, "spec"_a, "q"_a, "cu_seqlens_q"_a, "out"_a.noconvert(),
        "k"_a.none() = nb::none(), "v"_a.none() = nb::none(), "cu_seqlens_kv"_a.none() = nb::none(),
        "kv_cache"_a.none() = nb::none(), "lse"_a.noconvert().none() = nb::none(),
        "max_seqlen_q"_a = 0, "max_seqlen_kv"_a = 0, "timestep"_a = 0.0, "block_m"_a = 128,
        "block_n"_a = 128, "skip_stats"_a.noconvert().none() = nb::none(), "checked"_a = false,
        "stream"_a = 0);
  m.def("decode", &py_decode, "spec"_a, "q"_a, "kv_cache"_a, "out"_a.noconvert(),
        "lse"_a.noconvert().none() = nb::none(), "beam_width"_a = 1,
        "cache_indirection"_a.none() = nb::none(), "num_splits"_a = 0, "max_seq_len"_a = 0,
        "workspace"_a.none() = nb::none(), "deterministic"_a = true, "batch_invariant"_a = false,
        "checked"_a = false, "stream"_a = 0);
  m.def("append_kv", &py_append_kv, "spec"_a, "kv_cache"_a, "positions"_a, "row_of_token"_a,
        "q_out"_a.noconvert(), "qkv"_a.none() = nb::none(), "q"_a.none() = nb::none(),
        "k"_a.none() = nb::none(), "v"_a.none() = nb::none(), "qkv_bias"_a.none() = nb::none(),
        "checked"_a = false, "stream"_a = 0);
  m.def("forward", &py_forward, "spec"_a, "qkv"_a, "kv_cache"_a, "cu_seqlens_q"_a, "past_lens"_a,
        "num_context"_a, "out"_a.noconvert(), "beam_width"_a = 1, "qkv_bias"_a.none() = nb::none(),
        "cache_indirection"_a.none() = nb::none(), "lse"_a.noconvert().none() = nb::none(),
        "workspace"_a.noconvert().none() = nb::none(), "num_splits"_a = 0,
        "decode_workspace"_a.none() = nb::none(), "deterministic"_a = true,
        "batch_invariant"_a = false, "checked"_a = false, "stream"_a = 0);
  m.def("dense", &py_dense, "spec"_a, "q"_a, "k"_a, "v"_a, "out"_a.noconvert(),
        "lse"_a.noconvert().none() = nb::none(), "timestep"_a = 0.0, "block_m"_a = 128,
        "block_n"_a = 128, "stats"_a = true, "skip_stats"_a.noconvert().none() = nb::none(),
        "checked"_a = false, "stream"_a = 0);
  m.def("merge_states", &py_merge_states, "out_a"_a, "lse_a"_a, "out_b"_a, "lse_b"_a,
        "out"_a.noconvert(), "lse"_a.noconvert().none() = nb::none(), "checked"_a = false,
        "stream"_a = 0);
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
      .def_static("from_json", &attnkit::AttentionConfig::from_json, "text"_a,
                  "Parses and validates JSON text; raises Error naming the key path.")
      .def_static("from_file", &attnkit::AttentionConfig::from_file, "path"_a,
                  "Parses and validates a JSON file; raises Error naming the key path.")
      .def(
          "resolve",
          [](const attnkit::AttentionConfig& c, const std::string& role) {
            return role_to_dict(c.resolve(role));
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
}
