"""The query's frame: rotary rotations per position, so keys can be read where the query lives.

With rotary embeddings the score is ``c <R_T q_T, R_i k_i>`` where ``q_T = x_T W_Q + b_Q`` is
the unrotated query and ``R_i k_i`` is the key as scored. Rotations are orthogonal, so the score
is ``c <q_T, R_T^T (R_i k_i)>``: the key rotated back by the query's position ``T`` is what the
query input is read against. ``RotaryFrame`` holds the per-position rotation of one prompt row
and applies ``R_T`` and ``R_T^T``; ``build_frame`` obtains it from the model (the rotary cos/sin
the model fires, or the sinusoids its spec describes) and *verifies* it: the rotated
``x W_Q + b_Q`` (normalised first on qk-norm architectures) must equal the query the model
scored, else a ``TLDynamicsError`` is raised rather than giving wrong weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from jaxtyping import Float
from torch import Tensor

from tl_dynamics.adapter import _rotary
from tl_dynamics.errors import TLDynamicsError

if TYPE_CHECKING:
    from tl_dynamics.adapter import LayerAttention, ModelAdapter

Style = Literal["none", "half", "interleaved"]
# Relative error allowed between the rotated x W_Q + b_Q and the model's scored query: float32
# rounding of a [d_model] x [d_model, d_head] product and a rotation, far below any real mismatch
# (a wrong frequency or pairing gives errors of order 1).
FRAME_RTOL = 1e-4
COS_SIN_ROLES = ("cos", "sin")


@dataclass(frozen=True)
class RotaryFrame:
    """Per-position rotary rotation of one prompt row (identity when ``style == "none"``).

    ``cos``/``sin`` are ``[pos, rot]`` in the model's own layout (``rot`` leading dims of each
    head rotate; the rest pass through).
    """

    style: Style
    cos: Float[Tensor, "pos rot"] | None = None
    sin: Float[Tensor, "pos rot"] | None = None

    def _apply(self, x: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> Tensor:
        fn = _rotary.apply_half if self.style == "half" else _rotary.apply_interleaved
        return fn(x, cos, sin, inverse=inverse)

    def rotate(self, x: Float[Tensor, "pos head d_head"]) -> Float[Tensor, "pos head d_head"]:
        """``R_p x_p`` for every position ``p`` (x's positions are the frame's first ones)."""
        if self.style == "none":
            return x
        n = x.shape[0]
        return self._apply(x[None], self.cos[None, :n], self.sin[None, :n], inverse=False)[0]

    def to_query_frame(self, keys: Float[Tensor, "src d_head"], position: int) -> Float[Tensor, "src d_head"]:
        """``R_T^T k`` for every row of ``keys``: scored keys seen from query position ``T``."""
        if self.style == "none":
            return keys
        n = keys.shape[0]
        cos = self.cos[position][None, None].expand(1, n, -1)
        sin = self.sin[position][None, None].expand(1, n, -1)
        return self._apply(keys[None, :, None], cos, sin, inverse=True)[0, :, 0]


def cos_sin_hooks(adapter: "ModelAdapter", layers: list[int], sink: dict) -> list:
    """``adapter.hooks`` entries that keep the rotary cos/sin a bridge fires, per layer."""
    out = []
    for layer in layers:
        spec = adapter.specs[layer]
        if spec.rotary != "half":
            continue
        for role in COS_SIN_ROLES:
            if adapter.hook_name(role, layer) is not None:
                out.append((role, layer, _keep(sink, layer, role)))
    return out


def _keep(sink: dict, layer: int, role: str):
    def fn(t: Tensor) -> None:
        sink[(layer, role)] = t.detach().float()
    return fn


def check_inputs(adapter: "ModelAdapter", la: "LayerAttention") -> None:
    """Raise unless ``la`` holds the attention input ``x`` the contextual MLP is built from."""
    if "x" not in la.reference:
        raise TLDynamicsError(f"layer {la.layer}: the attention input x was not captured; capture "
                              "with inputs=True (adapter.attention(..., inputs=True))")


def unrotated_queries(adapter: "ModelAdapter", la: "LayerAttention") -> Float[Tensor, "batch pos head d_head"]:
    """The query before rotary from the captured attention input (needs ``inputs=True``):
    ``x W_Q + b_Q``, normalised on qk-norm architectures (``adapter.query_norm``)."""
    check_inputs(adapter, la)
    x = la.reference["x"]
    q = torch.einsum("bpm,hmd->bphd", x, adapter.W_Q(la.layer)) + adapter.b_Q(la.layer)
    norm = adapter.query_norm(la.layer)
    return q if norm is None else norm.apply_heads(q)


def build_frames(adapter: "ModelAdapter", la: "LayerAttention", key_valid: Tensor,
                 captured: dict) -> list[RotaryFrame]:
    """One verified ``RotaryFrame`` per batch row of ``la``: ``R_p q(x_p)`` (``q`` from
    ``unrotated_queries``) must equal the query the model scored (on every architecture, rotary
    or not, with or without qk-norm), else this raises.

    ``captured`` holds ``{(layer, "cos"|"sin"): tensor}`` from ``cos_sin_hooks``.
    """
    spec = la.spec
    n_batch, n_pos = la.q.shape[:2]
    q_lin = unrotated_queries(adapter, la)
    candidates: list[list[RotaryFrame]] = []
    if spec.rotary == "none":
        candidates.append([RotaryFrame("none")] * n_batch)
    elif spec.rotary == "half" and (la.layer, "cos") in captured:
        cos, sin = captured[(la.layer, "cos")], captured[(la.layer, "sin")]
        cos, sin = (t[None] if t.ndim == 2 else t for t in (cos, sin))  # [batch, pos, rot]
        cos, sin = (t.expand(n_batch, *t.shape[1:]) if t.shape[0] == 1 else t for t in (cos, sin))
        candidates.append(_per_row("half", cos, sin, n_pos))
    elif spec.rotary_dim is not None and spec.rotary_base is not None:
        positions = _rotary.positions_from_mask(key_valid.to(la.q.device))
        cos, sin = _rotary.interleaved_cos_sin(positions, spec.rotary_dim, spec.rotary_base)
        if spec.rotary != "interleaved":  # rotate_half layout of the same frequencies first
            candidates.append(_per_row("half", torch.cat((cos[..., ::2], cos[..., ::2]), -1),
                                       torch.cat((sin[..., ::2], sin[..., ::2]), -1), n_pos))
        candidates.append(_per_row("interleaved", cos, sin, n_pos))
    if not candidates:
        raise TLDynamicsError(
            f"layer {la.layer} of {adapter.info.architecture} is rotary ({spec.rotary!r}) but its "
            "rotation is unknown: the model fired no cos/sin and its spec gives no rotary_dim/base")
    valid = key_valid.to(la.q.device)
    if not valid.any():
        return candidates[0]
    scale = max(la.q[valid].abs().max().item(), 1.0)
    worst = float("inf")
    for frames in candidates:
        rotated = torch.stack([f.rotate(q_lin[b]) for b, f in enumerate(frames)])
        err = (rotated - la.q)[valid].abs().max().item()
        if err <= FRAME_RTOL * scale:
            return frames
        worst = min(worst, err)
    what = "rotary query" if spec.rotary != "none" else "query"
    raise TLDynamicsError(
        f"layer {la.layer} of {adapter.info.architecture}: could not reproduce the scored {what} "
        f"from the layer input (best max error {worst:.3g}, tried "
        f"{[c[0].style for c in candidates]}); the contextual-MLP weights would be wrong here")


def _per_row(style: Style, cos: Tensor, sin: Tensor, n_pos: int) -> list[RotaryFrame]:
    return [RotaryFrame(style, cos[b, :n_pos].float(), sin[b, :n_pos].float())
            for b in range(cos.shape[0])]
