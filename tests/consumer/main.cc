// A downstream program built against the installed package: one small prefill on the CPU.
#include <attnkit/attnkit.h>

#include <cmath>
#include <cstdio>
#include <vector>

int main() {
  attnkit::AttentionSpec spec;
  spec.num_q_heads = 2;
  spec.num_kv_heads = 1;
  spec.head_dim = 8;
  const int tokens = 3;
  std::vector<float> q(tokens * 2 * 8), k(tokens * 8), v(tokens * 8), out(tokens * 2 * 8, NAN);
  for (size_t i = 0; i < q.size(); ++i) q[i] = 0.01f * static_cast<float>(i % 7);
  for (size_t i = 0; i < k.size(); ++i) k[i] = 0.02f * static_cast<float>(i % 5);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i % 3);
  std::vector<int32_t> cu = {0, tokens};
  using attnkit::DType;
  attnkit::PrefillArgs args;
  args.q = {q.data(), DType::kF32, {tokens, 2, 8}};
  args.k = {k.data(), DType::kF32, {tokens, 1, 8}};
  args.v = {v.data(), DType::kF32, {tokens, 1, 8}};
  args.cu_seqlens_q = {cu.data(), DType::kInt32, {2}};
  args.cu_seqlens_kv = {cu.data(), DType::kInt32, {2}};
  args.out = {out.data(), DType::kF32, {tokens, 2, 8}};
  attnkit::prefill(spec, args);
  // The first query attends only the first key (causal): its output is v[0].
  if (std::fabs(out[0] - v[0]) > 1e-6f) {
    std::printf("unexpected output %f\n", out[0]);
    return 1;
  }
  std::printf("consumer ok: attnkit %s\n", attnkit::version());
  return 0;
}
