"""The linear maps a layer applies to one residual vector at each position, with this pass's norm
scales frozen: residual vector -> query, key (the frozen input norm, ``W_Q``/``W_K``, a frozen
q/k norm, rotary) or value (the frozen input norm, ``W_V``). They are what ``ResidualSplit``'s
``queries``/``keys`` apply to every part, read out as matrices, so a quantity read from the
queries or keys of a layer can be written as a dot product with any residual vector (the chain
of an edge, ``qk_attribution.explain``; docs/math.md §10.8).
"""

from __future__ import annotations

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from tl_dynamics.adapter._residual import Residual


def _basis(res: Residual) -> Residual:
    """``d_model`` parts, the unit vectors, each present at every position with coefficient 1,
    on ``res``'s stream and frozen scales (so a frozen q/k norm reads the pass's own totals)."""
    d = res.stream.shape[-1]
    eye = torch.eye(d, dtype=res.stream.dtype, device=res.stream.device)
    ones = torch.ones(*res.scale.shape, 1, dtype=res.stream.dtype, device=res.stream.device)
    return Residual(
        res.layer,
        tuple(f"e{k}" for k in range(d)),
        ("basis",) * d,
        [ones] * d,
        [eye[k : k + 1] for k in range(d)],
        res.stream,
        res.scale,
        res.positions,
        res.valid,
    )


def side_map(
    split: Any, res: Residual, head: int, side: str
) -> Float[Tensor, "batch pos d_model d_head"]:
    """The matrix ``M`` with ``part @ M[b, p]`` the part's share of head ``head``'s query
    (``side="query"``) or key (``"key"``) at position ``p`` of prompt ``b`` on this pass (the
    bias part, the norm's shift through ``W`` plus ``b``, left out: it is no residual vector's).

    Example:
        >>> from tl_dynamics import testing
        >>> from tl_dynamics.adapter import ModelAdapter, ResidualSplit
        >>> split = ResidualSplit(ModelAdapter(testing.cached_model("llama")), 1)
        >>> res = split.run("a b c")
        >>> M = side_map(split, res, 0, "key")
        >>> K = split.keys(res, [0])[:-1, 0, 2, 0]           # every part's key at position 2
        >>> V = res.vectors()[:, 0, 2]                        # the parts themselves
        >>> bool(torch.allclose(V @ M[0, 2], K, atol=1e-5))
        True
    """
    basis = _basis(res)
    parts = split.queries(basis, [head]) if side == "query" else split.keys(basis, [head])
    return parts[:-1, ..., 0, :].permute(1, 2, 0, 3)  # [b, pos, d_model, d_head]


def bias_part(split: Any, res: Residual, head: int, side: str) -> Float[Tensor, "batch pos d_head"]:
    """The part of head ``head``'s query or key at each position that no residual vector wrote:
    the input norm's shift through ``W`` plus ``b``, through the frozen q/k norm and rotary (the
    last part of ``ResidualSplit.queries``/``keys``), formed without any part."""
    empty = Residual(res.layer, (), (), [], [], res.stream, res.scale, res.positions, res.valid)
    parts = split.queries(empty, [head]) if side == "query" else split.keys(empty, [head])
    return parts[-1, ..., 0, :]


def value_map(split: Any, res: Residual, head: int) -> tuple[Tensor, Tensor]:
    """``(M, bias)``: the value of head ``head`` at position ``p`` of prompt ``b`` is ``sum over
    the parts of part @ M[b, p] + bias`` (the frozen input norm and ``W_V``; ``bias`` ``[d_head]``:
    the norm's shift through ``W_V`` plus ``b_V``), ``M`` ``[batch, pos, d_model, d_head]``.

    Example:
        >>> from tl_dynamics import testing
        >>> from tl_dynamics.adapter import ModelAdapter, ResidualSplit
        >>> ad = ModelAdapter(testing.cached_model("gpt2"))
        >>> split = ResidualSplit(ad, 1)
        >>> res = split.run("a b c")
        >>> M, bias = value_map(split, res, 2)
        >>> v = res.stream[0, 1] @ M[0, 1] + bias
        >>> bool(torch.allclose(v, ad.attention("a b c", layers=1)[1].v[0, 1, 2], atol=1e-5))
        True
    """
    ad = split.adapter
    W = ad.W_V(res.layer)[head].float()  # [d_model, d_head]
    folded = split.norm.fold(W)
    M = folded[None, None] / res.scale[..., None, None]
    shift = split.norm.shift
    bias = ad.b_V(res.layer)[head].float() + (0.0 if shift is None else shift.to(W) @ W)
    return M, bias
