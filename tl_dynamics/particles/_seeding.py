"""Seed the particle dynamics from one attention head of a real model (through the adapter only).

The mapping, in the paper's column convention (``<Q x, K y>``, ``V x``), for a head with
TransformerLens weights ``W_Q, W_K, W_V: [d_model, d_head]``, ``W_O: [d_head, d_model]``
and score multiplier ``c`` (scores are ``c <x W_Q, y W_K>``):

    Q := W_Q^T,  K := W_K^T   (so Q^T K = W_Q W_K^T, the head's bilinear QK form, [d_model, d_model])
    V := (W_V W_O)^T          (x V_row = x W_V W_O is the head's OV map on row vectors)
    beta := c * radius^2

so particles live on ``S^{d_model - 1}``. What this drops: the biases ``b_Q, b_K, b_V,
b_O``; the input normalisation (its gain and centring; particles are plain unit
vectors); positional information (rotary, ALiBi, learned positions), the causal mask
unless you pass ``causal=True`` to :func:`simulate`; the other heads, the MLPs, and the
fact that a real model changes weights from layer to layer (here one head acts for all
time). ``radius`` is the norm of the vectors the head really scores: a LayerNorm output
has norm about ``sqrt(d_model)`` times its gain, so ``radius=sqrt(d_model)`` gives the
model's own score scale, while ``radius=1`` (default) keeps ``beta = c`` as the issue asks.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.particles._checks import Problems, shape_str

DROPPED = "biases, input normalisation, positions, other heads, MLPs"
# multi-head latent attention: W_Q, W_K, W_V are the factors' products, gains folded in
LATENT_DROPPED = ", the latent RMS norms' per-token scales (docs/math.md §1.7)"


@dataclass(frozen=True)
class HeadSource:
    """Where seeded dynamics came from: ``(layer, head)`` of ``model``, the head's score
    multiplier ``scale``, the ``radius`` in ``beta = scale * radius**2``, and what the
    idealised flow leaves out (``dropped``)."""

    layer: int
    head: int
    model: str
    scale: float
    radius: float
    dropped: str = DROPPED

    @property
    def name(self) -> str:
        """``L{layer}H{head}``."""
        return f"L{self.layer}H{self.head}"


@dataclass(frozen=True)
class HeadDynamics:
    """``Q, K, V, beta`` for :func:`simulate`, taken from one head, with provenance.

    ``Q, K: [d_head, d_model]``, ``V: [d_model, d_model]``; ``simulate(x0, **hd.kwargs())``.
    ``V_factors``: ``(W_V [d_model, d_head], W_O [d_head, d_model])``, ``V = (W_V W_O)^T``,
    which ``kwargs()`` passes so that a step costs ``d_head`` per value rather than ``d_model``.
    """

    Q: Float[Tensor, "d_head d_model"]
    K: Float[Tensor, "d_head d_model"]
    V: Float[Tensor, "d_model d_model"]
    beta: float
    source: HeadSource
    V_factors: tuple[Tensor, Tensor] | None = None

    @property
    def d(self) -> int:
        return int(self.V.shape[0])

    @property
    def qk(self) -> Tensor:
        """The bilinear form ``Q^T K = W_Q W_K^T`` (``[d_model, d_model]``)."""
        return self.Q.transpose(-1, -2) @ self.K

    @property
    def ov(self) -> Tensor:
        """The head's OV map on row vectors, ``W_V W_O = V^T`` (``[d_model, d_model]``)."""
        return self.V.transpose(-1, -2)

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments for :func:`simulate` (``beta, Q, K, V, source``; ``V`` factored
        where ``V_factors`` is known)."""
        V = self.V if self.V_factors is None else self.V_factors
        return {"beta": self.beta, "Q": self.Q, "K": self.K, "V": V, "source": self.source}

    def __repr__(self) -> str:
        s = self.source
        return (
            f"HeadDynamics(layer={s.layer}, head={s.head}, d={self.d}, d_head={self.Q.shape[0]}, "
            f"beta={self.beta:.4g})"
        )


def from_head(
    model: Any, layer: int, head: int, radius: float = 1.0, dtype: torch.dtype = torch.float64
) -> HeadDynamics:
    """Read one head's ``W_Q, W_K, W_V, W_O`` and score scale and map them to ``Q, K, V, beta``.

    ``model`` is anything :class:`tl_dynamics.adapter.ModelAdapter` accepts, or an object
    that already has ``head_weights(layer, head)`` (an adapter). See the module docstring
    for the mapping and what it leaves out.

    Args:
        model: a TransformerLens model, a ``ModelAdapter``, or an object with ``head_weights``.
        layer: the head's layer.
        head: the head's index.
        radius: the norm of the particles' real inputs: ``beta = scale * radius**2``.
        dtype: ``torch.float64`` or ``torch.float32``.

    Returns:
        ``HeadDynamics``: ``Q, K`` ``[d_head, d_model]``, ``V`` ``[d_model, d_model]``
        (``(W_V W_O)^T``), ``beta`` and provenance; ``simulate(x0, **hd.kwargs())``.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> W = NS(W_Q=torch.eye(4, 2), W_K=torch.eye(4, 2), W_V=torch.eye(4, 2), W_O=torch.eye(2, 4), scale=0.5)
        >>> hd = from_head(NS(head_weights=lambda layer, head: W), 0, 0)
        >>> hd.beta, tuple(hd.Q.shape), tuple(hd.V.shape)
        (0.5, (2, 4), (4, 4))
        >>> from tl_dynamics import testing
        >>> hd = from_head(testing.tiny_model("gpt2"), 1, 0)  # c = 1/4, radius 1
        >>> hd.beta, tuple(hd.Q.shape), tuple(hd.V.shape)
        (0.25, (16, 64), (64, 64))
    """
    p = Problems("from_head")
    r: float | None = None
    try:
        r = float(radius)
    except (TypeError, ValueError):
        pass
    if r is None or not math.isfinite(r) or r <= 0:
        p.add(f"radius must be a finite number > 0, got {radius!r}")
    if dtype not in (torch.float64, torch.float32):
        p.add(f"dtype must be torch.float64 or torch.float32, got {dtype}")
    r = p.raise_or(r)
    adapter = model if hasattr(model, "head_weights") else ModelAdapter.of(model)
    w = adapter.head_weights(layer, head)

    p = Problems(f"from_head(layer={layer}, head={head})")
    mats = {}
    for name in ("W_Q", "W_K", "W_V", "W_O"):
        m = getattr(w, name, None)
        if not isinstance(m, torch.Tensor) or m.ndim != 2:
            p.add(
                f"head_weights().{name} must be a 2-D tensor, got {shape_str(m) if m is not None else 'nothing'}"
            )
        else:
            mats[name] = m.detach().to(device="cpu", dtype=dtype)  # simulate runs on the CPU
    raw: Any = getattr(w, "scale", None)
    scale: float | None
    try:
        scale = float(raw)
    except (TypeError, ValueError):
        scale = None
    if scale is None or not math.isfinite(scale) or scale <= 0:
        p.add(f"head_weights().scale must be a number > 0 (the score multiplier), got {raw!r}")
    scale = p.raise_or(scale)
    WQ, WK, WV, WO = mats["W_Q"], mats["W_K"], mats["W_V"], mats["W_O"]
    dm, dh = WQ.shape
    expect = {"W_Q": (dm, dh), "W_K": (dm, dh), "W_V": (dm, WV.shape[1]), "W_O": (WV.shape[1], dm)}
    for name, want in expect.items():
        if tuple(mats[name].shape) != want:
            p.add(
                f"{name} must be [{want[0]}, {want[1]}] given W_Q {list(WQ.shape)} and W_V {list(WV.shape)}, got {list(mats[name].shape)}"
            )
    p.raise_if_any()
    specs = getattr(adapter, "specs", None)
    sunk = bool(specs) and bool(getattr(specs[layer], "sinks", False))
    latent = bool(specs) and bool(getattr(specs[layer], "latent", False))
    source = HeadSource(
        layer=layer,
        head=head,
        model=_model_name(model),
        scale=scale,
        radius=r,
        dropped=DROPPED
        + (", the learned attention sink" if sunk else "")
        + (LATENT_DROPPED if latent else ""),
    )
    return HeadDynamics(
        Q=WQ.T.contiguous(),
        K=WK.T.contiguous(),
        V=(WV @ WO).T.contiguous(),
        beta=scale * r * r,
        source=source,
        V_factors=(WV.contiguous(), WO.contiguous()),
    )


def _model_name(model: Any) -> str:
    cfg = getattr(model, "cfg", None)
    name = getattr(cfg, "model_name", None) if cfg is not None else None
    if not name:
        return type(model).__name__
    return os.path.basename(str(name).rstrip("/\\")) or str(
        name
    )  # local folders: keep the last part
