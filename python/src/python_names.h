// The C++ messages in the Python arguments' words. The C++ validation names C++ fields
// (cu_seqlens_kv, spec.logit_softcap, kv_cache.num_blocks); the Python functions spell them
// differently (cu_seqlens_k, softcap, k.shape[0]). The binding rewrites every attnkit::Error that
// a Python call raises through one table per function, so the C++ messages stay in C++ names and
// the Python user reads the argument they passed.
#pragma once

#include <algorithm>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace attnkit::python {

struct Rename {
  std::string_view cpp;
  std::string_view python;
};

// The Python entry point a message comes from: which table renames it.
enum class PyFunction {
  kPrefill,       // packed k, v
  kPrefillPaged,  // kv_cache=KvView
  kDecode,        // k_cache / v_cache arrays (or a KvView) with seq_lens, block_table, ...
  kAppendKv,
  kForward,
  kDense,
  kMergeStates,
  kDecodeWorkspace,
  kKvCache,
  kRingPrefill,    // attnkit.cp.ring_prefill: q, k, v [local tokens, H, D]
  kShardedDecode,  // attnkit.cp.sharded_decode: decode's arguments
  kCommunicator,   // attnkit.cp's communicator factories
  kOther,          // names that are already the Python ones
};

namespace detail {

// AttentionSpec fields, set from the keyword arguments of every function.
inline constexpr Rename kSpecRenames[] = {
    {"spec.softmax_scale", "softmax_scale"},
    {"spec.mask.window", "window"},
    {"spec.mask.sink_tokens", "sink_tokens"},
    {"spec.mask.kind", "causal"},
    {"spec.mask sliding_window", "a sliding window (window=)"},
    {"spec.mask", "window"},
    {"spec.alibi_slopes", "alibi"},
    {"spec.alibi", "alibi"},
    {"spec.logit_softcap", "softcap"},
    {"spec.backend", "backend"},
    {"spec.rope.style", "rope"},
    {"spec.rope.rotary_dim", "rotary_dim"},
    {"spec.rope.base", "rope_base"},
    {"spec.rope.scaling", "rope_scaling"},
    {"spec.rope.factor", "rope_factor"},
    {"spec.rope.original_max_position", "original_max_position"},
    {"spec.rope", "low_freq_factor, high_freq_factor"},  // the llama3 factors' message
    {"spec.skip_softmax.threshold", "skip_softmax[\"threshold\"]"},
    {"spec.skip_softmax.target_sparsity", "skip_softmax[\"target_sparsity\"]"},
    {"spec.skip_softmax.disabled_until_timestep", "skip_softmax[\"disabled_until_timestep\"]"},
    {"spec.skip_softmax", "skip_softmax"},
    {"spec.quant.dtype_qk", "quant[\"dtype_qk\"]"},
    {"spec.quant", "quant"},
};

// KvCacheView fields as a KvView (k, v [num_blocks, Hkv, T, D], seq_lens, block_table, k_scale,
// v_scale, window_slots, sink_tokens) spells them; the fields of the same name need no entry.
inline constexpr Rename kKvViewRenames[] = {
    {"kv_cache.dtype", "kv_cache.k"},
    {"kv_cache.device", "kv_cache.k"},
    {"kv_cache.k_base", "kv_cache.k"},
    {"kv_cache.v_base", "kv_cache.v"},
    {"kv_cache.num_blocks", "kv_cache.k.shape[0]"},
    {"kv_cache.num_kv_heads", "kv_cache.k.shape[1]"},
    {"kv_cache.tokens_per_block", "kv_cache.k.shape[2]"},
    {"kv_cache.head_dim", "kv_cache.k.shape[3]"},
    {"kv_cache.block_stride_bytes", "kv_cache.k.strides[0]"},
};

// decode() takes the cache as separate arguments: k_cache, v_cache, seq_lens, block_table, ...
inline constexpr Rename kDecodeCacheRenames[] = {
    {"kv_cache.dtype", "k_cache"},
    {"kv_cache.device", "k_cache"},
    {"kv_cache.k_base", "k_cache"},
    {"kv_cache.v_base", "v_cache"},
    {"kv_cache.num_blocks", "k_cache.shape[0]"},
    {"kv_cache.num_kv_heads", "k_cache.shape[1]"},
    {"kv_cache.tokens_per_block", "k_cache.shape[2]"},
    {"kv_cache.head_dim", "k_cache.shape[3]"},
    {"kv_cache.block_stride_bytes", "k_cache.strides[0]"},
    {"kv_cache.k", "k_cache"},
    {"kv_cache.v", "v_cache"},
    {"kv_cache.", ""},  // kv_cache.seq_lens -> seq_lens, kv_cache.block_table -> block_table, ...
    {"kv_cache", "k_cache"},
};

// An NHD cache's arrays are [num_blocks, T, Hkv, D]: these come first in its tables (the first
// match of equal length wins), for a KvView and for decode()'s k_cache / v_cache.
inline constexpr Rename kKvViewNhdRenames[] = {
    {"kv_cache.num_kv_heads", "kv_cache.k.shape[2]"},
    {"kv_cache.tokens_per_block", "kv_cache.k.shape[1]"},
    {"spec.num_kv_heads", "kv_cache.k.shape[2]"},
};
inline constexpr Rename kDecodeCacheNhdRenames[] = {
    {"kv_cache.num_kv_heads", "k_cache.shape[2]"},
    {"kv_cache.tokens_per_block", "k_cache.shape[1]"},
    {"spec.num_kv_heads", "k_cache.shape[2]"},
};

inline constexpr Rename kPrefillRenames[] = {
    {"cu_seqlens_kv", "cu_seqlens_k"},  {"max_seqlen_kv", "max_seqlen_k"},
    {"spec.num_q_heads", "q.shape[1]"}, {"spec.num_kv_heads", "k.shape[1]"},
    {"spec.head_dim", "q.shape[2]"},    {"num_q_heads", "q.shape[1]"},
};
inline constexpr Rename kPrefillPagedRenames[] = {
    {"spec.num_q_heads", "q.shape[1]"},
    {"spec.num_kv_heads", "kv_cache.k.shape[1]"},
    {"spec.head_dim", "q.shape[2]"},
    {"num_q_heads", "q.shape[1]"},
};
inline constexpr Rename kDecodeRenames[] = {
    {"spec.num_q_heads", "q.shape[1]"},
    {"spec.num_kv_heads", "k_cache.shape[1]"},
    {"spec.head_dim", "q.shape[2]"},
    {"num_q_heads", "q.shape[1]"},
};
// append_kv / forward: the query heads are num_q_heads (or what qkv's width leaves).
inline constexpr Rename kQkvRenames[] = {
    {"spec.num_q_heads", "num_q_heads"},
    {"spec.num_kv_heads", "kv_cache.k.shape[1]"},
    {"spec.head_dim", "kv_cache.k.shape[3]"},
};
inline constexpr Rename kDenseRenames[] = {
    {"spec.num_q_heads", "q.shape[2]"},
    {"spec.num_kv_heads", "k.shape[2]"},
    {"spec.head_dim", "q.shape[3]"},
    {"num_q_heads", "q.shape[2]"},
};
inline constexpr Rename kDecodeWorkspaceRenames[] = {
    {"spec.num_q_heads", "num_q_heads"},
    {"spec.num_kv_heads", "num_kv_heads"},
    {"spec.head_dim", "head_dim"},
};
inline constexpr Rename kRingPrefillRenames[] = {
    {"spec.num_q_heads", "q.shape[1]"},
    {"spec.num_kv_heads", "k.shape[1]"},
    {"spec.head_dim", "q.shape[2]"},
    {"num_q_heads", "q.shape[1]"},
};
inline constexpr Rename kCommunicatorRenames[] = {
    {"make_nccl_communicator", "nccl_communicator"},
    {"make_in_process_group", "in_process_group"},
    {"timeout_seconds", "timeout"},
};
// KvCache(...) takes the KvCacheManagerConfig fields as keyword arguments of the same names.
inline constexpr Rename kKvCacheRenames[] = {
    {"KvCacheManagerConfig.", ""},
    {"KvCacheManagerConfig", "KvCache"},
    {"KvCacheManager::", "KvCache."},
};

inline bool is_identifier_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

// Longest C++ name first, so that spec.mask.window wins over spec.mask.
inline std::vector<Rename> sorted(std::initializer_list<std::pair<const Rename*, size_t>> parts) {
  std::vector<Rename> all;
  for (const auto& [begin, count] : parts) all.insert(all.end(), begin, begin + count);
  std::stable_sort(all.begin(), all.end(),
                   [](const Rename& a, const Rename& b) { return a.cpp.size() > b.cpp.size(); });
  return all;
}

template <size_t N>
std::pair<const Rename*, size_t> part(const Rename (&table)[N]) {
  return {table, N};
}

}  // namespace detail

// The renames of one Python function, longest C++ name first; nhd: the call's cache is NHD.
inline const std::vector<Rename>& renames_of(PyFunction function, bool nhd = false) {
  using namespace detail;
  static const std::vector<Rename> nhd_tables[] = {
      sorted({part(kKvViewNhdRenames), part(kSpecRenames), part(kKvViewRenames),
              part(kPrefillPagedRenames)}),
      sorted({part(kDecodeCacheNhdRenames), part(kSpecRenames), part(kDecodeCacheRenames),
              part(kDecodeRenames)}),
      sorted(
          {part(kKvViewNhdRenames), part(kSpecRenames), part(kKvViewRenames), part(kQkvRenames)}),
  };
  if (nhd) {
    switch (function) {
      case PyFunction::kPrefillPaged:
        return nhd_tables[0];
      case PyFunction::kDecode:
        return nhd_tables[1];
      case PyFunction::kAppendKv:
      case PyFunction::kForward:
        return nhd_tables[2];
      default:
        break;
    }
  }
  static const std::vector<Rename> tables[] = {
      sorted({part(kSpecRenames), part(kKvViewRenames), part(kPrefillRenames)}),
      sorted({part(kSpecRenames), part(kKvViewRenames), part(kPrefillPagedRenames)}),
      sorted({part(kSpecRenames), part(kDecodeCacheRenames), part(kDecodeRenames)}),
      sorted({part(kSpecRenames), part(kKvViewRenames), part(kQkvRenames)}),
      sorted({part(kSpecRenames), part(kKvViewRenames), part(kQkvRenames)}),
      sorted({part(kSpecRenames), part(kDenseRenames)}),
      sorted({}),
      sorted({part(kSpecRenames), part(kDecodeWorkspaceRenames)}),
      sorted({part(kKvCacheRenames)}),
      sorted({part(kSpecRenames), part(kRingPrefillRenames)}),
      sorted({part(kSpecRenames), part(kDecodeCacheRenames), part(kDecodeRenames)}),
      sorted({part(kCommunicatorRenames)}),
      sorted({}),
  };
  return tables[static_cast<int>(function)];
}

// `message` with every C++ name of `renames` replaced by its Python name. A name matches where it
// starts an identifier path (not after a letter, digit, '_' or '.') and, unless it ends in
// punctuation itself ("kv_cache."), where the identifier ends.
inline std::string to_python_names(std::string_view message, const std::vector<Rename>& renames) {
  std::string out;
  out.reserve(message.size());
  size_t i = 0;
  while (i < message.size()) {
    const bool at_start =
        i == 0 || !(detail::is_identifier_char(message[i - 1]) || message[i - 1] == '.');
    const Rename* match = nullptr;
    if (at_start) {
      for (const Rename& r : renames) {
        if (message.substr(i, r.cpp.size()) != r.cpp) continue;
        const size_t end = i + r.cpp.size();
        const bool open_ended = !detail::is_identifier_char(r.cpp.back());
        if (open_ended || end == message.size() || !detail::is_identifier_char(message[end])) {
          match = &r;
          break;
        }
      }
    }
    if (match != nullptr) {
      out += match->python;
      i += match->cpp.size();
    } else {
      out += message[i++];
    }
  }
  return out;
}

// The function whose table renames a message that names its operation first ("decode: ...", as
// the device faults that check_device_errors() reports do; "KvCacheManager...").
inline PyFunction function_of_message(std::string_view message, PyFunction fallback) {
  static constexpr std::pair<std::string_view, PyFunction> kOps[] = {
      {"prefill: ", PyFunction::kPrefill},
      {"decode: ", PyFunction::kDecode},
      {"append_kv: ", PyFunction::kAppendKv},
      {"forward: ", PyFunction::kForward},
      {"dense: ", PyFunction::kDense},
      {"merge_states: ", PyFunction::kMergeStates},
      {"KvCacheManager", PyFunction::kKvCache},
      {"ring_prefill: ", PyFunction::kRingPrefill},
      {"sharded_decode: ", PyFunction::kShardedDecode},
  };
  for (const auto& [prefix, function] : kOps) {
    if (message.substr(0, prefix.size()) == prefix) return function;
  }
  return fallback;
}

}  // namespace attnkit::python
