"""diffusers integration: attention processors that run ``attnkit.dense``.

:class:`AttnProcessor` computes what diffusers' ``AttnProcessor2_0`` computes for an
``Attention`` module (UNet self / cross attention, DiT blocks) and :class:`JointAttnProcessor`
what ``JointAttnProcessor2_0`` computes (SD3's joint attention over image and text tokens), with
the attention itself in ``attnkit.dense``. Each call resolves its settings (backend,
skip-softmax, SAGE quantization) from an :class:`attnkit.AttentionConfig` for the call's role:
``"self"`` (no encoder_hidden_states), ``"cross"`` (encoder_hidden_states given) or ``"joint"``
(joint attention over the concatenated tokens), so one JSON config steers every layer kind
(docs/configuration.md)::

    import attnkit, attnkit.diffusers
    config = attnkit.AttentionConfig.from_json(text)
    attnkit.diffusers.set_processors(pipe.unet, config)     # or pipe.transformer
    attnkit.diffusers.set_timestep(pipe.unet, 0.7)           # the skip-softmax gate, per step

Attention masks are rejected (``attnkit.dense`` is unmasked); so are processors this module has
no counterpart for (:func:`set_processors` names them). See docs/python.md ("diffusers").
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

import attnkit

from . import Error

__all__ = ["AttnProcessor", "JointAttnProcessor", "set_processors", "set_timestep"]


def _no_mask(attention_mask: Any) -> None:
    if attention_mask is not None:
        raise Error(
            "attention_mask: attnkit.dense attends every key (no mask); accepted: None "
            "(drop encoder_attention_mask / attention_mask, or keep diffusers' own processor "
            "for masked layers)"
        )


def _heads(x: torch.Tensor, batch: int, head_dim: int) -> torch.Tensor:
    """[B, S, H * D] projections -> [B, S, H, D] views: the layout dense() reads, no copy."""
    return x.view(batch, -1, x.shape[-1] // head_dim, head_dim)


def _qkv(projections: tuple, norms: tuple, x_q: Any, x_kv: Any, head_dim: int) -> tuple:
    """Q from ``x_q``, K and V from ``x_kv`` through the (q, k, v) ``projections``, then the
    (q, k) ``norms`` (None: none), which act on the head dimension, the last in either layout."""
    batch = x_q.shape[0]
    q, k, v = (_heads(p(x), batch, head_dim) for p, x in zip(projections, (x_q, x_kv, x_kv)))
    norm_q, norm_k = norms
    return (norm_q(q) if norm_q is not None else q), (norm_k(k) if norm_k is not None else k), v


def _module_qkv(attn: Any, x_q: Any, x_kv: Any, head_dim: int) -> tuple:
    """The module's own q / k / v projections and q / k norms."""
    return _qkv(
        (attn.to_q, attn.to_k, attn.to_v), (attn.norm_q, attn.norm_k), x_q, x_kv, head_dim
    )


class _Base:
    def __init__(
        self,
        config: Optional[attnkit.AttentionConfig] = None,
        *,
        role: Optional[str] = None,
        backend: Optional[str] = None,
        kernel: str = "auto",
        timestep: float = 0.0,
    ) -> None:
        if config is not None and not isinstance(config, attnkit.AttentionConfig):
            raise Error(
                f"config: expected an attnkit.AttentionConfig or None, got {type(config).__name__}"
            )
        if role is not None and config is not None:
            config.resolve(role)  # a malformed role name raises here, not at the first step
        self.config = config
        self.role = role
        self.backend = backend
        self.kernel = kernel
        self.timestep = float(timestep)

    def _attend(
        self, attn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, role: str
    ) -> torch.Tensor:
        return attnkit.dense(
            q,
            k,
            v,
            config=self.config,
            role=self.role or role,
            backend=self.backend,
            kernel=self.kernel,
            softmax_scale=float(attn.scale),
            timestep=self.timestep,
        )


class AttnProcessor(_Base):
    """``AttnProcessor2_0``'s computation with the attention in ``attnkit.dense``.

    config: an AttentionConfig (None: every call backend "auto", no skip-softmax, no quant);
    role: a fixed role for every call (e.g. "self.video"), None: "self" without
    encoder_hidden_states, "cross" with them; backend / kernel: override the config's backend,
    as in ``dense``; timestep: the normalized diffusion timestep of the skip-softmax gate
    (``set_timestep`` updates it between steps). The softmax scale is the module's ``attn.scale``
    (``AttnProcessor2_0`` passes none to SDPA, i.e. 1/sqrt(head_dim): the same value unless the
    module was built with ``scale_qk=False``). K/V with fewer heads than Q (``kv_heads``) run as
    GQA. A non-None attention_mask raises attnkit.Error.
    """

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        temb: Optional[torch.Tensor] = None,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        _no_mask(attention_mask)
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        image = hidden_states.ndim == 4
        if image:
            batch, channel, height, width = hidden_states.shape
            hidden_states = hidden_states.view(batch, channel, height * width).transpose(1, 2)
        batch = hidden_states.shape[0]
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)

        role = "self" if encoder_hidden_states is None else "cross"
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        elif attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
        head_dim = attn.to_q.out_features // attn.heads
        q, k, v = _module_qkv(attn, hidden_states, encoder_hidden_states, head_dim)

        out = self._attend(attn, q, k, v, role)
        hidden_states = out.reshape(batch, -1, out.shape[2] * head_dim).to(hidden_states.dtype)
        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        if image:
            hidden_states = hidden_states.transpose(-1, -2).reshape(batch, channel, height, width)
        if attn.residual_connection:
            hidden_states = hidden_states + residual
        return hidden_states / attn.rescale_output_factor


class JointAttnProcessor(_Base):
    """``JointAttnProcessor2_0``'s computation (SD3 / SD3.5 joint attention) with the attention
    in ``attnkit.dense``: image tokens and text tokens (``encoder_hidden_states``, through the
    module's ``add_*_proj``) attend one concatenated sequence, role "joint"; without
    encoder_hidden_states (SD3.5's second attention in dual-attention blocks) the image tokens
    attend themselves, role "self". Arguments as for :class:`AttnProcessor`. Returns
    (hidden_states, encoder_hidden_states) with text tokens, else hidden_states.
    """

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        _no_mask(attention_mask)
        batch, num_image = hidden_states.shape[0], hidden_states.shape[1]
        head_dim = attn.to_q.out_features // attn.heads
        q, k, v = _module_qkv(attn, hidden_states, hidden_states, head_dim)
        role = "self"
        if encoder_hidden_states is not None:
            role = "joint"
            text = _qkv(
                (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj),
                (attn.norm_added_q, attn.norm_added_k),
                encoder_hidden_states,
                encoder_hidden_states,
                head_dim,
            )
            q, k, v = (torch.cat(pair, dim=1) for pair in zip((q, k, v), text))

        out = self._attend(attn, q, k, v, role)
        hidden_states = out.reshape(batch, -1, out.shape[2] * head_dim).to(hidden_states.dtype)
        if encoder_hidden_states is not None:
            hidden_states, encoder_hidden_states = (
                hidden_states[:, :num_image],
                hidden_states[:, num_image:],
            )
            if not attn.context_pre_only:
                encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        if encoder_hidden_states is not None:
            return hidden_states, encoder_hidden_states
        return hidden_states


# diffusers' processors with an attnkit counterpart (the classic AttnProcessor computes the same
# attention with explicit scores).
_COUNTERPARTS = {
    "AttnProcessor2_0": AttnProcessor,
    "AttnProcessor": AttnProcessor,
    "JointAttnProcessor2_0": JointAttnProcessor,
}


def set_processors(
    model: Any,
    config: Optional[attnkit.AttentionConfig] = None,
    *,
    roles: Optional[Callable[[str], Optional[str]]] = None,
    backend: Optional[str] = None,
    kernel: str = "auto",
    timestep: float = 0.0,
) -> dict:
    """Replaces every attention processor of ``model`` (a diffusers model with
    ``attn_processors`` / ``set_attn_processor``: UNets, SD3's transformer, ...) by its attnkit
    counterpart: ``AttnProcessor2_0`` / ``AttnProcessor`` -> :class:`AttnProcessor`,
    ``JointAttnProcessor2_0`` -> :class:`JointAttnProcessor`.

    roles: optional ``name -> role`` (the processor's key in ``model.attn_processors``, e.g.
    "down_blocks.0.attentions.0.transformer_blocks.0.attn2.processor"); a returned role is fixed
    for that layer (e.g. "self.video" for temporal layers), None keeps the automatic
    self / cross / joint. config, backend, kernel, timestep: as for :class:`AttnProcessor`.
    Raises attnkit.Error naming the first processor without a counterpart (and changes nothing).
    Returns the new processors by name.
    """
    current = model.attn_processors
    new = {}
    for name, processor in current.items():
        kind = _COUNTERPARTS.get(type(processor).__name__)
        if kind is None:
            raise Error(
                f"model: the processor {name} is a {type(processor).__name__}; accepted: "
                f"{', '.join(_COUNTERPARTS)} (attnkit has no counterpart for the others)"
            )
        new[name] = kind(
            config,
            role=roles(name) if roles is not None else None,
            backend=backend,
            kernel=kernel,
            timestep=timestep,
        )
    model.set_attn_processor(dict(new))
    return new


def set_timestep(model: Any, timestep: float) -> None:
    """Sets the normalized diffusion timestep (in [0, 1], the skip-softmax gate of
    docs/diffusion.md) on every attnkit processor of ``model``; call it once per denoising step
    (e.g. from a pipeline's ``callback_on_step_end``)."""
    for processor in model.attn_processors.values():
        if isinstance(processor, _Base):
            processor.timestep = float(timestep)
