"""Rotary tables of a delegated Hugging Face attention module, for bridges that fire none.

Some TransformerBridge attention classes (``AttentionBridge``) run the Hugging Face module as
it is and fire ``hook_q``/``hook_k`` on its projections, before rotary, with no cos/sin or
rotated-q/k hooks (ModernBERT decoder). The module itself receives its rotary tables as the
``position_embeddings=(cos, sin)`` argument; a forward pre-hook on it reads them in the probe
pass (``_probepass``), so the layer's ``Rotation`` comes from the very tables the module uses
(per layer: a model with global and local rotary bases gives each layer its own). The module's
own rotary function (``apply_rotary_pos_emb`` of its modeling file) then rotates the probe's
queries, so the ``Rotation`` read from the tables is verified against what the module
computes, direction included (NanoChat rotates the other way).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import Tensor

__all__ = ["module_rotated_queries"]


def module_rotated_queries(adapter: Any, layer: int, got: dict[str, Tensor]) -> None:
    """Store as ``got["rot_q"]`` the probe's queries rotated by the module's own rotary function
    (where the probe captured the attention input ``x`` and the module's tables), so that the
    layer's ``Rotation`` is verified against it (``_rotation``); nothing where the function is
    missing or takes other arguments (it takes q and k, or one tensor)."""
    orig = adapter.model.blocks[layer].attn.original_component
    rotate = getattr(sys.modules.get(type(orig).__module__), "apply_rotary_pos_emb", None)
    if rotate is None or "x" not in got or "cos" not in got:
        return
    q = adapter.unrotated_queries(layer, adapter.attention_input(layer, got["x"].float()))
    q_heads = q.transpose(1, 2)  # the module's [batch, head, pos, d_head]
    cos, sin = got["cos"].float(), got["sin"].float()
    try:
        with torch.no_grad():
            rotated, _ = rotate(q_heads, q_heads, cos, sin)
    except (TypeError, ValueError, RuntimeError):
        try:  # one tensor at a time (Gemma 4: ``apply_rotary_pos_emb(x, cos, sin)``)
            with torch.no_grad():
                rotated = rotate(q_heads, cos, sin)
        except (TypeError, ValueError, RuntimeError):
            return
    got["rot_q"] = rotated.transpose(1, 2)
