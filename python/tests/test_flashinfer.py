"""attnkit.flashinfer: FlashInfer's paged-KV wrappers (indptr / indices / last_page_len page
tables, NHD and HND caches) against the NumPy float64 attention of conftest, on CPU torch
tensors (reference backend) and, with a GPU and attnkit's CUDA backend, in bf16 with a CUDA
graph replayed after a new plan()."""

import math

import numpy as np
import pytest
from conftest import assert_close, reference_attention

import attnkit

torch = pytest.importorskip("torch")
fi = pytest.importorskip("attnkit.flashinfer")

needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and attnkit.info()["cuda"]),
    reason="needs a CUDA GPU and attnkit built with the CUDA backend",
)
LOG2E = 1.0 / math.log(2.0)


class Pages:
    """A random paged cache in FlashInfer's form: pages of each request shuffled over a pool
    bigger than needed, K/V [pages, 2, page_size, Hkv, D] (NHD) or [pages, 2, Hkv, page_size, D]
    (HND), and each request's K/V gathered back as [len, Hkv, D] float64 for the oracle.
    pool_pages: the pool's size (default: three pages more than the requests use), so that
    page tables of different steps can address one pool."""

    def __init__(self, rng, lens, hkv, d, page_size, layout, dtype, device="cpu",
                 pool_pages=None):
        counts = [-(-n // page_size) for n in lens]
        self.total = sum(counts) + 3 if pool_pages is None else pool_pages
        assert self.total >= sum(counts), "pool_pages: fewer pages than the requests use"
        perm = rng.permutation(self.total)
        self.indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        self.indices = perm[: sum(counts)].astype(np.int32)
        self.last_page_len = np.array([n - (c - 1) * page_size for n, c in zip(lens, counts)],
                                      np.int32)
        self.lens, self.shape, self.layout = lens, (page_size, hkv, d), layout
        self.cache = self.fresh_cache(rng, dtype, device)
        self.kv = self.gather(self.cache)

    def fresh_cache(self, rng, dtype, device="cpu"):
        """Another layer's cache over the same page table."""
        nhd = rng.standard_normal((self.total, 2) + self.shape)
        data = torch.from_numpy(nhd if self.layout == "NHD" else nhd.transpose(0, 1, 3, 2, 4))
        # A fresh tensor: torch's own strides (NumPy keeps arbitrary strides on size-1 axes).
        return torch.empty(data.shape, dtype=dtype, device=device).copy_(data)

    def gather(self, cache):
        exact = cache.double().cpu().numpy()
        exact = exact if self.layout == "NHD" else exact.transpose(0, 1, 3, 2, 4)
        kv = []
        for b, n in enumerate(self.lens):
            pages = self.indices[self.indptr[b]:self.indptr[b + 1]]
            seq = exact[pages].transpose(1, 0, 2, 3, 4).reshape((2, -1) + self.shape[1:])[:, :n]
            kv.append((seq[0], seq[1]))
        return kv

    def tables(self, device="cpu"):
        return tuple(torch.from_numpy(x).to(device) for x in
                     (self.indptr, self.indices, self.last_page_len))


def _workspace(device="cpu"):
    return torch.empty(1 << 16, dtype=torch.uint8, device=device)


def _oracle(q, kv, pos, dtype, **kw):
    q = q.double().cpu().numpy()
    ref, lse = reference_attention(q, kv[0], kv[1], pos, **kw)
    naive, _ = reference_attention(q, kv[0], kv[1], pos, dtype=dtype, **kw)
    return ref, lse, naive


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("as_tuple", [False, True])
def test_decode_wrapper_matches_reference(rng, layout, as_tuple):
    hq, hkv, d, page = 8, 2, 64, 16
    lens = [1, 16, 37, 50, 17]
    pages = Pages(rng, lens, hkv, d, page, layout, torch.float16)
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(_workspace(), layout)
    wrapper.plan(*pages.tables(), hq, hkv, d, page, q_data_type=torch.float32,
                 kv_data_type=torch.float16, logits_soft_cap=3.0, window_left=20)
    # One plan, then a run per layer, each layer with its own cache over the same page table.
    for layer in [pages.cache, pages.fresh_cache(rng, torch.float16)]:
        cache = (layer[:, 0], layer[:, 1]) if as_tuple else layer
        q = torch.from_numpy(rng.standard_normal((len(lens), hq, d))).float()
        out, lse = wrapper.run(q, cache, return_lse=True)
        assert out.shape == q.shape and lse.shape == (len(lens), hq)
        for b, (n, kv) in enumerate(zip(lens, pages.gather(layer))):
            ref, ref_lse, naive = _oracle(q[b:b + 1], kv, np.array([n - 1]), np.float32,
                                          mask="window", window=21, softcap=3.0)
            assert_close(out[b:b + 1].numpy(), ref, naive)
            np.testing.assert_allclose(lse[b].numpy(), ref_lse[0] * LOG2E, rtol=1e-5, atol=1e-5)


def test_decode_wrapper_alibi_gqa_and_scale(rng):
    hq, hkv, d, page = 8, 1, 64, 8
    lens = [9, 24, 3]
    pages = Pages(rng, lens, hkv, d, page, "HND", torch.float16)
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(_workspace(), kv_layout="HND")
    wrapper.plan(*pages.tables(), hq, hkv, d, page, pos_encoding_mode="ALIBI", sm_scale=0.3,
                 q_data_type="float32", kv_data_type="float16")
    q = torch.from_numpy(rng.standard_normal((len(lens), hq, d))).float()
    out = torch.full_like(q, float("nan"))
    assert wrapper.run(q, pages.cache, out=out) is out
    slopes = np.array(attnkit.default_alibi_slopes(hq))
    for b, n in enumerate(lens):
        ref, _, naive = _oracle(q[b:b + 1], pages.kv[b], np.array([n - 1]), np.float32,
                                scale=0.3, slopes=slopes)
        assert_close(out[b:b + 1].numpy(), ref, naive)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_wrapper_appends_over_the_cache(rng, layout, causal):
    """Chunked prefill: each request's queries are the last qo_len of its cached tokens."""
    hq, hkv, d, page = 4, 2, 64, 16
    kv_lens, qo_lens = [40, 16, 7, 33], [9, 16, 1, 0]
    pages = Pages(rng, kv_lens, hkv, d, page, layout, torch.float16)
    qo_indptr = torch.tensor(np.concatenate([[0], np.cumsum(qo_lens)]), dtype=torch.int32)
    wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(_workspace(), layout)
    wrapper.plan(qo_indptr, *pages.tables(), hq, hkv, d, page, causal=causal,
                 q_data_type=torch.float32, kv_data_type=torch.float16)
    q = torch.from_numpy(rng.standard_normal((sum(qo_lens), hq, d))).float()
    outs = {None: wrapper.run(q, pages.cache)}
    if causal:  # a per-call window, as FlashInfer's run(window_left=) allows
        outs[5] = wrapper.run(q, pages.cache, window_left=5)
    for window, out in outs.items():
        start = 0
        for b, (nk, nq) in enumerate(zip(kv_lens, qo_lens)):
            if nq == 0:
                continue
            kw = dict(mask="window", window=window + 1) if window else dict(
                mask="causal" if causal else "none")
            ref, _, naive = _oracle(q[start:start + nq], pages.kv[b], np.arange(nk - nq, nk),
                                    np.float32, **kw)
            assert_close(out[start:start + nq].numpy(), ref, naive)
            start += nq


def test_cuda_graph_mode_plans_into_fixed_buffers(rng):
    """use_cuda_graph=True: plan() rewrites the same block table / seq_lens buffers (the
    addresses a captured run reads), and a run after a new plan reads the new table."""
    hq, hkv, d, page, batch = 4, 2, 64, 8, 3
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
        _workspace(), "NHD", use_cuda_graph=True,
        paged_kv_indptr_buffer=torch.empty(batch + 1, dtype=torch.int32),
        paged_kv_indices_buffer=torch.empty(32, dtype=torch.int32),
        paged_kv_last_page_len_buffer=torch.empty(batch, dtype=torch.int32),
        max_pages_per_request=8)
    assert wrapper.is_cuda_graph_enabled
    addresses = None
    for lens in ([5, 17, 30], [31, 2, 9]):
        pages = Pages(rng, lens, hkv, d, page, "NHD", torch.float16)
        wrapper.plan(*pages.tables(), hq, hkv, d, page, q_data_type=torch.float32,
                     kv_data_type=torch.float16)
        plan = wrapper._plan
        now = (plan.block_table.data_ptr(), plan.seq_lens.data_ptr())
        assert addresses in (None, now)
        addresses = now
        q = torch.from_numpy(rng.standard_normal((batch, hq, d))).float()
        out = wrapper.run(q, pages.cache)
        for b, n in enumerate(lens):
            ref, _, naive = _oracle(q[b:b + 1], pages.kv[b], np.array([n - 1]), np.float32)
            assert_close(out[b:b + 1].numpy(), ref, naive)
    with pytest.raises(attnkit.Error, match="max_pages_per_request"):
        pages = Pages(rng, [80, 1, 1], hkv, d, page, "NHD", torch.float16)
        wrapper.plan(*pages.tables(), hq, hkv, d, page, q_data_type=torch.float32,
                     kv_data_type=torch.float16)
    with pytest.raises(attnkit.Error, match="batch size 2"):
        pages = Pages(rng, [3, 4], hkv, d, page, "NHD", torch.float16)
        wrapper.plan(*pages.tables(), hq, hkv, d, page)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_run_reads_either_layout_in_place(rng, layout):
    """run()'s KvView is the caller's cache (no scratch copy), in the wrapper's layout, over the
    plan's block table of FlashInfer's page ids."""
    hq, hkv, d, page = 4, 2, 64, 16
    pages = Pages(rng, [20, 5], hkv, d, page, layout, torch.float16)
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(_workspace(), layout)
    wrapper.plan(*pages.tables(), hq, hkv, d, page, q_data_type=torch.float16)
    view = wrapper._view(torch.zeros(2, hq, d, dtype=torch.float16), pages.cache, None, None)
    assert view.layout == layout
    assert view.k.data_ptr() == pages.cache[:, 0].data_ptr()
    assert view.v.data_ptr() == pages.cache[:, 1].data_ptr()
    np.testing.assert_array_equal(view.block_table[0, :2].cpu().numpy(), pages.indices[:2])
    np.testing.assert_array_equal(view.block_table[1, :1].cpu().numpy(), pages.indices[2:3])


def test_rejections_name_the_argument(rng):
    hq, hkv, d, page = 4, 2, 64, 16
    pages = Pages(rng, [20, 5], hkv, d, page, "NHD", torch.float16)
    tables = pages.tables()
    dec = fi.BatchDecodeWithPagedKVCacheWrapper(_workspace())
    q = torch.zeros(2, hq, d, dtype=torch.float16)
    with pytest.raises(attnkit.Error, match="plan"):
        dec.run(q, pages.cache)
    bad = {
        "pos_encoding_mode": dict(pos_encoding_mode="ROPE_LLAMA"),
        "window_right": dict(window_right=-1),
        "q_len_per_req": dict(q_len_per_req=2),
        "fixed_split_size": dict(fixed_split_size=4),
        "o_data_type": dict(o_data_type=torch.float32),
        "q_data_type": dict(q_data_type="fp4"),
    }
    for name, kw in bad.items():
        with pytest.raises(attnkit.Error, match=f"^{name}: "):
            dec.plan(*tables, hq, hkv, d, page, **kw)
    last = tables[2].clone()
    last[1] = page + 1
    with pytest.raises(attnkit.Error, match="^last_page_len: got 17 at request 1"):
        dec.plan(tables[0], tables[1], last, hq, hkv, d, page)
    with pytest.raises(attnkit.Error, match="^indptr: got request 1 with no page"):
        dec.plan(torch.tensor([0, 2, 2], dtype=torch.int32), tables[1], tables[2], hq, hkv, d,
                 page)
    with pytest.raises(attnkit.Error, match="^backend: "):
        fi.BatchDecodeWithPagedKVCacheWrapper(_workspace(), backend="fa2")
    with pytest.raises(attnkit.Error, match="^kv_layout: "):
        fi.BatchDecodeWithPagedKVCacheWrapper(_workspace(), "NDH")
    with pytest.raises(attnkit.Error, match="^paged_kv_indptr_buffer: "):
        fi.BatchDecodeWithPagedKVCacheWrapper(_workspace(), use_cuda_graph=True)

    dec.plan(*tables, hq, hkv, d, page)
    out = torch.full_like(q, float("nan"))
    for kw, name in ((dict(sinks=torch.zeros(hq)), "sinks"), (dict(q_scale=0.5), "q_scale"),
                     (dict(window_left=3), "window_left"),
                     (dict(skip_softmax_threshold_scale_factor=1.0),
                      "skip_softmax_threshold_scale_factor")):
        with pytest.raises(attnkit.Error, match=f"^{name}: "):
            dec.run(q, pages.cache, out=out, **kw)
    with pytest.raises(attnkit.Error, match="^q: got torch.float32"):
        dec.run(q.float(), pages.cache, out=out)
    with pytest.raises(attnkit.Error, match="^paged_kv_cache: "):
        dec.run(q, pages.cache[:, :, :8], out=out)
    # A pool that ends at the plan's largest page id: that page is missing (the pool holds
    # three pages more than the plan uses, shuffled, so a fixed cut could still hold them all).
    short = int(pages.indices.max())
    with pytest.raises(attnkit.Error, match=f"^paged_kv_cache: got {short} pages; accepted: more "
                       f"than the largest page id of the plan \\({short}\\)"):
        dec.run(q, pages.cache[:short], out=out)
    with pytest.raises(attnkit.Error, match="^q: "):
        dec.run(q[:1], pages.cache, out=out[:1])
    assert torch.isnan(out).all()  # nothing written by a rejected call

    pre = fi.BatchPrefillWithPagedKVCacheWrapper(_workspace())
    qo = torch.tensor([0, 3, 5], dtype=torch.int32)
    for kw, name in ((dict(custom_mask=torch.ones(10, dtype=torch.bool)), "custom_mask"),
                     (dict(use_fp16_qk_reduction=True), "use_fp16_qk_reduction"),
                     (dict(head_dim_vo=32), "head_dim_vo"),
                     (dict(window_left=4), "window_left")):
        with pytest.raises(attnkit.Error, match=f"^{name}: "):
            pre.plan(qo, *tables, hq, hkv, d, page, **kw)
    with pytest.raises(attnkit.Error, match="^qo_indptr: got 2 entries"):
        pre.plan(qo[:2], *tables, hq, hkv, d, page)


@needs_cuda
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_cuda_decode_graph_replay_after_replan(rng, layout):
    """bf16 on the GPU: run() captured in a CUDA graph, then plan() with new lengths and a new
    page table and new cache contents, and the replayed graph computes the new step."""
    hq, hkv, d, page, batch = 16, 2, 128, 16, 4
    dev = "cuda"
    wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
        _workspace(dev), layout, use_cuda_graph=True,
        paged_kv_indptr_buffer=torch.empty(batch + 1, dtype=torch.int32, device=dev),
        paged_kv_indices_buffer=torch.empty(64, dtype=torch.int32, device=dev),
        paged_kv_last_page_len_buffer=torch.empty(batch, dtype=torch.int32, device=dev),
        max_pages_per_request=16)
    steps = [[3, 100, 17, 250], [250, 1, 64, 33]]
    # One pool size for both steps: the captured run() reads the one pool tensor it was
    # captured with, which each step's cache is copied into.
    pool_pages = max(sum(-(-n // page) for n in lens) for lens in steps) + 3
    pages = [Pages(rng, lens, hkv, d, page, layout, torch.bfloat16, dev, pool_pages=pool_pages)
             for lens in steps]
    pool = pages[0].cache.clone()
    q = torch.zeros(batch, hq, d, dtype=torch.bfloat16, device=dev)
    out = torch.zeros_like(q)
    wrapper.plan(*pages[0].tables(dev), hq, hkv, d, page, q_data_type=torch.bfloat16)
    wrapper.run(q, pool, out=out)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q, pool, out=out)
    for lens, step in zip(steps, pages):
        wrapper.plan(*step.tables(dev), hq, hkv, d, page, q_data_type=torch.bfloat16)
        pool.copy_(step.cache)
        q.copy_(torch.from_numpy(rng.standard_normal((batch, hq, d))).to(dev, torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        for b, n in enumerate(lens):
            ref, _, _ = _oracle(q[b:b + 1], step.kv[b], np.array([n - 1]), np.float64)
            naive = _naive_bf16(q[b:b + 1], step.kv[b], n - 1)
            assert_close(out[b:b + 1].float().cpu().numpy(), ref, naive)


@needs_cuda
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_cuda_prefill_wrapper_bf16(rng, layout):
    hq, hkv, d, page = 8, 2, 128, 16
    kv_lens, qo_lens = [300, 64, 129], [300, 1, 40]
    dev = "cuda"
    pages = Pages(rng, kv_lens, hkv, d, page, layout, torch.bfloat16, dev)
    qo_indptr = torch.tensor(np.concatenate([[0], np.cumsum(qo_lens)]), dtype=torch.int32)
    wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(_workspace(dev), layout)
    wrapper.plan(qo_indptr, *pages.tables(dev), hq, hkv, d, page, causal=True,
                 q_data_type=torch.bfloat16)
    q = torch.from_numpy(rng.standard_normal((sum(qo_lens), hq, d))).to(dev, torch.bfloat16)
    out = wrapper.run(q, pages.cache)
    torch.cuda.synchronize()
    start = 0
    for b, (nk, nq) in enumerate(zip(kv_lens, qo_lens)):
        qb = q[start:start + nq]
        ref, _, _ = _oracle(qb, pages.kv[b], np.arange(nk - nq, nk), np.float64)
        naive = _naive_bf16(qb, pages.kv[b], nk - 1)
        assert_close(out[start:start + nq].float().cpu().numpy(), ref, naive)
        start += nq


def _naive_bf16(q, kv, last_pos):
    """Causal attention computed in bf16 on the GPU (the same-precision yardstick)."""
    k, v = (torch.from_numpy(x).to(q.device, torch.bfloat16) for x in kv)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q, k).float() / q.shape[-1] ** 0.5
    pos = torch.arange(last_pos - q.shape[0] + 1, last_pos + 1, device=q.device)
    s = s.masked_fill(torch.arange(k.shape[0], device=q.device)[None] > pos[:, None],
                      float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1).to(q.dtype), v).float().cpu().numpy()
