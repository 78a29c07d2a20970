"""Rotary position embeddings as plain tensors: one ``Rotation`` per layer, one apply routine.

With rotary embeddings a query (or key) ``y`` at position ``p`` is scored as ``y R_p`` (row
vectors), where ``R_p`` rotates pairs of the first ``rotary_dim`` coordinates by the angles
``p * inv_freq`` and multiplies them by ``magnitude`` (1 unless a rope scaling rescales the
tables). Since ``R_a R_b^T = magnitude^2 R_{a-b}``, a score depends on the positions only
through the offset ``query position - key position`` (docs/math.md §1.5).

Two pair layouts exist: ``"half"`` (Llama, GPT-NeoX: coordinate ``k`` pairs with
``k + rotary_dim/2``) and ``"interleaved"`` (GPT-J, TransformerLens native: ``2k`` with
``2k + 1``). ``ModelAdapter.rotation(layer)`` reads a layer's ``Rotation`` from the model and
checks it against the model's own rotated queries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

Layout = Literal["half", "interleaved"]

# ``apply`` rotates blocks of about this many bytes of its input at a time (they stay in cache).
BLOCK_BYTES = 2**19


def apply(
    x: Float[Tensor, "... d_head"],
    cos: Float[Tensor, "... rot"],
    sin: Float[Tensor, "... rot"],
    layout: Layout,
    transpose: bool = False,
) -> Float[Tensor, "... d_head"]:
    """``x R`` on the first ``cos.shape[-1]`` coordinates of ``x`` (the rest pass through).

    ``cos``/``sin`` are tables in the layout's order, broadcastable to ``x[..., :rot]``;
    computed in ``x``'s dtype. ``transpose=True`` applies ``R^T`` (the inverse when the tables
    have unit magnitude).

    Example:
        >>> x = torch.tensor([[1.0, 0.0]])
        >>> apply(x, torch.tensor([[0.0, 0.0]]), torch.tensor([[1.0, 1.0]]), "half")  # 90 degrees
        tensor([[0., 1.]])
    """
    rot = cos.shape[-1]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if transpose:
        sin = -sin
    if torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad or sin.requires_grad):
        return _apply_differentiable(x, cos, sin, layout)  # ``out=`` does not record a graph
    # Each half of a pair written in place, ``a * cos - b * sin`` and ``b * cos + a * sin``: the
    # same products and sums, bit for bit, as ``x cos + turned(x) sin`` with ``turned`` the pairs
    # swapped and negated, without forming ``turned`` or the concatenations, a cache-sized block
    # of the leading axis at a time (this runs over every part of every query and key in QK
    # attribution: 3x faster than the one expression on SmolLM2's parts).
    if layout == "half":
        half = rot // 2
        lo, hi = slice(0, half), slice(half, rot)
    else:
        lo, hi = slice(0, rot, 2), slice(1, rot, 2)
    shape = torch.broadcast_shapes(x.shape[:-1], cos.shape[:-1], sin.shape[:-1])
    out = torch.empty(*shape, x.shape[-1], dtype=x.dtype, device=x.device)
    if rot < x.shape[-1]:
        out[..., rot:] = x[..., rot:]
    blocks = x.ndim > 1 and x.shape[0] == out.shape[0]  # else one block: the whole of x
    step = max(1, BLOCK_BYTES // max(1, x[0].numel() * x.element_size())) if blocks else len(out)
    for i in range(0, len(out), step):
        xi, oi, ci, si = x, out, cos, sin
        if blocks:
            xi, oi = x[i : i + step], out[i : i + step]
            ci, si = (
                t if t.ndim < x.ndim or t.shape[0] == 1 else t[i : i + step] for t in (cos, sin)
            )
        a, b = xi[..., lo], xi[..., hi]
        first, second = oi[..., lo], oi[..., hi]
        torch.mul(a, ci[..., lo], out=first)
        first.sub_(b * si[..., lo])
        torch.mul(b, ci[..., hi], out=second)
        second.add_(a * si[..., hi])
    return out


def _apply_differentiable(x: Tensor, cos: Tensor, sin: Tensor, layout: Layout) -> Tensor:
    """``apply`` as one expression autograd records (the same values)."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    if layout == "half":
        half = rot // 2
        turned = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    else:
        turned = torch.stack((-x_rot[..., 1::2], x_rot[..., ::2]), dim=-1).flatten(-2)
    return torch.cat((x_rot * cos + turned * sin, x_pass), dim=-1)


def positions_from_mask(key_valid: Bool[Tensor, "batch pos"]) -> Int[Tensor, "batch pos"]:
    """Position ids as the hosts derive them from the padding mask: ``0, 1, 2, ...`` counted
    over real tokens, so a left-padded row starts at 0 on its first real token (padding
    positions get an arbitrary id; they are never attended to).

    Example:
        >>> positions_from_mask(torch.tensor([[False, True, True], [True, True, False]])).tolist()
        [[1, 0, 1], [0, 1, 2]]
    """
    mask = key_valid.long()
    derived = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    arange = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    needs = ((derived != arange) & (mask != 0)).any(dim=1, keepdim=True)
    return torch.where(needs, derived, arange)


def layout_order(per_pair: Tensor, layout: Layout) -> Tensor:
    """``[..., rot/2]`` values per pair -> ``[..., rot]`` in the layout's coordinate order."""
    if layout == "half":
        return torch.cat((per_pair, per_pair), dim=-1)
    return per_pair.repeat_interleave(2, dim=-1)


@dataclass(frozen=True, eq=False)
class Rotation:
    """One layer's rotary rotation, as the model applies it.

    Attributes:
        layer: the layer it belongs to.
        layout: ``"half"`` (pairs ``(k, k + rotary_dim/2)``) or ``"interleaved"`` (pairs
            ``(2k, 2k+1)``).
        rotary_dim: how many leading coordinates of each head rotate (the rest pass through).
        inv_freq: angle per position of each pair, ``[rotary_dim/2]`` (float64 holding the
            model's own float32 frequencies where it keeps them).
        magnitude: factor the model multiplies both ``cos`` and ``sin`` by (1 unless a rope
            scaling rescales them); scores carry its square.
        table: the model's own ``(cos, sin)`` tables ``[n, rotary_dim]`` for positions
            ``0..n-1`` where it keeps them (HookedTransformer, TransformerLens native), used
            as they are so that rotations match the model bit for bit; None elsewhere.
        start: the first rotated coordinate (0: the leading ``rotary_dim``; multi-head latent
            attention rotates the last ``rotary_dim`` of its ``[nope ; rope]`` q and k).

    Tables are computed the way the hosts compute them: float32 angles ``p * inv_freq``.

    Example:
        >>> r = Rotation(0, "half", 2, torch.tensor([1.0], dtype=torch.float64))
        >>> r.rotate(torch.tensor([[1.0, 0.0]]), torch.tensor([0])).tolist()
        [[1.0, 0.0]]
        >>> torch.allclose(r.matrix(3, 2) @ r.matrix(1, 2).T, r.matrix(2, 2), atol=1e-6)
        True
    """

    layer: int
    layout: Layout
    rotary_dim: int
    inv_freq: Float[Tensor, " pairs"]
    magnitude: float = 1.0
    table: tuple[Tensor, Tensor] | None = field(default=None, repr=False)
    start: int = 0

    def cos_sin(
        self, positions: Int[Tensor, "..."]
    ) -> tuple[Float[Tensor, "... rot"], Float[Tensor, "... rot"]]:
        """The float32 ``cos``/``sin`` tables at ``positions``, magnitude included, in the layout's order.

        Negative positions give the transposed rotation.

        Args:
            positions: Positions, any shape ``[...]``.

        Returns:
            ``(cos, sin)``, each ``[..., rotary_dim]``.

        Example:
            >>> r = Rotation(0, "half", 2, torch.tensor([1.0], dtype=torch.float64))
            >>> cos, sin = r.cos_sin(torch.tensor([0, 1]))
            >>> cos.shape, round(sin[1, 0].item(), 4)
            (torch.Size([2, 2]), 0.8415)
        """
        positions = torch.as_tensor(positions)
        if (
            self.table is not None
            and positions.numel()
            and int(positions.abs().max()) < self.table[0].shape[0]
        ):
            index = positions.abs().long().to(self.table[0].device)
            cos, sin = self.table[0][index].float(), self.table[1][index].float()
            sign = torch.where(positions < 0, -1.0, 1.0).to(sin.device)[..., None]
            return cos.to(positions.device), (sin * sign).to(positions.device)
        angles = positions.float()[..., None] * self.inv_freq.float().to(positions.device)
        cos = layout_order(torch.cos(angles), self.layout) * self.magnitude
        sin = layout_order(torch.sin(angles), self.layout) * self.magnitude
        return cos, sin

    def rotate(
        self, x: Float[Tensor, "... d_head"], positions: Int[Tensor, "..."], transpose: bool = False
    ) -> Float[Tensor, "... d_head"]:
        """Rotate ``x`` by each position's rotation: ``x R_p`` (``transpose``: ``x R_p^T``).

        Computed in ``x``'s dtype. ``positions`` has the shape of ``x``'s leading dimensions (e.g.
        ``[batch, pos]`` for ``x`` ``[batch, pos, head, d_head]``, or ``[pos]`` for ``[pos,
        d_head]``); dimensions of ``x`` after them (heads) share the position.

        Args:
            x: Vectors, ``[..., d_head]``.
            positions: Their positions, ``x``'s leading dimensions.
            transpose: Apply ``R_p^T`` (the inverse rotation).

        Returns:
            The rotated vectors, ``[..., d_head]``.

        Example:
            >>> r = Rotation(0, "half", 2, torch.tensor([1.0], dtype=torch.float64))
            >>> x = torch.tensor([[1.0, 0.0]])
            >>> torch.allclose(r.rotate(r.rotate(x, torch.tensor([3])), torch.tensor([3]), True), x)
            True
        """
        positions = torch.as_tensor(positions, device=x.device)
        cos, sin = self.cos_sin(positions)
        shape = (*positions.shape, *([1] * (x.ndim - 1 - positions.ndim)), self.rotary_dim)
        if self.start:
            turned = apply(
                x[..., self.start :], cos.reshape(shape), sin.reshape(shape), self.layout, transpose
            )
            return torch.cat((x[..., : self.start], turned), dim=-1)
        return apply(x, cos.reshape(shape), sin.reshape(shape), self.layout, transpose)

    def matrix(self, offset: int, d_head: int) -> Float[Tensor, "d_head d_head"]:
        """The matrix ``R_offset`` with ``score = c q R_offset k^T`` for unrotated ``q`` and ``k``.

        The query sits at ``i`` and the key at ``i - offset``; the magnitude's square is included
        on the rotated coordinates (the others, from ``start`` on outside the rotary block, pass
        through unscaled).

        Args:
            offset: Query position minus key position.
            d_head: The head dimension (coordinates past ``rotary_dim`` pass through).

        Returns:
            The matrix, ``[d_head, d_head]``.

        Example:
            >>> r = Rotation(0, "half", 2, torch.tensor([1.0], dtype=torch.float64))
            >>> r.matrix(0, 3)
            tensor([[1., 0., 0.],
                    [0., 1., 0.],
                    [0., 0., 1.]])
        """
        eye = torch.eye(d_head, dtype=torch.float32)
        gain = torch.ones(d_head)
        gain[self.start : self.start + self.rotary_dim] = self.magnitude
        return self.rotate(eye[None], torch.tensor([offset]))[0] * gain[:, None]
