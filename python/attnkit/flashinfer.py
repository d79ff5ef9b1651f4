"""FlashInfer-style paged-KV wrappers over attnkit's decode / prefill (PyTorch tensors).

:class:`BatchDecodeWithPagedKVCacheWrapper` and :class:`BatchPrefillWithPagedKVCacheWrapper`
take FlashInfer's constructor, ``plan()`` and ``run()`` arguments (names, order, defaults) so
that a FlashInfer user changes the import: ``plan()`` once per step converts FlashInfer's page
table (``indptr`` / ``indices`` / ``last_page_len``, the CSR of each request's pages) into
attnkit's block table and seq_lens on the device, and ``run()`` once per layer calls
``attnkit.decode`` / ``attnkit.prefill`` over a :class:`attnkit.KvView` of the layer's cache::

    from attnkit.flashinfer import BatchDecodeWithPagedKVCacheWrapper
    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace, "HND")
    wrapper.plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                 page_size, q_data_type=torch.bfloat16)
    for layer in range(num_layers):
        o = wrapper.run(q[layer], kv_cache[layer])

Where attnkit differs (docs/python.md, "FlashInfer"):

- Layout: attnkit's kernels read both of FlashInfer's page layouts in place, ``kv_layout="NHD"``
  (the default, [pages, page_size, Hkv, D]) and ``"HND"`` ([pages, Hkv, page_size, D]);
  page_size is one of attnkit's block sizes (8, 16, 32, 64 or 128).
- LSE: returned in FlashInfer's base 2 (attnkit's natural-log LSE times log2(e)).
- Options that change only how the result is computed (``use_tensor_cores``, ``enable_pdl``,
  ``non_blocking``, ``disable_split_kv`` for prefill) are accepted and have no effect; options
  that change the result and that attnkit does not compute (RoPE inside attention, custom
  masks, sinks, fp16 QK reduction, fp8 queries, ``q_len_per_req > 1``, ...) raise
  :class:`attnkit.Error` naming the argument. The workspace buffer is only used for its device:
  split-KV decode keeps its own :class:`attnkit.DecodeWorkspace`.

CUDA graphs: with ``use_cuda_graph=True`` the block table, seq_lens (and cu_seqlens_q) live in
buffers allocated once, that ``plan()`` (outside the graph) overwrites in place, the split-KV
workspace is allocated once, and ``run()`` neither allocates (give ``out=``), synchronizes nor
reads device memory on the host, so a ``run()`` captured in a graph replays correctly after
later ``plan()`` calls with the same batch size. Scales given as Python floats are turned into
device tensors once per value (do a first run before capture, or pass tensors).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import torch

import attnkit

from . import Error

__all__ = ["BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper"]

_LOG2E = 1.0 / math.log(2.0)
_CAUSAL_WINDOWS = "-1 with causal=False (attnkit's windows are causal)"
_BACKENDS = ("auto", "fused", "vanilla")
_DTYPES = {
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "e4m3": torch.float8_e4m3fn,
    "int8": torch.int8,
}


def _reject(name: str, got: Any, accepted: str) -> None:
    raise Error(f"{name}: got {got}; accepted: {accepted}")


def _dtype(x: Any, name: str) -> Optional[torch.dtype]:
    if x is None or isinstance(x, torch.dtype):
        return x
    if isinstance(x, str) and x.removeprefix("torch.") in _DTYPES:
        return _DTYPES[x.removeprefix("torch.")]
    _reject(name, repr(x), f"a torch.dtype or one of {', '.join(_DTYPES)}")


def _host_ints(x: Any, name: str) -> np.ndarray:
    """A 1-D int64 NumPy copy (reads device tensors back: plan() synchronizes, as FlashInfer's)."""
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point or x.dtype == torch.bool or x.ndim != 1:
            _reject(name, f"a {x.dtype} tensor of shape {list(x.shape)}", "a 1-D integer tensor")
        return x.detach().to("cpu", torch.int64).numpy()
    arr = np.asarray(x)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        _reject(name, f"an array of dtype {arr.dtype} and shape {list(arr.shape)}", "1-D integers")
    return arr.astype(np.int64)


def _must_be(name: str, value: Any, default: Any, why: str) -> None:
    if value is not default and value != default:
        _reject(name, repr(value), f"{default!r} ({why})")


class _Plan:
    """attnkit's view of one FlashInfer page table, on the wrapper's device."""

    def __init__(self) -> None:
        self.batch = 0
        self.seq_lens: Optional[torch.Tensor] = None  # int32 [batch]
        self.block_table: Optional[torch.Tensor] = None  # int32 [batch, width]
        self.max_page = -1  # largest page id referenced (checked against the cache at run)
        self.max_seq_len = 0


class _PagedWrapper:
    _kind = ""

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str,
        use_cuda_graph: bool,
        indptr_buf: Optional[torch.Tensor],
        indices_buf: Optional[torch.Tensor],
        last_page_len_buf: Optional[torch.Tensor],
        backend: str,
        jit_args: Any,
        max_pages_per_request: Optional[int],
    ) -> None:
        if not isinstance(float_workspace_buffer, torch.Tensor):
            _reject(
                "float_workspace_buffer",
                type(float_workspace_buffer).__name__,
                "a torch.Tensor on the device the wrapper runs on",
            )
        if kv_layout not in ("NHD", "HND"):
            _reject("kv_layout", repr(kv_layout), '"NHD" or "HND"')
        if backend not in _BACKENDS:
            _reject(
                "backend",
                repr(backend),
                f"{', '.join(_BACKENDS)} (attnkit's backends; FlashInfer's fa2 / fa3 / "
                "trtllm-gen / cudnn / cute-dsl are FlashInfer kernels)",
            )
        if jit_args is not None:
            _reject("jit_args", "custom JIT arguments", "None (attnkit has no JIT variants)")
        self.device = float_workspace_buffer.device
        self._kv_layout = kv_layout
        self._backend = backend
        self._use_cuda_graph = bool(use_cuda_graph)
        self._plan: Optional[_Plan] = None
        self._spec: dict = {}
        self._scales: dict = {}
        self._workspace: Optional[attnkit.DecodeWorkspace] = None
        if self._use_cuda_graph:
            for name, buf in (
                ("paged_kv_indptr_buffer", indptr_buf),
                ("paged_kv_indices_buffer", indices_buf),
                ("paged_kv_last_page_len_buffer", last_page_len_buf),
            ):
                if not isinstance(buf, torch.Tensor) or buf.ndim != 1:
                    _reject(name, type(buf).__name__, "a 1-D torch.Tensor with use_cuda_graph=True")
            batch = int(last_page_len_buf.shape[0])
            if int(indptr_buf.shape[0]) != batch + 1:
                _reject(
                    "paged_kv_indptr_buffer",
                    f"{indptr_buf.shape[0]} entries",
                    f"batch_size + 1 = {batch + 1} (paged_kv_last_page_len_buffer has {batch})",
                )
            capacity = int(indices_buf.shape[0])
            width = int(max_pages_per_request) if max_pages_per_request else capacity
            if width < 1 or width > max(capacity, 1):
                _reject(
                    "max_pages_per_request",
                    width,
                    f"1 .. {capacity} (the paged_kv_indices_buffer length)",
                )
            # Fixed addresses that plan() overwrites: what a captured run() reads.
            self._fixed = _Plan()
            self._fixed.batch = batch
            self._fixed.seq_lens = torch.zeros(batch, dtype=torch.int32, device=self.device)
            self._fixed.block_table = torch.full(
                (batch, width), -1, dtype=torch.int32, device=self.device
            )
            self._capacity = capacity

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    # ---- plan -----------------------------------------------------------------------------

    def _plan_pages(
        self, indptr: Any, indices: Any, last_page_len: Any, page_size: int, prefix: str
    ) -> _Plan:
        """The block table and seq_lens of FlashInfer's page table (host arithmetic, then one
        copy to the device). ``prefix`` is the argument prefix of the caller ("" or
        "paged_kv_")."""
        n_indptr, n_indices = prefix + "indptr", prefix + "indices"
        n_last = prefix + "last_page_len"
        ptr = _host_ints(indptr, n_indptr)
        idx = _host_ints(indices, n_indices)
        last = _host_ints(last_page_len, n_last)
        batch = int(last.shape[0])
        if ptr.shape[0] != batch + 1:
            _reject(n_indptr, f"{ptr.shape[0]} entries", f"batch_size + 1 = {batch + 1}")
        pages = np.diff(ptr)
        if ptr.shape[0] and (ptr[0] != 0 or (pages < 0).any()):
            _reject(n_indptr, ptr.tolist()[:8], "non-decreasing offsets starting at 0")
        if ptr[-1] > idx.shape[0]:
            _reject(n_indices, f"{idx.shape[0]} entries", f">= {n_indptr}[-1] = {int(ptr[-1])}")
        if (pages < 1).any():
            row = int(np.argmax(pages < 1))
            _reject(n_indptr, f"request {row} with no page", "at least one page per request")
        if ((last < 1) | (last > page_size)).any():
            row = int(np.argmax((last < 1) | (last > page_size)))
            _reject(n_last, f"{int(last[row])} at request {row}", f"1 .. page_size = {page_size}")
        used = idx[: ptr[-1]]
        if used.size and used.min() < 0:
            _reject(n_indices, f"page {int(used.min())}", "page ids >= 0")
        plan = _Plan()
        plan.batch = batch
        seq_lens = (pages - 1) * page_size + last
        plan.max_seq_len = int(seq_lens.max()) if batch else 0
        plan.max_page = int(used.max()) if used.size else -1
        width = int(pages.max()) if batch else 0
        fixed = self._fixed if self._use_cuda_graph else None
        if fixed is not None:
            if batch != fixed.batch:
                _reject(
                    n_last,
                    f"batch size {batch}",
                    f"{fixed.batch}, fixed by the buffers of a use_cuda_graph wrapper",
                )
            if width > fixed.block_table.shape[1] or used.size > self._capacity:
                _reject(
                    n_indptr,
                    f"{width} pages in one request, {used.size} in all",
                    f"at most {fixed.block_table.shape[1]} and {self._capacity} "
                    "(max_pages_per_request, paged_kv_indices_buffer)",
                )
            width = int(fixed.block_table.shape[1])
        table = np.full((batch, max(width, 1)), -1, dtype=np.int32)
        for b in range(batch):
            n = int(pages[b])
            table[b, :n] = used[ptr[b] : ptr[b] + n]
        host_lens = torch.from_numpy(seq_lens.astype(np.int32))
        host_table = torch.from_numpy(table)
        if fixed is not None:
            fixed.seq_lens.copy_(host_lens)
            fixed.block_table.copy_(host_table)
            plan.seq_lens, plan.block_table = fixed.seq_lens, fixed.block_table
        else:
            plan.seq_lens = host_lens.to(self.device)
            plan.block_table = host_table.to(self.device)
        return plan

    def _plan_spec(
        self,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        pos_encoding_mode: str,
        window_left: int,
        logits_soft_cap: Optional[float],
        sm_scale: Optional[float],
        q_data_type: Any,
        kv_data_type: Any,
        o_data_type: Any,
    ) -> None:
        if pos_encoding_mode not in ("NONE", "ALIBI"):
            _reject(
                "pos_encoding_mode",
                repr(pos_encoding_mode),
                '"NONE" or "ALIBI" (attnkit rotates Q and K once, in append_kv, before caching: '
                "store rotated keys and pass rotated queries)",
            )
        if int(window_left) < -1:
            _reject("window_left", window_left, "-1 (no window) or >= 0")
        q_dtype = _dtype(q_data_type, "q_data_type")
        kv_dtype = _dtype(kv_data_type, "kv_data_type") or q_dtype
        o_dtype = _dtype(o_data_type, "o_data_type") or q_dtype
        if o_dtype != q_dtype:
            _reject("o_data_type", o_dtype, f"{q_dtype} (attnkit writes the query's dtype)")
        self._spec = {
            "num_qo_heads": int(num_qo_heads),
            "num_kv_heads": int(num_kv_heads),
            "head_dim": int(head_dim),
            "page_size": int(page_size),
            "alibi": pos_encoding_mode == "ALIBI",
            "window_left": int(window_left),
            "softcap": float(logits_soft_cap or 0.0),
            "sm_scale": sm_scale,
            "q_dtype": q_dtype,
            "kv_dtype": kv_dtype,
        }

    # ---- run ------------------------------------------------------------------------------

    def _view(self, q: torch.Tensor, paged_kv_cache: Any, k_scale: Any, v_scale: Any):
        if self._plan is None:
            raise Error(f"run: plan() has not been called on this {type(self).__name__}")
        spec = self._spec
        if not isinstance(q, torch.Tensor) or q.dtype != spec["q_dtype"]:
            got = q.dtype if isinstance(q, torch.Tensor) else type(q).__name__
            _reject("q", got, f"a {spec['q_dtype']} tensor (plan's q_data_type)")
        if q.device != self.device:
            _reject("q", f"device {q.device}", f"{self.device} (the workspace buffer's device)")
        if isinstance(paged_kv_cache, tuple) and len(paged_kv_cache) == 2:
            k, v = paged_kv_cache
            if k.ndim != 4 or v.ndim != 4:
                _reject("paged_kv_cache", f"shapes {list(k.shape)}, {list(v.shape)}", "4-D (k, v)")
        elif isinstance(paged_kv_cache, torch.Tensor) and paged_kv_cache.ndim == 5:
            if paged_kv_cache.shape[1] != 2:
                _reject("paged_kv_cache", list(paged_kv_cache.shape), "[pages, 2, ...] (K then V)")
            k, v = paged_kv_cache[:, 0], paged_kv_cache[:, 1]
        else:
            _reject(
                "paged_kv_cache",
                type(paged_kv_cache).__name__,
                "a (k_cache, v_cache) tuple of 4-D tensors or one 5-D [pages, 2, ...] tensor",
            )
        nhd = self._kv_layout == "NHD"
        page_axis, head_axis = (1, 2) if nhd else (2, 1)
        expect = (spec["page_size"], spec["num_kv_heads"], spec["head_dim"])
        got = (int(k.shape[page_axis]), int(k.shape[head_axis]), int(k.shape[3]))
        if got != expect or tuple(v.shape) != tuple(k.shape):
            layout = "[pages, page_size, Hkv, D]" if nhd else "[pages, Hkv, page_size, D]"
            _reject(
                "paged_kv_cache",
                f"k {list(k.shape)}, v {list(v.shape)}",
                f"{layout} ({self._kv_layout}) with page_size, Hkv, D = {expect} (plan's)",
            )
        if k.dtype != spec["kv_dtype"] or v.dtype != k.dtype:
            _reject("paged_kv_cache", f"dtype {k.dtype}", f"{spec['kv_dtype']} (plan's)")
        if self._plan.max_page >= int(k.shape[0]):
            _reject(
                "paged_kv_cache",
                f"{k.shape[0]} pages",
                f"more than the largest page id of the plan ({self._plan.max_page})",
            )
        return attnkit.KvView(
            k,
            v,
            self._plan.seq_lens,
            self._plan.block_table,
            k_scale=self._scale(k_scale, "k_scale"),
            v_scale=self._scale(v_scale, "v_scale"),
            layout=self._kv_layout,
        )

    def _scale(self, scale: Any, name: str) -> Any:
        if scale is None or isinstance(scale, torch.Tensor):
            return scale
        if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            _reject(name, repr(scale), "None, a positive float, or a float32 tensor [1] / [Hkv]")
        key = float(scale)
        if key not in self._scales:
            self._scales[key] = torch.tensor([key], dtype=torch.float32, device=self.device)
        return self._scales[key]

    def _window(self, window_left: Optional[int]) -> Optional[int]:
        left = self._spec["window_left"] if window_left is None else int(window_left)
        return None if left < 0 else left + 1  # FlashInfer's left bound excludes the query

    def run_return_lse(self, q: torch.Tensor, paged_kv_cache: Any, *args: Any, **kw: Any) -> Any:
        """run(..., return_lse=True): (out, base-2 LSE)."""
        return self.run(q, paged_kv_cache, *args, return_lse=True, **kw)

    def _attention_args(self) -> dict:
        """The attention options plan() fixed, as attnkit's keyword arguments."""
        spec = self._spec
        return {
            "softmax_scale": spec["sm_scale"],
            "alibi": spec["alibi"],
            "softcap": spec["softcap"],
            "backend": self._backend,
        }

    @staticmethod
    def _lse_base2(result: Any, return_lse: bool, lse_given: bool) -> Any:
        if not (return_lse or lse_given):
            return result
        out, lse = result
        lse.mul_(_LOG2E)  # attnkit's natural log -> FlashInfer's base 2 (-inf stays -inf)
        return (out, lse) if return_lse else out

    @staticmethod
    def _no_extra(args: tuple, **options: Any) -> None:
        if args:
            _reject("*args", f"{len(args)} extra arguments", "none (no custom kernels in attnkit)")
        for name, value in options.items():
            if value is not None:
                _reject(name, repr(value) if not isinstance(value, torch.Tensor) else "a tensor",
                        "None (attnkit does not compute it)")


class BatchDecodeWithPagedKVCacheWrapper(_PagedWrapper):
    """FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` on ``attnkit.decode``.

    Constructor, ``plan`` and ``run`` take FlashInfer's arguments (see the module doc for what
    attnkit does not serve). ``max_pages_per_request`` (attnkit's own, ``use_cuda_graph`` only):
    the width of the fixed block table (default: the ``paged_kv_indices_buffer`` length).
    ``run(q [batch, Hq, D], paged_kv_cache)`` returns out [batch, Hq, D] (and the base-2 LSE
    float32 [batch, Hq] with ``return_lse``).
    """

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        paged_kv_indptr_buffer: Optional[torch.Tensor] = None,
        paged_kv_indices_buffer: Optional[torch.Tensor] = None,
        paged_kv_last_page_len_buffer: Optional[torch.Tensor] = None,
        backend: str = "auto",
        jit_args: Any = None,
        *,
        max_pages_per_request: Optional[int] = None,
    ) -> None:
        super().__init__(
            float_workspace_buffer,
            kv_layout,
            use_cuda_graph,
            paged_kv_indptr_buffer,
            paged_kv_indices_buffer,
            paged_kv_last_page_len_buffer,
            backend,
            jit_args,
            max_pages_per_request,
        )
        self._use_tensor_cores = bool(use_tensor_cores)  # a kernel choice; attnkit picks its own
        self._num_splits = 0

    @property
    def use_tensor_cores(self) -> bool:
        return self._use_tensor_cores

    def plan(
        self,
        indptr: Any,
        indices: Any,
        last_page_len: Any,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *,
        pos_encoding_mode: str = "NONE",
        window_left: int = -1,
        window_right: int = 0,
        logits_soft_cap: Optional[float] = None,
        q_data_type: Any = "float16",
        kv_data_type: Any = None,
        o_data_type: Any = None,
        data_type: Any = None,
        sm_scale: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
        non_blocking: bool = True,
        block_tables: Any = None,
        seq_lens: Any = None,
        fixed_split_size: Optional[int] = None,
        disable_split_kv: bool = False,
        q_len_per_req: int = 1,
    ) -> None:
        """FlashInfer's decode plan: once per step, before the layers' run() calls (reads the
        page table on the host and copies attnkit's block table to the device; not inside a
        CUDA graph). ``data_type`` (FlashInfer's deprecated spelling) sets q and kv dtypes;
        ``disable_split_kv=True`` runs one split per row; rope_scale / rope_theta are unused as
        in FlashInfer without RoPE."""
        _must_be("window_right", window_right, 0, "attnkit's decode window is causal")
        _must_be("q_len_per_req", q_len_per_req, 1, "one query per request; for more use "
                 "BatchPrefillWithPagedKVCacheWrapper with causal=True")
        self._no_extra(
            (), block_tables=block_tables, seq_lens=seq_lens, fixed_split_size=fixed_split_size
        )
        if data_type is not None:
            q_data_type = kv_data_type = data_type
        self._plan_spec(
            num_qo_heads,
            num_kv_heads,
            head_dim,
            page_size,
            pos_encoding_mode,
            window_left,
            logits_soft_cap,
            sm_scale,
            q_data_type,
            kv_data_type,
            o_data_type,
        )
        plan = self._plan_pages(indptr, indices, last_page_len, int(page_size), "")
        self._num_splits = 1 if disable_split_kv else 0
        if self.device.type == "cuda":
            ws = self._workspace
            key = (int(num_qo_heads), int(num_kv_heads), int(head_dim))
            if ws is None or self._ws_key[0] != key or self._ws_key[1] < plan.batch:
                self._workspace = attnkit.DecodeWorkspace(
                    num_q_heads=key[0],
                    num_kv_heads=key[1],
                    head_dim=key[2],
                    max_rows=max(plan.batch, 1),
                    device=str(self.device),
                )
                self._ws_key = (key, plan.batch)
        self._plan = plan

    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache: Any,
        *args: Any,
        q_scale: Optional[float] = None,
        k_scale: Any = None,
        v_scale: Any = None,
        out: Optional[torch.Tensor] = None,
        lse: Optional[torch.Tensor] = None,
        return_lse: bool = False,
        enable_pdl: Optional[bool] = None,
        window_left: Optional[int] = None,
        sinks: Optional[torch.Tensor] = None,
        q_len_per_req: Optional[int] = None,
        skip_softmax_threshold_scale_factor: Optional[float] = None,
        kv_cache_sf: Any = None,
    ) -> Any:
        """Decode attention of one layer over the planned page table (see the class doc)."""
        self._no_extra(
            args,
            q_scale=q_scale,
            sinks=sinks,
            skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor,
            kv_cache_sf=kv_cache_sf,
        )
        if q_len_per_req is not None:
            _must_be("q_len_per_req", q_len_per_req, 1, "one query per request")
        if window_left is not None and int(window_left) != self._spec.get("window_left"):
            _reject("window_left", window_left, f"None or plan's {self._spec.get('window_left')}")
        view = self._view(q, paged_kv_cache, k_scale, v_scale)
        if q.ndim != 3 or q.shape[0] != self._plan.batch:
            _reject("q", list(q.shape), f"[{self._plan.batch}, Hq, D] (plan's batch size)")
        result = attnkit.decode(
            q,
            view,
            window=self._window(None),
            num_splits=self._num_splits,
            max_seq_len=0 if self._use_cuda_graph else self._plan.max_seq_len,
            workspace=self._workspace,
            out=out,
            lse=lse,
            return_lse=return_lse,
            **self._attention_args(),
        )
        return self._lse_base2(result, return_lse, lse is not None)


class BatchPrefillWithPagedKVCacheWrapper(_PagedWrapper):
    """FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` on ``attnkit.prefill`` over the
    paged cache (chunked prefill / append: each request's queries are the last qo_len of its
    kv_len cached tokens, bottom-right aligned as in FlashInfer).

    ``causal`` defaults to False, as in FlashInfer; ``window_left >= 0`` needs causal=True
    (attnkit's windows are causal). ``run(q [qo_indptr[-1], Hq, D], paged_kv_cache)`` returns
    out of q's shape (and the base-2 LSE float32 [qo_indptr[-1], Hq] with ``return_lse``).
    ``max_pages_per_request``: as for the decode wrapper; with ``use_cuda_graph`` the query
    length bound passed to the kernels is ``qo_indptr_buf``'s capacity, fixed at capture.
    """

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: Optional[torch.Tensor] = None,
        paged_kv_indptr_buf: Optional[torch.Tensor] = None,
        paged_kv_indices_buf: Optional[torch.Tensor] = None,
        paged_kv_last_page_len_buf: Optional[torch.Tensor] = None,
        custom_mask_buf: Optional[torch.Tensor] = None,
        mask_indptr_buf: Optional[torch.Tensor] = None,
        backend: str = "auto",
        jit_args: Any = None,
        jit_kwargs: Any = None,
        *,
        max_pages_per_request: Optional[int] = None,
        max_qo_len: Optional[int] = None,
    ) -> None:
        super().__init__(
            float_workspace_buffer,
            kv_layout,
            use_cuda_graph,
            paged_kv_indptr_buf,
            paged_kv_indices_buf,
            paged_kv_last_page_len_buf,
            backend,
            jit_args,
            max_pages_per_request,
        )
        self._no_extra(
            (), custom_mask_buf=custom_mask_buf, mask_indptr_buf=mask_indptr_buf,
            jit_kwargs=jit_kwargs
        )
        self._max_qo_len = int(max_qo_len) if max_qo_len else 0
        if self._use_cuda_graph:
            if not isinstance(qo_indptr_buf, torch.Tensor) or qo_indptr_buf.ndim != 1 or int(
                qo_indptr_buf.shape[0]
            ) != self._fixed.batch + 1:
                _reject(
                    "qo_indptr_buf",
                    type(qo_indptr_buf).__name__,
                    f"a 1-D torch.Tensor of batch_size + 1 = {self._fixed.batch + 1} entries",
                )
            self._cu_q = torch.zeros(self._fixed.batch + 1, dtype=torch.int32, device=self.device)
        self._qo: tuple = (None, 0, 0)  # (cu_seqlens_q on the device, total_q, max_qo_len)
        self._causal = False

    def plan(
        self,
        qo_indptr: Any,
        paged_kv_indptr: Any,
        paged_kv_indices: Any,
        paged_kv_last_page_len: Any,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int,
        page_size: int,
        head_dim_vo: Optional[int] = None,
        custom_mask: Optional[torch.Tensor] = None,
        packed_custom_mask: Optional[torch.Tensor] = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        sm_scale: Optional[float] = None,
        window_left: int = -1,
        logits_soft_cap: Optional[float] = None,
        rope_scale: Optional[float] = None,
        rope_theta: Optional[float] = None,
        q_data_type: Any = "float16",
        kv_data_type: Any = None,
        o_data_type: Any = None,
        non_blocking: bool = True,
        prefix_len_ptr: Optional[torch.Tensor] = None,
        token_pos_in_items_ptr: Optional[torch.Tensor] = None,
        token_pos_in_items_len: int = 0,
        max_item_len_ptr: Optional[torch.Tensor] = None,
        seq_lens: Optional[torch.Tensor] = None,
        seq_lens_q: Optional[torch.Tensor] = None,
        block_tables: Optional[torch.Tensor] = None,
        max_token_per_sequence: Optional[int] = None,
        max_sequence_kv: Optional[int] = None,
        fixed_split_size: Optional[int] = None,
        disable_split_kv: bool = False,
    ) -> None:
        """FlashInfer's prefill plan (see the class and module docs)."""
        if head_dim_vo is not None and int(head_dim_vo) != int(head_dim_qk):
            _reject("head_dim_vo", head_dim_vo, f"None or head_dim_qk = {head_dim_qk}")
        _must_be("use_fp16_qk_reduction", use_fp16_qk_reduction, False,
                 "attnkit accumulates Q.K in float32")
        _must_be("token_pos_in_items_len", token_pos_in_items_len, 0, "no multi-item scoring")
        self._no_extra(
            (),
            custom_mask=custom_mask,
            packed_custom_mask=packed_custom_mask,
            prefix_len_ptr=prefix_len_ptr,
            token_pos_in_items_ptr=token_pos_in_items_ptr,
            max_item_len_ptr=max_item_len_ptr,
            seq_lens=seq_lens,
            seq_lens_q=seq_lens_q,
            block_tables=block_tables,
            max_token_per_sequence=max_token_per_sequence,
            max_sequence_kv=max_sequence_kv,
            fixed_split_size=fixed_split_size,
        )
        if int(window_left) >= 0 and not causal:
            _reject("window_left", window_left, _CAUSAL_WINDOWS)
        self._plan_spec(
            num_qo_heads,
            num_kv_heads,
            head_dim_qk,
            page_size,
            pos_encoding_mode,
            window_left,
            logits_soft_cap,
            sm_scale,
            q_data_type,
            kv_data_type,
            o_data_type,
        )
        cu = _host_ints(qo_indptr, "qo_indptr")
        lens = np.diff(cu)
        if cu.shape[0] == 0 or cu[0] != 0 or (lens < 0).any():
            _reject("qo_indptr", cu.tolist()[:8], "non-decreasing offsets starting at 0")
        plan = self._plan_pages(
            paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, int(page_size), "paged_kv_"
        )
        if cu.shape[0] != plan.batch + 1:
            _reject("qo_indptr", f"{cu.shape[0]} entries", f"batch_size + 1 = {plan.batch + 1}")
        max_qo = int(lens.max()) if lens.size else 0
        host_cu = torch.from_numpy(cu.astype(np.int32))
        if self._use_cuda_graph:
            bound = self._max_qo_len or max_qo
            if max_qo > bound:
                _reject("qo_indptr", f"a request of {max_qo} queries", f"<= max_qo_len = {bound}")
            self._max_qo_len = bound
            self._cu_q.copy_(host_cu)
            self._qo = (self._cu_q, int(cu[-1]), bound)
        else:
            self._qo = (host_cu.to(self.device), int(cu[-1]), max_qo)
        self._causal = bool(causal)
        self._plan = plan

    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache: Any,
        *args: Any,
        q_scale: Any = None,
        k_scale: Any = None,
        v_scale: Any = None,
        out: Optional[torch.Tensor] = None,
        lse: Optional[torch.Tensor] = None,
        return_lse: bool = False,
        enable_pdl: Optional[bool] = None,
        window_left: Optional[int] = None,
        sinks: Optional[torch.Tensor] = None,
        kv_cache_sf: Any = None,
        skip_softmax_threshold_scale_factor: Optional[float] = None,
        use_fp16_softmax: Optional[bool] = None,
        uses_spcompress: Optional[bool] = None,
    ) -> Any:
        """Prefill attention of one layer over the planned page table. ``window_left``
        overrides plan's for this call (-1: none), as in FlashInfer."""
        self._no_extra(
            args,
            q_scale=q_scale,
            sinks=sinks,
            kv_cache_sf=kv_cache_sf,
            skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor,
            use_fp16_softmax=use_fp16_softmax or None,
            uses_spcompress=uses_spcompress or None,
        )
        view = self._view(q, paged_kv_cache, k_scale, v_scale)
        cu_q, total_q, max_qo = self._qo
        if q.ndim != 3 or (q.shape[0] != total_q and not self._use_cuda_graph):
            _reject("q", list(q.shape), f"[qo_indptr[-1] = {total_q}, Hq, D]")
        window = self._window(window_left)
        if window is not None and not self._causal:
            _reject("window_left", window_left, _CAUSAL_WINDOWS)
        spec = self._spec
        page_rows = int(self._plan.block_table.shape[1]) * spec["page_size"]
        result = attnkit.prefill(
            q,
            cu_seqlens_q=cu_q,
            kv_cache=view,
            causal=self._causal or window is not None,
            window=window,
            max_seqlen_q=max(max_qo, 1),
            max_seqlen_k=max(page_rows if self._use_cuda_graph else self._plan.max_seq_len, 1),
            out=out,
            lse=lse,
            return_lse=return_lse,
            **self._attention_args(),
        )
        return self._lse_base2(result, return_lse, lse is not None)
