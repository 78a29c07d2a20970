"""A layer's input norm with its scale frozen at one pass's own value: a linear map per position.

LayerNorm ``x = g (r - mean r) / s + b`` with ``s = sqrt(var r + eps)``, RMSNorm
``x = g r / s`` with ``s = sqrt(mean r^2 + eps)`` (Gemma's gain ``1 + w``), or no norm: once
``s`` is the value the pass computed at that position, ``x`` is linear in ``r`` plus the shift
``b``, so every part of the residual stream maps to its own part of ``x`` (docs/math.md §10.2).
The convention (centred or not, gain ``w`` or ``1 + w``, shift or not, ``eps``) is read from
what the model's own norm module computes, never from its class name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from tl_dynamics.errors import TLDynamicsError

# Relative error within which a candidate reproduces the norm module on random inputs (float32
# reorders sums: ~1e-7; half precision rounds at ~1e-3).
_PROBE_RTOL = {torch.float32: 1e-4, torch.float64: 1e-4}
_HALF_RTOL = 2e-2


@dataclass(frozen=True)
class InputNorm:
    """``x = gain * (P r) / s(r) + shift``: ``P`` subtracts the mean where ``center``.

    ``eps is None`` means the layer reads the stream as it is (no norm): ``s = 1``, gain 1.

    Args:
        center: Subtract the mean over ``d_model`` first (LayerNorm).
        gain: The gain, offset included (``1 + w`` for Gemma's), ``[d_model]``, or None for 1.
        shift: The additive shift ``b``, ``[d_model]``, or None.
        eps: The epsilon under the square root, or None for no norm.
    """

    center: bool
    gain: Float[Tensor, " d_model"] | None
    shift: Float[Tensor, " d_model"] | None
    eps: float | None

    def scale(self, r: Float[Tensor, "... d_model"]) -> Float[Tensor, "..."]:
        """The per-position scale ``s`` the norm divides by (ones without a norm)."""
        r = r.float()
        if self.eps is None:
            return torch.ones(r.shape[:-1], device=r.device)
        if self.center:
            r = r - r.mean(-1, keepdim=True)
        return torch.sqrt(r.pow(2).mean(-1) + self.eps)

    def fold(self, W: Float[Tensor, "d_model n"]) -> Float[Tensor, "d_model n"]:
        """``P diag(gain) W``: a part ``c`` of the stream reaches ``x W`` as ``c fold(W) / s``."""
        W = W.float()
        if self.gain is not None:
            W = W * self.gain.to(W.device)[:, None]
        return W - W.mean(0, keepdim=True) if self.center and self.eps is not None else W

    def apply(
        self, r: Float[Tensor, "... d_model"], s: Float[Tensor, "..."] | None = None
    ) -> Float[Tensor, "... d_model"]:
        """The norm's output with scale ``s`` (the pass's own where None)."""
        r = r.float()
        s = self.scale(r) if s is None else s
        if self.center and self.eps is not None:
            r = r - r.mean(-1, keepdim=True)
        x = r / s[..., None]
        if self.gain is not None:
            x = x * self.gain.to(x.device)
        return x if self.shift is None else x + self.shift.to(x.device)


def _param(module: Any, names: tuple[str, ...]) -> Tensor | None:
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, Tensor):
            return value.detach().float()
    return None


def read_input_norm(module: Any, d_model: int, where: str) -> InputNorm:
    """The ``InputNorm`` that reproduces ``module`` (called as the model calls it), read from
    what it computes on random inputs; ``where`` names the layer in the refusal."""
    inner = getattr(module, "original_component", None) or module
    weight = _param(inner, ("weight", "w"))
    bias = _param(inner, ("bias", "b"))
    eps_attr = next(
        (
            float(getattr(inner, n))
            for n in ("eps", "variance_epsilon", "epsilon")
            if isinstance(getattr(inner, n, None), (int, float))
        ),
        None,
    )
    try:
        dtype = next(p.dtype for p in module.parameters())
    except (StopIteration, AttributeError):
        dtype = torch.float32
    gen = torch.Generator().manual_seed(0)
    r = torch.randn(4, d_model, generator=gen) * torch.tensor([[0.01], [0.1], [1.0], [10.0]])
    try:
        with torch.no_grad():
            device = next((p.device for p in module.parameters()), torch.device("cpu"))
            want = module(r.to(device, dtype)).float().cpu()
    except Exception as exc:  # a norm with another calling convention
        raise TLDynamicsError(
            f"{where}: cannot probe its input norm {type(inner).__name__} "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    tol = _PROBE_RTOL.get(dtype, _HALF_RTOL)
    candidates = [InputNorm(False, None, None, None)]
    for center in (True, False):
        for offset in (0.0, 1.0) if weight is not None else (None,):
            gain = None if offset is None or weight is None else (weight + offset).cpu()
            for shift in (bias.cpu(), None) if bias is not None else (None,):
                probe = InputNorm(center, gain, shift, 0.0)
                eps = eps_attr if eps_attr is not None else _solve_eps(probe, r, want)
                candidates.append(InputNorm(center, gain, shift, eps))
    errors = []
    for candidate in candidates:
        got = candidate.apply(r)
        err = float(((got - want).abs().amax(-1) / want.abs().amax(-1).clamp_min(1e-30)).max())
        if err <= tol:
            return candidate
        errors.append(round(err, 4))
    raise TLDynamicsError(
        f"{where}: its input norm {type(inner).__name__} is neither a LayerNorm, an RMSNorm "
        f"(gain w or 1 + w) nor the identity (relative errors {errors}), so the residual stream "
        "cannot be mapped to the attention input part by part"
    )


def _solve_eps(probe: InputNorm, r: Tensor, want: Tensor) -> float:
    """``eps`` from the smallest probe row (where it matters most): ``s^2 = mean(P r)^2 + eps``
    with ``s = |gain * P r| / |want - shift|`` (0 where it cannot be read)."""
    row = r[:1]
    unscaled = probe.apply(row, torch.ones(1))
    shift = 0.0 if probe.shift is None else probe.shift
    unscaled = unscaled - shift
    got = want[:1] - shift
    s = unscaled.norm() / got.norm().clamp_min(1e-30)
    centred = row - row.mean(-1, keepdim=True) if probe.center else row
    return max(0.0, float(s.pow(2) - centred.pow(2).mean()))
