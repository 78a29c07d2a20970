"""q, k and v as the layer scored them, from hooks that hold something else on some bridges.

``assemble`` (``_collect``) reads ``hook_q``/``hook_k``/``hook_v``; on most hosts they hold the
projections, and rotary is applied after (from the rotated-q/k hooks, the model's cos/sin, or a
``Rotation``). Two families need one more step first, both read from the layer's spec:

- multi-head latent attention (``spec.latent``, ``_mla``): the hooks fire on
  ``[batch, head, pos, d]`` after rotary; they are laid out per position;
- Llama 4 (``spec.prenorm``): the bridge delegates to Hugging Face and hooks the projections
  before the weightless q/k RMS norm; the norm is applied here (``ModelAdapter.query_norm``, to
  keys too), then the rotation as usual (it commutes with this norm).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from tl_dynamics.adapter._mla import latent_qkv

__all__ = ["scored_qkv"]


def scored_qkv(adapter: Any, spec: Any, st: dict[str, Tensor], q: Tensor, k: Tensor,
               v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(q, k, v)`` as ``[batch, pos, head, d]``, normalised where the hooks are pre-norm."""
    q, k, v = latent_qkv(spec, st, q, k, v)
    if spec.prenorm:
        norm = adapter.query_norm(spec.layer)
        q, k = norm.apply_heads(q), norm.apply_heads(k)
    return q, k, v
