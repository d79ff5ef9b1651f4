// libFuzzer target: the validation of every entry point, run on the reference backend. An input
// builds one call (packed or paged prefill, decode, append_kv, forward, dense, merge_states) that
// starts valid and then takes a few mutations: extents, strides, ndim, dtypes, devices, data
// pointers, lengths, cu_seqlens, positions, block-table and indirection entries, spec and args
// fields. The call must either throw attnkit::Error with every buffer unchanged, or succeed with
// its inputs unchanged and every output element written, finite and within what attention can
// produce (a convex combination of V). Each tensor lives in a buffer of exactly the bytes its
// view spans, so a read or write outside it is an AddressSanitizer report.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <vector>

#include "attnkit/attnkit.h"
#include "core/element.h"

namespace {

using namespace attnkit;

constexpr int64_t kMaxElements = 1 << 15;  // larger tensors are given without data
constexpr int64_t kMaxBytes = 1 << 20;

// What the failing call was (set by Call::run, printed by fuzz_fail).
std::function<void()> g_describe_call;

[[noreturn]] void fuzz_fail(const char* what) {
  std::fprintf(stderr, "entry_fuzzer: %s\n", what);
  if (g_describe_call) g_describe_call();
  std::abort();
}

// Deterministic values from one seed of the input (the data bytes need not come from it).
struct Random {
  uint64_t state;
  uint64_t next() {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
  }
  float uniform() { return static_cast<float>(next() >> 40) / static_cast<float>(1 << 24); }
};

enum class Role { kData, kMeta, kOutput };

struct Slot {
  TensorView* view = nullptr;
  Role role = Role::kData;
  std::vector<uint8_t> storage;
  bool misalign = false;
  const char* name = "";
  DType filled_as = DType::kF32;
};
// Buffers hold valid values of the dtype they were filled for; a view whose dtype was mutated
// gets its buffer refilled (the old bytes could read as NaN in the new dtype).

struct PoolSlot {
  KvCacheView* cache = nullptr;
  int64_t v_offset = 0;
  std::vector<uint8_t> storage;
  bool misalign = false;
  DType filled_as = DType::kBF16;
};

bool is_float(DType d) {
  return d == DType::kF32 || d == DType::kF16 || d == DType::kBF16 || d == DType::kFp8E4M3;
}
bool known_dtype(DType d) { return static_cast<uint8_t>(d) <= static_cast<uint8_t>(DType::kInt64); }

// Element of `dtype` at `p`, which may be unaligned.
double value_at(const uint8_t* p, DType dtype) {
  alignas(8) uint8_t bytes[8];
  std::memcpy(bytes, p, dtype_size(dtype));
  return detail::load_as_float(bytes, dtype, 0);
}

// A value of `dtype` in [-1, 1] (float types) or a random int8 code: never NaN. `p` may be
// unaligned (the buffers of misaligned views).
void fill_value(uint8_t* p, DType dtype, Random& rng) {
  switch (dtype) {
    case DType::kFp8E4M3: {
      uint8_t code = static_cast<uint8_t>(rng.next());
      if ((code & 0x7f) == 0x7f) code &= 0xfe;  // 0x7f / 0xff are NaN
      *p = code;
      return;
    }
    case DType::kInt8:
      *p = static_cast<uint8_t>(rng.next());
      return;
    case DType::kF32:
    case DType::kF16:
    case DType::kBF16: {
      alignas(8) uint8_t value[8];
      detail::store_from_float(value, dtype, 0, 2.0f * rng.uniform() - 1.0f);
      std::memcpy(p, value, dtype_size(dtype));
      return;
    }
    default:
      for (size_t i = 0; i < dtype_size(dtype); ++i) p[i] = 0;
      return;
  }
}

class Call {
 public:
  explicit Call(FuzzedDataProvider& in) : in_(in), rng_{in.ConsumeIntegral<uint64_t>() | 1} {}

  void run();

 private:
  // ---- building ----
  int32_t pick(int32_t lo, int32_t hi) { return in_.ConsumeIntegralInRange<int32_t>(lo, hi); }
  bool chance(int32_t one_in) { return pick(0, one_in - 1) == 0; }

  Slot& tensor(TensorView& view, DType dtype, std::initializer_list<int64_t> shape, Role role,
               const char* name) {
    view = TensorView(nullptr, dtype, shape);
    slots_.push_back({&view, role, {}, false, name, dtype});
    Slot& slot = slots_.back();
    slot.storage.resize(static_cast<size_t>(view.numel()) * dtype_size(dtype));
    fill(slot, 0);
    view.data = slot.storage.empty() ? nullptr : slot.storage.data();
    return slot;
  }
  // An int32 metadata tensor with the given values.
  void meta(TensorView& view, const std::vector<int32_t>& values,
            std::initializer_list<int64_t> shape, const char* name) {
    Slot& slot = tensor(view, DType::kInt32, shape, Role::kMeta, name);
    if (!values.empty()) std::memcpy(slot.storage.data(), values.data(), values.size() * 4);
  }
  void fill(Slot& slot, size_t from) {
    const DType dtype = slot.view->dtype;
    const size_t elt = known_dtype(dtype) ? dtype_size(dtype) : 1;
    for (size_t i = from; i + elt <= slot.storage.size(); i += elt) {
      if (slot.role == Role::kMeta) {
        int32_t value = static_cast<int32_t>(rng_.next() % 8);
        std::memcpy(&slot.storage[i], &value, std::min<size_t>(elt, 4));
      } else {
        fill_value(&slot.storage[i], dtype, rng_);
      }
    }
  }

  AttentionSpec make_spec(bool dense_call);
  // A KV cache of `rows` rows holding lens[r] tokens (seq_lens given when `with_lens`); cyclic
  // only with a sliding-window spec. Each row has its own blocks (writes never collide).
  void make_cache(KvCacheView& cache, const AttentionSpec& spec, DType q_dtype, int32_t rows,
                  bool allow_cyclic, bool with_lens, int32_t min_capacity);
  std::vector<int32_t> pick_lens(int32_t rows, int64_t capacity, bool cyclic, int32_t min_len);

  void build_prefill(bool paged);
  void build_decode();
  void build_append_kv();
  void build_forward();
  void build_dense();
  void build_merge_states();

  // ---- mutating ----
  int64_t interesting(int64_t old);
  void mutate_once();
  void rehome(Slot& slot);
  void rehome_pool();

  // ---- checking ----
  double max_abs(const TensorView& view) const;
  double pool_v_max() const;
  void check_outputs(double bound, const std::vector<const TensorView*>& lse_views) const;
  void invoke();
  void describe() const;

  FuzzedDataProvider& in_;
  Random rng_;
  std::deque<Slot> slots_;
  PoolSlot pool_;
  std::vector<int32_t*> ints_;
  std::vector<double*> doubles_;
  std::vector<uint8_t*> enums_;
  std::vector<bool*> bools_;

  int op_ = 0;
  bool checked_ = false;
  AttentionSpec spec_;
  KvCacheView cache_;
  PrefillArgs prefill_;
  DecodeArgs decode_;
  AppendKvArgs append_;
  ForwardArgs forward_;
  DenseArgs dense_;
  MergeStatesArgs merge_;
  DenseStats stats_;
};

AttentionSpec Call::make_spec(bool dense_call) {
  AttentionSpec spec;
  spec.num_kv_heads = pick(1, 2);
  spec.num_q_heads = spec.num_kv_heads * pick(1, 3);
  spec.head_dim = 8 * pick(1, 3);
  spec.softmax_scale = chance(4) ? 0.3 : 0.0;
  if (dense_call) {
    spec.mask.kind = MaskKind::kNone;
    if (chance(3)) {
      SkipSoftmaxSpec skip;
      if (chance(2)) {
        skip.threshold = rng_.uniform();
      } else {
        skip.target_sparsity = rng_.uniform();
        skip.calibration_a = 0.5 + rng_.uniform();
        skip.calibration_b = rng_.uniform() * 4 - 2;
      }
      skip.disabled_until_timestep = chance(2) ? 0.0 : rng_.uniform();
      spec.skip_softmax = skip;
    }
    if (chance(3)) {
      SageQuantSpec quant;
      quant.dtype_qk = chance(2) ? DType::kInt8 : DType::kFp8E4M3;
      const int32_t sizes[] = {1, 4, 16};
      quant.q_block_size = sizes[pick(0, 2)];
      quant.k_block_size = sizes[pick(0, 2)];
      spec.quant = quant;
    }
  } else {
    const int32_t mask = pick(0, 2);
    spec.mask.kind = static_cast<MaskKind>(mask);
    if (spec.mask.kind == MaskKind::kSlidingWindow) {
      spec.mask.window = pick(1, 6);
      spec.mask.sink_tokens = pick(0, 2);
    }
    spec.alibi = chance(6);
    spec.logit_softcap = chance(6) ? 5.0 : 0.0;
    if (chance(3)) {
      spec.rope.style = chance(2) ? RopeStyle::kGptNeox : RopeStyle::kGptJ;
      spec.rope.rotary_dim = chance(2) ? 0 : spec.head_dim / 2;
      spec.rope.scaling = static_cast<RopeScaling>(pick(0, 2));
      spec.rope.factor = 2.0;
    }
  }
  return spec;
}

std::vector<int32_t> Call::pick_lens(int32_t rows, int64_t capacity, bool cyclic, int32_t min_len) {
  std::vector<int32_t> lens(rows);
  for (int32_t r = 0; r < rows; ++r) {
    int64_t len = pick(min_len, static_cast<int32_t>(std::max<int64_t>(min_len, capacity)));
    if (cyclic && chance(3))
      len = chance(2) ? pick(0, 100000) : std::numeric_limits<int32_t>::max();
    lens[r] = static_cast<int32_t>(len);
  }
  return lens;
}

void Call::make_cache(KvCacheView& c, const AttentionSpec& spec, DType q_dtype, int32_t rows,
                      bool allow_cyclic, bool with_lens, int32_t min_capacity) {
  const DType dtypes[] = {DType::kBF16, DType::kF16, DType::kFp8E4M3, DType::kInt8};
  c.dtype = dtypes[pick(0, 3)];
  const bool quantized = c.dtype == DType::kFp8E4M3 || c.dtype == DType::kInt8;
  if (!quantized && q_dtype != DType::kF32) c.dtype = q_dtype;
  c.num_kv_heads = spec.num_kv_heads;
  c.head_dim = spec.head_dim;
  c.paged = !chance(4);
  c.layout = chance(2) ? KvCacheLayout::kNHD : KvCacheLayout::kHND;  // the same bytes either way
  const bool cyclic = allow_cyclic && spec.mask.kind == MaskKind::kSlidingWindow && chance(2);
  int32_t max_blocks = 1;
  if (c.paged) {
    c.tokens_per_block = chance(2) ? 8 : 16;
    const int32_t t = c.tokens_per_block;
    if (cyclic) {
      c.sink_tokens = spec.mask.sink_tokens;
      c.window_slots = cyclic_window_slots(spec.mask.window, t);
      max_blocks = (c.sink_tokens + c.window_slots + t - 1) / t;
    } else {
      max_blocks = std::max(pick(1, 3), (min_capacity + t - 1) / t);
    }
    c.num_blocks = std::max(1, rows * max_blocks + pick(0, 2));
  } else {
    if (cyclic) {
      c.sink_tokens = spec.mask.sink_tokens;
      c.window_slots = spec.mask.window + pick(0, 3);
      c.tokens_per_block = c.sink_tokens + c.window_slots;
    } else {
      c.tokens_per_block = std::max(pick(1, 24), min_capacity);
    }
    c.num_blocks = std::max(1, rows + pick(0, 2));
  }
  const int64_t block_bytes =
      int64_t{c.num_kv_heads} * c.tokens_per_block * c.head_dim * dtype_size(c.dtype);
  // One pool [num_blocks, 2, <block>], sometimes with padding between blocks.
  c.block_stride_bytes = 2 * block_bytes + (chance(4) ? 16 : 0);
  pool_.cache = &c;
  pool_.v_offset = block_bytes;
  pool_.filled_as = c.dtype;
  pool_.storage.resize(
      static_cast<size_t>((c.num_blocks - 1) * c.block_stride_bytes + 2 * block_bytes));
  const size_t elt = dtype_size(c.dtype);
  for (size_t i = 0; i + elt <= pool_.storage.size(); i += elt)
    fill_value(&pool_.storage[i], c.dtype, rng_);
  c.k_base = pool_.storage.data();
  c.v_base = pool_.storage.data() + pool_.v_offset;

  const int64_t capacity = int64_t{max_blocks} * c.tokens_per_block;
  if (c.paged) {
    std::vector<int32_t> ids(c.num_blocks);
    for (int32_t i = 0; i < c.num_blocks; ++i) ids[i] = i;
    for (int32_t i = c.num_blocks - 1; i > 0; --i) std::swap(ids[i], ids[rng_.next() % (i + 1)]);
    std::vector<int32_t> table(static_cast<size_t>(rows) * max_blocks);
    for (size_t i = 0; i < table.size(); ++i) table[i] = ids[i];
    meta(c.block_table, table, {rows, max_blocks}, "kv_cache.block_table");
  }
  if (with_lens) {
    meta(c.seq_lens, pick_lens(rows, capacity, cyclic, 0), {rows}, "kv_cache.seq_lens");
  }
  if (quantized || chance(4)) {
    const bool per_head = chance(2);
    const int64_t n = per_head ? c.num_kv_heads : 1;
    for (TensorView* scale : {&c.k_scale, &c.v_scale}) {
      Slot& slot = tensor(*scale, DType::kF32, {n}, Role::kData, "kv_cache scale");
      for (int64_t i = 0; i < n; ++i) {
        const float value = quantized ? 0.01f + 0.05f * rng_.uniform() : 0.5f + rng_.uniform();
        std::memcpy(&slot.storage[i * 4], &value, 4);
      }
    }
  }
  for (int32_t* p : {&c.num_blocks, &c.num_kv_heads, &c.tokens_per_block, &c.head_dim,
                     &c.window_slots, &c.sink_tokens}) {
    ints_.push_back(p);
  }
  enums_.push_back(reinterpret_cast<uint8_t*>(&c.dtype));
  bools_.push_back(&c.paged);
}

DType q_dtype_of(int32_t choice) {
  const DType dtypes[] = {DType::kF32, DType::kF16, DType::kBF16};
  return dtypes[choice];
}

void Call::build_prefill(bool paged) {
  spec_ = make_spec(false);
  const DType dtype = q_dtype_of(pick(0, 2));
  const int32_t hq = spec_.num_q_heads, hkv = spec_.num_kv_heads, d = spec_.head_dim;
  const int32_t batch = pick(0, 3);
  std::vector<int32_t> cu_q{0}, cu_kv{0};
  if (paged) {
    make_cache(cache_, spec_, dtype, batch, true, true, 4);
    // Queries: at most the row's tokens, and a cyclic chunk must leave its window in place.
    std::vector<int32_t> lens(batch);
    if (batch > 0) std::memcpy(lens.data(), cache_.seq_lens.data, batch * 4);
    for (int32_t i = 0; i < batch; ++i) {
      int32_t n = pick(0, std::min(lens[i], 4));
      if (cache_.window_slots > 0)
        n = std::min(n, std::max(1, cache_.window_slots - spec_.mask.window + 1));
      cu_q.push_back(cu_q.back() + n);
    }
    prefill_.kv_cache = &cache_;
  } else {
    for (int32_t i = 0; i < batch; ++i) {
      const int32_t n_kv = pick(0, 8);
      const int32_t n_q = spec_.mask.kind == MaskKind::kNone ? pick(0, 6) : pick(0, n_kv);
      cu_q.push_back(cu_q.back() + n_q);
      cu_kv.push_back(cu_kv.back() + n_kv);
    }
    tensor(prefill_.k, dtype, {cu_kv.back(), hkv, d}, Role::kData, "prefill.k");
    tensor(prefill_.v, dtype, {cu_kv.back(), hkv, d}, Role::kData, "prefill.v");
    meta(prefill_.cu_seqlens_kv, cu_kv, {batch + 1}, "prefill.cu_seqlens_kv");
  }
  tensor(prefill_.q, dtype, {cu_q.back(), hq, d}, Role::kData, "prefill.q");
  tensor(prefill_.out, dtype, {cu_q.back(), hq, d}, Role::kOutput, "prefill.out");
  if (chance(2)) tensor(prefill_.lse, DType::kF32, {cu_q.back(), hq}, Role::kOutput, "prefill.lse");
  meta(prefill_.cu_seqlens_q, cu_q, {batch + 1}, "prefill.cu_seqlens_q");
  ints_.push_back(&prefill_.max_seqlen_q);
  ints_.push_back(&prefill_.max_seqlen_kv);
}

void Call::build_decode() {
  spec_ = make_spec(false);
  const DType dtype = q_dtype_of(pick(0, 2));
  const int32_t hq = spec_.num_q_heads, d = spec_.head_dim;
  const int32_t beam = chance(3) ? 2 : 1;
  const int32_t rows = beam * pick(0, 3);
  make_cache(decode_.kv_cache, spec_, dtype, rows, beam == 1, true, 1);
  // The beams of a sequence share their length.
  auto* lens = static_cast<int32_t*>(decode_.kv_cache.seq_lens.data);
  int32_t longest = 0;
  for (int32_t r = 0; r < rows; ++r) {
    lens[r] = lens[r - r % beam];
    longest = std::max(longest, lens[r]);
  }
  decode_.beam_width = beam;
  if (beam > 1 && chance(2)) {
    const int32_t max_seq = longest + pick(0, 2);
    std::vector<int32_t> ind(static_cast<size_t>(rows) * max_seq);
    for (int32_t& x : ind) x = static_cast<int32_t>(rng_.next() % beam);
    meta(decode_.cache_indirection, ind, {rows / beam, beam, max_seq}, "decode.cache_indirection");
  }
  tensor(decode_.q, dtype, {rows, hq, d}, Role::kData, "decode.q");
  tensor(decode_.out, dtype, {rows, hq, d}, Role::kOutput, "decode.out");
  if (chance(2)) tensor(decode_.lse, DType::kF32, {rows, hq}, Role::kOutput, "decode.lse");
  decode_.num_splits = pick(0, 3);
  decode_.max_seq_len = chance(2) ? 0 : longest;
  for (int32_t* p : {&decode_.beam_width, &decode_.num_splits, &decode_.max_seq_len}) {
    ints_.push_back(p);
  }
  bools_.push_back(&decode_.deterministic);
}

void Call::build_append_kv() {
  spec_ = make_spec(false);
  const DType dtype = q_dtype_of(pick(0, 2));
  const int32_t hq = spec_.num_q_heads, hkv = spec_.num_kv_heads, d = spec_.head_dim;
  const int32_t rows = pick(1, 3);
  const int32_t tokens = pick(0, 6);
  KvCacheView& cache = append_.kv_cache;
  make_cache(cache, spec_, dtype, rows, true, false, tokens);
  const int64_t capacity = cache.row_capacity();
  // Consecutive positions per row: distinct slots in the linear and the cyclic layout.
  std::vector<int32_t> next(rows), positions(tokens), row_of(tokens);
  for (int32_t r = 0; r < rows; ++r) {
    next[r] =
        cache.window_slots > 0 ? pick(0, 1000) : pick(0, static_cast<int32_t>(capacity - tokens));
  }
  for (int32_t t = 0; t < tokens; ++t) {
    row_of[t] = pick(0, rows - 1);
    positions[t] = next[row_of[t]]++;
  }
  meta(append_.positions, positions, {tokens}, "append.positions");
  meta(append_.row_of_token, row_of, {tokens}, "append.row_of_token");
  const int64_t width = int64_t{hq + 2 * hkv} * d;
  if (chance(3)) {
    tensor(append_.q, dtype, {tokens, hq, d}, Role::kData, "append.q");
    tensor(append_.k, dtype, {tokens, hkv, d}, Role::kData, "append.k");
    tensor(append_.v, dtype, {tokens, hkv, d}, Role::kData, "append.v");
  } else {
    tensor(append_.qkv, dtype, {tokens, width}, Role::kData, "append.qkv");
  }
  if (chance(3)) tensor(append_.qkv_bias, dtype, {width}, Role::kData, "append.qkv_bias");
  tensor(append_.q_out, dtype, {tokens, hq, d}, Role::kOutput, "append.q_out");
}

void Call::build_forward() {
  spec_ = make_spec(false);
  if (spec_.mask.kind == MaskKind::kNone) spec_.mask.kind = MaskKind::kCausal;
  const DType dtype = q_dtype_of(pick(0, 2));
  const int32_t hq = spec_.num_q_heads, hkv = spec_.num_kv_heads, d = spec_.head_dim;
  const int32_t num_context = pick(0, 2);
  const int32_t num_generation = pick(num_context == 0 ? 1 : 0, 2);
  const int32_t beam = chance(3) ? 2 : 1;
  const int32_t rows = num_context + num_generation * beam;
  KvCacheView& cache = forward_.kv_cache;
  make_cache(cache, spec_, dtype, rows, beam == 1, false, 5);
  const int64_t capacity = cache.row_capacity();
  const bool cyclic = cache.window_slots > 0;
  std::vector<int32_t> cu{0}, past, lens;
  for (int32_t i = 0; i < num_context; ++i) {
    int32_t n = pick(1, 4);
    if (cyclic) n = std::min(n, std::max(1, cache.window_slots - spec_.mask.window + 1));
    const int32_t p = cyclic ? pick(0, 1000) : pick(0, static_cast<int32_t>(capacity - n));
    cu.push_back(cu.back() + n);
    past.push_back(p);
    lens.push_back(p + n);
  }
  int32_t longest_generation = 0;
  for (int32_t i = 0; i < num_generation; ++i) {
    const int32_t p = cyclic ? pick(0, 1000) : pick(0, static_cast<int32_t>(capacity - 1));
    cu.push_back(cu.back() + beam);
    past.push_back(p);
    for (int32_t b = 0; b < beam; ++b) lens.push_back(p + 1);
    longest_generation = std::max(longest_generation, p + 1);
  }
  const int32_t requests = num_context + num_generation;
  meta(forward_.cu_seqlens_q, cu, {requests + 1}, "forward.cu_seqlens_q");
  meta(forward_.past_lens, past, {requests}, "forward.past_lens");
  meta(cache.seq_lens, lens, {rows}, "kv_cache.seq_lens");
  forward_.num_context = num_context;
  forward_.beam_width = beam;
  if (beam > 1 && num_generation > 0 && chance(2)) {
    const int32_t max_seq = longest_generation + pick(0, 2);
    std::vector<int32_t> ind(static_cast<size_t>(num_generation) * beam * max_seq);
    for (int32_t& x : ind) x = static_cast<int32_t>(rng_.next() % beam);
    meta(forward_.cache_indirection, ind, {num_generation, beam, max_seq},
         "forward.cache_indirection");
  }
  const int64_t width = int64_t{hq + 2 * hkv} * d;
  tensor(forward_.qkv, dtype, {cu.back(), width}, Role::kData, "forward.qkv");
  if (chance(3)) tensor(forward_.qkv_bias, dtype, {width}, Role::kData, "forward.qkv_bias");
  tensor(forward_.out, dtype, {cu.back(), hq, d}, Role::kOutput, "forward.out");
  if (chance(2)) tensor(forward_.lse, DType::kF32, {cu.back(), hq}, Role::kOutput, "forward.lse");
  forward_.num_splits = pick(0, 2);
  for (int32_t* p : {&forward_.num_context, &forward_.beam_width, &forward_.num_splits}) {
    ints_.push_back(p);
  }
}

void Call::build_dense() {
  spec_ = make_spec(true);
  const DType dtype = q_dtype_of(pick(0, 2));
  const int32_t hq = spec_.num_q_heads, hkv = spec_.num_kv_heads, d = spec_.head_dim;
  const int64_t b = pick(0, 2), sq = pick(0, 5), skv = pick(0, 6);
  tensor(dense_.q, dtype, {b, sq, hq, d}, Role::kData, "dense.q");
  tensor(dense_.k, dtype, {b, skv, hkv, d}, Role::kData, "dense.k");
  tensor(dense_.v, dtype, {b, skv, hkv, d}, Role::kData, "dense.v");
  tensor(dense_.out, dtype, {b, sq, hq, d}, Role::kOutput, "dense.out");
  if (chance(2)) tensor(dense_.lse, DType::kF32, {b, sq, hq}, Role::kOutput, "dense.lse");
  dense_.timestep = rng_.uniform();
  dense_.block_m = chance(2) ? 16 : 32;
  dense_.block_n = chance(2) ? 16 : 32;
  if (chance(2)) dense_.stats = &stats_;
  ints_.push_back(&dense_.block_m);
  ints_.push_back(&dense_.block_n);
  doubles_.push_back(&dense_.timestep);
  if (spec_.quant) {
    ints_.push_back(&spec_.quant->q_block_size);
    enums_.push_back(reinterpret_cast<uint8_t*>(&spec_.quant->dtype_qk));
  }
  if (spec_.skip_softmax && spec_.skip_softmax->threshold) {
    doubles_.push_back(&*spec_.skip_softmax->threshold);
  }
}

void Call::build_merge_states() {
  const DType dtypes[] = {DType::kF32, DType::kF16, DType::kBF16};
  const DType dtype = dtypes[pick(0, 2)];
  const int64_t n = pick(0, 4), h = pick(1, 3), d = pick(1, 16);
  tensor(merge_.out_a, dtype, {n, h, d}, Role::kData, "merge.out_a");
  tensor(merge_.out_b, dtype, {n, h, d}, Role::kData, "merge.out_b");
  for (TensorView* lse : {&merge_.lse_a, &merge_.lse_b}) {
    Slot& slot = tensor(*lse, DType::kF32, {n, h}, Role::kData, "lse_a / lse_b");
    for (int64_t i = 0; i < n * h; ++i) {
      const float value = chance(4) ? -INFINITY : 10.0f * rng_.uniform() - 5.0f;
      std::memcpy(&slot.storage[i * 4], &value, 4);
    }
  }
  tensor(merge_.out, dtype, {n, h, d}, Role::kOutput, "merge.out");
  if (chance(2)) tensor(merge_.lse, DType::kF32, {n, h}, Role::kOutput, "merge.lse");
}

// Wrapping arithmetic: the old value may be anything.
int64_t wrap_add(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b));
}

int64_t Call::interesting(int64_t old) {
  switch (pick(0, 15)) {
    case 0:
      return 0;
    case 1:
      return 1;
    case 2:
      return -1;
    case 3:
      return wrap_add(old, 1);
    case 4:
      return wrap_add(old, -1);
    case 5:
      return wrap_add(old, old);
    case 6:
      return std::numeric_limits<int32_t>::max();
    case 7:
      return std::numeric_limits<int32_t>::min();
    case 8:
      return int64_t{1} << 31;
    case 9:
      return (int64_t{1} << 32) + 1;
    case 10:
      return std::numeric_limits<int64_t>::max();
    case 11:
      return std::numeric_limits<int64_t>::min();
    case 12:
      return int64_t{1} << 34;
    case 13:
      return pick(0, 64);
    case 14:
      return wrap_add(old, pick(-8, 8));
    default:
      return in_.ConsumeIntegral<int64_t>();
  }
}

void Call::mutate_once() {
  const int32_t what = pick(0, 13);
  if (what <= 5 && !slots_.empty()) {
    Slot& slot = slots_[pick(0, static_cast<int32_t>(slots_.size()) - 1)];
    TensorView& t = *slot.view;
    const int dim = t.ndim > 0 && t.ndim <= TensorView::kMaxDims ? pick(0, t.ndim - 1) : 0;
    switch (what) {
      case 0:
        t.shape[dim] = interesting(t.shape[dim]);
        if (chance(2) && t.ndim > 0 && t.ndim <= TensorView::kMaxDims) {
          int64_t stride = 1;  // row-major again, with wrapping products
          for (int d = t.ndim - 1; d >= 0; --d) {
            t.strides[d] = stride;
            stride = static_cast<int64_t>(static_cast<uint64_t>(stride) *
                                          static_cast<uint64_t>(t.shape[d]));
          }
        }
        break;
      case 1:
        t.strides[dim] = interesting(t.strides[dim]);
        break;
      case 2:
        t.ndim = static_cast<int>(interesting(t.ndim) % 16);
        break;
      case 3:
        t.dtype = static_cast<DType>(pick(0, 8));
        break;
      case 4:
        if (chance(3)) {
          t = TensorView{};
        } else if (chance(2)) {
          t.data = nullptr;
        } else {
          slot.misalign = true;
        }
        break;
      default:
        t.device = chance(2) ? Device::cuda(pick(0, 1)) : Device{DeviceType::kCPU, pick(-1, 1)};
        break;
    }
    return;
  }
  if (what <= 8) {  // a metadata value
    std::vector<Slot*> metas;
    for (Slot& s : slots_) {
      if (s.role == Role::kMeta && s.storage.size() >= 4) metas.push_back(&s);
    }
    if (metas.empty()) return;
    Slot& s = *metas[pick(0, static_cast<int32_t>(metas.size()) - 1)];
    const size_t i = pick(0, static_cast<int32_t>(s.storage.size() / 4) - 1);
    int32_t value;
    std::memcpy(&value, &s.storage[i * 4], 4);
    value = static_cast<int32_t>(interesting(value));
    std::memcpy(&s.storage[i * 4], &value, 4);
    return;
  }
  ints_.insert(ints_.end(), {&spec_.num_q_heads, &spec_.num_kv_heads, &spec_.head_dim,
                             &spec_.mask.window, &spec_.mask.sink_tokens, &spec_.rope.rotary_dim});
  switch (what) {
    case 9:
    case 10: {
      int32_t* p = ints_[pick(0, static_cast<int32_t>(ints_.size()) - 1)];
      *p = static_cast<int32_t>(interesting(*p));
      break;
    }
    case 11: {
      const double values[] = {0.0, -1.0, NAN, INFINITY, -INFINITY, 1e6, 1e-300, 0.5, 2.0, 1.0};
      doubles_.insert(doubles_.end(), {&spec_.softmax_scale, &spec_.logit_softcap, &spec_.rope.base,
                                       &spec_.rope.factor});
      *doubles_[pick(0, static_cast<int32_t>(doubles_.size()) - 1)] = values[pick(0, 9)];
      break;
    }
    case 12: {
      enums_.insert(enums_.end(), {reinterpret_cast<uint8_t*>(&spec_.mask.kind),
                                   reinterpret_cast<uint8_t*>(&spec_.rope.style),
                                   reinterpret_cast<uint8_t*>(&spec_.rope.scaling),
                                   reinterpret_cast<uint8_t*>(&spec_.backend)});
      *enums_[pick(0, static_cast<int32_t>(enums_.size()) - 1)] = static_cast<uint8_t>(pick(0, 8));
      break;
    }
    default:
      if (pool_.cache != nullptr && chance(2)) {
        pool_.cache->block_stride_bytes = interesting(pool_.cache->block_stride_bytes);
      } else if (pool_.cache != nullptr && chance(2)) {
        pool_.misalign = true;
      } else {
        bools_.push_back(&spec_.alibi);
        bool* b = bools_[pick(0, static_cast<int32_t>(bools_.size()) - 1)];
        *b = !*b;
      }
      break;
  }
}

// Gives the view a buffer of exactly the bytes it spans (the old bytes first), or no data when it
// is too large to give. Views that no correct caller could pass keep their old buffer: the
// library must reject them before it reads anything.
void Call::rehome(Slot& slot) {
  TensorView& t = *slot.view;
  if (t.data == nullptr) return;
  if (t.ndim < 0 || t.ndim > TensorView::kMaxDims || !known_dtype(t.dtype)) return;
  // Counts saturate at 2^100: far past anything given, and no __int128 overflow.
  constexpr __int128 kCap = __int128{1} << 100;
  __int128 numel = 1, last = 0;
  bool negative = false;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] < 0) return;
    const auto sat_mul = [&](__int128 a, __int128 b) {  // a, b in [0, kCap]
      return (a != 0 && b > kCap / a) ? kCap : std::min(kCap, a * b);
    };
    numel = sat_mul(numel, t.shape[d]);
    if (t.shape[d] > 1) {
      if (t.strides[d] < 0) {
        negative = true;
      } else {
        last = std::min(kCap, last + sat_mul(t.shape[d] - 1, t.strides[d]));
      }
    }
  }
  if (numel == 0) return;
  if (negative) return;
  const __int128 bytes = (last + 1) * static_cast<__int128>(dtype_size(t.dtype));
  if (bytes > std::numeric_limits<int64_t>::max()) return;
  if (numel > kMaxElements || bytes > kMaxBytes) {
    t.data = nullptr;
    return;
  }
  size_t old = slot.storage.size();
  slot.storage.resize(static_cast<size_t>(bytes) + (slot.misalign ? 1 : 0));
  if (t.dtype != slot.filled_as || slot.misalign) {
    old = slot.misalign ? 1 : 0;  // the elements start at the misaligned byte
    slot.filled_as = t.dtype;
  }
  if (slot.storage.size() > old) fill(slot, old);
  t.data = slot.storage.data() + (slot.misalign ? 1 : 0);
}

void Call::rehome_pool() {
  KvCacheView* c = pool_.cache;
  if (c == nullptr || c->k_base == nullptr) return;
  if (c->num_blocks < 1 || c->tokens_per_block < 1 || c->num_kv_heads < 1 || c->head_dim < 1 ||
      c->block_stride_bytes < 0 || !known_dtype(c->dtype)) {
    return;
  }
  const __int128 block_bytes = __int128{c->num_kv_heads} * c->tokens_per_block * c->head_dim *
                               static_cast<__int128>(dtype_size(c->dtype));
  const __int128 span = static_cast<__int128>(c->num_blocks - 1) * c->block_stride_bytes +
                        pool_.v_offset + block_bytes;
  if (span > std::numeric_limits<int64_t>::max()) return;
  if (span > kMaxBytes) {
    c->k_base = c->v_base = nullptr;
    return;
  }
  size_t old = pool_.storage.size();
  pool_.storage.resize(static_cast<size_t>(span) + (pool_.misalign ? 1 : 0));
  if (c->dtype != pool_.filled_as || pool_.misalign) {
    old = pool_.misalign ? 1 : 0;
    pool_.filled_as = c->dtype;
  }
  const size_t elt = dtype_size(c->dtype);
  for (size_t i = old; i + elt <= pool_.storage.size(); i += elt) {
    fill_value(&pool_.storage[i], c->dtype, rng_);
  }
  uint8_t* base = pool_.storage.data() + (pool_.misalign ? 1 : 0);
  c->k_base = base;
  c->v_base = base + pool_.v_offset;
}

// Visits every element of a view whose extents and strides the call accepted.
void for_each_element(const TensorView& t, const std::function<void(int64_t)>& visit) {
  if (t.data == nullptr || t.ndim < 0 || t.ndim > TensorView::kMaxDims) return;
  int64_t index[TensorView::kMaxDims] = {};
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] <= 0) return;
  }
  while (true) {
    int64_t offset = 0;
    for (int d = 0; d < t.ndim; ++d) offset += index[d] * t.strides[d];
    visit(offset);
    int d = t.ndim - 1;
    while (d >= 0 && ++index[d] == t.shape[d]) index[d--] = 0;
    if (d < 0) return;
  }
}

// The largest |value| in the buffer of `t` (every element the view can reach, and more).
double Call::max_abs(const TensorView& t) const {
  double m = 0.0;
  if (!t.defined() || !is_float(t.dtype)) return m;
  for (const Slot& slot : slots_) {
    if (slot.view != &t) continue;
    const size_t elt = dtype_size(t.dtype);
    for (size_t i = slot.misalign ? 1 : 0; i + elt <= slot.storage.size(); i += elt) {
      m = std::max(m, std::fabs(value_at(&slot.storage[i], t.dtype)));
    }
  }
  return m;
}

// The largest |K or V| the cache can hand a query: every stored value times the largest scale.
double Call::pool_v_max() const {
  const KvCacheView* c = pool_.cache;
  if (c == nullptr || pool_.storage.empty()) return 0.0;
  if (!is_float(c->dtype) && c->dtype != DType::kInt8) return 0.0;  // rejected: nothing is read
  double scale = 1.0;
  for (const TensorView* s : {&c->k_scale, &c->v_scale}) {
    if (s->defined()) scale = std::max(scale, max_abs(*s));
  }
  double m = 0.0;
  const size_t elt = dtype_size(c->dtype);
  for (size_t i = 0; i + elt <= pool_.storage.size(); i += elt) {
    m = std::max(m, std::fabs(value_at(&pool_.storage[i], c->dtype)));
  }
  return m * scale;
}

// On success: every element of each output view written (no poison left), finite (LSE: not NaN,
// not +inf) and at most `bound` in magnitude; the bytes of its buffer outside the view untouched.
void Call::check_outputs(double bound, const std::vector<const TensorView*>& lse_views) const {
  for (const Slot& slot : slots_) {
    if (slot.role != Role::kOutput) continue;
    const TensorView& t = *slot.view;
    if (!t.defined() || t.data == nullptr || !is_float(t.dtype)) continue;
    const bool is_lse = std::find(lse_views.begin(), lse_views.end(), &t) != lse_views.end();
    const size_t elt = dtype_size(t.dtype);
    const auto* base = static_cast<const uint8_t*>(t.data);
    std::vector<uint8_t> covered(slot.storage.size(), 0);
    for_each_element(t, [&](int64_t offset) {
      const size_t at = static_cast<size_t>(base - slot.storage.data()) + offset * elt;
      if (at + elt > covered.size()) fuzz_fail("an accepted output view reaches past its buffer");
      std::fill(covered.begin() + at, covered.begin() + at + elt, 1);
      const double x = value_at(base + offset * elt, t.dtype);
      if (std::isnan(x)) {
        std::fprintf(stderr, "entry_fuzzer: %s element at offset %lld\n", slot.name,
                     static_cast<long long>(offset));
        fuzz_fail("an output element is NaN (unwritten or computed as NaN)");
      }
      if (is_lse) {
        if (x == INFINITY) fuzz_fail("an LSE is +inf");
      } else if (!(std::fabs(x) <= bound)) {
        std::fprintf(stderr, "entry_fuzzer: |out| = %g, bound %g\n", x, bound);
        fuzz_fail("an output element is outside what attention can produce");
      }
    });
    for (size_t i = 0; i < covered.size(); ++i) {
      if (!covered[i] && slot.storage[i] != 0xff) fuzz_fail("a call wrote outside its output view");
    }
  }
}

void Call::describe() const {
  const char* ops[] = {"prefill (packed)", "prefill (paged)", "decode",      "append_kv",
                       "forward",          "dense",           "merge_states"};
  std::fprintf(stderr,
               "call: %s; spec Hq %d Hkv %d D %d mask %d window %d sinks %d alibi %d scale %g "
               "softcap %g rope %d\n",
               ops[op_], spec_.num_q_heads, spec_.num_kv_heads, spec_.head_dim,
               static_cast<int>(spec_.mask.kind), spec_.mask.window, spec_.mask.sink_tokens,
               spec_.alibi ? 1 : 0, spec_.softmax_scale, spec_.logit_softcap,
               static_cast<int>(spec_.rope.style));
  if (spec_.quant) {
    std::fprintf(stderr, "  quant: dtype %s q_block %d k_block %d\n",
                 dtype_name(spec_.quant->dtype_qk), spec_.quant->q_block_size,
                 spec_.quant->k_block_size);
  }
  if (spec_.skip_softmax) {
    std::fprintf(stderr, "  skip_softmax: threshold %g target %g\n",
                 spec_.skip_softmax->threshold.value_or(-1),
                 spec_.skip_softmax->target_sparsity.value_or(-1));
  }
  for (const Slot& slot : slots_) {
    const TensorView& t = *slot.view;
    std::fprintf(stderr, "  %s: %s %s strides", slot.name, dtype_name(t.dtype),
                 t.shape_str().c_str());
    for (int d = 0; d >= 0 && d < t.ndim && d < TensorView::kMaxDims; ++d) {
      std::fprintf(stderr, " %lld", static_cast<long long>(t.strides[d]));
    }
    if (slot.role == Role::kData) std::fprintf(stderr, " max |x| %g", max_abs(t));
    if (slot.role == Role::kMeta && t.data != nullptr) {
      std::fprintf(stderr, " values");
      for (size_t i = 0; i + 4 <= slot.storage.size() && i < 128; i += 4) {
        int32_t v;
        std::memcpy(&v, &slot.storage[i], 4);
        std::fprintf(stderr, " %d", v);
      }
    }
    std::fprintf(stderr, "\n");
  }
  if (const KvCacheView* c = pool_.cache) {
    std::fprintf(stderr,
                 "  kv_cache: %s paged %d blocks %d T %d Hkv %d D %d stride %lld window_slots %d "
                 "sinks %d\n",
                 dtype_name(c->dtype), c->paged ? 1 : 0, c->num_blocks, c->tokens_per_block,
                 c->num_kv_heads, c->head_dim, static_cast<long long>(c->block_stride_bytes),
                 c->window_slots, c->sink_tokens);
    std::fprintf(stderr, "  pool max |K, V| x scale %g\n", pool_v_max());
  }
}

void Call::invoke() {
  switch (op_) {
    case 0:
    case 1:
      prefill_.checked = checked_;
      prefill(spec_, prefill_);
      break;
    case 2:
      decode_.checked = checked_;
      decode(spec_, decode_);
      break;
    case 3:
      append_.checked = checked_;
      append_kv(spec_, append_);
      break;
    case 4:
      forward_.checked = checked_;
      forward(spec_, forward_);
      break;
    case 5:
      dense_.checked = checked_;
      dense(spec_, dense_);
      break;
    default:
      merge_.checked = checked_;
      merge_states(merge_);
      break;
  }
}

void Call::run() {
  op_ = pick(0, 6);
  switch (op_) {
    case 0:
      build_prefill(false);
      break;
    case 1:
      build_prefill(true);
      break;
    case 2:
      build_decode();
      break;
    case 3:
      build_append_kv();
      break;
    case 4:
      build_forward();
      break;
    case 5:
      build_dense();
      break;
    default:
      build_merge_states();
      break;
  }
  const int32_t mutations = pick(0, 3);
  for (int32_t i = 0; i < mutations; ++i) mutate_once();
  for (Slot& slot : slots_) rehome(slot);
  rehome_pool();
  checked_ = chance(4);

  // What the result may hold, from the inputs as they are now.
  const double pool_max = pool_v_max();
  double bound = 0.0;
  switch (op_) {
    case 0:
      bound = max_abs(prefill_.v);
      break;
    case 1:
    case 2:
      bound = pool_max;
      break;
    case 3:  // rotated Q: a pair's rotation keeps its norm
      bound = 1.5 * (max_abs(append_.qkv) + max_abs(append_.q) + max_abs(append_.qkv_bias));
      break;
    case 4: {  // new V is quantized into the cache (fp8 rounds by up to 1/16, int8 by scale / 2)
      double scale = 1.0;
      for (const TensorView* s : {&forward_.kv_cache.k_scale, &forward_.kv_cache.v_scale}) {
        if (s->defined()) scale = std::max(scale, max_abs(*s));
      }
      const double fresh = max_abs(forward_.qkv) + max_abs(forward_.qkv_bias);
      bound = std::max(pool_max, fresh * 1.07 + scale);
      // A layout whose K and V regions overlap (legal: the bases are the caller's) lets the new
      // K, stored as k / k_scale, be read back as V: no bound on the values then.
      const KvCacheView& c = forward_.kv_cache;
      const int64_t block_bytes = int64_t{c.num_kv_heads} * c.tokens_per_block * c.head_dim *
                                  static_cast<int64_t>(dtype_size(c.dtype));
      if (pool_.v_offset < block_bytes || c.block_stride_bytes < pool_.v_offset + block_bytes) {
        bound = INFINITY;
      }
      break;
    }
    case 5:  // SAGE rounds P to fp8 before P * V (by up to 1/16), unnormalized again
      bound = max_abs(dense_.v) * (spec_.quant ? 1.07 : 1.0);
      break;
    default:
      bound = std::max(max_abs(merge_.out_a), max_abs(merge_.out_b));
      break;
  }
  bound = bound * 1.02 + 1e-6;
  g_describe_call = [this] { describe(); };

  for (Slot& slot : slots_) {
    if (slot.role == Role::kOutput) std::fill(slot.storage.begin(), slot.storage.end(), 0xff);
  }
  std::vector<std::vector<uint8_t>> before;
  for (const Slot& slot : slots_) before.push_back(slot.storage);
  const std::vector<uint8_t> pool_before = pool_.storage;

  bool accepted = true;
  try {
    invoke();
  } catch (const Error&) {
    accepted = false;
  }
  const bool writes_cache = op_ == 3 || op_ == 4;
  size_t i = 0;
  for (const Slot& slot : slots_) {
    const bool changed = slot.storage != before[i++];
    if (changed && (!accepted || slot.role != Role::kOutput)) {
      fuzz_fail(accepted ? "a call wrote to an input" : "a rejected call wrote to a buffer");
    }
  }
  if (pool_.storage != pool_before && (!accepted || !writes_cache)) {
    fuzz_fail(accepted ? "a call that reads the cache wrote to it"
                       : "a rejected call wrote to the cache");
  }
  if (!accepted) return;
  check_outputs(bound, {&prefill_.lse, &decode_.lse, &forward_.lse, &dense_.lse, &merge_.lse});
  if (dense_.stats != nullptr && stats_.tiles_skipped > stats_.tiles_total) {
    fuzz_fail("dense: more tiles skipped than considered");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  Call call(in);
  call.run();
  return 0;
}
