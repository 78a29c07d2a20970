"""Gated attention: a per-query output gate multiplies ``z`` before the output projection.

Qwen3-Next and Qwen3.5 (``gated_q_proj``) project each head's query and a gate of the same
width together (``q_proj`` gives ``[q_h ; g_h]`` per head), and the head's attended value is
multiplied by ``sigmoid(g_h)`` element-wise (docs/math.md §1.9):

    z_ih = (sum_j p_ijh v_jh) * gate_ih

TransformerLens fires the gate's logits on ``hook_q_gate`` (``[batch, pos, head * d_head]``),
after the softmax and before the sigmoid, and ``hook_z`` on the gated ``z``. AFMoE gates with
``sigmoid(x W_gate)`` from its own ``gate_proj``, Laguna with ``softplus(x W_g)`` from its
``g_proj`` (one gate per head, or per entry); their bridges run the Hugging Face module and hook
no gate, so the adapter forms it from the attention input ``x`` and the module's own weight.
BitNet's ``attn_sub_norm`` (an RMSNorm over all heads between ``z`` and the output projection)
is one more multiplier of this form, ``w / rms(z_i)`` (``sub_norm_gate``), formed from ``z``.

The pattern is untouched, so scores, pattern and every split of them are exact as before; ``z``
and the head outputs include the gate (``LayerAttention.z``). What treats the head's output as
``pattern @ v`` times a fixed matrix (the OV circuit ``W_V W_O``, per-source outputs ``v_j W_O``,
the contextual MLP's outgoing weights) does not hold on such a layer: the gate depends on the
query, so those refuse by name (``gate_refusal``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from tl_dynamics.adapter import _switches
from tl_dynamics.adapter._jetmoe import ROUTED_ROLES, ROUTER_WHAT, routed_refusal
from tl_dynamics.errors import TLDynamicsError

__all__ = ["GATE_WHAT", "gate_refusal", "gate_roles", "layer_gate", "output_gate", "sub_norm_gate"]

GATE_WHAT = {
    "sigmoid": "a sigmoid output gate computed from the query projection (q_proj's second half "
    "per head) multiplies z element-wise, z_i = (sum_j p_ij v_j) * sigmoid(g_i)",
    "gate_proj": "a sigmoid output gate from its own projection (gate_proj) multiplies z "
    "element-wise, z_i = (sum_j p_ij v_j) * sigmoid(x_i W_gate)",
    "g_proj": "a softplus output gate from its own projection (g_proj) multiplies z, "
    "z_i = (sum_j p_ij v_j) * softplus(x_i W_g), one gate per head or per entry",
    "sub_norm": "an RMSNorm over all heads (attn_sub_norm) divides z by its root mean square "
    "over every head and scales it by a gain, z_i = (sum_j p_ij v_j) * w / rms_i",
    "router": ROUTER_WHAT,  # JetMoE (_jetmoe): the router weight multiplies z, W_O per token
}
# the Hugging Face attention module's gate projection, by gate kind (module gates only)
_MODULE_GATES = {"gate_proj": "gate_proj", "g_proj": "g_proj"}


def output_gate(model: Any, orig: Any = None) -> str | None:
    """The kind of output gate on ``z`` of an attention layer (``orig``: its Hugging Face module),
    a key of ``GATE_WHAT``, or None.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> output_gate(NS(cfg=NS(gated_q_proj=True))), output_gate(NS(cfg=NS()))
        ('sigmoid', None)
    """
    if _switches.gated_q_proj(model, orig):
        return "sigmoid"
    name = type(orig).__name__
    if name == "AfmoeAttention":
        return "gate_proj"
    if name == "LagunaAttention":
        return "g_proj"
    if name == "BitNetAttention":
        return "sub_norm"
    return "router" if name == "JetMoeAttention" else None


def layer_gate(adapter: Any, spec: Any, st: dict[str, Tensor]) -> Tensor | None:
    """The gate multiplier ``[batch, pos, head, d_head or 1]`` of a gated layer from its stashed
    hooks: the hooked logits (``sigmoid``), or the attention input ``x`` through the module's
    own gate projection (``gate_proj``, ``g_proj``); None on an ungated layer."""
    kind = getattr(spec, "gate", None)
    if kind in (None, "sub_norm", "router"):  # formed from z / the routing once assembled
        return None
    role = "x" if kind in _MODULE_GATES else "gate"
    if role not in st:
        raise TLDynamicsError(
            f"layer {spec.layer} of {adapter.info.architecture} has gated "
            f"attention but the forward pass did not fire its {role!r} hook"
        )
    if kind == "sigmoid":
        logits = st["gate"].float()
    else:
        orig = adapter.model.blocks[spec.layer].attn.original_component
        weight = getattr(orig, _MODULE_GATES[kind]).weight.detach().float()
        logits = st["x"].float() @ weight.T
    logits = logits.reshape(*logits.shape[:2], adapter.n_heads, -1)
    return torch.nn.functional.softplus(logits) if kind == "g_proj" else torch.sigmoid(logits)


def gate_roles(spec: Any) -> list[str]:
    """The hook roles a gated layer needs to form its gate (none on an ungated layer, and none
    for ``sub_norm``, formed from ``z`` itself: ``sub_norm_gate``)."""
    kind = getattr(spec, "gate", None)
    if kind == "router":  # JetMoE: its input, router logits and shared k/v (_jetmoe)
        return list(ROUTED_ROLES)
    return [] if kind in (None, "sub_norm") else ["x" if kind in _MODULE_GATES else "gate"]


def sub_norm_gate(adapter: Any, layer: int, z: Tensor) -> Tensor:
    """BitNet's ``attn_sub_norm`` as a multiplier on ``z`` (``[batch, pos, head, d_head]``):
    ``w / sqrt(mean(z_i^2) + eps)``, the mean over every head's entries of query ``i``, read
    from the module's own norm (its weight and epsilon)."""
    norm = adapter.model.blocks[layer].attn.original_component.attn_sub_norm
    flat = z.reshape(*z.shape[:2], -1)
    inv = torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + float(norm.variance_epsilon))
    return (inv * norm.weight.detach().float()).reshape(z.shape)


def gate_refusal(spec: Any, architecture: str, what: str) -> TLDynamicsError:
    """The refusal of ``what`` (an analysis or a weight) on a gated layer."""
    if spec.gate == "router":
        return routed_refusal(spec, architecture, what)
    return TLDynamicsError(
        f"{what}: layer {spec.layer} of {architecture} has gated attention ({GATE_WHAT[spec.gate]}),"
        " so the head's output is not pattern @ v times a fixed matrix; it does not model the "
        "gate (the pattern, z and head outputs are exact: ModelAdapter.attention)"
    )
