"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4-MoE-Lite, Youtu): q, k and v as scored.

In latent attention (docs/math.md, "Latent attention") the query and key of head ``h`` are each
the concatenation of a non-rotary part, decompressed from a low-rank latent, and a rotary part:

    q_h = [q_h^nope ; R_i q_h^rope],   k_jh = [k_jh^nope ; R_j k_j^rope]

where the key's rotary part ``k_j^rope`` is one vector per position shared by every head. So
``<q_h, k_jh> = <q_h^nope, k_jh^nope> + <R_i q_h^rope, R_j k_j^rope>``, and the q/k head width
(nope + rope) differs from the value head width. TransformerLens's ``MLAAttentionBridge``
recomputes this attention and fires ``hook_q``/``hook_k`` on the concatenated, rotated q and k
(``[batch, head, pos, d_qk]``, shared rotary key already broadcast to every head) and
``hook_v`` on the values (``[batch, head, pos, d_v]``); its ``hook_z`` is the flat
``[batch, pos, head * d_v]`` input of the output projection. This module turns those into the
``[batch, pos, head, d]`` layout ``LayerAttention`` uses, and reads ``W_O`` per head from the
output projection, so the pattern, ``z`` and head outputs recompute exactly.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from tl_dynamics.errors import TLDynamicsError

__all__ = ["LATENT_BRIDGES", "latent_W_O", "latent_qkv", "latent_weight", "latent_z_patch"]

# Bridges whose q/k/v hooks fire on [batch, head, pos, d] after rotary (see module doc).
LATENT_BRIDGES = {"MLAAttentionBridge"}


def latent_qkv(spec: Any, st: dict[str, Tensor], q: Tensor, k: Tensor,
               v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(q, k, v)`` as ``[batch, pos, head, d]`` on latent-attention layers (``spec.latent``);
    unchanged elsewhere. Also lays the stashed reference ``z`` out per head (``d_v`` wide)."""
    if not getattr(spec, "latent", False):
        return q, k, v
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if "z" in st:
        st["z"] = st["z"].reshape(*st["z"].shape[:2], v.shape[2], v.shape[3])
    return q, k, v


def latent_W_O(model: Any, layer: int, n_heads: int) -> Tensor:
    """``W_O`` of a latent-attention layer, ``[head, d_v, d_model]``, from the output
    projection's own weight (``o_proj``: ``[d_model, head * d_v]``), as float32."""
    weight = model.blocks[layer].attn.o.original_component.weight.detach().float()
    return weight.T.reshape(n_heads, -1, weight.shape[0])


def latent_z_patch(fn: Callable[[Tensor], Tensor | None], n_heads: int
                   ) -> Callable[[Tensor], Tensor | None]:
    """A ``z`` patch for a latent-attention layer: ``fn`` sees and returns ``z`` per head
    (``[batch, pos, head, d_v]``), whatever layout the host's ``hook_z`` has (the flat input of
    the output projection, which TransformerLens splits with the config's ``d_head``)."""
    def patch(activation: Tensor) -> Tensor | None:
        out = fn(activation.reshape(*activation.shape[:2], n_heads, -1))
        return None if out is None else out.reshape(out.shape[0], *activation.shape[1:])
    return patch


def latent_weight(model: Any, layer: int, name: str, bias_shape: tuple[int, ...] | None,
                  n_heads: int, architecture: str) -> Tensor:
    """``W_O`` (per head) or ``b_O`` (zeros where it has none) of a latent-attention layer, from
    its output projection; any other weight is a TLDynamicsError: there is no single
    W_Q/W_K/W_V matrix."""
    if name == "W_O":
        return latent_W_O(model, layer, n_heads)
    if name == "b_O":
        o_proj = model.blocks[layer].attn.o.original_component
        if o_proj.bias is not None:
            return o_proj.bias.detach().float()
        shape = bias_shape if bias_shape is not None else tuple(o_proj.weight.shape[:1])
        return torch.zeros(shape, device=o_proj.weight.device)
    raise TLDynamicsError(
        f"layer {layer} of {architecture} has multi-head latent attention: its queries and keys "
        "come from low-rank factors with a rotary part shared across heads, so there is no "
        f"{name} matrix; analyses that read {name} do not apply (the pattern, z and head "
        "outputs are exact: ModelAdapter.attention)")
