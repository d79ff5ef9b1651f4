"""attnkit.torch: the torch.library custom ops (schema, fake implementations, torch.compile) and
attnkit.torch.sdpa against torch's own scaled_dot_product_attention. CPU tensors here (reference
backend); the CUDA tests need a GPU, torch with CUDA and attnkit's CUDA backend."""

import numpy as np
import pytest
from conftest import assert_close, tolerance

import attnkit

torch = pytest.importorskip("torch")
import attnkit.torch as ak_torch  # noqa: E402  (needs torch)

needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and attnkit.info()["cuda"]),
    reason="needs a CUDA GPU, torch with CUDA and attnkit built with the CUDA backend",
)

F = torch.nn.functional


def _t(rng, shape, dtype=torch.float32, device="cpu"):
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(device, dtype)


def test_ops_are_registered():
    for name in ("flash_attn", "flash_attn_varlen", "flash_attn_with_kvcache", "sdpa"):
        assert hasattr(torch.ops.attnkit, name), name
    schema = str(torch.ops.attnkit.flash_attn_with_kvcache.default._schema)
    assert "Tensor(a1!) k_cache" in schema and "Tensor(a2!) v_cache" in schema, schema


def _opcheck(op, args):
    # Schema (declared mutations), fake implementation vs the real one, and AOT dispatch.
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor",
                                                "test_aot_dispatch_dynamic"))


def test_opcheck_flash_attn(rng):
    q, k, v = _t(rng, (2, 5, 4, 32)), _t(rng, (2, 9, 2, 32)), _t(rng, (2, 9, 2, 32))
    _opcheck(torch.ops.attnkit.flash_attn.default,
             (q, k, v, None, True, 3, 0, 0.0, None, True))
    _opcheck(torch.ops.attnkit.flash_attn.default,
             (q, k, v, 0.2, False, -1, -1, 2.0, None, False))


def test_opcheck_flash_attn_varlen(rng):
    q, k, v = _t(rng, (10, 4, 32)), _t(rng, (14, 2, 32)), _t(rng, (14, 2, 32))
    cu_q = torch.tensor([0, 3, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 14], dtype=torch.int32)
    _opcheck(torch.ops.attnkit.flash_attn_varlen.default,
             (q, k, v, cu_q, cu_k, 7, 8, None, True, -1, -1, 0.0,
              torch.tensor([0.5, 0.25, 0.125, 0.0625]), True, None, None))


def test_opcheck_flash_attn_with_kvcache(rng):
    k_cache, v_cache = _t(rng, (6, 16, 2, 32), torch.bfloat16), _t(rng, (6, 16, 2, 32),
                                                                   torch.bfloat16)
    q = _t(rng, (2, 2, 4, 32), torch.bfloat16)
    k, v = _t(rng, (2, 2, 2, 32), torch.bfloat16), _t(rng, (2, 2, 2, 32), torch.bfloat16)
    table = torch.tensor([[4, 1, 5], [0, 3, -1]], dtype=torch.int32)
    lens = torch.tensor([20, 9], dtype=torch.int32)
    _opcheck(torch.ops.attnkit.flash_attn_with_kvcache.default,
             (q, k_cache, v_cache, k, v, None, None, lens, table, None, True, -1, -1, 0.0, True,
              None, 0, True))


def test_opcheck_sdpa(rng):
    q, k, v = _t(rng, (2, 4, 6, 32)), _t(rng, (2, 2, 9, 32)), _t(rng, (2, 2, 9, 32))
    _opcheck(torch.ops.attnkit.sdpa.default, (q, k, v, True, None, True))
    _opcheck(torch.ops.attnkit.sdpa.default, (q, k, v, False, 0.3, True))


SDPA_CASES = {
    "plain": dict(hq=4, hkv=4, l=7, s=7, kw={}),
    "cross_scale": dict(hq=4, hkv=4, l=5, s=12, kw=dict(scale=0.2)),
    "causal": dict(hq=4, hkv=4, l=9, s=9, kw=dict(is_causal=True)),
    "causal_fewer_queries": dict(hq=4, hkv=4, l=4, s=11, kw=dict(is_causal=True)),
    "gqa_causal": dict(hq=8, hkv=2, l=10, s=10, kw=dict(is_causal=True, enable_gqa=True)),
}


@pytest.mark.parametrize("case", sorted(SDPA_CASES))
def test_sdpa_matches_torch(rng, case):
    c = SDPA_CASES[case]
    q = _t(rng, (2, c["hq"], c["l"], 64))
    k, v = _t(rng, (2, c["hkv"], c["s"], 64)), _t(rng, (2, c["hkv"], c["s"], 64))
    out = ak_torch.sdpa(q, k, v, **c["kw"])
    assert out.shape == q.shape and out.dtype == q.dtype
    kw = dict(c["kw"])
    if kw.pop("enable_gqa", False):  # torch's reference in float64, GQA by repeating heads
        k, v = (x.repeat_interleave(c["hq"] // c["hkv"], 1) for x in (k, v))
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kw)
    naive = F.scaled_dot_product_attention(q, k, v, **kw)
    assert_close(out.numpy(), ref.numpy(), naive.double().numpy())


def test_sdpa_three_dims_and_strided(rng):
    q, k, v = _t(rng, (3, 8, 32)), _t(rng, (3, 8, 32)), _t(rng, (3, 8, 32))
    out = ak_torch.sdpa(q, k, v, is_causal=True)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    assert out.shape == (3, 8, 32)
    assert_close(out.numpy(), ref.numpy(),
                 F.scaled_dot_product_attention(q, k, v, is_causal=True).double().numpy())
    # [B, L, H, E] storage viewed as [B, H, L, E] (what a model's transpose(1, 2) gives).
    qs, ks, vs = (_t(rng, (2, 6, 4, 32)).transpose(1, 2) for _ in range(3))
    out = ak_torch.sdpa(qs, ks, vs)
    ref = F.scaled_dot_product_attention(qs.double(), ks.double(), vs.double())
    assert_close(out.numpy(), ref.numpy(),
                 F.scaled_dot_product_attention(qs, ks, vs).double().numpy())


@pytest.mark.parametrize("kw, shapes, name", [
    (dict(attn_mask=torch.ones(5, 5, dtype=torch.bool)), None, "attn_mask"),
    (dict(dropout_p=0.1), None, "dropout_p"),
    (dict(is_causal=True), ((1, 2, 6, 32), (1, 2, 5, 32)), "is_causal"),
    (dict(), ((1, 4, 5, 32), (1, 2, 5, 32)), "key"),
    (dict(), ((1, 2, 5, 32), (1, 2, 5, 16)), "key"),
    (dict(scale=float("inf")), None, "scale"),
])
def test_sdpa_rejects(rng, kw, shapes, name):
    qs, ks = shapes or ((1, 2, 5, 32), (1, 2, 5, 32))
    q, k, v = _t(rng, qs), _t(rng, ks), _t(rng, ks)
    with pytest.raises(attnkit.Error, match=f"^{name}: "):
        ak_torch.sdpa(q, k, v, **kw)


def test_sdpa_compile_fullgraph(rng):
    q, k, v = _t(rng, (2, 4, 8, 32)), _t(rng, (2, 4, 8, 32)), _t(rng, (2, 4, 8, 32))

    def layer(q, k, v):
        return ak_torch.sdpa(q.sin(), k, v, is_causal=True).transpose(1, 2).flatten(2)

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v), layer(q, k, v), rtol=0, atol=0)


@needs_cuda
@pytest.mark.parametrize("case", sorted(SDPA_CASES))
def test_cuda_sdpa_bf16_matches_torch(rng, case):
    c = SDPA_CASES[case]
    q = _t(rng, (2, c["hq"], c["l"] * 16, 128), torch.bfloat16, "cuda")
    k = _t(rng, (2, c["hkv"], c["s"] * 16, 128), torch.bfloat16, "cuda")
    v = _t(rng, (2, c["hkv"], c["s"] * 16, 128), torch.bfloat16, "cuda")
    out = ak_torch.sdpa(q, k, v, **c["kw"])
    torch.cuda.synchronize()
    attnkit.check_errors()
    kw = dict(c["kw"])
    if kw.pop("enable_gqa", False):
        k, v = (x.repeat_interleave(c["hq"] // c["hkv"], 1) for x in (k, v))
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **kw)
    naive = F.scaled_dot_product_attention(q, k, v, **kw)  # torch's bf16 kernel: the yardstick
    err = (out.double() - ref).abs().max().item()
    assert err <= tolerance(naive.double().cpu().numpy(), ref.cpu().numpy())


@needs_cuda
def test_cuda_graph_capture_sdpa(rng):
    q, k, v = (_t(rng, (2, 8, 256, 128), torch.bfloat16, "cuda") for _ in range(3))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ak_torch.sdpa(q, k, v, is_causal=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ak_torch.sdpa(q, k, v, is_causal=True)
    for _ in range(2):
        for x in (q, k, v):
            x.copy_(_t(rng, x.shape, torch.bfloat16, "cuda"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, ak_torch.sdpa(q, k, v, is_causal=True), rtol=0, atol=0)


@needs_cuda
def test_cuda_compile_reduce_overhead(rng):
    # mode="reduce-overhead": inductor plus CUDA graphs around the custom ops.
    q, k, v = (_t(rng, (1, 8, 128, 128), torch.bfloat16, "cuda") for _ in range(3))

    def layer(q, k, v):
        return ak_torch.sdpa(q * 0.5, k, v, is_causal=True).float()  # exact ops around it

    compiled = torch.compile(layer, fullgraph=True, mode="reduce-overhead")
    for _ in range(3):
        got = compiled(q, k, v).clone()
    torch.testing.assert_close(got, layer(q, k, v), rtol=0, atol=0)
