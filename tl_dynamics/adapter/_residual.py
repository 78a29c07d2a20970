"""``Residual``: the parts of the stream entering one layer on one pass (``ResidualSplit.gather``,
``_components.py``; docs/math.md §10.1)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from jaxtyping import Float
from torch import Tensor


def relative_error(a: Tensor, b: Tensor, valid: Tensor) -> float:
    """``max |a - b| / max |b|`` over the valid positions ``[batch, pos]``."""
    if not bool(valid.any()):
        return 0.0
    diff, ref = (a - b)[valid], b[valid]
    return float(diff.abs().max() / ref.abs().max().clamp_min(1e-30))


def layer_parts(
    part: dict[str, Tensor],
    l: int,
    pre: dict[int, Tensor],
    valid: Tensor,
    sequential: bool,
    has_mlp: bool,
) -> tuple[Tensor, float | None]:
    """Layer ``l``'s MLP output (what its block added besides attention) and the relative error
    of its attention output ``sum_h z_h W_O[h] + b_O`` against the stream (None where no check
    applies), from ``part`` (``kept[l]`` of ``ResidualSplit.keep``). Formed once per pass and
    kept in ``part``, which every later layer's split of the pass reads (QK attribution splits up
    to 30 layers from one pass)."""
    if "split mlp" not in part:
        attn = torch.einsum("bihd,hdm->bim", part["z"], part["W_O"]) + part["b_O"]
        err: float | None = None
        if sequential:
            mid = part["resid_mid"]
            err = relative_error(attn, mid - pre[l], valid)
            mlp = pre[l + 1] - mid
        else:
            mlp = pre[l + 1] - pre[l] - attn
            if not has_mlp:
                err = relative_error(attn, pre[l + 1] - pre[l], valid)
        part["split mlp"] = mlp
        if err is not None:
            part["split error"] = torch.tensor(err)
    error = part.get("split error")
    return part["split mlp"], None if error is None else float(error)


@dataclass(frozen=True)
class Residual:
    """The parts of the stream entering one layer on one pass, and the layer's frozen norm.

    ``coefficients[c] @ bases[c]`` (``bases[c]`` None: the coefficients are the vectors) is part
    ``c`` ``[batch, pos, d_model]``; the parts sum to ``stream``. ``scale`` is the input norm's
    per-position ``s`` on this pass; ``errors`` the checks made while gathering (relative).
    """

    layer: int
    names: tuple[str, ...]
    kinds: tuple[str, ...]
    coefficients: list[Tensor]
    bases: list[Tensor | None]
    stream: Float[Tensor, "batch pos d_model"]
    scale: Float[Tensor, "batch pos"]
    positions: Tensor
    valid: Tensor
    errors: dict[str, float] = field(default_factory=dict)

    def rows(self, index: Tensor) -> "Residual":
        """The same parts at the positions ``index`` only (``[n]``; e.g. the query rows a caller
        reads): every per-position tensor sliced along its position axis.

        Example:
            >>> from tl_dynamics import testing
            >>> from tl_dynamics.adapter import ModelAdapter, ResidualSplit
            >>> res = ResidualSplit(ModelAdapter(testing.cached_model("gpt2")), 1).run("a b c")
            >>> tuple(res.rows(torch.tensor([1, 3])).stream.shape)
            (1, 2, 64)
        """
        i = index.to(self.stream.device)
        return Residual(
            self.layer,
            self.names,
            self.kinds,
            [c[:, i] for c in self.coefficients],
            self.bases,
            self.stream[:, i],
            self.scale[:, i],
            self.positions[:, i],
            self.valid[:, i],
            dict(self.errors),
        )

    def vectors(self) -> Float[Tensor, "part batch pos d_model"]:
        """Every part as residual vectors (memory: parts x stream; for checks and small models)."""
        return torch.stack(
            [c if b is None else c @ b for c, b in zip(self.coefficients, self.bases)]
        )

    def project(
        self, W: Float[Tensor, "d_model n"], extra: int = 0
    ) -> Float[Tensor, "part batch pos n"]:
        """``part @ W`` for every part, without forming the parts in ``d_model``, written into
        one buffer (``extra`` more slots left uninitialised at its end)."""
        out = W.new_empty(len(self.coefficients) + extra, *self.scale.shape, W.shape[1])
        for i, (coef, basis) in enumerate(zip(self.coefficients, self.bases)):
            torch.matmul(coef, W if basis is None else basis @ W, out=out[i])
        return out
