"""flash_attn-compatible entry points: flash_attn's names, argument order, defaults and layouts.

``from attnkit.flash_attn import flash_attn_func, flash_attn_varlen_func,
flash_attn_with_kvcache`` replaces ``from flash_attn import ...``. Inputs are torch tensors (CUDA
or CPU) or NumPy arrays (CPU); CPU inputs run on the reference backend. With torch tensors every
call goes through a ``torch.library`` custom op (``torch.ops.attnkit.*``, see attnkit.torch), so
``torch.compile(fullgraph=True)`` and CUDA-graph capture see one opaque op per call.

Where attnkit's semantics differ from flash_attn's the call raises :class:`attnkit.Error` naming
the argument rather than computing something else; docs/python.md ("Coming from flash_attn,
FlashInfer or vLLM") lists the differences. The layouts:

- flash_attn_func: q [B, Sq, Hq, D], k / v [B, Sk, Hkv, D]; LSE [B, Hq, Sq].
- flash_attn_varlen_func: q [total_q, Hq, D], k / v [total_k, Hkv, D] (or, with block_table,
  [num_blocks, page_size, Hkv, D]); LSE [Hq, total_q].
- flash_attn_with_kvcache: q [B, Sq, Hq, D]; k_cache / v_cache [B_cache, S_cache, Hkv, D] or,
  with block_table, [num_blocks, page_size, Hkv, D] (NHD); new k / v [B, S_new, Hkv, D];
  LSE [B, Hq, Sq].

attnkit's kernels read NHD caches ([num_blocks, T, Hkv, D], docs/kv_cache.md) in place, so the
caches of flash_attn_with_kvcache and of paged flash_attn_varlen_func are attended where they lie
(see _nhd_view): a page of 8, 16, 32, 64 or 128 tokens is one attnkit block, a larger page (a
multiple of 8) several. Only a cache attnkit cannot address (a block whose [page, Hkv, D] is not
contiguous, K and V with different block strides, or pages split into blocks of a pool whose
pages are not packed) is copied, once per call.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from . import Error, KvView, decode, dense, prefill

try:  # The compat layer is for torch users; NumPy arrays work without torch.
    import torch as _torch
except ImportError:  # pragma: no cover - exercised where torch is absent
    _torch = None

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]

# Tokens per attnkit block of a page: the largest of attnkit's paged block sizes dividing the page.
_BLOCK_SIZES = (128, 64, 32, 16, 8)


# ---- array helpers: the same code runs on NumPy arrays and torch tensors ----------------------


def _is_torch(x: Any) -> bool:
    return _torch is not None and isinstance(x, _torch.Tensor)


def _check_array(x: Any, name: str) -> None:
    if not (_is_torch(x) or isinstance(x, np.ndarray)):
        raise Error(
            f"{name}: expected a torch tensor or a numpy array, got {type(x).__module__}."
            f"{type(x).__name__}"
        )


def _shape(x: Any, name: str, ndim: int) -> tuple:
    _check_array(x, name)
    shape = tuple(int(s) for s in x.shape)
    if len(shape) != ndim:
        raise Error(f"{name}: expected {ndim} dimensions, got shape {list(shape)}")
    return shape


def _same_shape(x: Any, name: str, shape: tuple, what: str) -> None:
    _check_array(x, name)
    if tuple(int(s) for s in x.shape) != shape:
        raise Error(f"{name}: expected shape {list(shape)} ({what}), got {list(x.shape)}")


def _dtype_name(x: Any) -> str:
    return str(x.dtype).replace("torch.", "")


def _same_dtype(x: Any, name: str, like: Any, like_name: str) -> None:
    if x.dtype != like.dtype:
        raise Error(
            f"{name}: expected the dtype of {like_name} ({_dtype_name(like)}), "
            f"got {_dtype_name(x)}"
        )


def _same_library(x: Any, name: str, like: Any) -> None:
    if _is_torch(x) != _is_torch(like):
        raise Error(f"{name}: expected a {'torch tensor' if _is_torch(like) else 'numpy array'}")
    if _is_torch(x) and x.device != like.device:
        raise Error(f"{name}: expected a tensor on {like.device}, got one on {x.device}")


def _arange(n: int, like: Any, step: int = 1) -> Any:
    """int32 [0, step, 2 step, ...) with n entries, next to ``like``."""
    if _is_torch(like):
        return _torch.arange(0, n * step, step, dtype=_torch.int32, device=like.device)
    return np.arange(0, n * step, step, dtype=np.int32)


def _full(like: Any, shape: Sequence[int], value: float, float32: bool = False) -> Any:
    if _is_torch(like):
        dtype = _torch.float32 if float32 else like.dtype
        return _torch.full(tuple(shape), value, dtype=dtype, device=like.device)
    return np.full(tuple(shape), value, dtype=np.float32 if float32 else like.dtype)


def _where(cond: Any, a: Any, b: Any) -> Any:
    if _is_torch(cond):
        return _torch.where(cond, a, b)
    return np.where(cond, a, b)


def _permute(x: Any, axes: Sequence[int]) -> Any:
    return x.permute(*axes) if _is_torch(x) else np.transpose(x, axes)


def _contiguous(x: Any) -> Any:
    return x.contiguous() if _is_torch(x) else np.ascontiguousarray(x)


def _copy(x: Any) -> Any:
    """A fresh C-ordered copy: its strides are the canonical ones even over extents of 1, which
    the views of an attnkit cache must have (ascontiguousarray / contiguous() may keep a view)."""
    if _is_torch(x):
        return x.clone(memory_format=_torch.contiguous_format)
    return np.array(x, order="C", copy=True)


def _concat(parts: Sequence[Any], axis: int) -> Any:
    if _is_torch(parts[0]):
        return _torch.cat(list(parts), dim=axis)
    return np.concatenate(parts, axis=axis)


def _float32(x: Any) -> Any:
    return x.float() if _is_torch(x) else x.astype(np.float32)


def _as_dtype(x: Any, like: Any) -> Any:
    return x.to(like.dtype) if _is_torch(x) else x.astype(like.dtype)


def _int32_array(x: Any, like: Any, name: str) -> Any:
    """An int32 array of ``x`` (int, list, NumPy or torch) next to ``like``."""
    if _is_torch(x):
        if x.dtype not in (_torch.int32, _torch.int64):
            raise Error(f"{name}: expected an int32 tensor, got {_dtype_name(x)}")
        return x.to(device=like.device, dtype=_torch.int32)
    host = np.asarray(x)
    if host.dtype.kind not in "iu":
        raise Error(f"{name}: expected integers, got dtype {host.dtype}")
    if host.size and (host.min() < -(2**31) or host.max() >= 2**31):
        raise Error(f"{name}: values must fit in int32")
    host = np.ascontiguousarray(host, dtype=np.int32)
    return _torch.from_numpy(host).to(like.device) if _is_torch(like) else host


def _host(x: Any) -> np.ndarray:
    """A NumPy copy (synchronizes with the device for CUDA tensors)."""
    if not _is_torch(x):
        return np.asarray(x)
    x = x.detach().cpu()
    return (x.float() if x.dtype == _torch.bfloat16 else x).numpy()  # NumPy has no bfloat16


def _on_host(x: Any) -> bool:
    return not (_is_torch(x) and x.device.type != "cpu")


# ---- argument translation ---------------------------------------------------------------------


def window_pair(window_size: Any) -> Tuple[int, int]:
    """flash_attn's window_size as two ints (left, right)."""
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        raise Error(
            f"window_size: expected a pair of ints (left, right), got {window_size!r}"
        ) from None
    return left, right


def _mask(causal: bool, window: Tuple[int, int], max_seqlen_k: int) -> Tuple[bool, Optional[int]]:
    """flash_attn's (causal, window_size) as attnkit's (causal, window).

    flash_attn: query i attends keys [i + Sk - Sq - left, i + Sk - Sq + right], -1 unbounded,
    causal forces right = 0, and a bound of at least max_seqlen_k is no bound. attnkit serves no
    mask, causal, and causal sliding windows of W = left + 1 keys (docs/semantics.md); a window
    reaching to the right of the query (right > 0, or left bounded with right unbounded) is not
    served.
    """
    left, right = window
    if causal:
        right = 0
    left = -1 if left < 0 or left >= max_seqlen_k else left
    right = -1 if right < 0 or right >= max_seqlen_k else right
    if left < 0 and right < 0:
        return False, None
    if right == 0:
        return True, None if left < 0 else left + 1
    raise Error(
        f"window_size: attnkit serves windows that end at the query (right = 0, or causal=True); "
        f"got window_size={tuple(window)} with causal={bool(causal)} and max_seqlen_k = "
        f"{max_seqlen_k} (accepted: (-1, -1), (left, 0), any window with causal=True)"
    )


def _alibi(alibi_slopes: Any, num_heads: int, batch: int, causal: bool) -> Optional[list]:
    """flash_attn's [Hq] or [B, Hq] fp32 slopes as attnkit's per-head list (read to the host)."""
    if alibi_slopes is None:
        return None
    if not causal:
        # flash_attn adds -slope * |i - j|, attnkit slope * (j - i): equal only for j <= i.
        raise Error(
            "alibi_slopes: served with causal=True (or a window (left, 0)) only: flash_attn's "
            "bias -slope * |i - j| and attnkit's slope * (j - i) differ for keys after the query"
        )
    slopes = np.asarray(_host(alibi_slopes), dtype=np.float64)
    if slopes.shape not in ((num_heads,), (batch, num_heads)):
        raise Error(
            f"alibi_slopes: expected shape [{num_heads}] or [{batch}, {num_heads}] (Hq or "
            f"[B, Hq]), got {list(slopes.shape)}"
        )
    if slopes.ndim == 2:
        if batch and not np.all(slopes == slopes[:1]):
            raise Error(
                "alibi_slopes: per-sequence slopes ([B, Hq] with rows that differ) are not "
                "supported; give one row [Hq] (attnkit takes the slopes per head)"
            )
        slopes = slopes[0] if batch else np.zeros(num_heads)
    if not np.all(np.isfinite(slopes)):
        raise Error("alibi_slopes: values must be finite")
    return [float(s) for s in slopes]


def _scale(softmax_scale: Optional[float]) -> Optional[float]:
    if softmax_scale is None:
        return None
    scale = float(softmax_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise Error(f"softmax_scale: must be finite and > 0 (None: 1 / sqrt(D)), got {scale}")
    return scale


def _softcap(softcap: float) -> float:
    cap = float(softcap)
    if math.isnan(cap) or math.isinf(cap):
        raise Error(f"softcap: must be finite (0 or less: off), got {cap}")
    return max(cap, 0.0)  # flash_attn: anything > 0 activates soft-capping


def _no_dropout(dropout_p: float) -> None:
    if float(dropout_p) != 0.0:
        raise Error(f"dropout_p: attnkit is inference-only: expected 0.0, got {dropout_p}")


def _heads(hq: int, hkv: int, kv_name: str) -> None:
    if hkv < 1 or hq % hkv:
        raise Error(
            f"{kv_name}: the number of KV heads ({hkv}) must divide the query heads ({hq})"
        )


def _lse_fa(lse: Any, batch: int, rows: int, heads: int) -> Any:
    """attnkit's [B * rows, H] LSE as flash_attn's [B, H, rows]."""
    return _contiguous(_permute(lse.reshape(batch, rows, heads), (0, 2, 1)))


# ---- static checks (shapes only: also the fake implementations of the torch ops) -------------


def dense_dims(q: Any, k: Any, v: Any) -> tuple:
    """flash_attn_func's shapes: (B, Sq, Sk, Hq, Hkv, D)."""
    b, sq, hq, d = _shape(q, "q", 4)
    sk, hkv = _shape(k, "k", 4)[1:3]
    _same_shape(k, "k", (b, sk, hkv, d), "[B, Sk, Hkv, D] with q's B and D")
    _same_shape(v, "v", (b, sk, hkv, d), "the shape of k")
    for x, name in ((k, "k"), (v, "v")):
        _same_library(x, name, q)
    _heads(hq, hkv, "k")
    return b, sq, sk, hq, hkv, d


def varlen_dims(q: Any, k: Any, v: Any, block_table: Any) -> tuple:
    """flash_attn_varlen_func's shapes: (total_q, Hq, D, Hkv)."""
    total_q, hq, d = _shape(q, "q", 3)
    if block_table is not None:
        hkv = _check_cache(k, v, q, d, ("k", "v"))[2]
    else:
        total_k, hkv = _shape(k, "k", 3)[:2]
        _same_shape(k, "k", (total_k, hkv, d), "[total_k, Hkv, D] with q's D")
        _same_shape(v, "v", (total_k, hkv, d), "the shape of k")
        for x, name in ((k, "k"), (v, "v")):
            _same_library(x, name, q)
    _heads(hq, hkv, "k")
    return total_q, hq, d, hkv


def kvcache_dims(q: Any, k_cache: Any, v_cache: Any, k: Any, v: Any) -> tuple:
    """flash_attn_with_kvcache's shapes: (B, Sq, Hq, D, cache shape, S_new)."""
    b, sq, hq, d = _shape(q, "q", 4)
    shape = _check_cache(k_cache, v_cache, q, d, ("k_cache", "v_cache"))
    _heads(hq, shape[2], "k_cache")
    if (k is None) != (v is None):
        missing, given = ("v", "k") if v is None else ("k", "v")
        raise Error(f"{missing}: required with {given} (new tokens need both), or give neither")
    s_new = 0
    if k is not None:
        s_new = _shape(k, "k", 4)[1]
        for x, name in ((k, "k"), (v, "v")):
            _same_shape(x, name, (b, s_new, shape[2], d), "[B, S_new, Hkv, D] with q's B and D")
            _same_library(x, name, q)
            _same_dtype(x, name, k_cache, "k_cache")
    return b, sq, hq, d, shape, s_new


# ---- flash_attn_func --------------------------------------------------------------------------


def flash_attn_impl(q, k, v, softmax_scale, causal, window, softcap, alibi_slopes, return_lse):
    """flash_attn_func on NumPy arrays or torch tensors: (out, lse or None)."""
    b, sq, sk, hq, hkv, d = dense_dims(q, k, v)
    causal, window = _mask(causal, window, sk)
    slopes = _alibi(alibi_slopes, hq, b, causal)
    scale, cap = _scale(softmax_scale), _softcap(softcap)
    # Bottom-right alignment: with a causal mask the first Sq - Sk queries see no key.
    rows = min(sq, sk) if causal else sq
    if b == 0 or rows == 0 or sk == 0:
        out = _full(q, (b, sq, hq, d), 0.0)
        return out, _full(q, (b, hq, sq), -math.inf, float32=True) if return_lse else None
    if not causal and slopes is None and cap == 0.0:
        # Unmasked [B, S, H, D] attention: dense() reads the layout as it is.
        res = dense(q, k, v, softmax_scale=scale, return_lse=return_lse)
        if not return_lse:
            return res, None
        return res[0], _contiguous(_permute(res[1], (0, 2, 1)))
    first = sq - rows
    res = prefill(
        q[:, first:].reshape(b * rows, hq, d),
        k.reshape(b * sk, hkv, d),
        v.reshape(b * sk, hkv, d),
        _arange(b + 1, q, rows),
        _arange(b + 1, q, sk),
        causal=causal,
        window=window,
        softmax_scale=scale,
        alibi=slopes if slopes is not None else False,
        softcap=cap,
        return_lse=return_lse,
        max_seqlen_q=rows,
        max_seqlen_k=sk,
    )
    o, l = res if return_lse else (res, None)
    if first == 0:
        return o.reshape(b, sq, hq, d), _lse_fa(l, b, sq, hq) if return_lse else None
    out = _full(q, (b, sq, hq, d), 0.0)
    out[:, first:] = o.reshape(b, rows, hq, d)
    lse = None
    if return_lse:
        lse = _full(q, (b, hq, sq), -math.inf, float32=True)
        lse[:, :, first:] = _lse_fa(l, b, rows, hq)
    return out, lse


def flash_attn_func(
    q: Any,
    k: Any,
    v: Any,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> Any:
    """flash_attn.flash_attn_func: q [B, Sq, Hq, D], k / v [B, Sk, Hkv, D] -> out [B, Sq, Hq, D].

    causal: bottom-right aligned (the first Sq - Sk queries of a causal call see no key and give
    zeros). window_size (left, right): -1 unbounded; served for right = 0 (or causal=True).
    alibi_slopes: [Hq] or [B, Hq] with equal rows, causal calls only (read to the host).
    softcap > 0 applies cap * tanh(logit / cap). dropout_p must be 0; deterministic is accepted
    (it concerns flash_attn's backward pass, which attnkit does not have).
    return_attn_probs=True returns (out, softmax_lse [B, Hq, Sq] float32, None): the third item
    (flash_attn's dropout-mask probabilities) is not computed.
    """
    _no_dropout(dropout_p)
    args = (q, k, v, softmax_scale, causal, window_pair(window_size), softcap, alibi_slopes)
    if _is_torch(q):
        out, lse = _ops.flash_attn(*args, return_attn_probs)
    else:
        out, lse = flash_attn_impl(*args, return_attn_probs)
    return (out, lse, None) if return_attn_probs else out


# ---- NHD caches -------------------------------------------------------------------------------


def _check_cache(k_cache: Any, v_cache: Any, q: Any, head_dim: int, names: tuple) -> tuple:
    """An NHD cache pair ([rows or blocks, tokens, Hkv, D], f16 / bf16 like q, or any of them
    for float32 CPU queries); names: the caller's names of the two arguments."""
    k_name, v_name = names
    shape = _shape(k_cache, k_name, 4)
    if shape[3] != head_dim:
        raise Error(f"{k_name}: expected head_dim {head_dim} (q's D) in dim 3, got {list(shape)}")
    _same_shape(v_cache, v_name, shape, f"the shape of {k_name}")
    for x, name in ((k_cache, k_name), (v_cache, v_name)):
        _same_library(x, name, q)
        _same_dtype(x, name, k_cache, k_name)
    if _dtype_name(k_cache) not in ("float16", "bfloat16"):
        raise Error(f"{k_name}: expected float16 or bfloat16, got {_dtype_name(k_cache)}")
    if _dtype_name(q) != "float32":
        _same_dtype(k_cache, k_name, q, "q")
    return shape


def _check_rows(lens: np.ndarray, table: Optional[np.ndarray], shape: tuple, names: tuple) -> None:
    """Host-side check (CPU inputs) that every row's tokens lie in the cache, in flash_attn's
    names. lens: tokens of each row after this call's appends; names: (lengths argument, what it
    counts, cache argument)."""
    lens_name, what, cache_name = names
    num_blocks, page = shape[0], shape[1]
    capacity = page * (table.shape[1] if table is not None else 1)
    for r, n in enumerate(lens.tolist()):
        if n < 0:
            raise Error(f"{lens_name}: row {r} has {n} tokens ({what}); must be >= 0")
        if n > capacity:
            raise Error(
                f"{lens_name}: row {r} needs {n} cache slots ({what}) but a row of {cache_name} "
                f"holds {capacity}"
            )
        if table is None:
            continue
        used = table[r, : (n + page - 1) // page]
        bad = np.nonzero((used < 0) | (used >= num_blocks))[0]
        if bad.size:
            c = int(bad[0])
            raise Error(
                f"block_table: row {r}, entry {c} = {int(used[c])} is not a block of "
                f"{cache_name} (0 .. {num_blocks - 1}) and row {r} holds {n} tokens"
            )


def _index(x: Any) -> Any:
    return x.long() if _is_torch(x) else x


def _element_strides(x: Any) -> tuple:
    if _is_torch(x):
        return tuple(int(v) for v in x.stride())
    return tuple(int(v) // x.itemsize for v in x.strides)


def _in_place(k_cache: Any, v_cache: Any, packed: bool) -> bool:
    """Whether attnkit reads the NHD pair where it lies: every block [S, Hkv, D] contiguous (the
    canonical strides, as the KvView requires), one block stride for K and V, and, where pages
    are split into blocks (packed), blocks that follow each other without a gap."""
    shape = tuple(int(v) for v in k_cache.shape)
    block = (shape[2] * shape[3], shape[3], 1)
    ks, vs = _element_strides(k_cache), _element_strides(v_cache)
    if ks[1:] != block or vs[1:] != block:
        return False
    if shape[0] > 1 and ks[0] != vs[0]:
        return False
    return not packed or shape[0] <= 1 or ks[0] == shape[1] * block[0]


def _nhd_view(k_cache: Any, v_cache: Any, block_table: Any, seq_lens: Any) -> tuple:
    """The rows of an NHD cache as a KvView (layout NHD); returns (view, slot_of, in_place).

    Contiguous cache ([B_cache, S_cache, Hkv, D], no table): row b is row b of the cache.
    Paged cache ([num_blocks, page_size, Hkv, D]): each page is page_size / T attnkit blocks of T
    tokens (T the largest of 128, 64, ..., 8 dividing the page), so a page of 8 .. 128 tokens is
    one block and the caller's table is the view's; the tokens of a page are contiguous in NHD, so
    the split needs no copy. in_place: the view reads the caller's arrays (_in_place); otherwise it
    reads a packed copy (of every row's table entries or of the whole pool, whichever is smaller:
    a choice by shapes, so it never synchronizes), and slot_of(rows, positions) gives the copy's
    (block, offset) of tokens, for appends. Table entries outside the pool become -1, which the
    kernels never read within a row's length without reporting a device fault.
    """
    num_blocks, page, hkv, d = (int(s) for s in k_cache.shape)
    batch = int(seq_lens.shape[0])
    if block_table is None:
        if batch > num_blocks:
            raise Error(
                f"k_cache: holds {num_blocks} rows (dim 0), fewer than the batch of q ({batch})"
            )
        if _in_place(k_cache, v_cache, False):
            return KvView(k_cache, v_cache, seq_lens, None, layout="NHD"), None, True
        k, v = _copy(k_cache[:batch]), _copy(v_cache[:batch])
        return KvView(k, v, seq_lens, None, layout="NHD"), lambda rows, pos: (rows, pos), False
    t = next((t for t in _BLOCK_SIZES if page % t == 0), None)
    if t is None:
        raise Error(f"k_cache: page_size (dim 1) must be a multiple of 8, got {page}")
    split = page // t
    width = int(block_table.shape[1])
    in_place = _in_place(k_cache, v_cache, split > 1)
    valid = (block_table >= 0) & (block_table < num_blocks)
    if in_place:
        if split == 1:
            return KvView(k_cache, v_cache, seq_lens, block_table, layout="NHD"), None, True
        src_k, src_v, base = k_cache, v_cache, _where(valid, block_table, -1)
    elif batch * width >= num_blocks:  # a copy of the whole pool, addressed by the caller's table
        src_k, src_v, base = _copy(k_cache), _copy(v_cache), _where(valid, block_table, -1)
    else:  # a copy of every row's blocks, in table order
        index = _index(_where(valid, block_table, 0))
        src_k = _copy(k_cache[index].reshape(batch * width, page, hkv, d))
        src_v = _copy(v_cache[index].reshape(batch * width, page, hkv, d))
        base = _where(valid, _arange(batch * width, block_table).reshape(batch, width), -1)
    n = int(src_k.shape[0])
    base = base.reshape(batch, width, 1)
    sub = _arange(split, block_table).reshape(1, 1, split)
    table = _where(base >= 0, base * split + sub, -1).reshape(batch, width * split)
    table = table.to(_torch.int32) if _is_torch(table) else table.astype(np.int32)

    def slot_of(rows: Any, pos: Any) -> tuple:
        return table[_index(rows), _index(pos // t)], pos % t

    # Packed pages: [n, page, Hkv, D] is [n * split, t, Hkv, D] without a copy.
    view = KvView(
        src_k.reshape(n * split, t, hkv, d),
        src_v.reshape(n * split, t, hkv, d),
        seq_lens,
        table,
        layout="NHD",
    )
    return view, slot_of, in_place


def _put(dst: Any, index: tuple, values: Any, valid: Any) -> None:
    """dst[index] = values ([N, ...]) for the tokens where ``valid`` ([N] bool); the others write
    nothing.

    Dropping invalid tokens from the index arrays would need their count (a synchronization on
    CUDA), so an invalid token repeats the write of the first valid one (the same value to the
    same place: the result does not depend on the order of the writes), or rewrites element 0
    with its own value when no token is valid. ``first`` stays a [1] device array used as an
    index array and broadcast: a 0-d torch index would be read to the host (``.item()``), which
    synchronizes and fails inside CUDA-graph capture.
    """
    if int(valid.shape[0]) == 0:
        return
    any_valid = valid.any()
    if _is_torch(valid):
        first = valid.int().argmax().reshape(1)
    else:
        first = np.array([np.argmax(valid)])

    def fix(i: Any) -> Any:
        if isinstance(i, slice):
            return i
        return _index(_where(valid, i, _where(any_valid, i[first], i[:1] * 0)))

    fixed = tuple(fix(i) for i in index)
    zero = tuple(i if isinstance(i, slice) else _index(i[:1] * 0) for i in index)
    own = dst[zero]  # [1, ...]: element 0's current value
    fill = _where(any_valid, values[first], own)  # [1, ...], broadcast over the tokens
    mask = valid.reshape((-1,) + (1,) * (values.ndim - 1))
    dst[fixed] = _where(mask, values, fill)


# ---- flash_attn_varlen_func -------------------------------------------------------------------


def flash_attn_varlen_impl(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale,
    causal,
    window,
    softcap,
    alibi_slopes,
    return_lse,
    block_table,
    seqused_k=None,
):
    """flash_attn_varlen_func: (out [total_q, Hq, D], lse [Hq, total_q] or None)."""
    total_q, hq, d, hkv = varlen_dims(q, k, v, block_table)
    cu_q = _int32_array(cu_seqlens_q, q, "cu_seqlens_q")
    if cu_q.ndim != 1 or int(cu_q.shape[0]) < 1:
        raise Error(f"cu_seqlens_q: expected shape [B + 1], got {list(cu_q.shape)}")
    batch = int(cu_q.shape[0]) - 1
    if seqused_k is not None:
        if block_table is None:
            raise Error(
                "seqused_k: only with block_table (packed k / v take their lengths from "
                "cu_seqlens_k)"
            )
        seq_lens = _int32_array(seqused_k, q, "seqused_k")
        if tuple(seq_lens.shape) != (batch,):
            raise Error(f"seqused_k: expected shape [{batch}] (B), got {list(seq_lens.shape)}")
        lens_names = ("seqused_k", "its keys", "k")
    else:
        if cu_seqlens_k is None:
            raise Error("cu_seqlens_k: required (or seqused_k with block_table)")
        cu_k = _int32_array(cu_seqlens_k, q, "cu_seqlens_k")
        if tuple(cu_k.shape) != (batch + 1,):
            raise Error(
                f"cu_seqlens_k: expected shape [{batch + 1}] (B + 1), got {list(cu_k.shape)}"
            )
        seq_lens = cu_k[1:] - cu_k[:-1]
        lens_names = ("cu_seqlens_k", "its keys", "k")
    max_q, max_k = int(max_seqlen_q), int(max_seqlen_k)
    for value, name in ((max_q, "max_seqlen_q"), (max_k, "max_seqlen_k")):
        if value < 0:
            raise Error(f"{name}: must be >= 0, got {value}")
    causal, window = _mask(causal, window, max_k)
    slopes = _alibi(alibi_slopes, hq, batch, causal)
    scale, cap = _scale(softmax_scale), _softcap(softcap)
    if total_q == 0 or batch == 0:
        out = _full(q, (total_q, hq, d), 0.0)
        return out, _full(q, (hq, total_q), -math.inf, float32=True) if return_lse else None
    kw = dict(
        causal=causal,
        window=window,
        softmax_scale=scale,
        alibi=slopes if slopes is not None else False,
        softcap=cap,
        return_lse=return_lse,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
    )
    if block_table is None:
        res = prefill(q, k, v, cu_q, cu_k, **kw)
    else:
        table = _int32_array(block_table, q, "block_table")
        if table.ndim != 2 or int(table.shape[0]) != batch:
            raise Error(
                f"block_table: expected shape [{batch}, max_blocks] (B rows), got "
                f"{list(table.shape)}"
            )
        if _on_host(q):
            lens = _host(seq_lens)
            _check_rows(lens, _host(table), tuple(k.shape), lens_names)
            n_q = np.diff(_host(cu_q))
            short = np.nonzero(n_q > lens)[0]
            if short.size:
                i = int(short[0])
                raise Error(
                    f"cu_seqlens_q: sequence {i} has {int(n_q[i])} queries but {int(lens[i])} "
                    "keys; over a paged cache the queries are the last keys (n_q <= n_k)"
                )
        view = _nhd_view(k, v, table, seq_lens)[0]
        res = prefill(q, cu_seqlens_q=cu_q, kv_cache=view, **kw)
    if not return_lse:
        return res, None
    return res[0], _contiguous(_permute(res[1], (1, 0)))


def flash_attn_varlen_func(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Any = None,
    *,
    seqused_k: Any = None,
) -> Any:
    """flash_attn.flash_attn_varlen_func: packed sequences without padding.

    q [total_q, Hq, D]; k / v [total_k, Hkv, D], or with block_table int32 [B, max_blocks] a
    paged NHD cache [num_blocks, page_size, Hkv, D] (page_size a multiple of 8) whose sequence
    i holds cu_seqlens_k[i + 1] - cu_seqlens_k[i] tokens. cu_seqlens_q / cu_seqlens_k: int32
    [B + 1]; max_seqlen_q / max_seqlen_k bound the lengths (nothing is read back from the
    device). A causal sequence needs n_q <= n_k (its queries are its last keys), as does every
    sequence over a paged cache. seqused_k (keyword; vLLM's flash_attn fork): int32 [B] key
    lengths of a paged call instead of cu_seqlens_k (which may then be None). Other arguments as
    for flash_attn_func.
    return_attn_probs=True returns (out, softmax_lse [Hq, total_q] float32, None).
    """
    _no_dropout(dropout_p)
    args = (
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        causal,
        window_pair(window_size),
        softcap,
        alibi_slopes,
        return_attn_probs,
        block_table,
        seqused_k,
    )
    out, lse = _ops.flash_attn_varlen(*args) if _is_torch(q) else flash_attn_varlen_impl(*args)
    return (out, lse, None) if return_attn_probs else out


# ---- flash_attn_with_kvcache ------------------------------------------------------------------


def _rotary(x: Any, cos: Any, sin: Any, pos: Any, interleaved: bool) -> Any:
    """RoPE from the caller's tables: x [B, S, H, D] at positions pos [B, S] (clipped to the
    table for the gather: the table covers every slot of the cache, so every position that is
    written lies in it)."""
    rows, half = int(cos.shape[0]), int(cos.shape[1])
    at = _index(_where(pos < 0, 0, _where(pos >= rows, rows - 1, pos)))
    c = _float32(cos[at])[:, :, None, :]  # [B, S, 1, rotary_dim / 2]
    s = _float32(sin[at])[:, :, None, :]
    xr = _float32(x[..., : 2 * half])
    if interleaved:  # GPT-J: pairs (0, 1), (2, 3), ...
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        pairs = (x1 * c - x2 * s, x1 * s + x2 * c)
        rotated = (_torch.stack(pairs, -1) if _is_torch(xr) else np.stack(pairs, -1)).reshape(
            xr.shape
        )
    else:  # GPT-NeoX: halves (i, i + rotary_dim / 2)
        x1, x2 = xr[..., :half], xr[..., half:]
        rotated = _concat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
    return _concat((_as_dtype(rotated, x), x[..., 2 * half :]), -1)


def flash_attn_with_kvcache_impl(
    q,
    k_cache,
    v_cache,
    k,
    v,
    rotary_cos,
    rotary_sin,
    cache_seqlens,
    block_table,
    softmax_scale,
    causal,
    window,
    softcap,
    rotary_interleaved,
    alibi_slopes,
    num_splits,
    return_lse,
):
    """flash_attn_with_kvcache: (out [B, Sq, Hq, D], lse [B, Hq, Sq] or None); appends k / v
    to k_cache / v_cache once the call is accepted."""
    b, sq, hq, d, shape, s_new = kvcache_dims(q, k_cache, v_cache, k, v)
    num_blocks, page, hkv = shape[:3]
    table = None
    if block_table is not None:
        table = _int32_array(block_table, q, "block_table")
        if table.ndim != 2 or int(table.shape[0]) != b:
            raise Error(
                f"block_table: expected shape [{b}, max_blocks] (q's batch), got "
                f"{list(table.shape)}"
            )
    capacity = page * (int(table.shape[1]) if table is not None else 1)
    if cache_seqlens is None:
        if k is not None:
            raise Error("cache_seqlens: required with new k / v (it says where they go)")
        # Made next to q (no host-to-device copy, which a captured graph cannot hold).
        cache_seqlens = _arange(b, q) * 0 + capacity
    lens = _int32_array(cache_seqlens, q, "cache_seqlens")
    if tuple(lens.shape) != (b,):
        raise Error(
            f"cache_seqlens: expected an int or shape [{b}] (q's batch), got {list(lens.shape)}"
        )
    if (rotary_cos is None) != (rotary_sin is None):
        missing = "rotary_sin" if rotary_sin is None else "rotary_cos"
        raise Error(f"{missing}: required with the other rotary table, or give neither")
    if rotary_cos is not None:
        if k is None:
            raise Error("rotary_cos: applies with new k / v only (flash_attn's rule); give k, v")
        rows, half = _shape(rotary_cos, "rotary_cos", 2)
        _same_shape(rotary_sin, "rotary_sin", (rows, half), "the shape of rotary_cos")
        if not 1 <= 2 * half <= d:
            raise Error(
                f"rotary_cos: expected [seqlen_ro, rotary_dim / 2] with rotary_dim <= D = {d}, "
                f"got shape {[rows, half]}"
            )
        if rows < capacity:
            raise Error(
                f"rotary_cos: {rows} positions, fewer than a row of k_cache holds ({capacity}); "
                "the table must cover every position of the cache"
            )
        for x, name in ((rotary_cos, "rotary_cos"), (rotary_sin, "rotary_sin")):
            _same_library(x, name, q)
    is_causal, window = _mask(causal, window, capacity)
    # A single query sits at the last key, so every key is before it: ALiBi's signs agree.
    slopes = _alibi(alibi_slopes, hq, b, is_causal or sq == 1)
    scale, cap = _scale(softmax_scale), _softcap(softcap)
    total = lens + s_new
    if _on_host(q):
        host_total = _host(total)
        host_table = _host(table) if table is not None else None
        _check_rows(host_total, host_table, shape, ("cache_seqlens", "counting k", "k_cache"))
        short = np.nonzero(host_total < sq)[0]
        if short.size:
            r = int(short[0])
            raise Error(
                f"cache_seqlens: row {r} holds {int(host_total[r])} tokens (counting k), fewer "
                f"than the {sq} queries: the queries are the last tokens of their row"
            )
    if b == 0 or sq == 0:
        out = _full(q, (b, sq, hq, d), 0.0)
        return out, _full(q, (b, hq, sq), -math.inf, float32=True) if return_lse else None

    view, slot_of, in_place = _nhd_view(k_cache, v_cache, table, total)
    saved = None  # in place: the appended slots' old K and V, restored if the call is rejected
    if k is not None:
        pos = lens.reshape(b, 1) + _arange(s_new, q).reshape(1, s_new)
        if rotary_cos is not None:
            k = _rotary(k, rotary_cos, rotary_sin, pos, rotary_interleaved)
            # flash_attn: with a mask query i sits at cache_seqlens + i, else all at cache_seqlens.
            q_pos = lens.reshape(b, 1) + _arange(sq, q).reshape(1, sq) * int(is_causal)
            q = _rotary(q, rotary_cos, rotary_sin, q_pos, rotary_interleaved)
        valid = ((pos >= 0) & (pos < capacity)).reshape(-1)
        rows = (_arange(b, q).reshape(b, 1) + pos * 0).reshape(-1)
        pos = _where(valid, pos.reshape(-1), 0)
        k_new, v_new = k.reshape(b * s_new, hkv, d), v.reshape(b * s_new, hkv, d)
        # The tokens' slots of the caller's cache (NHD: [token's Hkv, D] at (block, offset)).
        if table is None:
            dst, ok = (rows, pos), valid
        else:
            entry = table[_index(rows), _index(pos // page)]
            ok = valid & (entry >= 0) & (entry < num_blocks)
            dst = (_where(ok, entry, 0), pos % page)
        if in_place:
            at = tuple(_index(i) for i in dst)
            saved = (k_cache[at], v_cache[at])
            _put(k_cache, dst, k_new, ok)
            _put(v_cache, dst, v_new, ok)
        else:
            block, offset = slot_of(rows, pos)
            copy_ok = valid & (block >= 0)
            _put(view.k, (block, offset), k_new, copy_ok)
            _put(view.v, (block, offset), v_new, copy_ok)
    kw = dict(softmax_scale=scale, alibi=slopes if slopes is not None else False, softcap=cap)
    try:
        if sq == 1:
            res = decode(
                q.reshape(b, hq, d),
                view,
                window=window,
                num_splits=int(num_splits),
                return_lse=return_lse,
                **kw,
            )
        else:
            res = prefill(
                q.reshape(b * sq, hq, d),
                cu_seqlens_q=_arange(b + 1, q, sq),
                kv_cache=view,
                causal=is_causal,
                window=window,
                return_lse=return_lse,
                max_seqlen_q=sq,
                max_seqlen_k=capacity,
                **kw,
            )
    except Error:
        if saved is not None:  # rejected: the caller's cache as it was
            _put(k_cache, dst, saved[0], ok)
            _put(v_cache, dst, saved[1], ok)
        raise
    o, l = res if return_lse else (res, None)
    if k is not None and not in_place:  # the call was accepted: append to the caller's cache
        _put(k_cache, dst, k_new, ok)
        _put(v_cache, dst, v_new, ok)
    return o.reshape(b, sq, hq, d), _lse_fa(l, b, sq, hq) if return_lse else None


def flash_attn_with_kvcache(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    k: Any = None,
    v: Any = None,
    rotary_cos: Any = None,
    rotary_sin: Any = None,
    cache_seqlens: Any = None,
    cache_batch_idx: Any = None,
    cache_leftpad: Any = None,
    block_table: Any = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Any = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
) -> Any:
    """flash_attn.flash_attn_with_kvcache: attention over a KV cache, appending new k / v in
    place first.

    q [B, Sq, Hq, D]. k_cache / v_cache: [B_cache, S_cache, Hkv, D] (row b of the batch is row b
    of the cache), or with block_table int32 [B, max_blocks] a paged NHD cache
    [num_blocks, page_size, Hkv, D] (page_size a multiple of 8); float16 / bfloat16 like q.
    cache_seqlens: int or int32 [B], tokens already cached (None: every row full, without k).
    k / v [B, S_new, Hkv, D]: written at positions cache_seqlens .. cache_seqlens + S_new - 1 of
    k_cache / v_cache (in place, once the call is accepted), then attended with the rest.
    rotary_cos / rotary_sin [seqlen_ro, rotary_dim / 2], seqlen_ro >= a cache row's capacity:
    RoPE on k (at its positions) and q (at cache_seqlens + i with a mask, else cache_seqlens),
    interleaved pairs (GPT-J, rotary_interleaved=True) or halves (GPT-NeoX). The Sq queries are
    the last tokens of their row. num_splits: decode's split-KV count (0: heuristic; Sq = 1
    only). return_softmax_lse=True returns (out, softmax_lse [B, Hq, Sq] float32).
    cache_batch_idx and cache_leftpad are not supported (they raise when given).
    """
    if cache_batch_idx is not None:
        raise Error("cache_batch_idx: not supported (row b of the batch uses row b of k_cache)")
    if cache_leftpad is not None:
        raise Error("cache_leftpad: not supported (every cache row starts at position 0)")
    args = (
        q,
        k_cache,
        v_cache,
        k,
        v,
        rotary_cos,
        rotary_sin,
        cache_seqlens,
        block_table,
        softmax_scale,
        causal,
        window_pair(window_size),
        softcap,
        rotary_interleaved,
        alibi_slopes,
        num_splits,
        return_softmax_lse,
    )
    if _is_torch(q):
        out, lse = _ops.flash_attn_with_kvcache(*args)
    else:
        if isinstance(cache_seqlens, int):
            args = args[:7] + (np.full((int(q.shape[0]),), cache_seqlens),) + args[8:]
        out, lse = flash_attn_with_kvcache_impl(*args)
    return (out, lse) if return_softmax_lse else out


# The torch custom ops (attnkit.torch) call back into the *_impl functions above.
if _torch is not None:
    from . import torch as _ops
else:
    _ops = None
