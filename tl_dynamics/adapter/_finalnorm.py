"""The model's final normalisation as plain arithmetic on frozen parameters, owned by the adapter.

The logit lens (``ModelAdapter.final_norm``, ``logit_lens``; the trajectories' lens) reads
residual states through the final norm. Calling the model's own ``ln_final`` module for that
would fire its hook points (``hook_in``, ``hook_scale``, ``hook_normalized``, ``hook_out``) a
second time in the user's pass: their cache would hold the lens's stacked states, their hooks
would be called again with other shapes, and a patching hook there would both break and steer
the lens. So the adapter reads the norm's parameters once and computes it itself, in float32:

    N(x) = (x - mean(x) if centred else x) / sqrt(mean((x - mean(x))^2 or x^2) + eps) * (o + w) + b

The reading goes by tables, never by a guess:

- a ``HookedTransformer``'s norm is one of TransformerLens's own classes (``HOOKED_NORMS``),
  whose names fix the arithmetic; its parameters are ``w``, ``b`` and ``eps``;
- a bridge's wrapper either drops the wrapped module's gain (``WEIGHTLESS_BRIDGES``: the folded
  ``LayerNormPre``/``RMSNormPre`` bridges) or runs the Hugging Face module it wraps, whose
  ``weight``, ``bias`` and epsilon (``EPS_ATTRIBUTES``) are read, and whose convention (centred
  or not, gain ``w`` or ``1 + w``) is the one candidate that reproduces the module itself on a
  fixed random input (the unhooked Hugging Face module, called once, when first read).

A norm of another class, or one no candidate reproduces, is refused by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from tl_dynamics.adapter import _readers
from tl_dynamics.errors import TLDynamicsError


@dataclass(frozen=True)
class _Rule:
    center: bool
    weight: str | None  # the attribute holding the gain, None: no gain
    bias: str | None


# TransformerLens's HookedTransformer norm classes (transformer_lens.components)
HOOKED_NORMS: dict[str, _Rule] = {
    "LayerNorm": _Rule(True, "w", "b"),
    "LayerNormPre": _Rule(True, None, None),
    "RMSNorm": _Rule(False, "w", None),
    "RMSNormPre": _Rule(False, None, None),
}
# bridge wrappers whose forward applies no gain or shift (weights folded into the unembedding)
WEIGHTLESS_BRIDGES: dict[str, _Rule] = {
    "LayerNormPreBridge": _Rule(True, None, None),
    "RMSNormPreBridge": _Rule(False, None, None),
}
# where a Hugging Face norm keeps its epsilon, newest name first
EPS_ATTRIBUTES = ("eps", "variance_epsilon", "epsilon")
# relative error within which a candidate reproduces the module (float32 sums reordered)
PROBE_RTOL = 1e-4


@dataclass(frozen=True)
class FinalNorm:
    """A final normalisation as frozen arithmetic.

    Args:
        kind: ``"norm"``, or ``"identity"`` where the model has no final norm.
        center: Subtract the mean first (LayerNorm) rather than not (RMSNorm).
        eps: The epsilon inside the square root.
        weight: The gain ``[d_model]`` (None: none).
        offset: Added to the gain (1 for Gemma's ``1 + w``).
        bias: The shift ``[d_model]`` (None: none).

    Example:
        >>> norm = FinalNorm("norm", center=False, eps=0.0)
        >>> [round(v, 4) for v in norm(torch.tensor([[3.0, 4.0]]))[0].tolist()]  # x / rms(x)
        [0.8485, 1.1314]
    """

    kind: str
    center: bool = False
    eps: float = 0.0
    weight: Tensor | None = None
    offset: float = 0.0
    bias: Tensor | None = None

    def __call__(self, x: Float[Tensor, "... d_model"]) -> Float[Tensor, "... d_model"]:
        """``N(x)`` in float32 (the input's dtype is upcast first, as the hosts do)."""
        x = x.float()
        if self.kind == "identity":
            return x
        if self.center:
            x = x - x.mean(-1, keepdim=True)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            x = x * (self.offset + self.weight.to(x.device))
        if self.bias is not None:
            x = x + self.bias.to(x.device)
        return x


def logit_directions(norm: FinalNorm, W_U: Tensor, ids: Tensor) -> tuple[bool, Tensor]:
    """What a write to the last residual stream does to the logits of ``ids`` directly, up to
    the final norm's positive per-position scale: ``(center, W)``, the logit change being
    ``(x - mean(x) if center else x) @ W`` times that scale, ``W`` the norm's gain times
    ``W_U[:, ids]`` ``[d_model, n]`` (``b_U``, the norm's shift and a soft-cap left out: they do
    not depend on the write).

    Example:
        >>> norm = FinalNorm("norm", center=False, weight=torch.tensor([2.0, 1.0]))
        >>> logit_directions(norm, torch.eye(2), torch.tensor([0]))
        (False, tensor([[2.],
                [0.]]))
    """
    W = W_U[:, ids.to(W_U.device)].float()
    if norm.kind == "identity":
        return False, W
    if norm.weight is not None:
        W = (norm.offset + norm.weight.to(W.device).float())[:, None] * W
    return bool(norm.center), W


def _param(owner: Any, name: str | None) -> Tensor | None:
    value = None if name is None else _readers.optional(owner, name)
    return value.detach().float().clone() if isinstance(value, Tensor) else None


def _eps(owner: Any, fallback: Any = None) -> float:
    for name in EPS_ATTRIBUTES:
        value = _readers.optional(owner, name)
        if isinstance(value, (int, float, Tensor)):
            return float(value)
    if isinstance(fallback, (int, float)):
        return float(fallback)
    raise _readers.refusal(owner, "/".join(EPS_ATTRIBUTES), "no epsilon of its final norm")


def read_final_norm(model: Any, host: str, architecture: str) -> FinalNorm:
    """The ``FinalNorm`` of ``model``'s ``ln_final`` (identity where it has none)."""
    ln = getattr(model, "ln_final", None)
    if ln is None or isinstance(ln, torch.nn.Identity):
        return FinalNorm("identity")
    cfg_eps = getattr(getattr(model, "cfg", None), "eps", None)
    name = type(ln).__name__
    if host == "hooked":
        rule = HOOKED_NORMS.get(name)
        if rule is None:
            raise _unknown(architecture, name, sorted(HOOKED_NORMS))
        return FinalNorm(
            "norm",
            rule.center,
            _eps(ln, cfg_eps),
            _param(ln, rule.weight),
            0.0,
            _param(ln, rule.bias),
        )
    if name in WEIGHTLESS_BRIDGES:
        rule = WEIGHTLESS_BRIDGES[name]
        inner = getattr(ln, "original_component", None)
        return FinalNorm("norm", rule.center, _eps(inner if inner is not None else ln, cfg_eps))
    inner = _readers.required(ln, "original_component", "the module the norm bridge wraps")
    if isinstance(inner, torch.nn.Identity):
        return FinalNorm("identity")
    return _probed(inner, architecture, cfg_eps, getattr(getattr(model, "cfg", None), "d_model", 0))


def _probed(module: Any, architecture: str, cfg_eps: Any, d_model: int) -> FinalNorm:
    """The candidate convention that reproduces the (unhooked) Hugging Face ``module``."""
    weight, bias, eps = _param(module, "weight"), _param(module, "bias"), _eps(module, cfg_eps)
    d = int(weight.shape[-1]) if weight is not None else _width(module, d_model)
    x = torch.randn(3, d, generator=torch.Generator().manual_seed(0)) * 3.0 + 0.5
    params = [p for p in module.parameters()] if hasattr(module, "parameters") else []
    dtype = params[0].dtype if params else torch.float32
    device = params[0].device if params else torch.device("cpu")
    try:
        with torch.no_grad():
            want = module(x.to(device=device, dtype=dtype)).float().cpu()
    except Exception as exc:  # a norm with another calling convention
        raise TLDynamicsError(
            f"{architecture}: cannot read its final norm {type(module).__name__} "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    offsets = (0.0, 1.0) if weight is not None else (0.0,)
    errors = []
    for center in (False, True):
        for offset in offsets:
            cand = FinalNorm("norm", center, eps, weight, offset, bias)
            err = float((cand(x) - want).abs().max() / want.abs().max().clamp_min(1e-30))
            if err <= (PROBE_RTOL if dtype in (torch.float32, torch.float64) else 2e-2):
                return cand
            errors.append(round(err, 4))
    raise TLDynamicsError(
        f"{architecture}: its final norm {type(module).__name__} is neither an RMSNorm nor a "
        f"LayerNorm with gain w or 1 + w (relative errors {errors}), so the adapter cannot "
        "compute it without calling the model's hooked module; the logit lens is not available"
    )


def _width(module: Any, d_model: int) -> int:
    shape = _readers.optional(module, "normalized_shape")
    if isinstance(shape, (tuple, list)) and shape:
        return int(shape[-1])
    if isinstance(d_model, int) and d_model > 0:
        return d_model
    raise _readers.refusal(module, "normalized_shape", "no width of a weightless final norm")


def _unknown(architecture: str, name: str, valid: list[str]) -> TLDynamicsError:
    return TLDynamicsError(
        f"{architecture}: its final norm is a {name}, which the adapter does not know (valid: "
        f"{valid}), so the logit lens is not available"
    )
