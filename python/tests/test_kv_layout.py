"""The NHD cache layout ([num_blocks, T, Hkv, D], vLLM's, flash_attn's and FlashInfer's) beside
HND ([num_blocks, Hkv, T, D]): KvView / decode / KvCache take layout="NHD", give the results of the
HND cache of the same contents bit for bit, and name NHD's dims in their errors; flash_attn's
NHD caches are read in place (CPU; the CUDA runs are in test_flash_attn_compat / the GPU suite)."""

import numpy as np
import pytest
from conftest import assert_close, reference_attention

import attnkit
from attnkit import flash_attn as fa


def _to_nhd(x):
    """[num_blocks, Hkv, T, D] -> a fresh [num_blocks, T, Hkv, D] array of the same elements."""
    return np.array(x.transpose(0, 2, 1, 3), order="C", copy=True)


def _paged(rng, lens, hkv, d, page, dtype=np.float16):
    """A random HND cache with shuffled blocks for rows of `lens` tokens."""
    width = max(-(-n // page) for n in lens)
    blocks = len(lens) * width + 2
    k = rng.standard_normal((blocks, hkv, page, d)).astype(dtype)
    v = rng.standard_normal((blocks, hkv, page, d)).astype(dtype)
    table = rng.permutation(blocks)[: len(lens) * width].reshape(len(lens), width)
    return k, v, table.astype(np.int32), np.array(lens, np.int32)


def test_decode_over_nhd_arrays_equals_hnd(rng):
    hq, hkv, d, page = 8, 2, 32, 16
    k, v, table, lens = _paged(rng, [1, 16, 17, 45], hkv, d, page)
    q = rng.standard_normal((4, hq, d)).astype(np.float16)
    for kw in (dict(), dict(window=7, sink_tokens=2), dict(alibi=True, softcap=20.0),
               dict(num_splits=3)):
        hnd = attnkit.decode(q, k, v, lens, table, return_lse=True, **kw)
        nhd = attnkit.decode(q, _to_nhd(k), _to_nhd(v), lens, table, layout="NHD",
                             return_lse=True, **kw)
        view = attnkit.KvView(_to_nhd(k), _to_nhd(v), lens, table, layout="NHD")
        nhd_view = attnkit.decode(q, view, return_lse=True, **kw)
        for a, b, c in zip(hnd, nhd, nhd_view):
            assert np.isfinite(a).all()
            np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(a, c)
    # Against the oracle, for one row (the NHD arrays read as [T, Hkv, D] per block).
    out = attnkit.decode(q, _to_nhd(k), _to_nhd(v), lens, table, layout="NHD")
    r, n = 3, int(lens[3])
    kr = _to_nhd(k)[table[r]].reshape(-1, hkv, d)[:n]
    vr = _to_nhd(v)[table[r]].reshape(-1, hkv, d)[:n]
    ref, _ = reference_attention(q[r:r + 1], kr, vr, np.array([n - 1]))
    naive, _ = reference_attention(q[r:r + 1], kr, vr, np.array([n - 1]), dtype=np.float16)
    assert_close(out[r:r + 1], ref, naive)


def test_contiguous_and_quantized_nhd_caches_equal_hnd(rng):
    hq, hkv, d = 4, 2, 16
    # Contiguous: row r is block r, T its capacity.
    k = rng.standard_normal((3, hkv, 40, d)).astype(np.float16)
    v = rng.standard_normal((3, hkv, 40, d)).astype(np.float16)
    lens = np.array([1, 33, 40], np.int32)
    q = rng.standard_normal((3, hq, d)).astype(np.float16)
    np.testing.assert_array_equal(
        attnkit.decode(q, k, v, lens), attnkit.decode(q, _to_nhd(k), _to_nhd(v), lens,
                                                      layout="NHD"))
    # int8 codes with per-head scales.
    k8, v8, table, lens = _paged(rng, [9, 30], hkv, d, 8)
    k8 = np.clip(np.round(k8.astype(np.float32) * 40), -127, 127).astype(np.int8)
    v8 = np.clip(np.round(v8.astype(np.float32) * 40), -127, 127).astype(np.int8)
    scales = dict(k_scale=np.array([0.02, 0.03], np.float32),
                  v_scale=np.array([0.025, 0.01], np.float32))
    q = rng.standard_normal((2, hq, d)).astype(np.float32)
    np.testing.assert_array_equal(
        attnkit.decode(q, k8, v8, lens, table, **scales),
        attnkit.decode(q, _to_nhd(k8), _to_nhd(v8), lens, table, layout="NHD", **scales))


def test_kv_cache_nhd_pool_append_prefill_decode_forward(rng):
    hq, hkv, d, t = 4, 2, 32, 16
    width = (hq + 2 * hkv) * d
    lens = [20, 35]
    caches = {layout: attnkit.KvCache(num_kv_heads=hkv, head_dim=d, tokens_per_block=t,
                                      max_tokens=16 * t, max_seq_len=128, num_layers=2,
                                      layout=layout)
              for layout in ("HND", "NHD")}
    nhd = caches["NHD"]
    assert nhd.layout == "NHD"
    assert nhd.pool.shape == (nhd.num_blocks, 2, 2, t, hkv, d)
    assert caches["HND"].pool.shape == (nhd.num_blocks, 2, 2, hkv, t, d)
    toks = sum(lens)
    qkv = rng.standard_normal((toks, width)).astype(np.float16)
    positions = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
    rows = np.concatenate([np.full(n, r) for r, n in enumerate(lens)]).astype(np.int32)
    cu = np.array([0, lens[0], toks], np.int32)
    step = rng.standard_normal((2, width)).astype(np.float16)
    results = {}
    for layout, cache in caches.items():
        for seq, n in enumerate(lens):
            assert cache.add(seq, [seq * 1000 + i for i in range(n)]) == 0
        view = cache.view(1, [0, 1])
        assert view.layout == layout
        assert view.num_kv_heads == hkv and view.tokens_per_block == t
        q = attnkit.append_kv(view, positions, rows, qkv=qkv, rope="gpt_neox")
        out = attnkit.prefill(q, kv_cache=view, cu_seqlens_q=cu)
        dec = attnkit.decode(q[cu[1:] - 1], view)
        for seq in range(2):
            cache.append(seq, [1])
        gen = attnkit.forward(step, cache.view(1, [0, 1]), [0, 1, 2], lens, num_context=0)
        results[layout] = (q, out, dec, gen)
    for a, b in zip(results["HND"], results["NHD"]):
        assert np.isfinite(a).all()
        np.testing.assert_array_equal(a, b)
    # The same blocks hold the same K / V, a token's heads side by side in NHD.
    np.testing.assert_array_equal(caches["NHD"].pool,
                                  caches["HND"].pool.transpose(0, 1, 2, 4, 3, 5))


def test_layout_errors_name_the_argument_and_nhd_dims(rng):
    hq, hkv, d, page = 4, 2, 16, 8
    k, v, table, lens = _paged(rng, [5, 9], hkv, d, page)
    q = rng.standard_normal((2, hq, d)).astype(np.float16)
    expected = r"^layout: expected 'HND' or 'NHD', got a str \('nhd'\)"
    with pytest.raises(attnkit.Error, match=expected):
        attnkit.KvView(k, v, lens, table, layout="nhd")
    with pytest.raises(attnkit.Error, match="^layout: "):
        attnkit.decode(q, k, v, lens, table, layout="TND")
    with pytest.raises(attnkit.Error, match="^layout: 'NHD' given with a KvView of layout 'HND'"):
        attnkit.decode(q, attnkit.KvView(k, v, lens, table), layout="NHD")
    with pytest.raises(attnkit.Error, match="^layout: "):
        attnkit.KvCache(num_kv_heads=2, head_dim=16, max_tokens=64, max_seq_len=32,
                        layout="THD")
    # An HND array passed as NHD (a transposed view): its blocks are not [T, Hkv, D] contiguous.
    with pytest.raises(attnkit.Error,
                       match=r"^k_cache: each block \[T, Hkv, D\] must be contiguous "
                             r"\(strides \[\*, Hkv\*D, D, 1\]\)"):
        attnkit.decode(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), lens, table,
                       layout="NHD")
    # The KV heads are NHD's dim 2 (and T its dim 1) in the messages.
    k3 = np.zeros((k.shape[0], page, 3, d), np.float16)
    divide = r"shape\[2\]: must divide q\.shape\[1\] \(4\), got 3"
    with pytest.raises(attnkit.Error, match=r"^k_cache\." + divide):
        attnkit.decode(q, k3, k3, lens, table, layout="NHD")
    k12 = np.zeros((k.shape[0], 12, hkv, d), np.float16)
    with pytest.raises(attnkit.Error, match=r"^decode: k_cache\.shape\[1\]: expected 8, 16"):
        attnkit.decode(q, k12, k12, lens, table, layout="NHD")
    view = attnkit.KvView(k3, k3, lens, table, layout="NHD")
    with pytest.raises(attnkit.Error, match=r"^kv_cache\.k\." + divide):
        attnkit.prefill(np.zeros((2, hq, d), np.float16), kv_cache=view,
                        cu_seqlens_q=np.array([0, 1, 2], np.int32))


# ---- flash_attn's NHD caches: read where they lie ---------------------------------------------


def test_flash_attn_caches_are_read_in_place(rng):
    hkv, d = 2, 16
    lens = np.array([5, 40], np.int32)
    for page, packed in ((16, True), (16, False), (256, True), (24, True), (24, False)):
        pool = rng.standard_normal((7, 2, page, hkv, d)).astype(np.float16)
        k, v = (pool[:, 0], pool[:, 1]) if not packed else (
            np.ascontiguousarray(pool[:, 0]), np.ascontiguousarray(pool[:, 1]))
        table = np.array([[3, 0, 1], [6, 2, 5]], np.int32)[:, : -(-40 // page)]
        view, _, in_place = fa._nhd_view(k, v, table, lens)
        assert view.layout == "NHD"
        # A page of 16 is one block; pages of 256 and 24 are split (blocks of 128 and 8), which a
        # pool of packed pages allows without a copy, and K / V sliced out of one pool do not.
        assert in_place == (page == 16 or packed)
        assert np.shares_memory(view.k, k) == in_place
        if page == 16:
            assert view.k is k and view.v is v
    k = rng.standard_normal((3, 64, hkv, d)).astype(np.float16)
    view, _, in_place = fa._nhd_view(k, k.copy(), None, lens)
    assert in_place and view.k is k and view.block_table is None


def test_flash_attn_kvcache_in_place_appends_and_restores_a_rejected_call(rng, monkeypatch):
    b, hq, hkv, d, page = 2, 4, 2, 32, 16
    k_cache = rng.standard_normal((6, page, hkv, d)).astype(np.float16)
    v_cache = rng.standard_normal((6, page, hkv, d)).astype(np.float16)
    table = np.array([[4, 1, -1], [0, 5, 2]], np.int32)
    lens = np.array([20, 33], np.int32)
    q = rng.standard_normal((b, 1, hq, d)).astype(np.float16)
    k = rng.standard_normal((b, 1, hkv, d)).astype(np.float16)
    v = rng.standard_normal((b, 1, hkv, d)).astype(np.float16)
    before = (k_cache.copy(), v_cache.copy())

    def rejected(*args, **kw):
        raise attnkit.Error("decode: rejected by the test")

    monkeypatch.setattr(fa, "decode", rejected)
    with pytest.raises(attnkit.Error, match="rejected by the test"):
        fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens,
                                   block_table=table)
    np.testing.assert_array_equal(k_cache, before[0])  # the in-place appends were undone
    np.testing.assert_array_equal(v_cache, before[1])
    monkeypatch.undo()
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens,
                                     block_table=table)
    for r in range(b):
        p = lens[r]
        blk, off = table[r, p // page], p % page
        np.testing.assert_array_equal(k_cache[blk, off], k[r, 0])
        np.testing.assert_array_equal(v_cache[blk, off], v[r, 0])
        ids = table[r, : (p + page) // page]
        kr, vr = (x[ids].reshape(-1, hkv, d)[: p + 1] for x in (k_cache, v_cache))
        ref, _ = reference_attention(q[r], kr, vr, np.array([p]))
        naive, _ = reference_attention(q[r], kr, vr, np.array([p]), dtype=np.float16)
        assert_close(out[r], ref, naive)
    # Nothing but the two new tokens' slots changed.
    changed = np.argwhere((k_cache != before[0]).any(axis=(2, 3)))
    assert sorted(map(tuple, changed)) == sorted(
        (int(table[r, lens[r] // page]), int(lens[r] % page)) for r in range(b))
