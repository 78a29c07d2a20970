"""q, k and v as the layer scored them, from hooks that hold something else on some bridges.

``assemble`` (``_collect``) reads ``hook_q``/``hook_k``/``hook_v``; on most hosts they hold the
projections, and rotary is applied after (from the rotated-q/k hooks, the model's cos/sin, or a
``Rotation``). Two families need one more step first, both read from the layer's spec:

- multi-head latent attention (``spec.latent``, ``_mla``): the hooks fire on
  ``[batch, head, pos, d]`` after rotary; they are laid out per position;
- Llama 4 (``spec.prenorm``): the bridge delegates to Hugging Face and hooks the projections
  before the weightless q/k RMS norm; the norm is applied here (``ModelAdapter.query_norm``, to
  keys too), then the rotation as usual (it commutes with this norm);
- rotary layers of delegating bridges that fire no rotary hooks (ModernBERT decoder): rotated
  here with the layer's ``Rotation``, read from the tables the module receives (``_modrope``).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from tl_dynamics.adapter._mla import latent_qkv
from tl_dynamics.adapter._qknorm import QueryNorm, read_query_norm
from tl_dynamics.adapter._readers import optional, refusal, required
from tl_dynamics.adapter._rotary import positions_from_mask

__all__ = ["scored_qkv"]


def scored_qkv(
    adapter: Any,
    spec: Any,
    st: dict[str, Tensor],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_valid: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(q, k, v)`` as ``[batch, pos, head, d]``, normalised where the hooks are pre-norm. On a
    rotary layer that fires no rotary hooks (``_modrope``) the rotated q and k are stored as
    ``st["rot_q"]``/``st["rot_k"]``, rotated by the layer's ``Rotation`` at the positions the
    host derives from ``key_valid`` (every position real when None)."""
    q, k, v = latent_qkv(spec, st, q, k, v)
    if spec.prenorm:
        q, k = (
            adapter.query_norm(spec.layer).apply_heads(q),
            key_norm(adapter, spec.layer).apply_heads(k),
        )
    if spec.rotary == "half" and not {"rot_q", "cos"} & set(st):
        if key_valid is None or tuple(key_valid.shape) != tuple(q.shape[:2]):
            key_valid = torch.ones(q.shape[:2], dtype=torch.bool, device=q.device)
        rotation = adapter.rotation(spec.layer)
        positions = positions_from_mask(key_valid.to(q.device))
        st["rot_q"], st["rot_k"] = rotation.rotate(q, positions), rotation.rotate(k, positions)
    return q, k, v


def key_norm(adapter: Any, layer: int) -> QueryNorm:
    """The key normalisation of a pre-norm layer, read as ``read_query_norm`` reads the query's:
    the module's ``k_norm`` (OLMo-Hybrid, over all key heads) or, where q and k share one
    (Llama 4's ``qk_norm``), the query norm itself."""
    orig = adapter.model.blocks[layer].attn.original_component
    if optional(orig, "k_norm") is None:
        # no key norm of its own: only a norm shared with the queries may stand in (never the
        # query's norm read for a key norm that a rename hid)
        if required(orig, "qk_norm", "one norm shared by queries and keys") is None:
            raise refusal(orig, "qk_norm", "None on a layer that normalises its keys")
        return adapter.query_norm(layer)
    return read_query_norm(
        SimpleNamespace(q_norm=orig.k_norm),
        f"layer {layer} of {adapter.info.architecture} (key norm)",
        gemma_gain=False,
        n_heads=adapter.n_kv_heads,
        d_head=adapter.head_width(layer),
        W_Q=None,
        b_Q=None,
    )
