"""A pattern ``S`` as a Markov chain on positions (docs/math.md §2.4).

Pure functions of one pattern ``[n, n]`` restricted to the real (non-padding) positions, in
float64. Bidirectional heads get their stationary distribution; causal heads, whose first
position is absorbing, get the expected number of steps to absorption and the stationary
vector of a damped walk ``alpha S + (1 - alpha) 1 u^T`` (``u`` uniform; ``DAMPING``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, cast

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from tl_dynamics import viz
from tl_dynamics.errors import TLDynamicsError

# PageRank's damping (Brin & Page 1998): with probability 0.15 the walk restarts uniformly.
DAMPING = 0.85
# Rows must sum to one within this (float32 softmax output).
ROW_SUM_TOL = 1e-4


def _check(S: Tensor) -> Tensor:
    if S.ndim != 2 or S.shape[0] != S.shape[1] or S.shape[0] == 0:
        raise TLDynamicsError(f"a pattern must be a square [pos, pos] matrix, got {tuple(S.shape)}")
    S = S.detach().double().cpu()
    err = (S.sum(-1) - 1).abs().max().item()
    if err > ROW_SUM_TOL or (S < 0).any():
        raise TLDynamicsError(
            f"a pattern must be row-stochastic (rows >= 0 summing to 1 within "
            f"{ROW_SUM_TOL}); largest row-sum error {err:.3g}: drop padding rows "
            "and columns first"
        )
    return S


def is_lower_triangular(S: Tensor) -> bool:
    return bool((torch.triu(S, diagonal=1).abs() == 0).all())


def stationary(S: Float[Tensor, "pos pos"]) -> Float[Tensor, " pos"]:
    """``pi`` with ``pi S = pi``, ``sum pi = 1`` (unique for an irreducible chain, e.g. any
    bidirectional softmax pattern): least squares on ``[S^T - I; 1^T] pi = [0; 1]``.

    Example:
        >>> import torch
        >>> [round(x, 6) for x in stationary(torch.tensor([[0.5, 0.5], [0.25, 0.75]])).tolist()]
        [0.333333, 0.666667]
    """
    S = _check(S)
    n = S.shape[0]
    system = torch.cat([S.T - torch.eye(n, dtype=S.dtype), torch.ones(1, n, dtype=S.dtype)])
    rhs = torch.zeros(n + 1, dtype=S.dtype)
    rhs[-1] = 1.0
    return torch.linalg.lstsq(system, rhs[:, None]).solution[:, 0]


def damped_stationary(S: Float[Tensor, "pos pos"], alpha: float = DAMPING) -> Float[Tensor, " pos"]:
    """Stationary vector of ``alpha S + (1 - alpha) 1 u^T``, ``u`` uniform:
    ``pi = (1 - alpha) u^T (I - alpha S)^{-1}``."""
    if not 0.0 <= alpha < 1.0:
        raise TLDynamicsError(f"damping alpha must be in [0, 1), got {alpha}")
    S = _check(S)
    n = S.shape[0]
    u = torch.full((n,), 1.0 / n, dtype=S.dtype)
    return torch.linalg.solve((torch.eye(n, dtype=S.dtype) - alpha * S).T, (1 - alpha) * u)


def absorption_steps(S: Float[Tensor, "pos pos"]) -> Float[Tensor, " pos"]:
    """Expected steps to reach position 0 from each position, for a causal (lower-triangular)
    pattern whose first row is ``[1, 0, ...]``: ``t = (I - T)^{-1} 1`` on the transient
    positions ``1..n-1`` (``inf`` where another position is absorbing, ``S_ii = 1``)."""
    S = _check(S)
    if not is_lower_triangular(S):
        raise TLDynamicsError(
            "absorption_steps needs a causal (lower-triangular) pattern; "
            "use stationary() for a bidirectional head"
        )
    n = S.shape[0]
    steps = torch.zeros(n, dtype=S.dtype)
    T = S[1:, 1:]
    # Lower-triangular: t_i = (1 + sum_{0<j<i} S_ij t_j) / (1 - S_ii), forward substitution.
    for i in range(n - 1):
        stay = 1.0 - T[i, i].item()
        steps[i + 1] = (
            float("inf") if stay <= 0 else (1.0 + (T[i, :i] * steps[1 : i + 1]).sum()) / stay
        )
    return steps


def effective_rank(singular_values: Tensor) -> float:
    """``exp`` of the entropy of the normalised singular values (Roy & Vetterli 2007)."""
    p = singular_values / singular_values.sum()
    p = p[p > 0]
    return float(torch.exp(-(p * p.log()).sum()))


@dataclass(frozen=True)
class ChainSummary(viz.Result):
    """Markov-chain facts of one head's pattern on one prompt (real positions only)."""

    layer: int
    head: int
    tokens: tuple[str, ...]
    causal: bool
    stationary: Tensor  # bidirectional: pi S = pi; causal: delta at position 0
    damped_stationary: Tensor  # PageRank-style, alpha = DAMPING
    absorption_steps: Tensor | None  # causal only
    eigenvalues: Tensor  # complex
    singular_values: Tensor
    effective_rank: float
    row_entropy: Tensor

    def to_dataframe(self) -> pd.DataFrame:
        data = {
            "token": list(self.tokens),
            "stationary": self.stationary.tolist(),
            "damped_stationary": self.damped_stationary.tolist(),
            "row_entropy": self.row_entropy.tolist(),
        }
        if self.absorption_steps is not None:
            data["absorption_steps"] = self.absorption_steps.tolist()
        return pd.DataFrame(data)


def chain_summary(
    S: Float[Tensor, "pos pos"],
    layer: int = -1,
    head: int = -1,
    tokens: Sequence[str] = (),
    alpha: float = DAMPING,
) -> ChainSummary:
    """All Markov-chain statistics of one pattern (already restricted to real positions)."""
    S64 = _check(S)
    causal = is_lower_triangular(S64) and S64.shape[0] > 1
    n = S64.shape[0]
    if causal:
        pi = torch.zeros(n, dtype=S64.dtype)
        pi[0] = 1.0
        steps = absorption_steps(S64)
    else:
        pi, steps = stationary(S64), None
    logs = torch.where(S64 > 0, S64.log(), torch.zeros_like(S64))
    sv = torch.linalg.svdvals(S64)
    return ChainSummary(
        layer=layer,
        head=head,
        tokens=tuple(tokens) or tuple(map(str, range(n))),
        causal=causal,
        stationary=pi,
        damped_stationary=damped_stationary(S64, alpha),
        absorption_steps=steps,
        eigenvalues=torch.linalg.eigvals(S64),
        singular_values=sv,
        effective_rank=effective_rank(sv),
        row_entropy=(-(S64 * logs).sum(-1)).clamp(min=0.0),
    )


def compose(
    patterns: Sequence[Float[Tensor, "pos pos"]], residual: float | None = None
) -> Float[Tensor, "pos pos"]:
    """Compose patterns through depth, first layer first: ``S_L ... S_2 S_1``.

    With ``residual`` (attention rollout, Abnar & Zuidema 2020, who use 0.5) each layer is
    ``(1 - residual) S + residual I`` (rows still sum to one) before the product.

    Example:
        >>> import torch
        >>> S = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
        >>> compose([S, S]).tolist()
        [[1.0, 0.0], [0.75, 0.25]]
    """
    if not patterns:
        raise TLDynamicsError("odds_ratio.composed needs at least one layer's pattern")
    if residual is not None and not 0.0 <= residual <= 1.0:
        raise TLDynamicsError(f"residual weight must be in [0, 1], got {residual}")
    out = None
    for S in patterns:
        S = _check(S)
        if out is not None and S.shape != out.shape:
            raise TLDynamicsError(
                f"patterns to compose must share a shape; got {tuple(S.shape)} "
                f"after {tuple(out.shape)}"
            )
        if residual is not None:
            S = (1 - residual) * S + residual * torch.eye(S.shape[0], dtype=S.dtype)
        out = S if out is None else S @ out
    return cast(Tensor, out)  # patterns is not empty (checked above)
