"""Gated attention: a per-query output gate multiplies ``z`` before the output projection.

Qwen3-Next and Qwen3.5 (``gated_q_proj``) project each head's query and a gate of the same
width together (``q_proj`` gives ``[q_h ; g_h]`` per head), and the head's attended value is
multiplied by ``sigmoid(g_h)`` element-wise (docs/math.md, "Gated attention"):

    z_ih = (sum_j p_ijh v_jh) * sigmoid(g_ih)

The pattern is untouched, so scores, pattern and every split of them are exact as before; ``z``
and the head outputs include the gate (``LayerAttention.z``). TransformerLens fires the gate's
logits on ``hook_q_gate`` (``[batch, pos, head * d_head]``), after the softmax and before the
sigmoid, and ``hook_z`` on the gated ``z``. What treats the head's output as ``pattern @ v`` times
a fixed matrix (the OV circuit ``W_V W_O``, per-source outputs ``v_j W_O``, the contextual MLP's
outgoing weights) does not hold on such a layer: the gate depends on the query, so those refuse
by name (``gate_refusal``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from tl_dynamics.errors import TLDynamicsError

__all__ = ["GATE_WHAT", "gate_refusal", "layer_gate", "output_gate"]

GATE_WHAT = {"sigmoid": "a sigmoid output gate computed from the query projection (q_proj's "
                        "second half per head) multiplies z element-wise, "
                        "z_i = (sum_j p_ij v_j) * sigmoid(g_i)"}


def output_gate(model: Any) -> str | None:
    """The kind of output gate the bridge applies to ``z`` on this model's attention layers.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> output_gate(NS(cfg=NS(gated_q_proj=True))), output_gate(NS(cfg=NS()))
        ('sigmoid', None)
    """
    return "sigmoid" if bool(getattr(model.cfg, "gated_q_proj", False)) else None


def layer_gate(spec: Any, st: dict[str, Tensor], n_heads: int, architecture: str) -> Tensor | None:
    """The gate multiplier ``sigmoid(g)`` ``[batch, pos, head, d_head]`` of a gated layer from its
    stashed hooks (None on an ungated layer)."""
    if getattr(spec, "gate", None) is None:
        return None
    if "gate" not in st:
        raise TLDynamicsError(f"layer {spec.layer} of {architecture} has gated attention but the "
                              "forward pass did not fire its gate hook")
    logits = st["gate"].float()
    return torch.sigmoid(logits.reshape(*logits.shape[:2], n_heads, -1))


def gate_refusal(spec: Any, architecture: str, what: str) -> TLDynamicsError:
    """The refusal of ``what`` (an analysis or a weight) on a gated layer."""
    return TLDynamicsError(
        f"{what}: layer {spec.layer} of {architecture} has gated attention ({GATE_WHAT[spec.gate]}),"
        " so the head's output is not pattern @ v times a fixed matrix; it does not model the "
        "gate (the pattern, z and head outputs are exact: ModelAdapter.attention)")
