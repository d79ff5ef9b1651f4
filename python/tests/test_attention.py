"""prefill / decode / dense / merge_states on NumPy arrays (CPU, reference backend) against a
NumPy float64 attention."""

import numpy as np
import pytest
from conftest import assert_close, reference_attention

import attnkit


def _varlen(rng, lens_q, lens_k, hq, hkv, d, dtype):
    tq, tk = sum(lens_q), sum(lens_k)
    q = rng.standard_normal((tq, hq, d)).astype(dtype)
    k = rng.standard_normal((tk, hkv, d)).astype(dtype)
    v = rng.standard_normal((tk, hkv, d)).astype(dtype)
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    return q, k, v, cu_q, cu_k


def _ref_varlen(q, k, v, cu_q, cu_k, dtype, **kw):
    outs, lses = [], []
    for i in range(len(cu_q) - 1):
        qi, ki, vi = q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]]
        pos = np.arange(len(ki) - len(qi), len(ki))  # bottom-right aligned
        o, l = reference_attention(qi, ki, vi, pos, dtype=dtype, **kw)
        outs.append(o)
        lses.append(l)
    return np.concatenate(outs), np.concatenate(lses)


CASES = {
    "causal": dict(hq=4, hkv=4, lens_q=[5, 17, 1], lens_k=[5, 17, 1], kw={}),
    "gqa_chunk": dict(hq=8, hkv=2, lens_q=[3, 9], lens_k=[20, 9], kw={}),
    "window_sink": dict(hq=4, hkv=2, lens_q=[30, 12], lens_k=[30, 12],
                        kw=dict(window=7, sink_tokens=2)),
    "cross": dict(hq=4, hkv=1, lens_q=[9, 4], lens_k=[5, 13], kw=dict(causal=False)),
    "alibi_softcap": dict(hq=4, hkv=2, lens_q=[11], lens_k=[11],
                          kw=dict(alibi=True, softcap=5.0, softmax_scale=0.3)),
}


def _ref_kwargs(kw, hq):
    out = {}
    if kw.get("window"):
        out.update(mask="window", window=kw["window"], sink=kw.get("sink_tokens", 0))
    elif kw.get("causal") is False:
        out["mask"] = "none"
    if kw.get("alibi"):
        out["slopes"] = np.array(attnkit.default_alibi_slopes(hq))
    if kw.get("softcap"):
        out["softcap"] = kw["softcap"]
    if kw.get("softmax_scale"):
        out["scale"] = kw["softmax_scale"]
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_prefill_matches_numpy(rng, case, dtype):
    c = CASES[case]
    d = 64
    q, k, v, cu_q, cu_k = _varlen(rng, c["lens_q"], c["lens_k"], c["hq"], c["hkv"], d, dtype)
    out = np.full(q.shape, np.nan, dtype=dtype)  # poisoned: unwritten elements fail
    res, lse = attnkit.prefill(q, k, v, cu_q, cu_k, out=out, return_lse=True, **c["kw"])
    assert res is out
    rk = _ref_varlen(q, k, v, cu_q, cu_k, np.float64, **_ref_kwargs(c["kw"], c["hq"]))
    naive = _ref_varlen(q, k, v, cu_q, cu_k, dtype, **_ref_kwargs(c["kw"], c["hq"]))
    assert_close(out, rk[0], naive[0])
    assert lse.dtype == np.float32 and lse.shape == (q.shape[0], c["hq"])
    np.testing.assert_allclose(lse, rk[1], rtol=1e-4, atol=1e-3)


def test_prefill_allocates_numpy_output(rng):
    q, k, v, cu_q, cu_k = _varlen(rng, [6], [6], 2, 2, 64, np.float32)
    out = attnkit.prefill(q, k, v)  # one sequence, causal, out allocated
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == q.shape
    ref, _ = reference_attention(q, k, v, np.arange(6))
    np.testing.assert_allclose(out, ref, atol=1e-5)


def test_prefill_strided_tokens_work_sliced_head_dim_rejected(rng):
    q, k, v, _, _ = _varlen(rng, [16], [8], 2, 2, 64, np.float32)
    q_strided = q[::2]  # token stride 2: accepted (only the last dimension must be contiguous)
    out = attnkit.prefill(q_strided, k, v)
    ref, _ = reference_attention(q_strided, k, v, np.arange(8))
    np.testing.assert_allclose(out, ref, atol=1e-5)
    wide = rng.standard_normal((8, 2, 128)).astype(np.float32)
    with pytest.raises(attnkit.Error, match="last dimension must be contiguous"):
        attnkit.prefill(wide[..., ::2], k, v)


def test_prefill_bad_input_raises_cpp_message_and_leaves_out(rng):
    q, k, v, cu_q, cu_k = _varlen(rng, [4, 4], [4, 4], 4, 2, 64, np.float32)
    out = np.full(q.shape, np.nan, dtype=np.float32)
    bad_k = k[:, :, :32].copy()  # head_dim 32 != 64
    with pytest.raises(attnkit.Error) as err:
        attnkit.prefill(q, bad_k, v, cu_q, cu_k, out=out)
    assert isinstance(err.value, ValueError)
    assert "prefill: k" in str(err.value) and "64" in str(err.value)
    assert np.isnan(out).all(), "a rejected call wrote into out"
    bad_cu = np.array([0, 5, 8], dtype=np.int32)  # 5 queries but 4 keys in sequence 0
    with pytest.raises(attnkit.Error, match="cu_seqlens_q"):
        attnkit.prefill(q, k, v, bad_cu, cu_k, out=out)
    assert np.isnan(out).all()
    with pytest.raises(attnkit.Error, match="out"):
        attnkit.prefill(q, k, v, cu_q, cu_k, out=np.empty(q.shape, dtype=np.float16))
    with pytest.raises(attnkit.Error, match="backend 'fused'"):
        attnkit.prefill(q, k, v, cu_q, cu_k, backend="fused")


def _paged_cache(rng, lens, hkv, d, block, dtype, extra_blocks=3):
    """A [num_blocks, 2, Hkv, T, D] pool with shuffled block ids; returns the pool, the table
    and the dense K/V of each row."""
    max_blocks = max((n + block - 1) // block for n in lens)
    num_blocks = len(lens) * max_blocks + extra_blocks
    pool = np.full((num_blocks, 2, hkv, block, d), np.nan, dtype=dtype)
    table = np.full((len(lens), max_blocks), -1, dtype=np.int32)
    ids = rng.permutation(num_blocks)
    dense_kv = []
    for r, n in enumerate(lens):
        kr = rng.standard_normal((n, hkv, d)).astype(dtype)
        vr = rng.standard_normal((n, hkv, d)).astype(dtype)
        for b in range((n + block - 1) // block):
            bid = ids[r * max_blocks + b]
            table[r, b] = bid
            t = slice(b * block, min(n, (b + 1) * block))
            pool[bid, 0, :, : t.stop - t.start] = kr[t].transpose(1, 0, 2)
            pool[bid, 1, :, : t.stop - t.start] = vr[t].transpose(1, 0, 2)
        dense_kv.append((kr, vr))
    return pool, table, dense_kv


@pytest.mark.parametrize("q_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("window", [None, 9])
def test_decode_paged_matches_numpy(rng, q_dtype, window):
    hq, hkv, d, block = 8, 2, 64, 16
    lens = [1, 16, 37, 50]
    pool, table, dense_kv = _paged_cache(rng, lens, hkv, d, block, np.float16)
    q = rng.standard_normal((len(lens), hq, d)).astype(q_dtype)
    out = np.full(q.shape, np.nan, dtype=q_dtype)
    attnkit.decode(q, pool[:, 0], pool[:, 1], np.array(lens, np.int32), table, window=window,
                   out=out)
    kw = dict(mask="window", window=window) if window else {}
    for r, n in enumerate(lens):
        kr, vr = dense_kv[r]
        ref, _ = reference_attention(q[r:r + 1], kr, vr, np.array([n - 1]), **kw)
        naive, _ = reference_attention(q[r:r + 1], kr, vr, np.array([n - 1]), dtype=q_dtype, **kw)
        assert_close(out[r:r + 1], ref, naive)


def test_decode_batch_invariant_rows_equal_alone(rng):
    """batch_invariant=True: the reference accepts it, changes no bit, and a row alone equals the
    same row in the batch; a forced split count is rejected."""
    hq, hkv, d, block = 4, 2, 64, 16
    lens = [5, 33, 17]
    pool, table, _ = _paged_cache(rng, lens, hkv, d, block, np.float16)
    q = rng.standard_normal((len(lens), hq, d)).astype(np.float32)
    lens32 = np.array(lens, np.int32)
    base, base_lse = attnkit.decode(q, pool[:, 0], pool[:, 1], lens32, table, return_lse=True)
    got, got_lse = attnkit.decode(q, pool[:, 0], pool[:, 1], lens32, table, return_lse=True,
                                  batch_invariant=True)
    np.testing.assert_array_equal(got, base)
    np.testing.assert_array_equal(got_lse, base_lse)
    for r in range(len(lens)):
        alone, alone_lse = attnkit.decode(q[r:r + 1], pool[:, 0], pool[:, 1], lens32[r:r + 1],
                                          table[r:r + 1], return_lse=True, batch_invariant=True)
        np.testing.assert_array_equal(alone[0], got[r])
        np.testing.assert_array_equal(alone_lse[0], got_lse[r])
    with pytest.raises(attnkit.Error, match="num_splits"):
        attnkit.decode(q, pool[:, 0], pool[:, 1], lens32, table, num_splits=2,
                       batch_invariant=True)


def test_decode_bad_block_id_rejected(rng):
    pool, table, _ = _paged_cache(rng, [20], 2, 64, 16, np.float16)
    q = rng.standard_normal((1, 2, 64)).astype(np.float32)
    out = np.full(q.shape, np.nan, dtype=np.float32)
    table[0, 1] = pool.shape[0] + 5
    with pytest.raises(attnkit.Error, match="block_table"):
        attnkit.decode(q, pool[:, 0], pool[:, 1], [20], table, out=out)
    assert np.isnan(out).all()


def test_merge_states_halves_equal_whole(rng):
    hq, hkv, d, n_q, n_k = 4, 2, 64, 7, 40
    q = rng.standard_normal((n_q, hq, d)).astype(np.float32)
    k = rng.standard_normal((n_k, hkv, d)).astype(np.float32)
    v = rng.standard_normal((n_k, hkv, d)).astype(np.float32)
    whole, whole_lse = attnkit.prefill(q, k, v, causal=False, return_lse=True)
    a, lse_a = attnkit.prefill(q, k[:13], v[:13], causal=False, return_lse=True)
    b, lse_b = attnkit.prefill(q, k[13:], v[13:], causal=False, return_lse=True)
    out, lse = attnkit.merge_states(a, lse_a, b, lse_b)
    np.testing.assert_allclose(out, whole, atol=1e-5)
    np.testing.assert_allclose(lse, whole_lse, atol=1e-5)
    # An empty partial state (lse = -inf) leaves the other one unchanged.
    empty_lse = np.full_like(lse_a, -np.inf)
    out2 = attnkit.merge_states(a, lse_a, np.zeros_like(b), empty_lse, return_lse=False)
    np.testing.assert_allclose(out2, a, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_dense_matches_numpy(rng, dtype):
    b, sq, skv, hq, hkv, d = 2, 19, 33, 4, 2, 64
    q = rng.standard_normal((b, sq, hq, d)).astype(dtype)
    k = rng.standard_normal((b, skv, hkv, d)).astype(dtype)
    v = rng.standard_normal((b, skv, hkv, d)).astype(dtype)
    out, lse, stats = attnkit.dense(q, k, v, return_lse=True, return_stats=True)
    assert stats["tiles_skipped"] == 0
    for i in range(b):
        ref, ref_lse = reference_attention(q[i], k[i], v[i], np.arange(sq), mask="none")
        naive, _ = reference_attention(q[i], k[i], v[i], np.arange(sq), mask="none", dtype=dtype)
        assert_close(out[i], ref, naive)
        np.testing.assert_allclose(lse[i], ref_lse, rtol=1e-4, atol=1e-3)


def test_dense_with_config_role(rng):
    cfg = attnkit.AttentionConfig.from_json(
        '{"default": {"backend": "vanilla"},'
        ' "per_role": {"cross": {"skip_softmax": {"threshold": 1e9}}}}'
    )
    q = rng.standard_normal((1, 32, 2, 64)).astype(np.float32)
    k = rng.standard_normal((1, 64, 2, 64)).astype(np.float32)
    v = rng.standard_normal((1, 64, 2, 64)).astype(np.float32)
    plain = attnkit.dense(q, k, v, config=cfg, role="self")
    ref, _ = reference_attention(q[0], k[0], v[0], np.arange(32), mask="none")
    np.testing.assert_allclose(plain[0], ref, atol=1e-5)
    # A huge lambda skips every tile that can be skipped; tiny tiles make that observable.
    _, stats = attnkit.dense(q, k, v, config=cfg, role="cross", block_m=16, block_n=16,
                             return_stats=True)
    assert stats["tiles_total"] > 0 and stats["tiles_skipped"] > 0
    with pytest.raises(attnkit.Error, match="fused"):
        attnkit.dense(q, k, v, backend="fused")


def test_prefill_skip_softmax_with_config_role(rng):
    cfg = attnkit.AttentionConfig.from_json(
        '{"per_role": {"self": {"skip_softmax": {"threshold": 1e9}},'
        ' "self.gated": {"skip_softmax": {"threshold": 1e9, "disabled_until_timestep": 0.5}}}}'
    )
    q, k, v, cu_q, cu_k = _varlen(rng, [40, 9], [40, 30], 2, 2, 64, np.float32)
    plain = attnkit.prefill(q, k, v, cu_q, cu_k)
    stats = np.full(4, -1, dtype=np.int64)
    # lambda = 1e9 keeps only the first (diagonal) key tile of each 16-row query tile.
    skipped = attnkit.prefill(q, k, v, cu_q, cu_k, config=cfg, role="self", block_m=16,
                              block_n=16, skip_stats=stats)
    total, n_skipped, block_m, block_n = stats.tolist()
    # Query tiles: sequence 0 rows 0-15 / 16-31 / 32-39 see 1 / 2 / 3 key tiles; sequence 1's one
    # tile (positions 21-29) sees 2. Per head: 8 pairs, of which 3 + 1 are not the first.
    assert (total, n_skipped, block_m, block_n) == (2 * 8, 2 * 4, 16, 16)
    assert not np.array_equal(skipped, plain)
    np.testing.assert_allclose(skipped[:16], plain[:16], atol=1e-6)  # one key tile: nothing lost
    # A closed gate is the plain call bit for bit; the stats still count the tiles.
    gated = attnkit.prefill(q, k, v, cu_q, cu_k, config=cfg, role="self.gated", timestep=0.8,
                            block_m=16, block_n=16, skip_stats=stats)
    assert np.array_equal(gated, plain)
    assert stats.tolist() == [2 * 8, 0, 16, 16]
    with pytest.raises(attnkit.Error, match="skip_stats"):
        attnkit.prefill(q, k, v, cu_q, cu_k, config=cfg, role="self",
                        skip_stats=np.zeros(2, dtype=np.int64))
    with pytest.raises(attnkit.Error, match="skip_softmax"):
        attnkit.prefill(q, k, v, cu_q, cu_k, window=8, skip_softmax={"threshold": 0.1})


def test_info():
    info = attnkit.info()
    assert info["version"] == attnkit.__version__
    assert isinstance(info["cuda"], bool) and isinstance(info["devices"], list)


def test_kernel_choice_validated_and_cpu_runs_reference(rng):
    # kernel= picks the fused kernel family on CUDA tensors; CPU tensors run the reference with
    # every choice, and a name outside the three raises attnkit.Error naming `kernel`.
    q, k, v, cu_q, cu_k = _varlen(rng, [7, 3], [7, 3], 4, 2, 32, np.float32)
    ref = attnkit.prefill(q, k, v, cu_q, cu_k)
    for kernel in ("auto", "portable", "hopper"):
        np.testing.assert_array_equal(attnkit.prefill(q, k, v, cu_q, cu_k, kernel=kernel), ref)
    out = np.full_like(q, np.nan)
    with pytest.raises(attnkit.Error, match="kernel: expected 'auto', 'portable' or 'hopper'"):
        attnkit.prefill(q, k, v, cu_q, cu_k, kernel="fa3", out=out)
    assert np.isnan(out).all()
    qd = rng.standard_normal((1, 9, 2, 32)).astype(np.float32)
    with pytest.raises(attnkit.Error, match="kernel"):
        attnkit.dense(qd, qd, qd, kernel="sm90")
