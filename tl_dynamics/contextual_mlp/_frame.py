"""The query's frame: where keys are read from the query's point of view on rotary layers.

With rotary embeddings the score is ``c <q_T R_T, k_i R_i>`` (row vectors) where
``q_T = x_T W_Q + b_Q`` is the unrotated query and ``k_i R_i`` is the key as scored. So the
score is ``c <q_T, (k_i R_i) R_T^T>``: the scored key taken back by the query's position ``T``
is what the query input is read against (docs/math.md §3.2). ``RotaryFrame`` is one prompt row's
rotation (the adapter's ``Rotation`` of the layer at the row's position ids) and applies
``R_T`` and ``R_T^T``. ``build_frames`` *verifies* it on every prompt: the rotated
``x W_Q + b_Q`` (normalised first on qk-norm architectures) must equal the query the model
scored, else a ``TLDynamicsError`` is raised rather than giving wrong weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from tl_dynamics.adapter import LayerAttention, ModelAdapter, Rotation
from tl_dynamics.errors import TLDynamicsError

# Relative error allowed between the rotated x W_Q + b_Q and the model's scored query: float32
# rounding of a [d_model] x [d_model, d_head] product and a rotation, far below any real mismatch
# (a wrong frequency or pairing gives errors of order 1).
FRAME_RTOL = 1e-4
# A half-precision model computes and stores its query in its own dtype: the float32
# recomputation then differs by a few of that dtype's rounding steps (measured on the tiny
# GPT-2 of tl_dynamics.testing: 1.9e-3 in float16, 1.5e-2 in bfloat16, relative to the largest
# query entry). The check allows FRAME_EPS_STEPS * eps(dtype) (7.8e-3 float16, 6.3e-2 bfloat16),
# still far below a real mismatch. docs/math.md §3.2, §7.
FRAME_EPS_STEPS = 8


def frame_tolerance(dtype: torch.dtype) -> float:
    """Relative tolerance of the frame check for a model computing in ``dtype``.

    Example:
        >>> frame_tolerance(torch.float32), frame_tolerance(torch.float16)
        (0.0001, 0.0078125)
    """
    if not dtype.is_floating_point or torch.finfo(dtype).bits >= 32:
        return FRAME_RTOL
    return max(FRAME_RTOL, FRAME_EPS_STEPS * torch.finfo(dtype).eps)


@dataclass(frozen=True, eq=False)
class RotaryFrame:
    """One prompt row's rotary rotation (identity when ``rotation`` is None).

    ``positions[p]`` is the position id the model rotated row position ``p`` by.

    Example:
        >>> frame = RotaryFrame()
        >>> frame.style, frame.rotate(torch.ones(3, 1, 2)).shape
        ('none', torch.Size([3, 1, 2]))
    """

    rotation: Rotation | None = None
    positions: Int[Tensor, " pos"] | None = None

    @property
    def style(self) -> str:
        """``"none"``, or the rotation's pair layout (``"half"``, ``"interleaved"``)."""
        return "none" if self.rotation is None else self.rotation.layout

    def _positions(self) -> Int[Tensor, " pos"]:
        if self.positions is None:
            raise TLDynamicsError("RotaryFrame: a rotation needs the positions it rotated by")
        return self.positions

    def rotate(self, x: Float[Tensor, "pos head d_head"]) -> Float[Tensor, "pos head d_head"]:
        """``x_p R_p`` for every position ``p`` (x's positions are the frame's first ones)."""
        if self.rotation is None:
            return x
        return self.rotation.rotate(x, self._positions()[: x.shape[0]].to(x.device))

    def to_query_frame(
        self, keys: Float[Tensor, "src d_head"], position: int
    ) -> Float[Tensor, "src d_head"]:
        """``k R_T^T`` for every row of ``keys``: scored keys seen from query position ``T``."""
        if self.rotation is None:
            return keys
        at = self._positions()[position].expand(keys.shape[0]).to(keys.device)
        return self.rotation.rotate(keys, at, transpose=True)


def check_inputs(adapter: ModelAdapter, la: LayerAttention) -> None:
    """Raise unless ``la`` holds the attention input ``x`` the contextual MLP is built from."""
    if "x" not in la.reference:
        raise TLDynamicsError(
            f"layer {la.layer}: the attention input x was not captured; capture "
            "with inputs=True (adapter.attention(..., inputs=True))"
        )


def build_frames(
    adapter: ModelAdapter,
    la: LayerAttention,
    key_valid: Bool[Tensor, "batch pos"],
    rotation: Rotation | None = None,
    *,
    rows: Sequence[int] | None = None,
) -> list[RotaryFrame]:
    """One verified ``RotaryFrame`` per batch row of ``la`` (captured with ``inputs=True``).

    ``rotation`` defaults to the layer's own (``adapter.rotation``), at the position ids the
    host derives from ``key_valid``. ``R_p q(x_p)`` (``q`` from ``adapter.unrotated_queries``)
    must equal the query the model scored on every real position (on every architecture,
    rotary or not, with or without qk-norm; without rotary or qk-norm it is compared along
    fixed random directions, ``_projected_error``), else this raises. ``rows`` (None: all) are the
    rows that are verified, for callers that build only those (the check is a ``d_model x
    d_model`` product per token).
    """
    check_inputs(adapter, la)
    rotation = adapter.rotation(la.layer) if rotation is None else rotation
    key_valid = key_valid.to(la.q.device)
    positions = adapter.positions(key_valid)
    frames = [
        RotaryFrame(rotation, None if rotation is None else positions[row].cpu())
        for row in range(la.q.shape[0])
    ]
    pick = slice(None) if rows is None else list(rows)
    key_valid, positions, q = key_valid[pick], positions[pick], la.q[pick]
    if not key_valid.any():
        return frames
    x = la.reference["x"][pick]
    if rotation is None and adapter.query_norm(la.layer) is None:
        err = _projected_error(adapter, la.layer, x, q)  # linear query: no [.., d_head] recompute
    else:
        q_lin = adapter.unrotated_queries(la.layer, x)
        rotated = q_lin if rotation is None else rotation.rotate(q_lin, positions)
        err = (rotated - q).abs().amax(dim=(-2, -1))  # [batch, pos]
    err = err[key_valid].max().item()
    scale = max(q.abs().amax(dim=(-2, -1))[key_valid].max().item(), 1.0)
    tolerance = frame_tolerance(adapter.dtype)
    if err > tolerance * scale:
        what = "rotary query" if rotation is not None else "query"
        raise TLDynamicsError(
            f"layer {la.layer} of {adapter.info.architecture}: could not reproduce the scored "
            f"{what} from the layer input (max error {err:.3g} > {tolerance:.3g} x {scale:.3g} "
            f"allowed for {adapter.dtype}, rotation "
            f"{'none' if rotation is None else rotation.layout}); the contextual-MLP weights "
            "would be wrong here"
        )
    return frames


# Directions per head along which a linear query is compared (see ``_projected_error``).
CHECK_DIRECTIONS = 4


def _projected_error(
    adapter: ModelAdapter,
    layer: int,
    x: Float[Tensor, "batch pos d_model"],
    q: Float[Tensor, "batch pos head d_head"],
) -> Float[Tensor, "batch pos"]:
    """Largest ``|(x W_Q + b_Q - q) . r|`` over ``CHECK_DIRECTIONS`` fixed random unit ``r`` per
    head: the frame check of a query linear in ``x`` (no rotary, no qk-norm) for
    ``d_model x CHECK_DIRECTIONS`` rather than ``d_model x d_head`` per head and token (at
    1,024 tokens on GPT-2 small the full recompute was 7% of a forward pass; issue 15).

    ``|e . r| <= |e|`` for a unit ``r``, so float rounding stays within what the full check
    allows for it (``sqrt(d_head)`` times the largest entry at most); a mismatch is missed only
    if every direction is almost orthogonal to it at every token, which a real one (a wrong
    weight, frequency or pairing: errors of order one along most directions) is not.
    """
    gen = torch.Generator().manual_seed(0)
    n_heads, d_head = q.shape[-2:]
    r = torch.randn(n_heads, d_head, CHECK_DIRECTIONS, generator=gen)
    r = (r / r.norm(dim=1, keepdim=True)).to(q.device)
    w = torch.einsum("hmd,hdk->mhk", adapter.W_Q(layer).float(), r)  # [d_model, head, k]
    lin = torch.einsum("bpm,mhk->bphk", x.float(), w) + torch.einsum(
        "hd,hdk->hk", adapter.b_Q(layer).float(), r
    )
    return (lin - torch.einsum("bphd,hdk->bphk", q, r)).abs().amax(dim=(-2, -1))
