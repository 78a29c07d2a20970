"""Weights as both hosts store them, normalised to one convention.

Attention weights per layer are ``[n_heads, d_model, d_head]`` (``W_O``: ``[n_heads, d_head,
d_model]``) with grouped K/V heads expanded to their query heads by ``repeat_interleave``
(the Hugging Face ``repeat_kv`` order); missing biases are zeros; everything is float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor


@dataclass(frozen=True)
class HeadWeights:
    """One head's weights. Scores are ``scale * <x W_Q + b_Q, y W_K + b_K>`` before any rotary
    embedding, position bias or soft-cap (see the layer's ``LayerSpec``). On multi-head latent
    attention layers ``W_Q``/``W_K``/``W_V`` are the low-rank factors' products with the latent
    norms' gains folded in, and the model divides the query by ``rho_q(x)`` and the non-rotary
    key and the value by ``rho_kv(y)`` (``ModelAdapter.latent``; docs/math.md §1.7)."""

    layer: int
    head: int
    W_Q: Float[Tensor, "d_model d_head"]
    W_K: Float[Tensor, "d_model d_head"]
    W_V: Float[Tensor, "d_model d_head"]
    W_O: Float[Tensor, "d_head d_model"]
    b_Q: Float[Tensor, " d_head"]
    b_K: Float[Tensor, " d_head"]
    b_V: Float[Tensor, " d_head"]
    b_O: Float[Tensor, " d_model"]
    scale: float


def expand_heads(w: Tensor, n_heads: int) -> Tensor:
    """Map grouped K/V heads (dim 0) to their query heads."""
    if w.shape[0] == n_heads:
        return w
    return torch.repeat_interleave(w, n_heads // w.shape[0], dim=0)


def attn_param(model: Any, layer: int, name: str) -> Tensor | None:
    """``blocks[layer].attn.<name>`` as float32, or None where the model has no such bias."""
    try:
        value = getattr(model.blocks[layer].attn, name)
    except (AttributeError, TypeError):
        return None
    if value is None:
        return None
    return value.detach().float()


def model_param(model: Any, name: str) -> Tensor | None:
    try:
        value = getattr(model, name)
    except (AttributeError, TypeError, NotImplementedError):
        return None
    return None if value is None else value.detach().float()


def weights_version(params: list[Tensor]) -> int:
    """A number that changes whenever one of ``params`` is modified in place (torch's per-tensor
    version counters), so cached copies of the weights can be dropped.

    Example:
        >>> lin = torch.nn.Linear(2, 2)
        >>> params = list(lin.parameters())
        >>> before = weights_version(params)
        >>> with torch.no_grad():
        ...     _ = lin.weight.mul_(2.0)
        >>> weights_version(params) != before
        True
    """
    return sum(param._version for param in params)
