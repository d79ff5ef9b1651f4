// attnkit C++ quick start (docs/guide.md): a configuration from JSON, a packed prefill, then a
// paged KV cache owned by KvCacheManager and driven through forward() (a context step, then
// generation steps) and decode(). The tensors live in host memory, so every call runs on the
// reference backend and the program runs anywhere; with device memory and Device::cuda(0) the
// same calls run the CUDA kernels. The ctest `example_cpp_quickstart` builds and runs it.
#include <attnkit/attnkit.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

namespace {

using attnkit::DType;

constexpr int32_t kQHeads = 8, kKvHeads = 2, kHeadDim = 64;
constexpr int32_t kQkvWidth = (kQHeads + 2 * kKvHeads) * kHeadDim;  // fused QKV row

std::vector<float> random_values(size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = uniform(rng);
  return v;
}

float max_abs_diff(const float* a, const float* b, size_t n) {
  float worst = 0;
  for (size_t i = 0; i < n; ++i) worst = std::max(worst, std::fabs(a[i] - b[i]));
  return worst;
}

// One forward() step over `seqs`: the first `num_context` rows are context chunks, the others
// generation rows; new_tokens[i] tokens of row i are in `qkv` (packed, in row order). The cache
// already counts them (add() / append() came first). Returns out [tokens, Hq, D].
std::vector<float> forward_step(const attnkit::AttentionSpec& spec,
                                const attnkit::KvCacheManager& cache,
                                const std::vector<attnkit::SeqId>& seqs, int32_t num_context,
                                const std::vector<int32_t>& new_tokens, std::vector<float>& qkv) {
  const attnkit::KvBlockTables tables = cache.block_tables(seqs);
  const int64_t rows = static_cast<int64_t>(seqs.size());
  std::vector<int32_t> cu_seqlens(rows + 1, 0), past_lens(rows);
  for (int64_t i = 0; i < rows; ++i) {
    cu_seqlens[i + 1] = cu_seqlens[i] + new_tokens[i];
    past_lens[i] = tables.seq_lens[i] - new_tokens[i];
  }
  const int64_t tokens = cu_seqlens[rows];
  std::vector<float> out(tokens * kQHeads * kHeadDim, NAN);

  attnkit::ForwardArgs args;
  args.qkv = {qkv.data(), DType::kF32, {tokens, kQkvWidth}};
  args.num_context = num_context;
  args.cu_seqlens_q = {cu_seqlens.data(), DType::kInt32, {rows + 1}};
  args.past_lens = {past_lens.data(), DType::kInt32, {rows}};
  args.kv_cache = cache.layer_view(/*layer=*/0, tables.table_view(), tables.seq_lens_view());
  args.out = {out.data(), DType::kF32, {tokens, kQHeads, kHeadDim}};
  attnkit::forward(spec, args);  // append_kv + prefill (context rows) + decode (generation rows)
  return out;
}

}  // namespace

int main() {
  std::mt19937 rng(2026);

  // 1. The layer: 8 query heads over 2 KV heads (GQA), head_dim 64, causal. The backend and the
  //    diffusion options come from a JSON configuration, resolved per role.
  const auto config = attnkit::AttentionConfig::from_json(R"({
    "default": {"backend": "auto"},
    "per_role": {"cross": {"backend": "vanilla"}}
  })");
  attnkit::AttentionSpec spec;
  spec.num_q_heads = kQHeads;
  spec.num_kv_heads = kKvHeads;
  spec.head_dim = kHeadDim;
  spec.mask.kind = attnkit::MaskKind::kCausal;
  spec = config.apply("self", spec);
  std::printf("role 'self' runs on backend %s\n", attnkit::backend_name(spec.backend));
  try {
    attnkit::AttentionConfig::from_json(R"({"default": {"backend": "fastest"}})");
    return 1;  // unreachable: an unknown backend is an error
  } catch (const attnkit::Error& error) {
    std::printf("rejected: %s\n", error.what());
  }

  // 2. Packed variable-length prefill: two sequences of 5 and 11 tokens, no padding.
  std::vector<int32_t> cu_seqlens = {0, 5, 16};
  const int64_t total = 16;
  std::vector<float> q = random_values(total * kQHeads * kHeadDim, rng);
  std::vector<float> k = random_values(total * kKvHeads * kHeadDim, rng);
  std::vector<float> v = random_values(total * kKvHeads * kHeadDim, rng);
  std::vector<float> out(total * kQHeads * kHeadDim, NAN);
  attnkit::PrefillArgs prefill;
  prefill.q = {q.data(), DType::kF32, {total, kQHeads, kHeadDim}};
  prefill.k = {k.data(), DType::kF32, {total, kKvHeads, kHeadDim}};
  prefill.v = {v.data(), DType::kF32, {total, kKvHeads, kHeadDim}};
  prefill.cu_seqlens_q = {cu_seqlens.data(), DType::kInt32, {3}};
  prefill.cu_seqlens_kv = {cu_seqlens.data(), DType::kInt32, {3}};
  prefill.out = {out.data(), DType::kF32, {total, kQHeads, kHeadDim}};
  attnkit::prefill(spec, prefill);
  // The first token of each sequence sees only its own key: its output is its own V row.
  for (int32_t first : {cu_seqlens[0], cu_seqlens[1]}) {
    for (int32_t h = 0; h < kQHeads; ++h) {
      const float* o = &out[(first * kQHeads + h) * kHeadDim];
      const float* expected = &v[(first * kKvHeads + h / spec.group_size()) * kHeadDim];
      if (max_abs_diff(o, expected, kHeadDim) > 1e-5f) {
        std::printf("prefill: unexpected output at token %d head %d\n", first, h);
        return 1;
      }
    }
  }
  std::printf("prefill: %lld tokens of 2 sequences\n", static_cast<long long>(total));

  // 3. A paged bf16 KV cache in host memory: blocks of 16 tokens, prefix reuse on.
  attnkit::KvCacheManagerConfig cache_config;
  cache_config.num_layers = 1;
  cache_config.num_kv_heads = kKvHeads;
  cache_config.head_dim = kHeadDim;
  cache_config.tokens_per_block = 16;
  cache_config.dtype = DType::kBF16;
  cache_config.device = attnkit::Device::cpu();
  cache_config.max_tokens = 4096;
  cache_config.max_seq_len = 512;
  attnkit::KvCacheManager cache(cache_config);

  // Context step: two prompts (37 and 12 tokens) in one forward() call.
  std::vector<int32_t> prompt_a(37), prompt_b(12);
  for (size_t i = 0; i < prompt_a.size(); ++i) prompt_a[i] = 1000 + static_cast<int32_t>(i);
  for (size_t i = 0; i < prompt_b.size(); ++i) prompt_b[i] = 2000 + static_cast<int32_t>(i);
  cache.add(1, prompt_a);
  cache.add(2, prompt_b);
  std::vector<float> qkv = random_values((37 + 12) * kQkvWidth, rng);
  std::vector<float> context_out = forward_step(spec, cache, {1, 2}, 2, {37, 12}, qkv);

  // Generation steps: one new token per sequence, then the same step through decode().
  std::vector<float> step_out;
  for (int32_t step = 0; step < 4; ++step) {
    cache.append(1, std::vector<int32_t>{3000 + step});
    cache.append(2, std::vector<int32_t>{4000 + step});
    qkv = random_values(2 * kQkvWidth, rng);
    step_out = forward_step(spec, cache, {1, 2}, 0, {1, 1}, qkv);
  }
  // decode() over the cache forward() just filled, with the same queries (no RoPE here, so the
  // query is the Q part of the fused row) gives the same output.
  std::vector<float> q_step(2 * kQHeads * kHeadDim);
  for (int32_t r = 0; r < 2; ++r) {
    std::copy_n(&qkv[r * kQkvWidth], kQHeads * kHeadDim, &q_step[r * kQHeads * kHeadDim]);
  }
  const std::vector<attnkit::SeqId> rows = {1, 2};
  const attnkit::KvBlockTables tables = cache.block_tables(rows);
  std::vector<float> decode_out(q_step.size(), NAN);
  attnkit::DecodeArgs decode;
  decode.q = {q_step.data(), DType::kF32, {2, kQHeads, kHeadDim}};
  decode.kv_cache = cache.layer_view(0, tables.table_view(), tables.seq_lens_view());
  decode.out = {decode_out.data(), DType::kF32, {2, kQHeads, kHeadDim}};
  attnkit::decode(spec, decode);
  const float diff = max_abs_diff(decode_out.data(), step_out.data(), decode_out.size());
  std::printf("decode: lengths %d and %d, max |decode - forward| = %g\n", tables.seq_lens[0],
              tables.seq_lens[1], diff);
  if (!(diff <= 1e-5f)) return 1;
  for (float x : context_out) {
    if (std::isnan(x)) return 1;  // forward() writes every output element
  }

  // Prefix reuse: a new request with the same prompt finds its full blocks cached.
  cache.release(1);
  const int64_t cached = cache.add(3, prompt_a);
  const attnkit::KvCacheStats stats = cache.stats();
  std::printf("prefix reuse: %lld of %zu prompt tokens cached; blocks used %d, free %d\n",
              static_cast<long long>(cached), prompt_a.size(), stats.used_blocks,
              stats.free_blocks);
  cache.check_invariants();
  if (cached != 32) return 1;  // two full blocks of 16 tokens

  std::printf("attnkit %s quick start ok\n", attnkit::version());
  return 0;
}
