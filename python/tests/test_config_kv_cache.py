"""AttentionConfig, the KvCache manager, append_kv and forward through a KvCache (CPU)."""

import numpy as np
import pytest
from conftest import assert_close, reference_attention

import attnkit

CONFIG = """{
  "default": {"backend": "vanilla"},
  "per_role": {
    "self": {"skip_softmax": {"threshold": 0.25}, "video": {"backend": "auto"}},
    "cross": {"quant": {"dtype_qk": "fp8_e4m3", "q_block_size": 4}}
  }
}"""


def test_config_parse_and_resolve():
    cfg = attnkit.AttentionConfig.from_json(CONFIG)
    assert sorted(cfg.roles()) == ["cross", "self", "self.video"]
    video = cfg.resolve("self.video")
    assert video["backend"] == "auto"  # its own
    assert video["skip_softmax"]["threshold"] == 0.25  # inherited from "self"
    cross = cfg.resolve("cross")
    assert cross["backend"] == "vanilla"  # from "default"
    assert cross["quant"] == {"dtype_qk": "fp8_e4m3", "q_block_size": 4, "k_block_size": 16}
    other = cfg.resolve("joint")
    assert other["backend"] == "vanilla" and other["skip_softmax"] is None
    assert "self.video" in cfg.resolved_json()


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"default": {"backend": "fast"}}', "backend"),
        ('{"default": {"skip_softmax": {"threshold": 0.1, "target_sparsity": 0.5}}}',
         "threshold"),
        ('{"per_role": {"self": {"quant": {"q_block_size": 3}}}}', "q_block_size"),
        ('{"defaults": {}}', "defaults"),
        ("{not json", "invalid JSON"),
    ],
)
def test_config_errors_carry_the_cpp_message(text, message):
    with pytest.raises(attnkit.Error, match=message) as err:
        attnkit.AttentionConfig.from_json(text)
    assert isinstance(err.value, ValueError) and str(err.value)


def _cache(**kw):
    args = dict(num_kv_heads=2, head_dim=64, tokens_per_block=16, max_tokens=16 * 12,
                max_seq_len=128, dtype="f16")
    args.update(kw)
    return attnkit.KvCache(**args)


def test_kv_cache_add_fork_release_stats(rng):
    cache = _cache()
    total = cache.num_blocks
    prompt = [int(t) for t in rng.integers(0, 32000, 40)]  # 2 full blocks + 8 tokens
    assert cache.add(1, prompt) == 0
    cache.check_invariants()
    s = cache.stats()
    assert (s["used_blocks"], s["free_blocks"] + s["cached_blocks"]) == (3, total - 3)
    assert 1 in cache and cache.length(1) == 40 and len(cache.blocks(1)) == 3

    cache.fork(1, 2)  # shares every block
    cache.check_invariants()
    assert cache.stats()["used_blocks"] == 3 and cache.blocks(2) == cache.blocks(1)
    cache.append(2, [7])  # copy-on-write of the shared partial block
    cache.check_invariants()
    s = cache.stats()
    assert s["cow_copies"] == 1 and s["used_blocks"] == 4
    assert cache.blocks(2)[:2] == cache.blocks(1)[:2] and cache.blocks(2)[2] != cache.blocks(1)[2]

    cache.release(1)
    cache.release(2)
    cache.check_invariants()
    s = cache.stats()
    assert s["used_blocks"] == 0 and s["cached_blocks"] == 2  # the full prompt blocks stay
    assert s["free_blocks"] + s["cached_blocks"] == total

    assert cache.probe_prefix(prompt) == 32
    assert cache.add(3, prompt) == 32  # prefix reuse of the 2 full blocks
    assert cache.stats()["hits"] == 2
    cache.check_invariants()

    with pytest.raises(attnkit.Error):
        cache.append(99, [1])  # unknown sequence
    with pytest.raises(attnkit.Error, match="max_seq_len"):
        cache.append(3, [1] * 200)
    cache.check_invariants()
    with pytest.raises(attnkit.Error, match="dtype"):
        _cache(dtype="f64")


def test_append_kv_then_decode_and_paged_prefill(rng):
    hq, hkv, d = 4, 2, 64
    lens = [20, 35]
    cache = _cache(num_layers=2)
    for seq, n in enumerate(lens):
        assert cache.add(seq, [seq * 1000 + t for t in range(n)]) == 0
    view = cache.view(1, [0, 1])
    assert list(view.seq_lens) == lens
    toks = sum(lens)
    q = rng.standard_normal((toks, hq, d)).astype(np.float16)
    k = rng.standard_normal((toks, hkv, d)).astype(np.float16)
    v = rng.standard_normal((toks, hkv, d)).astype(np.float16)
    positions = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
    rows = np.concatenate([np.full(n, r) for r, n in enumerate(lens)]).astype(np.int32)
    q_out = attnkit.append_kv(view, positions, rows, q=q, k=k, v=v)
    np.testing.assert_array_equal(q_out, q)  # no RoPE, no bias: Q passes through

    cu = np.array([0, lens[0], toks], dtype=np.int32)
    out = attnkit.prefill(q, kv_cache=view, cu_seqlens_q=cu)
    last = cu[1:] - 1
    dec = attnkit.decode(q[last], view)
    for r in range(2):
        sl = slice(cu[r], cu[r + 1])
        ref, _ = reference_attention(q[sl], k[sl], v[sl], np.arange(lens[r]))
        naive, _ = reference_attention(q[sl], k[sl], v[sl], np.arange(lens[r]), dtype=np.float16)
        assert_close(out[sl], ref, naive)
        assert_close(dec[r:r + 1], ref[-1:], naive[-1:])
    # Layer 0 was never written: the layers of the pool are independent.
    assert not np.array_equal(cache.pool[:, 0], cache.pool[:, 1])


def test_forward_context_then_generation_step(rng):
    hq, hkv, d = 4, 2, 64
    width = (hq + 2 * hkv) * d
    lens = [9, 24]
    cache = _cache()
    for seq, n in enumerate(lens):
        assert cache.add(seq, [seq * 1000 + t for t in range(n)]) == 0
    qkv = rng.standard_normal((sum(lens), width)).astype(np.float16)
    cu = np.array([0, lens[0], sum(lens)], dtype=np.int32)
    out = attnkit.forward(qkv, cache.view(0, [0, 1]), cu, [0, 0], num_context=2)
    q = qkv[:, : hq * d].reshape(-1, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].reshape(-1, hkv, d)
    v = qkv[:, (hq + hkv) * d:].reshape(-1, hkv, d)
    expected = attnkit.prefill(q, k, v, cu, cu)
    np.testing.assert_array_equal(out, expected)

    # One generation token per sequence: attends everything cached plus itself.
    for seq in range(2):
        cache.append(seq, [1])
    step = rng.standard_normal((2, width)).astype(np.float16)
    gen = attnkit.forward(step, cache.view(0, [0, 1]), [0, 1, 2], lens, num_context=0)
    for r in range(2):
        sl = slice(cu[r], cu[r + 1])
        kr = np.concatenate([k[sl], step[r:r + 1, hq * d: (hq + hkv) * d].reshape(1, hkv, d)])
        vr = np.concatenate([v[sl], step[r:r + 1, (hq + hkv) * d:].reshape(1, hkv, d)])
        qr = step[r:r + 1, : hq * d].reshape(1, hq, d)
        ref, _ = reference_attention(qr, kr, vr, np.array([lens[r]]))
        naive, _ = reference_attention(qr, kr, vr, np.array([lens[r]]), dtype=np.float16)
        assert_close(gen[r:r + 1], ref, naive)
