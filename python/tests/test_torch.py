"""PyTorch tensors through DLPack: CPU tensors here, CUDA tensors on a GPU (skipped
without torch, a GPU or attnkit's CUDA backend)."""

import numpy as np
import pytest
from conftest import assert_close, reference_attention

import attnkit

torch = pytest.importorskip("torch")

needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and attnkit.info()["cuda"]),
    reason="needs a CUDA GPU and attnkit built with the CUDA backend",
)


def test_torch_cpu_prefill_allocates_torch(rng):
    q = torch.from_numpy(rng.standard_normal((12, 4, 64)).astype(np.float32))
    k = torch.from_numpy(rng.standard_normal((12, 2, 64)).astype(np.float32))
    v = torch.from_numpy(rng.standard_normal((12, 2, 64)).astype(np.float32))
    out, lse = attnkit.prefill(q, k, v, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and lse.shape == (12, 4)
    ref, _ = reference_attention(q.numpy(), k.numpy(), v.numpy(), np.arange(12))
    np.testing.assert_allclose(out.numpy(), ref, atol=1e-5)


def _naive_bf16(q, k, v, causal):
    """Attention computed in bf16 on the GPU (the same-precision yardstick), heads [S, H, D]."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q, kk).float() / q.shape[-1] ** 0.5
    if causal:
        n_q, n_k = q.shape[0], k.shape[0]
        key = torch.arange(n_k, device=q.device)[None]
        mask = key > torch.arange(n_q, device=q.device)[:, None] + (n_k - n_q)
        s = s.masked_fill(mask, float("-inf"))
    p = torch.softmax(s, -1).to(q.dtype)
    return torch.einsum("hqk,khd->qhd", p, vv)


@needs_cuda
@pytest.mark.parametrize("backend", ["auto", "vanilla"])
def test_cuda_prefill_bf16(rng, backend):
    n, hq, hkv, d = 300, 8, 2, 128
    shapes = ((n, hq, d), (n, hkv, d), (n, hkv, d))
    gen = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    q, k, v = (torch.from_numpy(x).to("cuda", torch.bfloat16) for x in gen)
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    attnkit.prefill(q, k, v, cu, cu, out=out, backend=backend, max_seqlen_q=n, max_seqlen_k=n)
    torch.cuda.synchronize()
    q64, k64, v64 = (x.float().cpu().numpy() for x in (q, k, v))
    ref, _ = reference_attention(q64, k64, v64, np.arange(n))
    naive = _naive_bf16(q, k, v, True).float().cpu().numpy()
    assert_close(out.float().cpu().numpy(), ref, naive)


@needs_cuda
def test_cuda_decode_bf16_kv_cache(rng):
    hq, hkv, d, lens = 8, 2, 128, [5, 70]
    cache = attnkit.KvCache(num_kv_heads=hkv, head_dim=d, max_seq_len=256, dtype="bf16",
                            device="cuda", max_tokens=4096)
    for seq, n in enumerate(lens):
        cache.add(seq, [seq * 1000 + t for t in range(n)])
    view = cache.view(0, [0, 1])
    toks = sum(lens)
    q, k, v = (torch.from_numpy(rng.standard_normal((toks, h, d)).astype(np.float32))
               .to("cuda", torch.bfloat16) for h in (hq, hkv, hkv))
    rows = torch.tensor(np.repeat([0, 1], lens), dtype=torch.int32, device="cuda")
    pos = torch.tensor(np.concatenate([np.arange(n) for n in lens]), dtype=torch.int32,
                       device="cuda")
    attnkit.append_kv(view, pos, rows, q=q, k=k, v=v)
    last = torch.tensor(np.cumsum(lens) - 1, device="cuda")
    out = attnkit.decode(q[last].contiguous(), view)
    torch.cuda.synchronize()
    start = 0
    for r, n in enumerate(lens):
        sl = slice(start, start + n)
        start += n
        q64, k64, v64 = (x[sl].float().cpu().numpy() for x in (q, k, v))
        ref, _ = reference_attention(q64[-1:], k64, v64, np.array([n - 1]))
        naive = _naive_bf16(q[sl][-1:], k[sl], v[sl], True).float().cpu().numpy()
        assert_close(out[r:r + 1].float().cpu().numpy(), ref, naive)
