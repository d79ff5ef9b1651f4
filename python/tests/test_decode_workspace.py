"""attnkit.DecodeWorkspace: argument checks everywhere; split-KV decode and forward through one
workspace on a GPU (skipped without torch, a GPU or attnkit's CUDA backend)."""

import numpy as np
import pytest
from conftest import assert_close, reference_attention

import attnkit

HEADS = dict(num_q_heads=8, num_kv_heads=2, head_dim=128)


@pytest.mark.parametrize(
    "kwargs, names",
    [
        (dict(max_rows=0), "max_rows"),
        (dict(max_rows=4, max_splits=1), "max_splits"),
        (dict(max_rows=4, max_splits=129), "max_splits"),
        (dict(max_rows=4, device="cpu"), "device"),
        (dict(max_rows=4, device="gpu"), "device"),
        (dict(max_rows=4, num_kv_heads=3), "num_kv_heads"),
    ],
)
def test_decode_workspace_rejects_bad_arguments(kwargs, names):
    args = dict(HEADS, max_splits=8, device="cuda")
    args.update(kwargs)
    with pytest.raises(attnkit.Error, match=names):
        attnkit.DecodeWorkspace(**args)


def test_decode_rejects_a_workspace_of_another_type(rng):
    q = rng.standard_normal((1, 8, 128)).astype(np.float32)
    k = rng.standard_normal((4, 2, 16, 128)).astype(np.float32)
    seq_lens = np.array([20], dtype=np.int32)
    table = np.array([[0, 1]], dtype=np.int32)
    with pytest.raises(attnkit.Error, match="workspace"):
        attnkit.decode(q, k, k, seq_lens, table, workspace=bytearray(16))


try:
    import torch
except ImportError:  # the argument checks above still run
    torch = None
needs_cuda = pytest.mark.skipif(
    torch is None or not (torch.cuda.is_available() and attnkit.info()["cuda"]),
    reason="needs torch, a CUDA GPU and attnkit built with the CUDA backend",
)


def _filled_cache(rng, lens, hq=8, hkv=2, d=128):
    cache = attnkit.KvCache(num_kv_heads=hkv, head_dim=d, max_seq_len=4096, dtype="bf16",
                            device="cuda", max_tokens=16384)
    for seq, n in enumerate(lens):
        cache.add(seq, [seq * 10000 + t for t in range(n)])
    view = cache.view(0, list(range(len(lens))))
    toks = sum(lens)
    q, k, v = (torch.from_numpy(rng.standard_normal((toks, h, d)).astype(np.float32))
               .to("cuda", torch.bfloat16) for h in (hq, hkv, hkv))
    rows = torch.tensor(np.repeat(np.arange(len(lens)), lens), dtype=torch.int32, device="cuda")
    pos = torch.tensor(np.concatenate([np.arange(n) for n in lens]), dtype=torch.int32,
                       device="cuda")
    attnkit.append_kv(view, pos, rows, q=q, k=k, v=v)
    return cache, view, q, k, v


def _naive_bf16_decode(q, k, v):
    """One query row [Hq, D] over keys [n, Hkv, D], softmax rounded to bf16 (the yardstick)."""
    group = q.shape[0] // k.shape[1]
    kk, vv = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    s = torch.einsum("hd,khd->hk", q.float(), kk) / q.shape[-1] ** 0.5
    p = torch.softmax(s, -1).to(torch.bfloat16).float()
    return torch.einsum("hk,khd->hd", p, vv).to(torch.bfloat16)


@needs_cuda
def test_cuda_decode_split_calls_through_one_workspace(rng):
    lens = [1500, 37, 900]
    ws = attnkit.DecodeWorkspace(**HEADS, max_rows=4, max_splits=16)
    assert ws.bytes > 0 and ws.device == "cuda:0"
    for _ in range(2):  # fresh data every round, the same workspace
        cache, view, q, k, v = _filled_cache(rng, lens)
        last = torch.tensor(np.cumsum(lens) - 1, device="cuda")
        qd = q[last].contiguous()
        outs = {}
        for splits in (3, 16, 0):
            out = torch.full_like(qd, float("nan"))
            attnkit.decode(qd, view, num_splits=splits, workspace=ws, out=out)
            outs[splits] = out
        plain = attnkit.decode(qd, view, num_splits=16)  # the per-call workspace
        # Splits allowed to merge over sums accumulated in L2 (3 rows x 2 KV heads x 100 splits:
        # more CTAs than the H200's SMs): the same bound, not the same bits.
        outs["accumulated"] = attnkit.decode(qd, view, num_splits=100, deterministic=False)
        torch.cuda.synchronize()
        # Same kernel, same split count, same merge order: identical bits.
        assert torch.equal(outs[16], plain)
        start = 0
        for r, n in enumerate(lens):
            sl = slice(start, start + n)
            start += n
            q64, k64, v64 = (x[sl].float().cpu().numpy() for x in (q, k, v))
            ref, _ = reference_attention(q64[-1:], k64, v64, np.array([n - 1]))
            naive = _naive_bf16_decode(q[sl][-1], k[sl], v[sl]).float().cpu().numpy()[None]
            for out in outs.values():
                assert_close(out[r:r + 1].float().cpu().numpy(), ref, naive)


@needs_cuda
def test_cuda_decode_rejects_a_too_small_workspace(rng):
    lens = [2000, 2000, 2000]  # 32 tiles a row: all 8 splits get keys
    cache, view, q, _, _ = _filled_cache(rng, lens)
    last = torch.tensor(np.cumsum(lens) - 1, device="cuda")
    qd = q[last].contiguous()
    out = torch.full_like(qd, float("nan"))
    # Capacity is checked against what the call needs (rows x splits x Hq x (D + 1) partial words,
    # rows x KV heads counters), not against max_rows / max_splits themselves: 3 rows x 8 splits
    # need 24768 words; these hold 2 x 2 x 8 x 129 = 4128 and 4 x 4 x 8 x 129 = 16512.
    for max_rows, max_splits in ((2, 2), (4, 4)):
        small = attnkit.DecodeWorkspace(**HEADS, max_rows=max_rows, max_splits=max_splits)
        with pytest.raises(attnkit.Error, match="workspace"):
            attnkit.decode(qd, view, num_splits=8, workspace=small, out=out)
    torch.cuda.synchronize()
    assert torch.isnan(out.float()).all()  # rejected before any launch: nothing written
    # One that holds the call exactly (3 rows x 8 splits) runs it.
    exact = attnkit.DecodeWorkspace(**HEADS, max_rows=3, max_splits=8)
    attnkit.decode(qd, view, num_splits=8, workspace=exact, out=out)
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all()


@needs_cuda
def test_cuda_forward_generation_through_a_decode_workspace(rng):
    hq, hkv, d = HEADS["num_q_heads"], HEADS["num_kv_heads"], HEADS["head_dim"]
    width = (hq + 2 * hkv) * d
    lens = [700, 1200]
    cache, view, _, _, _ = _filled_cache(rng, lens)
    for seq in range(2):
        cache.append(seq, [1])
    view = cache.view(0, [0, 1])
    step = torch.from_numpy(rng.standard_normal((2, width)).astype(np.float32)).to(
        "cuda", torch.bfloat16)
    ws = attnkit.DecodeWorkspace(**HEADS, max_rows=2, max_splits=8)
    # The same step twice (append_kv rewrites the same slots): through the workspace and through
    # the per-call allocation, the same split count, so the same bits.
    got = attnkit.forward(step, view, [0, 1, 2], lens, num_context=0, num_splits=8,
                          decode_workspace=ws)
    plain = attnkit.forward(step, view, [0, 1, 2], lens, num_context=0, num_splits=8)
    torch.cuda.synchronize()
    assert torch.isfinite(got.float()).all()
    assert torch.equal(got, plain)
    small = attnkit.DecodeWorkspace(**HEADS, max_rows=2, max_splits=4)
    with pytest.raises(attnkit.Error, match="decode_workspace"):
        attnkit.forward(step, view, [0, 1, 2], lens, num_context=0, num_splits=8,
                        decode_workspace=small)
