"""Hugging Face transformers integration: ``attn_implementation="attnkit"``.

Importing this module registers :func:`attention_forward` under the name ``"attnkit"`` with
transformers' ``AttentionInterface``, and transformers' SDPA mask builder (``sdpa_mask``) under
the same name with its ``AttentionMaskInterface``, so that a model built with
``attn_implementation="attnkit"`` (``from_pretrained``, ``from_config``, or
``model.set_attn_implementation("attnkit")``, which does not reach the encoder and decoder
stacks of T5-family models: choose the name when building those) runs its attention through
attnkit::

    import attnkit.hf
    model = AutoModelForCausalLM.from_config(config, attn_implementation="attnkit")

The model then builds the same masks as for ``"sdpa"`` (None where SDPA's ``is_causal`` would
serve, else a boolean ``[B, 1, Sq, Skv]`` mask). :func:`attention_forward` maps them onto
attnkit's calls: no mask -> one ``prefill`` (causal, or ``dense`` where nothing masks), a boolean
mask -> the padded tokens removed and one varlen ``prefill`` over the rest, after checking that the
mask is exactly a pattern attnkit computes (causal or sliding-window, bottom-right aligned, over
each row's unpadded tokens; or key padding alone for bidirectional attention). Anything else
raises :class:`attnkit.Error` naming the argument; nothing is approximated. See docs/python.md
("Hugging Face transformers").
"""

from __future__ import annotations

from typing import Any, Optional

import torch

import attnkit

from . import Error

__all__ = ["attention_forward", "register", "NAME"]

NAME = "attnkit"


def _reject(name: str, what: str, accepted: str) -> None:
    raise Error(f"{name}: {what}; accepted: {accepted}")


def _check_kwargs(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kw: dict
) -> None:
    dropout = kw.pop("dropout", 0.0) or 0.0
    if dropout != 0.0:
        _reject(
            "dropout",
            f"got {dropout} (attnkit is an inference forward pass)",
            "0.0 (call model.eval(), or set the config's attention_dropout to 0)",
        )
    for name in ("position_bias", "s_aux", "sinks"):
        if kw.get(name) is not None:
            _reject(
                name,
                f"given by {type(module).__name__}; attnkit has no per-logit bias or "
                "attention sink",
                'None (run such models with attn_implementation="sdpa" or "eager")',
            )
    if kw.get("output_attentions"):
        _reject(
            "output_attentions",
            "True: attnkit never materializes the attention probabilities",
            'False (or attn_implementation="eager" to get them)',
        )
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        _reject(
            "query",
            f"shapes {list(query.shape)}, {list(key.shape)}, {list(value.shape)}",
            "query [B, Hq, Sq, D], key / value [B, Hkv, Skv, D]",
        )
    if value.shape[-1] != query.shape[-1] or key.shape[-1] != query.shape[-1]:
        _reject(
            "value",
            f"head_dim {value.shape[-1]} (key {key.shape[-1]}) differs from the query's "
            f"{query.shape[-1]}",
            "one head_dim for query, key and value",
        )


def _padding_pattern(
    mask: torch.Tensor, batch: int, sq: int, skv: int, causal: bool, window: Optional[int]
) -> tuple:
    """The rows' unpadded queries and keys when ``mask`` is exactly attnkit's varlen pattern.

    Returns (q_valid [B, Sq], k_valid [B, Skv]) boolean tensors: row b's kept keys form one
    sequence; causally, its kept queries are the last ones of that sequence (bottom-right aligned)
    and attend the kept keys at or before their own position (within ``window`` of it), in the
    compacted order; bidirectionally, every query attends every kept key. Raises Error naming
    attention_mask where the mask is anything else (per-head masks, packed sequences, custom or
    additive masks), so an unserved pattern never runs as a served one.
    """
    accepted = (
        "None, or the boolean mask transformers builds for attn_implementation='attnkit' "
        "(causal or sliding-window attention over each row's unpadded tokens, or key padding "
        "for bidirectional attention)"
    )
    if mask.dtype != torch.bool:
        _reject(
            "attention_mask",
            f"dtype {mask.dtype} (an additive mask, e.g. from a custom 4D mask or position bias)",
            accepted,
        )
    if mask.ndim != 4 or mask.shape[0] != batch or tuple(mask.shape[2:]) != (sq, skv):
        _reject(
            "attention_mask",
            f"shape {list(mask.shape)} for query length {sq} and key length {skv}",
            f"[{batch}, 1, {sq}, {skv}] booleans",
        )
    m = mask[:, 0]
    if mask.shape[1] != 1 and not torch.equal(mask, m[:, None].expand_as(mask)):
        _reject("attention_mask", "differs between heads", accepted)
    k_valid = m.any(1)
    if causal:
        q_valid = m.any(2)
        n_q = q_valid.sum(1, keepdim=True)
        n_k = k_valid.sum(1, keepdim=True)
        # Position of each kept query in its compacted sequence (bottom-right aligned) and the
        # compacted index of each kept key; the pattern is then a plain causal / window mask.
        q_pos = n_k - n_q + q_valid.cumsum(1) - 1
        k_pos = k_valid.cumsum(1) - 1
        dist = q_pos[:, :, None] - k_pos[:, None, :]
        expected = q_valid[:, :, None] & k_valid[:, None, :] & (dist >= 0)
        if window is not None:
            expected &= dist < window
    else:
        q_valid = torch.ones((batch, sq), dtype=torch.bool, device=m.device)
        expected = k_valid[:, None, :].expand(batch, sq, skv)
    if not torch.equal(expected, m):
        what = "is not " + (
            "a causal" + (f" window-{window}" if window is not None else "")
            if causal
            else "a key-padding"
        )
        _reject("attention_mask", what + " mask over the rows' unpadded tokens", accepted)
    return q_valid, k_valid


def _cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    cu = torch.zeros(lengths.shape[0] + 1, dtype=torch.int32, device=lengths.device)
    cu[1:] = lengths.cumsum(0)
    return cu


def _uniform_cu_seqlens(batch: int, length: int, device: torch.device) -> torch.Tensor:
    """[0, L, 2L, ..., B*L] made on the device (no host-to-device copy, no synchronization)."""
    return torch.arange(batch + 1, dtype=torch.int32, device=device) * length


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    **kwargs: Any,
) -> tuple:
    """transformers' attention-function signature (as ``sdpa_attention_forward``), on attnkit.

    query: [B, Hq, Sq, D]; key, value: [B, Hkv, Skv, D] (GQA / MQA served without repeating
    K/V); attention_mask: None or the boolean [B, 1, Sq, Skv] mask of transformers' ``sdpa_mask``
    (see the module docstring). scaling: the softmax scale (None: 1/sqrt(D)); is_causal: None
    takes ``module.is_causal`` (default True), as for SDPA; sliding_window: the window of the
    layer (W keys, the query's own included, as in transformers' masks); softcap: logit
    soft-capping ``cap * tanh(x / cap)`` (Gemma 2; SDPA raises for it, attnkit serves it).

    Without a mask the semantics are SDPA's: causal when Sq > 1 and the module is causal (a
    key length above Sq is an empty static cache's unwritten tail, cut off as SDPA does), else
    every key. Rejected (attnkit.Error naming the argument): dropout > 0, a position_bias or
    attention-sink tensor (s_aux / sinks), output_attentions=True, masks that are not a served
    pattern, value head_dim different from the query's. Padded query positions (causal attention
    over a padded batch) get zeros.

    Returns (attn_output [B, Sq, Hq, D] in the query's dtype, None).
    """
    kw = dict(kwargs)
    _check_kwargs(module, query, key, value, kw)
    batch, hq, sq, d = (int(s) for s in query.shape)
    hkv, skv = int(key.shape[1]), int(key.shape[2])
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    window = int(sliding_window) if sliding_window else None
    cap = float(softcap) if softcap else 0.0
    if window is not None and not causal:
        _reject(
            "sliding_window",
            f"{window} on a bidirectional layer (attnkit's windows are causal)",
            "None for bidirectional attention",
        )
    # [B, H, S, D] -> [B, S, H, D]: views with a contiguous last dimension, what attnkit reads.
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))

    if attention_mask is None:
        causal = bool(causal) and sq > 1
        if causal and skv > sq:
            # SDPA's is_causal is top-left aligned and transformers passes no mask only for an
            # empty static cache here: the keys after the first Sq are unwritten slots.
            k, v, skv = k[:, :sq], v[:, :sq], sq
        if not causal and cap == 0.0:
            return attnkit.dense(q, k, v, softmax_scale=scaling), None
        out = attnkit.prefill(
            q.reshape(batch * sq, hq, d),
            k.reshape(batch * skv, hkv, d),
            v.reshape(batch * skv, hkv, d),
            _uniform_cu_seqlens(batch, sq, query.device),
            _uniform_cu_seqlens(batch, skv, query.device),
            causal=causal,
            window=window if causal else None,
            softmax_scale=scaling,
            softcap=cap,
            max_seqlen_q=sq,
            max_seqlen_k=skv,
        )
        return out.view(batch, sq, hq, d), None

    q_valid, k_valid = _padding_pattern(attention_mask, batch, sq, skv, bool(causal), window)
    n_q, n_k = q_valid.sum(1), k_valid.sum(1)
    packed = attnkit.prefill(
        q[q_valid],
        k[k_valid],
        v[k_valid],
        _cu_seqlens(n_q),
        _cu_seqlens(n_k),
        causal=bool(causal),
        window=window,
        softmax_scale=scaling,
        softcap=cap,
        max_seqlen_q=int(n_q.max()) if batch else 0,
        max_seqlen_k=int(n_k.max()) if batch else 0,
    )
    out = torch.zeros((batch, sq, hq, d), dtype=query.dtype, device=query.device)
    out[q_valid] = packed
    return out, None


def register(name: str = NAME) -> None:
    """Registers :func:`attention_forward` and transformers' SDPA mask builder under ``name``
    (done for "attnkit" when this module is imported). Without the mask entry transformers would
    build no mask at all for the name, and padded batches would silently attend padding."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)


register()
