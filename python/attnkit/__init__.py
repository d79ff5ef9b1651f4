"""attnkit: attention for LLM and diffusion inference (Python binding of the C++ library).

Every function takes DLPack tensors (PyTorch, NumPy, CuPy, JAX, ...) and runs on their device:
CPU arrays run on the reference backend (fp64 accumulation), CUDA tensors on the backend that
``backend`` selects. Outputs are allocated with the input's array library when ``out`` is None
(NumPy, PyTorch and CuPy; other libraries must pass ``out=``). Every rejected call raises
:class:`attnkit.Error` (a ``ValueError``) naming the argument as this package spells it and what
is accepted, and writes nothing. Ctrl-C stops a long CPU call with ``KeyboardInterrupt``.

Shapes use B sequences, Hq query heads, Hkv KV heads (dividing Hq), D head_dim, and packed
("varlen") token dimensions without padding. See docs/python.md.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from . import _attnkit as _C
from ._arguments import (
    INT64,
    UINT64,
    bool_arg,
    describe,
    dict_arg,
    float_arg,
    float_list,
    int32_values,
    int_arg,
    int_list,
    opt_float_arg,
    opt_int_arg,
    opt_str_arg,
    shape_of,
    str_arg,
)

Error = _C.Error
Error.__module__ = "attnkit"
DeviceFaultError = _C.DeviceFaultError
DeviceFaultError.__module__ = "attnkit"
AttentionConfig = _C.AttentionConfig

__all__ = [
    "Error",
    "DeviceFaultError",
    "check_errors",
    "AttentionConfig",
    "KvView",
    "KvCache",
    "DecodeWorkspace",
    "info",
    "prefill",
    "decode",
    "append_kv",
    "forward",
    "dense",
    "merge_states",
    "default_alibi_slopes",
    "cp",
]

__version__ = _C.info()["version"]

_DLPACK_CPU, _DLPACK_CUDA = 1, 2


def info() -> dict:
    """Build and device information.

    Returns a dict: ``version`` (str), ``cuda`` (bool: built with the CUDA backend),
    ``cuda_architectures`` (str, e.g. "80,90a"), ``devices`` (list of dicts with ordinal, name,
    compute_capability, sm_count, total_memory, l2_bytes; empty without a GPU).
    """
    return _C.info()


def check_errors(stream: Optional[int] = None) -> None:
    """Raises :class:`attnkit.DeviceFaultError` for a device fault recorded since the last check.

    Kernels check the metadata they read from device memory (block tables, seq_lens, positions,
    cu_seqlens, cache_indirection); a value that would take them outside a tensor is skipped, its
    row written as zeros, and the first such fault is kept in a per-device status word. This
    synchronizes ``stream`` (default: PyTorch's current stream when torch has initialized CUDA,
    else the legacy default stream), reads the word of its device, clears it and raises naming
    the op, argument, row and value. Also raises :class:`attnkit.Error` for an asynchronous CUDA
    error of earlier work. Returns at once without CUDA work (CPU calls never fault). Calls with
    ``checked=True`` (or ``ATTNKIT_CHECKED=1``) check after every call instead. See
    docs/safety.md.
    """
    if stream is None:
        stream = 0
        import sys

        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            stream = torch.cuda.current_stream().cuda_stream
    _C.check_device_errors(int_arg(stream, "stream", UINT64))


def default_alibi_slopes(num_heads: int) -> list:
    """The default ALiBi slopes for ``num_heads`` heads in [1, 65536] (docs/semantics.md), a list
    of floats."""
    return list(_C.default_alibi_slopes(int_arg(num_heads, "num_heads")))


# ---- helpers ----------------------------------------------------------------------------------


def _library(x: Any) -> str:
    return type(x).__module__.split(".")[0]


def _device(x: Any) -> tuple:
    dev = getattr(x, "__dlpack_device__", None)
    return tuple(dev()) if dev is not None else (_DLPACK_CPU, 0)


def _is_cuda(x: Any) -> bool:
    return _device(x)[0] == _DLPACK_CUDA


def _empty(like: Any, shape: Sequence[int], float32: bool = False) -> Any:
    """An uninitialized array of ``shape`` from ``like``'s library, on its device, with its dtype
    (or float32)."""
    lib = _library(like)
    if lib == "numpy":
        import numpy as np

        return np.empty(shape, dtype=np.float32 if float32 else like.dtype)
    if lib == "torch":
        import torch

        return torch.empty(
            tuple(shape), dtype=torch.float32 if float32 else like.dtype, device=like.device
        )
    if lib == "cupy":
        import cupy

        with like.device:
            return cupy.empty(shape, dtype=cupy.float32 if float32 else like.dtype)
    raise Error(
        f"out: required for arrays of type {type(like).__module__}.{type(like).__name__}; "
        "outputs are allocated only for numpy, torch and cupy inputs"
    )


def _int32(x: Any, like: Any, name: str) -> Any:
    """Lists and NumPy integer arrays become int32 arrays next to ``like``; other arrays pass
    through (the C++ validation checks their dtype and device)."""
    if x is None:
        return None
    if isinstance(x, (list, tuple, range)) or (
        _library(x) == "numpy" and x.dtype.kind in "iu" and x.dtype.itemsize != 4
    ):
        import numpy as np

        host = np.ascontiguousarray(int32_values(x, name), dtype=np.int32)
        if _library(like) == "torch" and _is_cuda(like):
            import torch

            return torch.from_numpy(host).to(like.device)
        if _library(like) == "cupy":
            import cupy

            return cupy.asarray(host)
        return host
    return x


def _host_int32(x: Any, name: str) -> Any:
    """A host int32 NumPy copy of ``x`` (list, NumPy or torch CPU array); values outside int32
    raise instead of wrapping, floats instead of being truncated."""
    import numpy as np

    return np.ascontiguousarray(int32_values(x, name), dtype=np.int32)


def _stream(x: Any, stream: Optional[int]) -> int:
    if stream is not None:
        return int_arg(stream, "stream", UINT64)
    if _is_cuda(x) and _library(x) == "torch":
        import torch

        return torch.cuda.current_stream(x.device).cuda_stream
    return 0


def _host(x: Any) -> Any:
    """A NumPy copy of a (small) array; synchronizes with the device for CUDA arrays."""
    import numpy as np

    if _library(x) == "torch":
        x = x.cpu()
    elif _library(x) == "cupy":
        x = x.get()
    return np.asarray(x)


def _max_len(cu: Any) -> int:
    """Longest sequence of a cu_seqlens array (reads device arrays back: pass max_seqlen_* on
    CUDA to avoid the synchronization)."""
    cu = _host(cu)
    return int((cu[1:] - cu[:-1]).max()) if cu.shape[0] > 1 else 0


def _mask(causal: Any, window: Any, sink_tokens: Any) -> dict:
    causal = bool_arg(causal, "causal")
    window = opt_int_arg(window, "window")
    sink_tokens = int_arg(sink_tokens, "sink_tokens")
    if window is not None and window != 0:
        if not causal:
            raise Error(
                f"window: a sliding window is causal; got window={window} with causal=False "
                "(accepted: causal=True, or window=None)"
            )
        return {"mask": "sliding_window", "window": window, "sink_tokens": sink_tokens}
    if sink_tokens:
        raise Error(f"sink_tokens: only with a sliding window, got sink_tokens={sink_tokens}")
    return {"mask": "causal" if causal else "none"}


def _spec(
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    softmax_scale: Any,
    alibi: Any,
    softcap: Any,
    backend: Any,
    kernel: Any = "auto",
) -> dict:
    spec = {
        "num_q_heads": int(num_q_heads),
        "num_kv_heads": int(num_kv_heads),
        "head_dim": int(head_dim),
        "softmax_scale": opt_float_arg(softmax_scale, "softmax_scale") or 0.0,
        "softcap": float_arg(softcap, "softcap"),
        "backend": str_arg(backend, "backend"),
        "kernel": str_arg(kernel, "kernel"),
    }
    if alibi is True:
        spec["alibi"] = True
    elif alibi is not False and alibi is not None:
        if isinstance(alibi, (str, bytes)) or not hasattr(alibi, "__iter__"):
            raise Error(
                f"alibi: expected False, True (the default slopes) or a sequence of [Hq] slopes, "
                f"got {describe(alibi)}"
            )
        spec["alibi"] = True
        spec["alibi_slopes"] = float_list(alibi, "alibi")
    return spec


def _rope(
    rope: Any,
    rotary_dim: Any,
    rope_base: Any,
    rope_scaling: Any,
    rope_factor: Any,
    low_freq_factor: Any,
    high_freq_factor: Any,
    original_max_position: Any,
) -> dict:
    return {
        "rope_style": str_arg(rope, "rope"),
        "rotary_dim": int_arg(rotary_dim, "rotary_dim"),
        "rope_base": float_arg(rope_base, "rope_base"),
        "rope_scaling": str_arg(rope_scaling, "rope_scaling"),
        "rope_factor": float_arg(rope_factor, "rope_factor"),
        "low_freq_factor": float_arg(low_freq_factor, "low_freq_factor"),
        "high_freq_factor": float_arg(high_freq_factor, "high_freq_factor"),
        "original_max_position": int_arg(original_max_position, "original_max_position"),
    }


def _shape(x: Any, name: str, ndim: int) -> tuple:
    return shape_of(x, name, ndim)


def _qkv_query_heads(width: int, num_q_heads: Any, hkv: int, d: int) -> int:
    """Hq of a packed qkv [num_tokens, (Hq + 2 * Hkv) * D]: num_q_heads, or what the width
    leaves."""
    if num_q_heads is not None:
        return int_arg(num_q_heads, "num_q_heads", (1, 2**31 - 1))
    if width % d != 0 or width // d - 2 * hkv < 1:
        raise Error(
            f"qkv: expected a width of (Hq + 2 * Hkv) * D with Hkv={hkv}, D={d} (from kv_cache) "
            f"and Hq >= 1, got width {width}"
        )
    return width // d - 2 * hkv


def _kv_view(kv_cache: Any, name: str = "kv_cache") -> "KvView":
    if not isinstance(kv_cache, KvView):
        raise Error(f"{name}: expected an attnkit.KvView, got {describe(kv_cache)}")
    return kv_cache


def _layout(layout: Any, name: str = "layout") -> str:
    """A cache layout: "HND" ([num_blocks, Hkv, T, D]) or "NHD" ([num_blocks, T, Hkv, D])."""
    if layout not in ("HND", "NHD"):
        raise Error(f"{name}: expected 'HND' or 'NHD', got {describe(layout)}")
    return layout


class KvView:
    """A paged (or contiguous) KV cache as the attention functions read it.

    k, v: [num_blocks, Hkv, T, D] each with ``layout="HND"`` (the default), or
    [num_blocks, T, Hkv, D] with ``layout="NHD"`` (vLLM's, flash_attn's and FlashInfer's paged
    layout, read in place): every block contiguous; the block stride may be larger, so
    ``pool[:, 0]`` / ``pool[:, 1]`` of a [num_blocks, 2, <block>] pool work; dtype f16 /
    bf16 / fp8_e4m3 / int8 (or uint16 / uint8 storage with ``kv_dtype="bf16"`` / ``"fp8_e4m3"``).
    seq_lens: int32 [rows]: tokens of each row, counting this step's.
    block_table: int32 [rows, max_blocks_per_seq], -1 = no block; None: a contiguous cache
    (row r is block r and T is the row capacity).
    k_scale, v_scale: float32 [1] or [Hkv] (required for fp8 / int8 caches).
    window_slots, sink_tokens: a cyclic sliding-window cache (0: linear).
    layout: "HND" or "NHD", the order of k's and v's dims 1 and 2 (above).
    """

    def __init__(
        self,
        k: Any,
        v: Any,
        seq_lens: Any = None,
        block_table: Any = None,
        *,
        k_scale: Any = None,
        v_scale: Any = None,
        window_slots: int = 0,
        sink_tokens: int = 0,
        kv_dtype: Optional[str] = None,
        layout: str = "HND",
    ) -> None:
        shape_of(k, "k", 4)
        shape_of(v, "v", 4)
        self.layout = _layout(layout)
        self.k, self.v = k, v
        self.seq_lens = _int32(seq_lens, k, "seq_lens")
        self.block_table = _int32(block_table, k, "block_table")
        self.k_scale, self.v_scale = k_scale, v_scale
        self.window_slots = int_arg(window_slots, "window_slots")
        self.sink_tokens = int_arg(sink_tokens, "sink_tokens")
        self.kv_dtype = opt_str_arg(kv_dtype, "kv_dtype")

    @property
    def num_kv_heads(self) -> int:
        return shape_of(self.k, "kv_cache.k", 4)[2 if self.layout == "NHD" else 1]

    @property
    def tokens_per_block(self) -> int:
        return shape_of(self.k, "kv_cache.k", 4)[1 if self.layout == "NHD" else 2]

    @property
    def head_dim(self) -> int:
        return shape_of(self.k, "kv_cache.k", 4)[3]

    def _dict(self) -> dict:
        return {
            "k": self.k,
            "v": self.v,
            "seq_lens": self.seq_lens,
            "block_table": self.block_table,
            "k_scale": self.k_scale,
            "v_scale": self.v_scale,
            "window_slots": self.window_slots,
            "sink_tokens": self.sink_tokens,
            "kv_dtype": self.kv_dtype,
            "layout": self.layout,
        }


def _as_view(k_cache: Any, v_cache: Any, seq_lens: Any, block_table: Any, **kw: Any) -> KvView:
    if isinstance(k_cache, KvView):
        if v_cache is not None or seq_lens is not None or block_table is not None:
            raise Error(
                "v_cache: must not be given with a KvView (it holds v, seq_lens, block_table)"
            )
        if kw.get("layout") is not None and _layout(kw["layout"]) != k_cache.layout:
            raise Error(
                f"layout: {kw['layout']!r} given with a KvView of layout {k_cache.layout!r} "
                "(the view holds its layout)"
            )
        return k_cache
    if kw.get("layout") is None:
        kw["layout"] = "HND"
    if k_cache is None or v_cache is None:
        raise Error("k_cache: needs a KvView, or k_cache and v_cache arrays")
    shape_of(k_cache, "k_cache", 4)
    shape_of(v_cache, "v_cache", 4)
    return KvView(k_cache, v_cache, seq_lens, block_table, **kw)


# ---- entry points -----------------------------------------------------------------------------


def prefill(
    q: Any,
    k: Any = None,
    v: Any = None,
    cu_seqlens_q: Any = None,
    cu_seqlens_k: Any = None,
    *,
    kv_cache: Optional[KvView] = None,
    causal: bool = True,
    window: Optional[int] = None,
    sink_tokens: int = 0,
    softmax_scale: Optional[float] = None,
    alibi: Any = False,
    softcap: float = 0.0,
    config: Optional[AttentionConfig] = None,
    role: str = "default",
    backend: Optional[str] = None,
    kernel: str = "auto",
    skip_softmax: Optional[dict] = None,
    timestep: float = 0.0,
    block_m: int = 128,
    block_n: int = 128,
    skip_stats: Any = None,
    out: Any = None,
    return_lse: bool = False,
    lse: Any = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    checked: bool = False,
    stream: Optional[int] = None,
) -> Any:
    """Packed variable-length context attention (FlashAttention's varlen forward).

    q: [total_q, Hq, D] f32 (CPU) / f16 / bf16. Packed mode: k, v: [total_kv, Hkv, D] of q's
    dtype, cu_seqlens_q / cu_seqlens_k: int32 [B + 1] (None: one sequence). Paged mode:
    ``kv_cache`` (a KvView whose seq_lens already count the queries' tokens) instead of k, v,
    cu_seqlens_k. The queries of sequence i are the last n_i of its keys (bottom-right aligned).
    causal / window / sink_tokens: the mask (window W: keys p - W < j <= p, plus j < sink_tokens);
    causal=False: no mask (cross attention). alibi: False, True (default slopes) or [Hq] slopes.
    softcap: > 0 applies cap * tanh(logit / cap). out: [total_q, Hq, D] (allocated if None).
    lse / return_lse: float32 [total_q, Hq] natural-log sum-exp (-inf for empty rows).
    kernel: the fused kernel on CUDA tensors: "auto" (the Hopper kernel on an H100 / H200 where
    it serves the call), "portable" (the mma.sync kernel of sm80+) or "hopper" (raises where the
    Hopper kernel cannot serve the call). config / role: an AttentionConfig whose resolved
    settings for ``role`` (backend, skip_softmax) apply; explicit ``backend`` / ``skip_softmax``
    override them (a config's quant is a dense() option and raises here).
    skip_softmax: dict as for dense(), with causal or no mask (docs/diffusion.md); timestep: the
    normalized diffusion timestep of its gate; block_m / block_n: the tiles of the skip decisions
    on the CPU reference (the fused kernels use their own). skip_stats: an int64 tensor [4] on q's
    device, overwritten in stream order with (tiles_total, tiles_skipped, block_m, block_n),
    without a synchronization.
    checked=True: synchronize after the call and raise a device fault at once (docs/safety.md).
    Returns out, or (out, lse) when return_lse or lse is given.
    """
    total_q, hq, d = _shape(q, "q", 3)
    paged = kv_cache is not None
    if paged:
        _kv_view(kv_cache)
        if k is not None or v is not None or cu_seqlens_k is not None:
            raise Error("kv_cache: must not be given together with k, v or cu_seqlens_k")
        hkv = kv_cache.num_kv_heads
    else:
        if k is None or v is None:
            raise Error("k, v: required (packed mode), or pass kv_cache= (paged mode)")
        hkv = _shape(k, "k", 3)[1]
        if cu_seqlens_k is None:
            cu_seqlens_k = [0, int(k.shape[0])]
    if cu_seqlens_q is None:
        cu_seqlens_q = [0, total_q]
    cu_seqlens_q = _int32(cu_seqlens_q, q, "cu_seqlens_q")
    cu_seqlens_k = _int32(cu_seqlens_k, q, "cu_seqlens_k")
    resolved = (
        config.resolve(role)
        if config is not None
        else {"backend": "auto", "skip_softmax": None, "quant": None}
    )
    spec = _spec(hq, hkv, d, softmax_scale, alibi, softcap, backend or resolved["backend"], kernel)
    spec.update(_mask(causal, window, sink_tokens))
    skip_softmax = dict_arg(
        skip_softmax,
        "skip_softmax",
        'a dict with "threshold" or "target_sparsity" and "calibration": {"a": a, "b": b}, '
        'and "disabled_until_timestep"',
    )
    spec["skip_softmax"] = skip_softmax if skip_softmax is not None else resolved["skip_softmax"]
    spec["quant"] = resolved["quant"]
    max_seqlen_q = opt_int_arg(max_seqlen_q, "max_seqlen_q")
    max_seqlen_k = opt_int_arg(max_seqlen_k, "max_seqlen_k")
    return_lse = bool_arg(return_lse, "return_lse")
    checked = bool_arg(checked, "checked")
    stream = _stream(q, stream)
    cuda = _is_cuda(q)
    # CUDA calls need the bounds (> 0: an empty batch's bound of 1 holds too).
    if cuda and max_seqlen_q is None:
        max_seqlen_q = max(_max_len(cu_seqlens_q), 1)
    if cuda and max_seqlen_k is None:
        if paged:
            lens = _host(kv_cache.seq_lens)
            max_seqlen_k = max(int(lens.max()) if lens.size else 0, 1)
        else:
            max_seqlen_k = max(_max_len(cu_seqlens_k), 1)
    if out is None:
        out = _empty(q, (total_q, hq, d))
    if lse is None and return_lse:
        lse = _empty(q, (total_q, hq), float32=True)
    _C.prefill(
        spec,
        q,
        cu_seqlens_q,
        out,
        k=k,
        v=v,
        cu_seqlens_kv=cu_seqlens_k,
        kv_cache=kv_cache._dict() if paged else None,
        lse=lse,
        max_seqlen_q=max_seqlen_q or 0,
        max_seqlen_kv=max_seqlen_k or 0,
        timestep=float_arg(timestep, "timestep"),
        block_m=int_arg(block_m, "block_m"),
        block_n=int_arg(block_n, "block_n"),
        skip_stats=skip_stats,
        checked=checked,
        stream=stream,
    )
    return (out, lse) if lse is not None else out


def decode(
    q: Any,
    k_cache: Any,
    v_cache: Any = None,
    seq_lens: Any = None,
    block_table: Any = None,
    *,
    k_scale: Any = None,
    v_scale: Any = None,
    kv_dtype: Optional[str] = None,
    window_slots: int = 0,
    window: Optional[int] = None,
    sink_tokens: int = 0,
    layout: Optional[str] = None,
    softmax_scale: Optional[float] = None,
    alibi: Any = False,
    softcap: float = 0.0,
    backend: str = "auto",
    beam_width: int = 1,
    cache_indirection: Any = None,
    num_splits: int = 0,
    max_seq_len: int = 0,
    workspace: Optional["DecodeWorkspace"] = None,
    deterministic: bool = True,
    batch_invariant: bool = False,
    out: Any = None,
    return_lse: bool = False,
    lse: Any = None,
    checked: bool = False,
    stream: Optional[int] = None,
) -> Any:
    """Generation attention: one new token per row over a paged (or contiguous) KV cache.

    q: [rows, Hq, D]. The cache: a KvView as ``k_cache``, or k_cache / v_cache
    [num_blocks, Hkv, T, D] (``layout="NHD"``: [num_blocks, T, Hkv, D]; None: "HND", or the
    KvView's own), seq_lens int32 [rows] (counting the new token, which sits at
    position seq_lens[r] - 1), block_table int32 [rows, max_blocks] (None: contiguous cache),
    k_scale / v_scale float32 [1] or [Hkv] (fp8 / int8 caches), kv_dtype for uint8 / uint16
    storage. window / sink_tokens: sliding-window mask (window_slots: cyclic cache capacity).
    beam_width / cache_indirection int32 [rows / beam_width, beam_width, max_seq]: beam search.
    num_splits: split-KV override (0: heuristic). workspace: a DecodeWorkspace for split calls on
    this stream (None: a per-call allocation and counter memset on the stream).
    deterministic=False lets split calls merge over f32 sums added in L2 in arrival order (a
    little faster at batch 1; output bits may vary from run to run).
    batch_invariant=True: a row's output and LSE are bitwise identical whether it runs alone or
    in any batch (splits of a fixed 1024 keys, one kernel whatever the batch; num_splits must be
    0; docs/semantics.md, "Batch-invariant decode").
    out: [rows, Hq, D]; lse: float32 [rows, Hq].
    checked=True: synchronize after the call and raise a device fault at once (docs/safety.md).
    Returns out, or (out, lse) when return_lse or lse is given.
    """
    rows, hq, d = _shape(q, "q", 3)
    window_slots = int_arg(window_slots, "window_slots")
    view = _as_view(
        k_cache,
        v_cache,
        seq_lens,
        block_table,
        k_scale=k_scale,
        v_scale=v_scale,
        window_slots=window_slots,
        sink_tokens=sink_tokens if window_slots else 0,
        kv_dtype=kv_dtype,
        layout=layout,
    )
    spec = _spec(hq, view.num_kv_heads, d, softmax_scale, alibi, softcap, backend)
    spec.update(_mask(True, window, sink_tokens))
    options = dict(
        beam_width=int_arg(beam_width, "beam_width"),
        cache_indirection=_int32(cache_indirection, q, "cache_indirection"),
        num_splits=int_arg(num_splits, "num_splits"),
        max_seq_len=int_arg(max_seq_len, "max_seq_len"),
        workspace=_workspace(workspace, "workspace"),
        deterministic=bool_arg(deterministic, "deterministic"),
        batch_invariant=bool_arg(batch_invariant, "batch_invariant"),
        checked=bool_arg(checked, "checked"),
        stream=_stream(q, stream),
    )
    if out is None:
        out = _empty(q, (rows, hq, d))
    if lse is None and bool_arg(return_lse, "return_lse"):
        lse = _empty(q, (rows, hq), float32=True)
    _C.decode(spec, q, view._dict(), out, lse=lse, **options)
    return (out, lse) if lse is not None else out


def append_kv(
    kv_cache: KvView,
    positions: Any,
    row_of_token: Any,
    *,
    qkv: Any = None,
    q: Any = None,
    k: Any = None,
    v: Any = None,
    num_q_heads: Optional[int] = None,
    qkv_bias: Any = None,
    rope: str = "none",
    rotary_dim: int = 0,
    rope_base: float = 10000.0,
    rope_scaling: str = "none",
    rope_factor: float = 1.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position: int = 8192,
    backend: str = "auto",
    q_out: Any = None,
    checked: bool = False,
    stream: Optional[int] = None,
) -> Any:
    """Fused QKV pre-processing: bias, RoPE at explicit positions, K/V written into the cache
    (quantized with its scales), rotated Q returned.

    Input: qkv [num_tokens, (Hq + 2 * Hkv) * D] (Q heads, K heads, V heads) with num_q_heads
    (default: what the width leaves), or q [num_tokens, Hq, D], k / v [num_tokens, Hkv, D].
    qkv_bias: [(Hq + 2 * Hkv) * D]. positions: int32 [num_tokens] absolute positions;
    row_of_token: int32 [num_tokens] block-table row of each token. rope: "none", "gpt_neox" or
    "gptj" (rotary_dim 0 = D; rope_scaling "none", "linear" or "llama3").
    checked=True: synchronize after the call and raise a device fault at once (docs/safety.md).
    Returns q_out [num_tokens, Hq, D] (allocated if None).
    """
    hkv, d = _kv_view(kv_cache).num_kv_heads, kv_cache.head_dim
    src = qkv if qkv is not None else q
    if src is None:
        raise Error("qkv: required (or q, k and v)")
    if qkv is not None:
        num_tokens, width = _shape(qkv, "qkv", 2)
        hq = _qkv_query_heads(width, num_q_heads, hkv, d)
    else:
        num_tokens, hq, _ = _shape(q, "q", 3)
    spec = _spec(hq, hkv, d, None, False, 0.0, backend)
    spec.update(
        _rope(
            rope,
            rotary_dim,
            rope_base,
            rope_scaling,
            rope_factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position,
        )
    )
    if kv_cache.window_slots:
        spec.update({"mask": "sliding_window", "window": kv_cache.window_slots})
        spec["sink_tokens"] = kv_cache.sink_tokens
    positions = _int32(positions, src, "positions")
    row_of_token = _int32(row_of_token, src, "row_of_token")
    checked = bool_arg(checked, "checked")
    stream = _stream(src, stream)
    if q_out is None:
        q_out = _empty(src, (num_tokens, hq, d))
    _C.append_kv(
        spec,
        kv_cache._dict(),
        positions,
        row_of_token,
        q_out,
        qkv=qkv,
        q=q,
        k=k,
        v=v,
        qkv_bias=qkv_bias,
        checked=checked,
        stream=stream,
    )
    return q_out


def forward(
    qkv: Any,
    kv_cache: KvView,
    cu_seqlens_q: Any,
    past_lens: Any,
    num_context: int,
    *,
    num_q_heads: Optional[int] = None,
    beam_width: int = 1,
    qkv_bias: Any = None,
    cache_indirection: Any = None,
    window: Optional[int] = None,
    sink_tokens: int = 0,
    softmax_scale: Optional[float] = None,
    alibi: Any = False,
    softcap: float = 0.0,
    rope: str = "none",
    rotary_dim: int = 0,
    rope_base: float = 10000.0,
    rope_scaling: str = "none",
    rope_factor: float = 1.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position: int = 8192,
    backend: str = "auto",
    num_splits: int = 0,
    workspace: Any = None,
    decode_workspace: Optional["DecodeWorkspace"] = None,
    deterministic: bool = True,
    batch_invariant: bool = False,
    out: Any = None,
    return_lse: bool = False,
    lse: Any = None,
    checked: bool = False,
    stream: Optional[int] = None,
) -> Any:
    """The in-flight-batching op: append_kv on every token, prefill over the cache for the first
    ``num_context`` requests, decode for the generation requests (beam_width tokens each).

    qkv: [num_tokens, (Hq + 2 * Hkv) * D] packed (context tokens first). kv_cache: KvView whose
    seq_lens int32 [rows] hold the lengths after this step (rows: one per context request, then
    beam_width per generation request). cu_seqlens_q: int32 [requests + 1] token offsets (host
    memory); past_lens: int32 [requests] tokens cached before this step (host memory).
    decode_workspace: a DecodeWorkspace for the generation rows' split-KV calls (see decode);
    deterministic, batch_invariant: as in decode, for the generation rows.
    out: [num_tokens, Hq, D]; lse: float32 [num_tokens, Hq].
    checked=True: synchronize after the call and raise a device fault at once (docs/safety.md).
    Returns out, or (out, lse) when return_lse or lse is given.
    """
    num_tokens, width = _shape(qkv, "qkv", 2)
    hkv, d = _kv_view(kv_cache).num_kv_heads, kv_cache.head_dim
    hq = _qkv_query_heads(width, num_q_heads, hkv, d)
    spec = _spec(hq, hkv, d, softmax_scale, alibi, softcap, backend)
    spec.update(_mask(True, window, sink_tokens))
    spec.update(
        _rope(
            rope,
            rotary_dim,
            rope_base,
            rope_scaling,
            rope_factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position,
        )
    )
    host_cu = _host_int32(cu_seqlens_q, "cu_seqlens_q")
    host_past = _host_int32(past_lens, "past_lens")
    num_context = int_arg(num_context, "num_context")
    options = dict(
        beam_width=int_arg(beam_width, "beam_width"),
        qkv_bias=qkv_bias,
        cache_indirection=_int32(cache_indirection, qkv, "cache_indirection"),
        workspace=workspace,
        num_splits=int_arg(num_splits, "num_splits"),
        decode_workspace=_workspace(decode_workspace, "decode_workspace"),
        deterministic=bool_arg(deterministic, "deterministic"),
        batch_invariant=bool_arg(batch_invariant, "batch_invariant"),
        checked=bool_arg(checked, "checked"),
        stream=_stream(qkv, stream),
    )
    if out is None:
        out = _empty(qkv, (num_tokens, hq, d))
    if lse is None and bool_arg(return_lse, "return_lse"):
        lse = _empty(qkv, (num_tokens, hq), float32=True)
    _C.forward(
        spec, qkv, kv_cache._dict(), host_cu, host_past, num_context, out, lse=lse, **options
    )
    return (out, lse) if lse is not None else out


def dense(
    q: Any,
    k: Any,
    v: Any,
    *,
    config: Optional[AttentionConfig] = None,
    role: str = "default",
    backend: Optional[str] = None,
    kernel: str = "auto",
    skip_softmax: Optional[dict] = None,
    quant: Optional[dict] = None,
    softmax_scale: Optional[float] = None,
    timestep: float = 0.0,
    block_m: int = 128,
    block_n: int = 128,
    out: Any = None,
    return_lse: bool = False,
    lse: Any = None,
    return_stats: bool = False,
    skip_stats: Any = None,
    checked: bool = False,
    stream: Optional[int] = None,
) -> Any:
    """Unmasked [B, S, H, D] attention (diffusion, encoders, cross attention).

    q: [B, Sq, Hq, D]; k, v: [B, Skv, Hkv, D] of q's dtype. config / role: an AttentionConfig
    whose resolved settings for ``role`` (backend, skip_softmax, quant) apply; the explicit
    ``backend`` / ``skip_softmax`` / ``quant`` arguments override them. skip_softmax: dict with
    the keys of the JSON config's skip_softmax object (docs/configuration.md): "threshold" or
    "target_sparsity" with "calibration": {"a": a, "b": b}, and "disabled_until_timestep".
    quant: dict with dtype_qk ("int8" | "fp8_e4m3"), q_block_size, k_block_size (1, 4, 16).
    timestep: normalized diffusion timestep (skip-softmax gate); block_m / block_n: the tiles of
    the skip decisions. kernel: the fused kernel on CUDA tensors, as for prefill(). out:
    [B, Sq, Hq, D]; lse: float32 [B, Sq, Hq].
    checked=True: synchronize after the call and raise a device fault at once (docs/safety.md).
    Returns out, plus lse and/or the stats dict (tiles_total, tiles_skipped, skipped_fraction,
    block_m, block_n: the tile the counts refer to, the kernel's own on CUDA) in that order when
    asked for. On CUDA, return_stats with tiles actually skipped synchronizes the stream; for the
    counts without a synchronization pass skip_stats, an int64 tensor [2] on q's device that is
    overwritten in stream order with (tiles_total, tiles_skipped).
    """
    b, sq, hq, d = _shape(q, "q", 4)
    hkv = _shape(k, "k", 4)[2]
    if config is not None and not isinstance(config, AttentionConfig):
        raise Error(f"config: expected an attnkit.AttentionConfig or None, got {describe(config)}")
    resolved = (
        config.resolve(str_arg(role, "role"))
        if config is not None
        else {"backend": "auto", "skip_softmax": None, "quant": None}
    )
    backend = opt_str_arg(backend, "backend")
    spec = _spec(hq, hkv, d, softmax_scale, False, 0.0, backend or resolved["backend"], kernel)
    spec["mask"] = "none"
    skip_softmax = dict_arg(
        skip_softmax,
        "skip_softmax",
        'a dict with "threshold" or "target_sparsity" and "calibration": {"a": a, "b": b}, '
        'and "disabled_until_timestep"',
    )
    quant = dict_arg(
        quant, "quant", 'a dict with "dtype_qk" (\'int8\' or \'fp8_e4m3\'), "q_block_size", '
        '"k_block_size"'
    )
    spec["skip_softmax"] = skip_softmax if skip_softmax is not None else resolved["skip_softmax"]
    spec["quant"] = quant if quant is not None else resolved["quant"]
    return_stats = bool_arg(return_stats, "return_stats")
    options = dict(
        timestep=float_arg(timestep, "timestep"),
        block_m=int_arg(block_m, "block_m"),
        block_n=int_arg(block_n, "block_n"),
        stats=return_stats,
        skip_stats=skip_stats,
        checked=bool_arg(checked, "checked"),
        stream=_stream(q, stream),
    )
    if out is None:
        out = _empty(q, (b, sq, hq, d))
    if lse is None and bool_arg(return_lse, "return_lse"):
        lse = _empty(q, (b, sq, hq), float32=True)
    stats = _C.dense(spec, q, k, v, out, lse=lse, **options)
    result = (out,) + ((lse,) if lse is not None else ()) + ((stats,) if return_stats else ())
    return result if len(result) > 1 else out


def merge_states(
    out_a: Any,
    lse_a: Any,
    out_b: Any,
    lse_b: Any,
    *,
    out: Any = None,
    lse: Any = None,
    return_lse: bool = True,
    checked: bool = False,
    stream: Optional[int] = None,
) -> Any:
    """Combine two partial attention results of the same queries over disjoint key sets.

    out_a, out_b: [N, H, D]; lse_a, lse_b: float32 [N, H]. Result: lse = log(e^lse_a + e^lse_b),
    out = (e^lse_a out_a + e^lse_b out_b) / e^lse (zeros and -inf where both are -inf).
    checked=True: synchronize after the call and raise a device fault at once (docs/safety.md).
    Returns (out, lse), or out alone with return_lse=False.
    """
    n, h, d = _shape(out_a, "out_a", 3)
    checked = bool_arg(checked, "checked")
    stream = _stream(out_a, stream)
    if out is None:
        out = _empty(out_a, (n, h, d))
    if lse is None and bool_arg(return_lse, "return_lse"):
        lse = _empty(out_a, (n, h), float32=True)
    _C.merge_states(out_a, lse_a, out_b, lse_b, out, lse=lse, checked=checked, stream=stream)
    return (out, lse) if lse is not None else out


# ---- KV cache manager -------------------------------------------------------------------------


class DecodeWorkspace:
    """Caller-owned split-KV workspace (the C++ DecodeWorkspace): partial outputs, LSEs and
    arrival counters for decode calls of up to ``max_rows`` rows and ``max_splits`` splits with
    these heads, allocated once on ``device`` ("cuda" or "cuda:N") with its counters zeroed. Pass
    it as ``decode(..., workspace=)`` or ``forward(..., decode_workspace=)``: a split call is then
    its kernels alone (one, or two where the separate merge kernel follows), with no allocation or
    memset (and no such nodes in a captured CUDA graph).

    One workspace per stream (or per set of calls that never run at the same time): calls that
    run concurrently must not share one. After a failed launch, ``reset(stream)`` re-zeroes the
    counters. A call that does not fit raises Error naming the argument.
    """

    def __init__(
        self,
        *,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_rows: int,
        max_splits: int = 128,
        device: str = "cuda",
    ) -> None:
        spec = _spec(
            int_arg(num_q_heads, "num_q_heads"),
            int_arg(num_kv_heads, "num_kv_heads"),
            int_arg(head_dim, "head_dim"),
            None,
            False,
            0.0,
            "auto",
        )
        self._ws = _C.DecodeWorkspace(
            spec,
            int_arg(max_rows, "max_rows", INT64),
            int_arg(max_splits, "max_splits"),
            str_arg(device, "device"),
        )

    @property
    def bytes(self) -> int:
        return self._ws.bytes

    @property
    def device(self) -> str:
        return self._ws.device

    def reset(self, stream: Optional[int] = None) -> None:
        """Enqueues a zeroing of the counters on ``stream`` (default: the legacy stream 0)."""
        self._ws.reset(int_arg(stream, "stream", UINT64) if stream is not None else 0)


def _workspace(ws: Any, name: str) -> Any:
    if ws is None:
        return None
    if not isinstance(ws, DecodeWorkspace):
        raise Error(f"{name}: expected an attnkit.DecodeWorkspace or None, got {describe(ws)}")
    return ws._ws


def _seq(seq: Any, name: str) -> int:
    """A sequence id (int64)."""
    return int_arg(seq, name, INT64)


class KvCache:
    """Paged KV-cache pool with prefix reuse, forks (copy-on-write) and eviction (the C++
    KvCacheManager). The pool is [num_blocks, num_layers, 2, Hkv, T, D] (``layout="HND"``, the
    default) or [num_blocks, num_layers, 2, T, Hkv, D] (``layout="NHD"``); ``view(layer, seqs)``
    gives the KvView that prefill / decode / append_kv / forward read.

    dtype: "f16", "bf16", "fp8_e4m3" or "int8"; device: "cpu" (host memory, reference backend)
    or "cuda[:N]". CPU pools need max_tokens or max_bytes; max_seq_len sets the table width.
    layer_windows / sink_tokens: sliding windows per layer (all windowed: a cyclic cache).
    layout: "HND" (blocks [Hkv, T, D]) or "NHD" (blocks [T, Hkv, D]); every view carries it.
    """

    def __init__(
        self,
        *,
        num_kv_heads: int,
        head_dim: int,
        max_seq_len: int,
        num_layers: int = 1,
        tokens_per_block: int = 16,
        dtype: str = "f16",
        device: str = "cpu",
        max_tokens: int = 0,
        max_bytes: int = 0,
        free_gpu_memory_fraction: float = 0.9,
        host_cache_bytes: int = 0,
        layer_windows: Sequence[int] = (),
        sink_tokens: int = 0,
        enable_prefix_reuse: bool = True,
        stream: int = 0,
        layout: str = "HND",
    ) -> None:
        self.layout = _layout(layout)
        self._m = _C.KvCacheManager(
            {
                "num_layers": int_arg(num_layers, "num_layers"),
                "num_kv_heads": int_arg(num_kv_heads, "num_kv_heads"),
                "head_dim": int_arg(head_dim, "head_dim"),
                "tokens_per_block": int_arg(tokens_per_block, "tokens_per_block"),
                "dtype": str_arg(dtype, "dtype"),
                "device": str_arg(device, "device"),
                "max_tokens": int_arg(max_tokens, "max_tokens", INT64),
                "max_bytes": int_arg(max_bytes, "max_bytes", INT64),
                "free_gpu_memory_fraction": float_arg(
                    free_gpu_memory_fraction, "free_gpu_memory_fraction"
                ),
                "host_cache_bytes": int_arg(host_cache_bytes, "host_cache_bytes", INT64),
                "max_seq_len": int_arg(max_seq_len, "max_seq_len"),
                "layer_windows": int_list(layer_windows, "layer_windows"),
                "sink_tokens": int_arg(sink_tokens, "sink_tokens"),
                "enable_prefix_reuse": bool_arg(enable_prefix_reuse, "enable_prefix_reuse"),
                "stream": int_arg(stream, "stream", UINT64),
                "layout": self.layout,
            }
        )
        self.dtype = dtype
        self.sink_tokens = sink_tokens
        self._prefix_reuse = bool(enable_prefix_reuse)
        pool = self._m.pool()
        if self._m.is_cuda():
            import torch

            pool = torch.from_dlpack(pool)
        self.pool = pool

    def add(self, seq: int, prompt: Sequence[int], salt: int = 0, priority: int = 0) -> int:
        """Starts ``seq`` with its prompt token ids; returns the leading tokens already cached."""
        return self._m.add(
            _seq(seq, "seq"),
            int_list(prompt, "prompt"),
            int_arg(salt, "salt", UINT64),
            int_arg(priority, "priority"),
        )

    def append(self, seq: int, tokens: Sequence[int]) -> None:
        """Appends tokens (generated tokens or the next chunk) to ``seq``."""
        self._m.append(_seq(seq, "seq"), int_list(tokens, "tokens"))

    def fork(self, src: int, dst: int) -> None:
        """New sequence ``dst`` sharing the blocks of ``src`` (copy-on-write of the last block)."""
        self._m.fork(_seq(src, "src"), _seq(dst, "dst"))

    def release(self, seq: int) -> None:
        """Drops ``seq``; its full blocks stay cached for reuse until evicted."""
        self._m.release(_seq(seq, "seq"))

    def reorder_beams(self, beams: Sequence[int], parents: Sequence[int]) -> None:
        """Beam b continues the history of beam parents[b] (see cache_indirection)."""
        self._m.reorder_beams(int_list(beams, "beams", INT64), int_list(parents, "parents"))

    def __contains__(self, seq: int) -> bool:
        return self._m.contains(_seq(seq, "seq"))

    def length(self, seq: int) -> int:
        return self._m.length(_seq(seq, "seq"))

    def blocks(self, seq: int) -> list:
        return list(self._m.blocks(_seq(seq, "seq")))

    def probe_prefix(self, prompt: Sequence[int], salt: int = 0) -> int:
        return self._m.probe_prefix(int_list(prompt, "prompt"), int_arg(salt, "salt", UINT64))

    def stats(self) -> dict:
        """hits, misses, evictions, offloads, onboards, cow_copies, num_blocks, free_blocks,
        cached_blocks, used_blocks, host_blocks, host_cached_blocks."""
        return self._m.stats()

    def check_invariants(self) -> None:
        """Raises Error describing the first broken bookkeeping invariant."""
        self._m.check_invariants()

    @property
    def num_blocks(self) -> int:
        return self._m.num_blocks()

    @property
    def max_blocks_per_seq(self) -> int:
        return self._m.max_blocks_per_seq()

    def block_tables(self, seqs: Sequence[int]) -> tuple:
        """(block_table int32 [len(seqs), max_blocks_per_seq], seq_lens int32 [len(seqs)]) as
        NumPy arrays."""
        return self._m.block_tables(int_list(seqs, "seqs", INT64))

    def cache_indirection(self, beams: Sequence[int], beam_width: int, max_seq: int) -> Any:
        """int32 [len(beams) / beam_width, beam_width, max_seq] NumPy array."""
        return self._m.cache_indirection(
            int_list(beams, "beams", INT64),
            int_arg(beam_width, "beam_width"),
            int_arg(max_seq, "max_seq"),
        )

    def view(
        self, layer: int, seqs: Sequence[int], *, k_scale: Any = None, v_scale: Any = None
    ) -> KvView:
        """The KvView of ``layer`` with one row per sequence of ``seqs`` (tables copied to the
        pool's device)."""
        layer = int_arg(layer, "layer")
        table, lens = self.block_tables(seqs)
        return self._view_of(layer, table, lens, k_scale, v_scale)

    def _view_of(self, layer: int, table: Any, lens: Any, k_scale: Any, v_scale: Any) -> KvView:
        """The KvView of ``layer`` over host block tables ``table`` / ``lens`` (this cache's or
        a ShardedKvCache's)."""
        window_slots = self._m.window_slots(layer)  # raises for a layer outside the pool
        pool = self.pool
        if self._m.is_cuda():
            table = pool.new_tensor(table, dtype=__import__("torch").int32)
            lens = pool.new_tensor(lens, dtype=__import__("torch").int32)
        raw = self.dtype if self.dtype in ("bf16", "fp8_e4m3") and not self._m.is_cuda() else None
        return KvView(
            pool[:, layer, 0],
            pool[:, layer, 1],
            lens,
            table,
            k_scale=k_scale,
            v_scale=v_scale,
            window_slots=window_slots,
            sink_tokens=self.sink_tokens if window_slots else 0,
            kv_dtype=raw,
            layout=self.layout,
        )


from . import cp  # noqa: E402  (context parallelism; needs the names above)

# ---- flash_attn-compatible functions (attnkit.flash_attn; loaded on first use) ------------------

_FLASH_ATTN_NAMES = ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache")


def __getattr__(name: str) -> Any:
    # Lazy, so that `import attnkit` does not import torch (attnkit.flash_attn does when present).
    if name in _FLASH_ATTN_NAMES:
        from . import flash_attn

        return getattr(flash_attn, name)
    raise AttributeError(f"module 'attnkit' has no attribute {name!r}")
