"""attnkit.flash_attn (flash_attn's calling conventions) against a NumPy float64 attention written
from flash_attn's documented semantics (bottom-right alignment, window_size (left, right),
ALiBi -slope * |i - j|, LSE [B, H, S] / [H, total]), on NumPy arrays and torch CPU tensors; the
CUDA tests need a GPU, torch with CUDA and attnkit's CUDA backend."""

import numpy as np
import pytest
from conftest import assert_close, masked_softmax

import attnkit
from attnkit.flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

try:
    import torch
except ImportError:
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="needs PyTorch")
needs_cuda = pytest.mark.skipif(
    torch is None or not (torch.cuda.is_available() and attnkit.info()["cuda"]),
    reason="needs a CUDA GPU, torch with CUDA and attnkit built with the CUDA backend",
)


def fa_reference(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, slopes=None,
                 scale=None, dtype=np.float64):
    """One sequence as flash_attn defines it: q [Sq, Hq, D], k / v [Sk, Hkv, D]. Query i attends
    keys [i + Sk - Sq - left, i + Sk - Sq + right] (-1: unbounded; causal: right = 0); ALiBi adds
    -slope * |i + Sk - Sq - j|. Computed in `dtype`. Returns out [Sq, Hq, D], lse [Hq, Sq]."""
    q, k, v = (np.asarray(x, dtype=dtype) for x in (q, k, v))
    sq, hq, d = q.shape
    sk, hkv, _ = k.shape
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    left, right = window
    if causal:
        right = 0
    row = np.arange(sq)[:, None] + sk - sq
    col = np.arange(sk)[None, :]
    allowed = np.ones((sq, sk), dtype=bool)
    if left >= 0:
        allowed &= col >= row - left
    if right >= 0:
        allowed &= col <= row + right
    out = np.zeros((sq, hq, d))
    lse = np.full((hq, sq), -np.inf)
    for h in range(hq):
        kh, vh = k[:, h // (hq // hkv)], v[:, h // (hq // hkv)]
        logits = (q[:, h] @ kh.T).astype(np.float64) * scale
        if softcap > 0:
            logits = softcap * np.tanh(logits / softcap)
        if slopes is not None:
            logits = logits - slopes[h] * np.abs(row - col)
        p, lse[h] = masked_softmax(logits, allowed)
        out[:, h] = (p.astype(dtype) @ vh).astype(np.float64)
    return out, lse


def check(out, lse, q, k, v, dtype, **kw):
    """out / lse of one sequence against the float64 oracle, tolerance of docs/testing.md."""
    ref, ref_lse = fa_reference(q, k, v, **kw)
    naive, _ = fa_reference(q, k, v, dtype=dtype, **kw)
    assert_close(out, ref, naive)
    if lse is not None:
        lse = np.asarray(lse, dtype=np.float64)
        assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse)), "rows without keys differ"
        finite = np.isfinite(ref_lse)
        np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=1e-4, atol=1e-3)


def rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


# ---- flash_attn_func --------------------------------------------------------------------------

DENSE_CASES = {
    "plain": dict(sq=9, sk=9, hq=4, hkv=4, kw={}),
    "cross_gqa": dict(sq=6, sk=13, hq=6, hkv=2, kw=dict(softmax_scale=0.2)),
    "causal": dict(sq=11, sk=11, hq=4, hkv=2, kw=dict(causal=True)),
    "causal_chunk": dict(sq=5, sk=17, hq=4, hkv=1, kw=dict(causal=True)),
    "causal_more_q": dict(sq=9, sk=4, hq=2, hkv=2, kw=dict(causal=True)),
    "local_left": dict(sq=16, sk=16, hq=4, hkv=2, kw=dict(window_size=(3, 0))),
    "causal_window": dict(sq=7, sk=20, hq=4, hkv=4, kw=dict(causal=True, window_size=(5, 9))),
    "softcap": dict(sq=8, sk=12, hq=4, hkv=2, kw=dict(softcap=2.5)),
    "alibi": dict(sq=10, sk=10, hq=4, hkv=2, kw=dict(causal=True, alibi=True)),
}


def _ref_kw(kw, hq):
    ref = {}
    if kw.get("causal"):
        ref["causal"] = True
    if "window_size" in kw:
        ref["window"] = kw["window_size"]
    if kw.get("softcap"):
        ref["softcap"] = kw["softcap"]
    if kw.get("softmax_scale"):
        ref["scale"] = kw["softmax_scale"]
    if kw.get("alibi"):
        ref["slopes"] = np.array(attnkit.default_alibi_slopes(hq))
    return ref


def _call_kw(kw, hq):
    call = {k: v for k, v in kw.items() if k != "alibi"}
    if kw.get("alibi"):
        call["alibi_slopes"] = np.array(attnkit.default_alibi_slopes(hq), dtype=np.float32)
    return call


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("case", sorted(DENSE_CASES))
def test_flash_attn_func(rng, case, dtype):
    c = DENSE_CASES[case]
    b, d = 2, 64
    q = rand(rng, (b, c["sq"], c["hq"], d), dtype)
    k = rand(rng, (b, c["sk"], c["hkv"], d), dtype)
    v = rand(rng, (b, c["sk"], c["hkv"], d), dtype)
    out, lse, probs = flash_attn_func(q, k, v, **_call_kw(c["kw"], c["hq"]),
                                      return_attn_probs=True)
    assert out.shape == q.shape and out.dtype == q.dtype and probs is None
    assert lse.shape == (b, c["hq"], c["sq"]) and lse.dtype == np.float32
    for i in range(b):
        check(out[i], lse[i], q[i], k[i], v[i], dtype, **_ref_kw(c["kw"], c["hq"]))
    plain = flash_attn_func(q, k, v, **_call_kw(c["kw"], c["hq"]))
    np.testing.assert_array_equal(plain, out)


def test_flash_attn_func_positional_order(rng):
    # flash_attn's order: q, k, v, dropout_p, softmax_scale, causal, window_size, softcap.
    q, k, v = (rand(rng, (1, 12, 2, 32), np.float32) for _ in range(3))
    out = flash_attn_func(q, k, v, 0.0, 0.3, True, (4, 0), 3.0)
    check(out[0], None, q[0], k[0], v[0], np.float32, causal=True, window=(4, 0), scale=0.3,
          softcap=3.0)


# ---- flash_attn_varlen_func -------------------------------------------------------------------


def _packed(rng, lens_q, lens_k, hq, hkv, d, dtype):
    q = rand(rng, (sum(lens_q), hq, d), dtype)
    k = rand(rng, (sum(lens_k), hkv, d), dtype)
    v = rand(rng, (sum(lens_k), hkv, d), dtype)
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    return q, k, v, cu_q, cu_k


VARLEN_CASES = {
    "causal": dict(lens_q=[7, 1, 19], lens_k=[7, 1, 19], kw=dict(causal=True)),
    "chunked": dict(lens_q=[3, 8], lens_k=[20, 8], kw=dict(causal=True, window_size=(6, -1))),
    "cross": dict(lens_q=[9, 4, 0], lens_k=[5, 13, 3], kw={}),
    "alibi_softcap": dict(lens_q=[12, 5], lens_k=[12, 9],
                          kw=dict(causal=True, alibi=True, softcap=4.0)),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("case", sorted(VARLEN_CASES))
def test_flash_attn_varlen_func(rng, case, dtype):
    c = VARLEN_CASES[case]
    hq, hkv, d = 4, 2, 64
    q, k, v, cu_q, cu_k = _packed(rng, c["lens_q"], c["lens_k"], hq, hkv, d, dtype)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(c["lens_q"]), max(c["lens_k"]),
                                         **_call_kw(c["kw"], hq), return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (hq, q.shape[0])  # flash_attn's [H, total_q]
    for i in range(len(c["lens_q"])):
        sq, sk = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        check(out[sq], lse[:, sq], q[sq], k[sk], v[sk], dtype, **_ref_kw(c["kw"], hq))


def _paged_nhd(rng, lens, page, hkv, d, dtype, spare_blocks=3):
    """An NHD pool [num_blocks, page, Hkv, D] holding sequences of `lens` tokens in shuffled
    blocks, its block table (-1 past each sequence) and each sequence's contiguous K / V."""
    blocks = [-(-n // page) for n in lens]
    width = max(blocks) + 1
    num_blocks = sum(blocks) + spare_blocks
    k_pool = rand(rng, (num_blocks, page, hkv, d), dtype)
    v_pool = rand(rng, (num_blocks, page, hkv, d), dtype)
    order = rng.permutation(num_blocks)
    table = np.full((len(lens), width), -1, dtype=np.int32)
    at = 0
    for r, n in enumerate(blocks):
        table[r, :n] = order[at:at + n]
        at += n
    seqs = []
    for r, n in enumerate(lens):
        ids = table[r, :blocks[r]]
        seqs.append((k_pool[ids].reshape(-1, hkv, d)[:n], v_pool[ids].reshape(-1, hkv, d)[:n]))
    return k_pool, v_pool, table, seqs


@pytest.mark.parametrize("page", [16, 24, 256])
def test_flash_attn_varlen_func_paged(rng, page):
    hq, hkv, d, dtype = 4, 2, 32, np.float16
    lens_k, lens_q = [37, 5, 300], [4, 5, 1]
    k_pool, v_pool, table, seqs = _paged_nhd(rng, lens_k, page, hkv, d, dtype)
    q = rand(rng, (sum(lens_q), hq, d), dtype)
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    before = k_pool.copy()
    out, lse, _ = flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, max(lens_q), max(lens_k),
                                         causal=True, block_table=table, return_attn_probs=True)
    np.testing.assert_array_equal(k_pool, before)
    for i, (k, v) in enumerate(seqs):
        sq = slice(cu_q[i], cu_q[i + 1])
        check(out[sq], lse[:, sq], q[sq], k, v, dtype, causal=True)
    # vLLM's spelling: the key lengths as seqused_k instead of cu_seqlens_k.
    same = flash_attn_varlen_func(q, k_pool, v_pool, cu_q, None, max(lens_q), max(lens_k),
                                  causal=True, block_table=table,
                                  seqused_k=np.array(lens_k, np.int32))
    np.testing.assert_array_equal(same, out)


# ---- flash_attn_with_kvcache ------------------------------------------------------------------


def _rope_ref(x, cos, sin, pos, interleaved, dtype=np.float64):
    """x [S, H, D] rotated at positions pos [S] with tables [rows, rd / 2], computed in dtype and
    returned in x's dtype."""
    rd = 2 * cos.shape[1]
    xr = x[..., :rd].astype(dtype)
    c, s = cos[pos].astype(dtype)[:, None], sin[pos].astype(dtype)[:, None]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = np.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).reshape(xr.shape)
    else:
        half = rd // 2
        x1, x2 = xr[..., :half], xr[..., half:]
        rot = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    return np.concatenate([rot.astype(x.dtype), x[..., rd:]], -1)


def _tables(rng, rows, rotary_dim):
    inv = 1.0 / (10000 ** (np.arange(0, rotary_dim, 2) / rotary_dim))
    angles = np.arange(rows)[:, None] * inv[None] + rng.uniform(0, 0.1)  # not a stock table
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


KVCACHE_CASES = {
    "decode_contiguous": dict(paged=False, sq=1, s_new=1, kw={}),
    "decode_paged_rope": dict(paged=True, sq=1, s_new=1, rope=True, interleaved=True, kw={}),
    "chunk_paged_causal_rope": dict(paged=True, sq=3, s_new=3, rope=True, interleaved=False,
                                    kw=dict(causal=True)),
    "chunk_contiguous_window": dict(paged=False, sq=4, s_new=4, kw=dict(window_size=(6, 0))),
    "no_append_noncausal": dict(paged=True, sq=2, s_new=0, kw=dict(softcap=3.0)),
    "decode_alibi": dict(paged=True, sq=1, s_new=1, kw=dict(alibi=True)),
}


@pytest.mark.parametrize("case", sorted(KVCACHE_CASES))
def test_flash_attn_with_kvcache(rng, case):
    c = KVCACHE_CASES[case]
    b, hq, hkv, d, page, dtype = 3, 4, 2, 64, 16, np.float16
    cached = [21, 0, 40] if c["s_new"] else [21, 2, 40]
    lens = [n + c["s_new"] for n in cached]
    if c["paged"]:
        k_cache, v_cache, table, _ = _paged_nhd(rng, [60] * b, page, hkv, d, dtype)
        capacity = table.shape[1] * page
    else:
        k_cache, v_cache, table, capacity = (rand(rng, (b + 1, 64, hkv, d), dtype),
                                             rand(rng, (b + 1, 64, hkv, d), dtype), None, 64)
    q = rand(rng, (b, c["sq"], hq, d), dtype)
    k_new = rand(rng, (b, c["s_new"], hkv, d), dtype) if c["s_new"] else None
    v_new = rand(rng, (b, c["s_new"], hkv, d), dtype) if c["s_new"] else None
    cos = sin = None
    if c.get("rope"):
        cos, sin = _tables(rng, capacity, 32)  # rotary_dim 32 of D = 64
    k_before, v_before = k_cache.copy(), v_cache.copy()
    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
        cache_seqlens=np.array(cached, dtype=np.int32), block_table=table,
        rotary_interleaved=c.get("interleaved", True), return_softmax_lse=True,
        **_call_kw(c["kw"], hq))
    assert out.shape == q.shape and lse.shape == (b, hq, c["sq"])

    def rows(pool, r, n):  # token rows 0 .. n-1 of cache row r
        if table is None:
            return pool[r, :n]
        return pool[table[r]].reshape(-1, hkv, d)[:n]

    masked = bool(c["kw"].get("causal") or "window_size" in c["kw"])
    expect_k, expect_v = k_before.copy(), v_before.copy()
    for r in range(b):
        new_pos = np.arange(cached[r], lens[r])
        kn = k_new[r] if k_new is not None else np.zeros((0, hkv, d), dtype)
        qr = q[r]
        if cos is not None:
            kn = _rope_ref(kn, cos, sin, new_pos, c["interleaved"])
            q_pos = lens[r] - c["sq"] + np.arange(c["sq"]) if masked else np.full(c["sq"],
                                                                                 cached[r])
            qr = _rope_ref(q[r], cos, sin, q_pos, c["interleaved"])
        for t, p in enumerate(new_pos):
            blk, off = (r, p) if table is None else (table[r, p // page], p % page)
            expect_k[blk, off], expect_v[blk, off] = kn[t], v_new[r, t]
        kr, vr = rows(expect_k, r, lens[r]), rows(expect_v, r, lens[r])
        ref_kw = _ref_kw(c["kw"], hq)
        check(out[r], lse[r], qr, kr, vr, dtype, **ref_kw)
    # In place: exactly the new tokens changed (RoPE'd ones within an f16 rounding step).
    np.testing.assert_allclose(k_cache.astype(np.float32), expect_k.astype(np.float32),
                               rtol=2e-3, atol=2e-3)
    np.testing.assert_array_equal(v_cache, expect_v)
    changed = np.any(k_cache != k_before, axis=(2, 3))
    assert changed.sum() <= sum(c["s_new"] for _ in range(b))


def test_kvcache_int_cache_seqlens_and_no_k(rng):
    b, hq, hkv, d, dtype = 2, 2, 1, 32, np.float16
    k_cache, v_cache = rand(rng, (b, 24, hkv, d), dtype), rand(rng, (b, 24, hkv, d), dtype)
    q = rand(rng, (b, 1, hq, d), dtype)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=10)
    for r in range(b):
        check(out[r], None, q[r], k_cache[r, :10], v_cache[r, :10], dtype)
    full = flash_attn_with_kvcache(q, k_cache, v_cache)  # None: every row full
    for r in range(b):
        check(full[r], None, q[r], k_cache[r], v_cache[r], dtype)


# ---- what is not served, and bad input: attnkit.Error naming the argument, nothing written ---


def _small(rng, dtype=np.float16):
    q = rand(rng, (2, 3, 4, 32), dtype)
    k = rand(rng, (2, 8, 2, 32), dtype)
    return q, k, rand(rng, (2, 8, 2, 32), dtype)


@pytest.mark.parametrize("kw, name", [
    (dict(window_size=(2, 3)), "window_size"),
    (dict(window_size=(2, -1)), "window_size"),
    (dict(window_size=(2,)), "window_size"),
    (dict(alibi_slopes=np.ones(4, np.float32)), "alibi_slopes"),
    (dict(causal=True, alibi_slopes=np.ones(3, np.float32)), "alibi_slopes"),
    (dict(causal=True, alibi_slopes=np.arange(8, dtype=np.float32).reshape(2, 4)),
     "alibi_slopes"),
    (dict(dropout_p=0.1), "dropout_p"),
    (dict(softmax_scale=-1.0), "softmax_scale"),
])
def test_flash_attn_func_rejects(rng, kw, name):
    q, k, v = _small(rng)
    with pytest.raises(attnkit.Error, match=name):
        flash_attn_func(q, k, v, **kw)


def test_flash_attn_func_rejects_shapes(rng):
    q, k, v = _small(rng)
    with pytest.raises(attnkit.Error, match="^k: .*divide"):
        flash_attn_func(q, rand(rng, (2, 8, 3, 32), np.float16), rand(rng, (2, 8, 3, 32),
                                                                      np.float16))
    with pytest.raises(attnkit.Error, match="^v: "):
        flash_attn_func(q, k, v[:, :5])
    with pytest.raises(attnkit.Error, match="^q: expected 4 dimensions"):
        flash_attn_func(q[0], k, v)
    with pytest.raises(attnkit.Error, match="^q: expected a torch tensor or a numpy array"):
        flash_attn_func(q.tolist(), k, v)


def _decode_setup(rng, paged=True):
    b, hq, hkv, d, page, dtype = 2, 4, 2, 32, 16, np.float16
    k_cache, v_cache, table, _ = _paged_nhd(rng, [30, 30], page, hkv, d, dtype, spare_blocks=1)
    q = rand(rng, (b, 1, hq, d), dtype)
    k, v = rand(rng, (b, 1, hkv, d), dtype), rand(rng, (b, 1, hkv, d), dtype)
    return q, k_cache, v_cache, k, v, table


def test_kvcache_rejections_write_nothing(rng):
    q, k_cache, v_cache, k, v, table = _decode_setup(rng)
    before = (k_cache.copy(), v_cache.copy())
    capacity = table.shape[1] * k_cache.shape[1]
    bad_table = table.copy()
    bad_table[1, 0] = k_cache.shape[0]
    cases = [
        (dict(cache_seqlens=np.array([5, capacity], np.int32)), "cache_seqlens"),
        (dict(cache_seqlens=np.array([5, -2], np.int32)), "cache_seqlens"),
        (dict(cache_seqlens=np.array([5, 7], np.int32), block_table=bad_table), "block_table"),
        (dict(cache_seqlens=np.array([5, 7], np.int32), cache_batch_idx=np.arange(2)),
         "cache_batch_idx"),
        (dict(cache_seqlens=np.array([5, 7], np.int32), cache_leftpad=np.zeros(2)),
         "cache_leftpad"),
        (dict(cache_seqlens=np.array([5, 7], np.int32), window_size=(3, 3)), "window_size"),
        (dict(cache_seqlens=np.array([5, 7], np.int32), softmax_scale=float("nan")),
         "softmax_scale"),
        (dict(cache_seqlens=np.array([5, 7], np.int32),
              rotary_cos=np.ones((4, 8), np.float32), rotary_sin=np.ones((4, 8), np.float32)),
         "rotary_cos"),
        (dict(), "cache_seqlens"),
    ]
    for kw, name in cases:
        kw.setdefault("block_table", table)
        with pytest.raises(attnkit.Error, match=f"^{name}: "):
            flash_attn_with_kvcache(q, k_cache, v_cache, k, v, **kw)
        np.testing.assert_array_equal(k_cache, before[0])
        np.testing.assert_array_equal(v_cache, before[1])
    with pytest.raises(attnkit.Error, match="^k_cache: page_size"):
        flash_attn_with_kvcache(q, k_cache[:, :12], v_cache[:, :12], k, v, cache_seqlens=3,
                                block_table=table)
    with pytest.raises(attnkit.Error, match="^k_cache: expected float16 or bfloat16"):
        flash_attn_with_kvcache(q.astype(np.float32), k_cache.astype(np.float32),
                                v_cache.astype(np.float32), cache_seqlens=3, block_table=table)
    with pytest.raises(attnkit.Error, match="^v: "):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, None, cache_seqlens=3, block_table=table)


def test_varlen_paged_rejects(rng):
    q, k_cache, v_cache, _, _, table = _decode_setup(rng)
    q = q.reshape(2, 4, 32)
    cu_q = np.array([0, 1, 2], np.int32)
    with pytest.raises(attnkit.Error, match="^cu_seqlens_k: "):
        flash_attn_varlen_func(q, k_cache, v_cache, cu_q, np.array([0, 5, 5 + 60], np.int32), 1,
                               60, block_table=table)
    with pytest.raises(attnkit.Error, match="^cu_seqlens_q: "):
        flash_attn_varlen_func(q, k_cache, v_cache, cu_q, np.array([0, 5, 5], np.int32), 1, 5,
                               block_table=table)
    with pytest.raises(attnkit.Error, match="^seqused_k: "):
        flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, 1, 5, block_table=table,
                               seqused_k=np.array([3], np.int32))
    with pytest.raises(attnkit.Error, match="^cu_seqlens_k: required"):
        flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, 1, 5, block_table=table)
    with pytest.raises(attnkit.Error, match="^seqused_k: only with block_table"):
        flash_attn_varlen_func(q, q, q, cu_q, cu_q, 1, 1, seqused_k=np.array([1, 1], np.int32))


# ---- torch CPU tensors: the same results through the custom ops, and under torch.compile ------


@needs_torch
@pytest.mark.parametrize("case", ["causal_chunk", "plain", "alibi"])
def test_torch_cpu_flash_attn_func_matches_numpy(rng, case):
    c = DENSE_CASES[case]
    q = rand(rng, (2, c["sq"], c["hq"], 64), np.float32)
    k = rand(rng, (2, c["sk"], c["hkv"], 64), np.float32)
    v = rand(rng, (2, c["sk"], c["hkv"], 64), np.float32)
    kw = _call_kw(c["kw"], c["hq"])
    ref, ref_lse, _ = flash_attn_func(q, k, v, **kw, return_attn_probs=True)
    tkw = {n: torch.from_numpy(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}
    out, lse, _ = flash_attn_func(*(torch.from_numpy(x) for x in (q, k, v)), **tkw,
                                  return_attn_probs=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    np.testing.assert_array_equal(out.numpy(), ref)
    np.testing.assert_array_equal(lse.numpy(), ref_lse)


@needs_torch
def test_torch_cpu_bf16_kvcache_paged(rng):
    b, hq, hkv, d, page = 2, 4, 2, 64, 16
    k_np, v_np, table, _ = _paged_nhd(rng, [40, 40], page, hkv, d, np.float32)
    k_cache = torch.from_numpy(k_np).bfloat16()
    v_cache = torch.from_numpy(v_np).bfloat16()
    q = torch.from_numpy(rand(rng, (b, 2, hq, d), np.float32)).bfloat16()
    k = torch.from_numpy(rand(rng, (b, 2, hkv, d), np.float32)).bfloat16()
    v = torch.from_numpy(rand(rng, (b, 2, hkv, d), np.float32)).bfloat16()
    cached = [13, 31]
    k_before = k_cache.clone()
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v,
                                  cache_seqlens=torch.tensor(cached, dtype=torch.int32),
                                  block_table=torch.from_numpy(table), causal=True)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    for r in range(b):
        ids = torch.from_numpy(table[r][table[r] >= 0]).long()
        n = cached[r] + 2
        kr = k_cache[ids].reshape(-1, hkv, d)[:n]
        vr = v_cache[ids].reshape(-1, hkv, d)[:n]
        assert torch.equal(kr[cached[r]:], k[r]) and torch.equal(vr[cached[r]:], v[r])
        assert torch.equal(kr[:cached[r]], k_before[ids].reshape(-1, hkv, d)[:cached[r]])
        ref, _ = fa_reference(q[r].float().numpy(), kr.float().numpy(), vr.float().numpy(),
                              causal=True)
        # bf16 has no NumPy dtype: the yardstick is float32 inputs rounded to bf16, i.e. the
        # same oracle; bf16 output rounding (2^-8 relative) bounds the difference.
        np.testing.assert_allclose(out[r].float().numpy(), ref, atol=2e-2, rtol=1e-2)


@needs_torch
def test_torch_compile_fullgraph(rng):
    q = torch.from_numpy(rand(rng, (2, 6, 4, 32), np.float32))
    k = torch.from_numpy(rand(rng, (2, 9, 2, 32), np.float32))
    v = torch.from_numpy(rand(rng, (2, 9, 2, 32), np.float32))

    def step(q, k, v):
        out, lse, _ = flash_attn_func(q, k, v, causal=True, window_size=(4, 0),
                                      return_attn_probs=True)
        packed = flash_attn_varlen_func(q.reshape(-1, 4, 32), k.reshape(-1, 2, 32),
                                        v.reshape(-1, 2, 32),
                                        torch.tensor([0, 6, 12], dtype=torch.int32),
                                        torch.tensor([0, 9, 18], dtype=torch.int32), 6, 9,
                                        causal=True, window_size=(4, 0))
        return out * 2, lse, packed

    eager = step(q, k, v)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v)
    assert len(eager) == len(compiled)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(eager[2].reshape(2, 6, 4, 32), eager[0] / 2, rtol=0, atol=0)


@needs_torch
def test_torch_compile_kvcache_mutates(rng):
    b, hq, hkv, d = 2, 4, 2, 32
    k_cache = torch.from_numpy(rand(rng, (b, 32, hkv, d), np.float16))
    v_cache = torch.from_numpy(rand(rng, (b, 32, hkv, d), np.float16))
    q = torch.from_numpy(rand(rng, (b, 1, hq, d), np.float16))
    k = torch.from_numpy(rand(rng, (b, 1, hkv, d), np.float16))
    v = torch.from_numpy(rand(rng, (b, 1, hkv, d), np.float16))
    lens = torch.tensor([3, 17], dtype=torch.int32)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    expected = flash_attn_with_kvcache(q, ref_k, ref_v, k, v, cache_seqlens=lens)

    def step(q, k_cache, v_cache, k, v, lens):
        return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens)

    out = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k_cache, v_cache, k, v,
                                                                   lens)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    assert torch.equal(k_cache[1, 17], k[1, 0]) and torch.equal(v_cache[0, 3], v[0, 0])


@needs_torch
@pytest.mark.parametrize("paged,sq,append", [(True, 1, True), (False, 1, True), (True, 3, True),
                                             (True, 1, False)])
def test_torch_kvcache_device_path_reads_nothing_back(rng, monkeypatch, paged, sq, append):
    """The path flash_attn_with_kvcache takes for CUDA tensors (lengths and table on the device)
    must read nothing back to the host, or CUDA-graph capture fails. It runs here on CPU tensors
    with the host-side checks of CPU inputs switched off (they read the lengths by design); a
    TorchFunctionMode records every tensor operation that reads values on the host (.item(),
    bool(), int(), a 0-d or boolean index, nonzero, ...). Output and appends must equal those of
    the ordinary CPU call."""
    from torch.overrides import TorchFunctionMode

    from attnkit import flash_attn as fa

    host_reads = {"item", "tolist", "cpu", "numpy", "nonzero", "masked_select", "__bool__",
                  "__int__", "__index__", "__float__"}

    class Probe(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.reads = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in host_reads:
                self.reads.append(name)
            elif name in ("__getitem__", "__setitem__"):
                index = args[1] if isinstance(args[1], tuple) else (args[1],)
                self.reads += [f"{name} with a {i.dim()}-d {i.dtype} index" for i in index
                               if isinstance(i, torch.Tensor)
                               and (i.dim() == 0 or i.dtype == torch.bool)]
            return func(*args, **(kwargs or {}))

    b, hq, hkv, d, page, width = 4, 4, 2, 32, 16, 4
    lens = [40, 3, 17, 60]  # + sq <= width * page; without appends every row is full
    k_pool, v_pool = (rand(rng, (b * width + 3, page, hkv, d), np.float16) for _ in range(2))
    table = rng.permutation(b * width + 3)[:b * width].reshape(b, width).astype(np.int32)
    if not paged:  # contiguous rows [B, S_cache, Hkv, D]
        k_pool, v_pool = (x[table].reshape(b, -1, hkv, d) for x in (k_pool, v_pool))
    k_cache, v_cache = torch.from_numpy(k_pool), torch.from_numpy(v_pool)
    table = torch.from_numpy(table) if paged else None
    q = torch.from_numpy(rand(rng, (b, sq, hq, d), np.float16))
    k, v = (torch.from_numpy(rand(rng, (b, sq, hkv, d), np.float16)) if append else None
            for _ in range(2))
    rows = int(k_cache.shape[1]) * (int(table.shape[1]) if paged else 1)
    cos, sin = (torch.from_numpy(t) if append else None for t in _tables(rng, rows, d))
    seqlens = torch.tensor(lens, dtype=torch.int32) if append else None

    def call(kc, vc):
        return fa.flash_attn_with_kvcache_impl(q, kc, vc, k, v, cos, sin, seqlens, table, None,
                                               True, (-1, -1), 0.0, False, None, 0, True)

    before = k_cache.clone()
    kc, vc = k_cache.clone(), v_cache.clone()
    expected = call(kc, vc)
    monkeypatch.setattr(fa, "_on_host", lambda x: False)
    probe = Probe()
    with probe:
        got = call(k_cache, v_cache)
    assert probe.reads == []
    for x, y in zip(got, expected):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert torch.equal(k_cache, kc) and torch.equal(v_cache, vc)
    if append:  # the appends happened (the comparison above is not of two untouched caches)
        assert not torch.equal(k_cache, before)


# ---- CUDA (the lead's H200 run) ---------------------------------------------------------------


def _cuda(x, dtype=None):
    t = torch.from_numpy(x).to("cuda")
    return t.to(dtype) if dtype is not None else t


@needs_cuda
@pytest.mark.parametrize("case", sorted(DENSE_CASES))
def test_cuda_flash_attn_func_bf16(rng, case):
    c = DENSE_CASES[case]
    b, d = 2, 128
    gen = [rand(rng, (b, c[s], c[h], d), np.float32)
           for s, h in (("sq", "hq"), ("sk", "hkv"), ("sk", "hkv"))]
    q, k, v = (_cuda(x, torch.bfloat16) for x in gen)
    kw = _call_kw(c["kw"], c["hq"])
    out, lse, _ = flash_attn_func(q, k, v, **kw, return_attn_probs=True)
    torch.cuda.synchronize()
    attnkit.check_errors()
    for i in range(b):
        q64, k64, v64 = (x[i].float().cpu().numpy() for x in (q, k, v))
        ref, ref_lse = fa_reference(q64, k64, v64, **_ref_kw(c["kw"], c["hq"]))
        naive = _naive_bf16(q[i], k[i], v[i], c["kw"], c["hq"])
        assert_close(out[i].float().cpu().numpy(), ref, naive)
        finite = np.isfinite(ref_lse)
        np.testing.assert_allclose(lse[i].cpu().numpy()[finite], ref_lse[finite], rtol=1e-3,
                                   atol=1e-2)


def _naive_bf16(q, k, v, kw, hq):
    """The same-precision yardstick: the reference's masking and bias with bf16 rounding of the
    inputs and probabilities (torch on the GPU)."""
    ref_kw = _ref_kw(kw, hq)
    sq, sk = q.shape[0], k.shape[0]
    group = hq // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = ref_kw.get("scale", q.shape[-1] ** -0.5)
    s = torch.einsum("qhd,khd->hqk", q, kk).float() * scale
    if ref_kw.get("softcap"):
        s = ref_kw["softcap"] * torch.tanh(s / ref_kw["softcap"])
    row = torch.arange(sq, device=q.device)[:, None] + sk - sq
    col = torch.arange(sk, device=q.device)[None]
    if "slopes" in ref_kw:
        slopes = torch.tensor(ref_kw["slopes"], device=q.device, dtype=torch.float32)
        s = s - slopes[:, None, None] * (row - col).abs()
    left, right = ref_kw.get("window", (-1, -1))
    right = 0 if ref_kw.get("causal") else right
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if left >= 0:
        allowed &= col >= row - left
    if right >= 0:
        allowed &= col <= row + right
    s = s.masked_fill(~allowed, float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, -1), nan=0.0).to(q.dtype)
    return torch.einsum("hqk,khd->qhd", p, vv).float().cpu().numpy()


@needs_cuda
@pytest.mark.parametrize("sq", [1, 4])
def test_cuda_kvcache_paged_bf16(rng, sq):
    b, hq, hkv, d, page = 3, 8, 2, 128, 16
    k_np, v_np, table, _ = _paged_nhd(rng, [200] * b, page, hkv, d, np.float32)
    k_cache, v_cache = _cuda(k_np, torch.bfloat16), _cuda(v_np, torch.bfloat16)
    q = _cuda(rand(rng, (b, sq, hq, d), np.float32), torch.bfloat16)
    k = _cuda(rand(rng, (b, sq, hkv, d), np.float32), torch.bfloat16)
    v = _cuda(rand(rng, (b, sq, hkv, d), np.float32), torch.bfloat16)
    cached = [0, 77, 190]
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v,
                                  cache_seqlens=torch.tensor(cached, dtype=torch.int32,
                                                             device="cuda"),
                                  block_table=_cuda(table), causal=True)
    torch.cuda.synchronize()
    attnkit.check_errors()
    for r in range(b):
        ids = torch.from_numpy(table[r][table[r] >= 0]).long().cuda()
        n = cached[r] + sq
        kr, vr = (c[ids].reshape(-1, hkv, d)[:n] for c in (k_cache, v_cache))
        assert torch.equal(kr[cached[r]:], k[r]) and torch.equal(vr[cached[r]:], v[r])
        ref, _ = fa_reference(q[r].float().cpu().numpy(), kr.float().cpu().numpy(),
                              vr.float().cpu().numpy(), causal=True)
        naive = _naive_bf16(q[r], kr, vr, dict(causal=True), hq)
        assert_close(out[r].float().cpu().numpy(), ref, naive)


@needs_cuda
def test_cuda_graph_capture_kvcache_decode(rng):
    b, hq, hkv, d, page = 4, 8, 2, 128, 16
    k_np, v_np, table, _ = _paged_nhd(rng, [256] * b, page, hkv, d, np.float32)
    k_cache, v_cache = _cuda(k_np, torch.bfloat16), _cuda(v_np, torch.bfloat16)
    table = _cuda(table)
    q = _cuda(rand(rng, (b, 1, hq, d), np.float32), torch.bfloat16)
    k = _cuda(rand(rng, (b, 1, hkv, d), np.float32), torch.bfloat16)
    v = _cuda(rand(rng, (b, 1, hkv, d), np.float32), torch.bfloat16)
    lens = torch.zeros(b, dtype=torch.int32, device="cuda")
    cos, sin = (_cuda(t) for t in _tables(rng, table.shape[1] * page, d))

    def step():
        return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin, cache_seqlens=lens,
                                       block_table=table, causal=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture, as torch recommends
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):  # replay with fresh inputs, compare with an eager call on a copy
        q.copy_(_cuda(rand(rng, q.shape, np.float32), torch.bfloat16))
        k.copy_(_cuda(rand(rng, k.shape, np.float32), torch.bfloat16))
        v.copy_(_cuda(rand(rng, v.shape, np.float32), torch.bfloat16))
        lens.copy_(torch.tensor(rng.integers(0, 200, b), dtype=torch.int32))
        kc, vc = k_cache.clone(), v_cache.clone()
        expected = flash_attn_with_kvcache(q, kc, vc, k, v, cos, sin, cache_seqlens=lens,
                                           block_table=table, causal=True)
        graph.replay()
        torch.cuda.synchronize()
        attnkit.check_errors()
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        assert torch.equal(k_cache, kc) and torch.equal(v_cache, vc)


@needs_cuda
def test_cuda_torch_compile_inductor(rng):
    q, k, v = (_cuda(rand(rng, (2, 64, 8, 128), np.float32), torch.bfloat16) for _ in range(3))

    def block(q, k, v):  # q * 0.5 is exact, and the op is opaque: equal bits to eager
        return flash_attn_func(q * 0.5, k, v, causal=True).float()

    eager = block(q, k, v)
    compiled = torch.compile(block, fullgraph=True)(q, k, v)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


@needs_torch
def test_torch_cpu_varlen_paged_matches_numpy(rng):
    hq, hkv, d, page = 4, 2, 32, 16
    lens_k, lens_q = [33, 70], [3, 1]
    k_pool, v_pool, table, _ = _paged_nhd(rng, lens_k, page, hkv, d, np.float16)
    q = rand(rng, (sum(lens_q), hq, d), np.float16)
    cu_q, cu_k = [0, 3, 4], [0, 33, 103]
    ref = flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, 3, 70, causal=True,
                                 block_table=table)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k_pool, v_pool))
    out = flash_attn_varlen_func(tq, tk, tv, cu_q, cu_k, 3, 70, causal=True,
                                 block_table=table.tolist())  # lists become int32 tensors
    np.testing.assert_array_equal(out.numpy(), ref)


def test_kvcache_strided_pool_view(rng):
    # FlashInfer's NHD pool [num_pages, 2, page_size, Hkv, D]: k / v are strided views of it.
    b, hq, hkv, d, page = 2, 4, 2, 32, 16
    pool = rand(rng, (6, 2, page, hkv, d), np.float16)
    table = np.array([[4, 1, -1], [0, 5, 2]], np.int32)
    q = rand(rng, (b, 1, hq, d), np.float16)
    k, v = rand(rng, (b, 1, hkv, d), np.float16), rand(rng, (b, 1, hkv, d), np.float16)
    lens = np.array([20, 33], np.int32)
    dense_pool = pool.copy()
    out = flash_attn_with_kvcache(q, pool[:, 0], pool[:, 1], k, v, cache_seqlens=lens,
                                  block_table=table)
    for r in range(b):
        p = lens[r]
        blk, off = table[r, p // page], p % page
        dense_pool[blk, 0, off], dense_pool[blk, 1, off] = k[r, 0], v[r, 0]
        ids = table[r, : (p + page) // page]
        kr = dense_pool[ids, 0].reshape(-1, hkv, d)[: p + 1]
        vr = dense_pool[ids, 1].reshape(-1, hkv, d)[: p + 1]
        check(out[r], None, q[r], kr, vr, np.float16)
    np.testing.assert_array_equal(pool, dense_pool)  # written through the views, nothing else
