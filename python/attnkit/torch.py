"""attnkit.torch: attnkit as PyTorch custom ops, and an SDPA-shaped entry point.

Importing this module (``import attnkit.torch``; attnkit.flash_attn does it when torch is
installed) registers ``torch.library`` custom ops with fake (meta) implementations:

- ``torch.ops.attnkit.flash_attn``: flash_attn_func's computation.
- ``torch.ops.attnkit.flash_attn_varlen``: flash_attn_varlen_func's.
- ``torch.ops.attnkit.flash_attn_with_kvcache``: flash_attn_with_kvcache's (mutates k_cache and
  v_cache).
- ``torch.ops.attnkit.sdpa``: :func:`sdpa`'s.

Each call is one opaque op to ``torch.compile`` (``fullgraph=True`` traces through the Python
wrappers without a graph break) and to CUDA-graph capture: the ops enqueue on the current stream
and read nothing back from the device, except ``alibi_slopes`` given as a CUDA tensor (read to
the host: pass them as a CPU tensor, a list or a NumPy array inside a captured region). The ops
run on CPU tensors too (reference backend), which is how the CPU tests exercise them.
"""

import math
from typing import Any, Optional, Tuple

import numpy as np
import torch

from . import Error, dense
from . import flash_attn as _fa

__all__ = ["sdpa"]


def _slopes(alibi_slopes: Any) -> Optional[torch.Tensor]:
    if alibi_slopes is None or isinstance(alibi_slopes, torch.Tensor):
        return alibi_slopes
    return torch.tensor(alibi_slopes, dtype=torch.float32)


def _int32(x: Any, like: torch.Tensor) -> Optional[torch.Tensor]:
    """Lists and NumPy arrays given for lengths and tables, as tensors next to ``like`` (the ops
    take tensors; the checks of dtype and shape are the implementation's)."""
    if x is None or isinstance(x, torch.Tensor):
        return x
    return torch.as_tensor(np.asarray(x), device=like.device)


def _no_lse(q: torch.Tensor) -> torch.Tensor:
    # Custom ops return tensors, never None: an empty LSE stands for "not asked for".
    return q.new_empty((0,), dtype=torch.float32)


# ---- flash_attn_func --------------------------------------------------------------------------


@torch.library.custom_op("attnkit::flash_attn", mutates_args=())
def _flash_attn_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: Optional[float],
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    return_lse: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    out, lse = _fa.flash_attn_impl(
        q, k, v, softmax_scale, causal, (window_left, window_right), softcap, alibi_slopes,
        return_lse,
    )
    return out, lse if lse is not None else _no_lse(q)


@_flash_attn_op.register_fake
def _(q, k, v, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, return_lse):
    b, sq, _, hq, _, d = _fa.dense_dims(q, k, v)
    lse = q.new_empty((b, hq, sq), dtype=torch.float32) if return_lse else _no_lse(q)
    return q.new_empty((b, sq, hq, d)), lse


def flash_attn(q, k, v, softmax_scale, causal, window, softcap, alibi_slopes, return_lse):
    out, lse = _flash_attn_op(
        q, k, v, softmax_scale, bool(causal), window[0], window[1], float(softcap),
        _slopes(alibi_slopes), bool(return_lse),
    )
    return out, lse if return_lse else None


# ---- flash_attn_varlen_func -------------------------------------------------------------------


@torch.library.custom_op("attnkit::flash_attn_varlen", mutates_args=())
def _flash_attn_varlen_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: Optional[torch.Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: Optional[float],
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],
    return_lse: bool,
    block_table: Optional[torch.Tensor],
    seqused_k: Optional[torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor]:
    out, lse = _fa.flash_attn_varlen_impl(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
        (window_left, window_right), softcap, alibi_slopes, return_lse, block_table, seqused_k,
    )
    return out, lse if lse is not None else _no_lse(q)


@_flash_attn_varlen_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
      window_left, window_right, softcap, alibi_slopes, return_lse, block_table, seqused_k):
    total_q, hq, d, _ = _fa.varlen_dims(q, k, v, block_table)
    lse = q.new_empty((hq, total_q), dtype=torch.float32) if return_lse else _no_lse(q)
    return q.new_empty((total_q, hq, d)), lse


def flash_attn_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                      softmax_scale, causal, window, softcap, alibi_slopes, return_lse,
                      block_table, seqused_k):
    out, lse = _flash_attn_varlen_op(
        q, k, v, _int32(cu_seqlens_q, q), _int32(cu_seqlens_k, q), int(max_seqlen_q),
        int(max_seqlen_k), softmax_scale, bool(causal), window[0], window[1], float(softcap),
        _slopes(alibi_slopes), bool(return_lse), _int32(block_table, q), _int32(seqused_k, q),
    )
    return out, lse if return_lse else None


# ---- flash_attn_with_kvcache ------------------------------------------------------------------


@torch.library.custom_op("attnkit::flash_attn_with_kvcache", mutates_args=("k_cache", "v_cache"))
def _flash_attn_with_kvcache_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor],
    v: Optional[torch.Tensor],
    rotary_cos: Optional[torch.Tensor],
    rotary_sin: Optional[torch.Tensor],
    cache_seqlens: Optional[torch.Tensor],
    block_table: Optional[torch.Tensor],
    softmax_scale: Optional[float],
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    rotary_interleaved: bool,
    alibi_slopes: Optional[torch.Tensor],
    num_splits: int,
    return_lse: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    out, lse = _fa.flash_attn_with_kvcache_impl(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, block_table,
        softmax_scale, causal, (window_left, window_right), softcap, rotary_interleaved,
        alibi_slopes, num_splits, return_lse,
    )
    return out, lse if lse is not None else _no_lse(q)


@_flash_attn_with_kvcache_op.register_fake
def _(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, block_table,
      softmax_scale, causal, window_left, window_right, softcap, rotary_interleaved, alibi_slopes,
      num_splits, return_lse):
    b, sq, hq, d, _, _ = _fa.kvcache_dims(q, k_cache, v_cache, k, v)
    lse = q.new_empty((b, hq, sq), dtype=torch.float32) if return_lse else _no_lse(q)
    return q.new_empty((b, sq, hq, d)), lse


def flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                            block_table, softmax_scale, causal, window, softcap,
                            rotary_interleaved, alibi_slopes, num_splits, return_lse):
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32,
                                   device=q.device)
    out, lse = _flash_attn_with_kvcache_op(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, _int32(cache_seqlens, q),
        _int32(block_table, q),
        softmax_scale, bool(causal), window[0], window[1], float(softcap),
        bool(rotary_interleaved), _slopes(alibi_slopes), int(num_splits), bool(return_lse),
    )
    return out, lse if return_lse else None


# ---- scaled_dot_product_attention -------------------------------------------------------------


def _sdpa_dims(query, key, value, is_causal: bool, enable_gqa: bool) -> tuple:
    """(B, Hq, L, Hkv, S, E) of SDPA's [B, H, L, E] (or [B, L, E]) inputs."""
    ndim = query.dim()
    if ndim not in (3, 4):
        raise Error(
            f"query: expected [B, H, L, E] or [B, L, E], got shape {list(query.shape)} (other "
            "batch ranks: reshape to one batch dimension)"
        )
    shapes = [tuple(x.shape) if ndim == 4 else (x.shape[0], 1) + tuple(x.shape[1:])
              for x in (query, key, value)]
    (b, hq, l, e), (bk, hkv, s, ek) = shapes[0], shapes[1]
    for x, name in ((key, "key"), (value, "value")):
        if x.dim() != ndim:
            raise Error(f"{name}: expected {ndim} dimensions like query, got {list(x.shape)}")
    if bk != b or ek != e:
        raise Error(f"key: expected batch {b} and E = {e} like query, got {list(key.shape)}")
    if shapes[2] != shapes[1]:
        raise Error(
            f"value: expected the shape of key {list(key.shape)} (attnkit needs Ev = E), got "
            f"{list(value.shape)}"
        )
    if hkv != hq and not enable_gqa:
        raise Error(
            f"key: {hkv} heads for {hq} query heads; pass enable_gqa=True for grouped-query "
            "attention (as scaled_dot_product_attention requires)"
        )
    if hq % hkv:
        raise Error(f"key: the number of heads ({hkv}) must divide the query heads ({hq})")
    if is_causal and l > s:
        raise Error(
            f"is_causal: served for L <= S (top-left aligned causal mask), got L = {l} queries "
            f"and S = {s} keys"
        )
    return b, hq, l, hkv, s, e


@torch.library.custom_op("attnkit::sdpa", mutates_args=())
def _sdpa_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    is_causal: bool,
    scale: Optional[float],
    enable_gqa: bool,
) -> torch.Tensor:
    b, hq, l, hkv, s, e = _sdpa_dims(query, key, value, is_causal, enable_gqa)
    three_dims = query.dim() == 3
    if three_dims:
        query, key, value = (x.unsqueeze(1) for x in (query, key, value))
    # [B, H, L, E] -> [B, L, H, E] views (attnkit reads strided layouts as they are).
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    out = query.new_zeros((b, hq, l, e))
    if l == 0 or s == 0 or b == 0:
        return out.squeeze(1) if three_dims else out
    if is_causal:
        # SDPA's causal mask is top-left aligned: query i sees keys j <= i, so the keys after L
        # are never seen and the rest is attnkit's bottom-right causal mask over L keys.
        o, _ = _fa.flash_attn_impl(q, k[:, :l], v[:, :l], scale, True, (-1, -1), 0.0, None, False)
        out.copy_(o.transpose(1, 2))
    else:
        dense(q, k, v, softmax_scale=scale, out=out.transpose(1, 2))
    return out.squeeze(1) if three_dims else out


@_sdpa_op.register_fake
def _(query, key, value, is_causal, scale, enable_gqa):
    _sdpa_dims(query, key, value, is_causal, enable_gqa)
    return query.new_empty(query.shape)


def sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """torch.nn.functional.scaled_dot_product_attention's signature on attnkit's kernels.

    query [B, Hq, L, E], key / value [B, Hkv, S, E] (or [B, L, E] / [B, S, E]); Hkv != Hq
    needs enable_gqa=True (query head h uses KV head h // (Hq / Hkv), as SDPA). is_causal: SDPA's
    top-left aligned mask (query i sees keys j <= i), served for L <= S. scale: None is
    1 / sqrt(E). Returns [B, Hq, L, E] (or [B, L, E]) in query's dtype.

    Not served (raise naming the argument): attn_mask (any explicit mask or bias), dropout_p > 0,
    a value head dim other than E, is_causal with L > S, other batch ranks. The unmasked call
    reads the transposed layout in place; the causal one packs query / key / value into
    attnkit's [tokens, H, E] layout first (one copy each).
    """
    if attn_mask is not None:
        raise Error(
            "attn_mask: explicit masks and biases are not served (use is_causal=True, or "
            "attnkit.flash_attn_func for sliding windows, soft-capping and ALiBi)"
        )
    if float(dropout_p) != 0.0:
        raise Error(f"dropout_p: attnkit is inference-only: expected 0.0, got {dropout_p}")
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise Error(f"scale: must be finite and > 0 (None: 1 / sqrt(E)), got {scale}")
    return _sdpa_op(query, key, value, bool(is_causal), scale, bool(enable_gqa))
