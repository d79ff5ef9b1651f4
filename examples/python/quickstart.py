"""attnkit Python quick start (docs/guide.md): a packed prefill, a paged KV cache driven through
forward() and decode(), dense attention with a JSON configuration, and an error.

NumPy arrays run on the CPU reference backend, so this runs anywhere; CUDA torch tensors (and
device="cuda" for the KvCache) run the same calls on the GPU. python/tests/test_examples.py runs
it: `PYTHONPATH=build/python python3 examples/python/quickstart.py`.
"""

import numpy as np

import attnkit

rng = np.random.default_rng(2026)
HQ, HKV, D = 8, 2, 64  # 8 query heads over 2 KV heads (GQA), head_dim 64


def randn(*shape):
    return rng.standard_normal(shape, dtype=np.float32)


# 1. Packed variable-length prefill, as FlashAttention's varlen API: two sequences of 5 and 11
#    tokens, q [16, HQ, D], k / v [16, HKV, D], no padding.
cu_seqlens = np.array([0, 5, 16], dtype=np.int32)
q, k, v = randn(16, HQ, D), randn(16, HKV, D), randn(16, HKV, D)
out, lse = attnkit.prefill(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, causal=True,
                           return_lse=True)
for first in cu_seqlens[:-1]:  # a first token sees only its own key: out = its V row
    np.testing.assert_allclose(out[first], np.repeat(v[first], HQ // HKV, axis=0), atol=1e-5)
print(f"prefill: out {out.shape}, lse {lse.shape}")

# 2. A paged KV cache (the C++ KvCacheManager): blocks of 16 tokens, f16 in host memory.
cache = attnkit.KvCache(num_kv_heads=HKV, head_dim=D, max_seq_len=512, tokens_per_block=16,
                        dtype="f16", device="cpu", max_tokens=4096)
prompts = {1: list(range(1000, 1037)), 2: list(range(2000, 2012))}
for seq, prompt in prompts.items():
    cache.add(seq, prompt)  # allocates the blocks; forward() writes their K/V
width = (HQ + 2 * HKV) * D  # one fused QKV row per token
qkv = randn(37 + 12, width)
out = attnkit.forward(qkv, cache.view(0, [1, 2]), cu_seqlens_q=[0, 37, 49], past_lens=[0, 0],
                      num_context=2)  # both requests are context chunks
assert np.isfinite(out).all()

for step in range(4):  # generation: one new token per sequence and step
    for seq in (1, 2):
        cache.append(seq, [3000 + step])
    past = [cache.length(1) - 1, cache.length(2) - 1]
    qkv = randn(2, width)
    step_out = attnkit.forward(qkv, cache.view(0, [1, 2]), cu_seqlens_q=[0, 1, 2],
                               past_lens=past, num_context=0)

# decode() reads the cache forward() filled; with the same queries (no RoPE: the Q part of the
# fused rows) it gives forward()'s generation output.
decode_out = attnkit.decode(qkv[:, : HQ * D].reshape(2, HQ, D), cache.view(0, [1, 2]))
np.testing.assert_allclose(decode_out, step_out, atol=1e-5)
print(f"decode: lengths {cache.length(1)} and {cache.length(2)}, matches forward()")

cache.release(1)
cached = cache.add(3, prompts[1])  # same prompt: its two full blocks are reused
assert cached == 32, cached
print(f"prefix reuse: {cached} of {len(prompts[1])} tokens cached; {cache.stats()['used_blocks']} "
      "blocks in use")
cache.check_invariants()

# 3. Dense [B, S, H, D] attention (diffusion) with per-role settings from a JSON configuration.
config = attnkit.AttentionConfig.from_json("""{
  "default": {"backend": "auto"},
  "per_role": {"self": {"skip_softmax": {"threshold": 0.0}}}
}""")
x = randn(1, 256, 4, D)
out = attnkit.dense(x, x, x, config=config, role="self")
print(f"dense: out {out.shape}")

# 4. Every rejected call raises attnkit.Error (a ValueError) naming the argument, and writes
#    nothing.
try:
    attnkit.prefill(q, k[:, :1].repeat(3, axis=1), v, cu_seqlens_q=cu_seqlens,
                    cu_seqlens_k=cu_seqlens)
except attnkit.Error as error:
    print(f"rejected: {error}")
else:
    raise SystemExit("expected attnkit.Error for 3 KV heads with 8 query heads")
print(f"attnkit {attnkit.__version__} quick start ok")
