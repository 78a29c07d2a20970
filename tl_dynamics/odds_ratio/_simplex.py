"""Least squares on the probability simplex: ``argmin_{a >= 0, sum a = 1} |M a - y|^2``.

Solved as the minimum-norm point of the convex hull of ``p_j = m_j - y`` (for ``a`` on the
simplex, ``M a - y = sum_j a_j p_j``) with Wolfe's algorithm (Wolfe 1976, "Finding the
nearest point in a polytope"): a finite active-set method that keeps an affinely independent
"corral" of points, so it copes with the rank-deficient Gram matrices of attention heads
(``n`` source outputs in a ``d_head``-dimensional subspace). Computed in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from tl_dynamics.errors import TLDynamicsError

# Relative tolerances (times max_j |p_j|^2): optimality test of the major cycle, and the
# smallest coordinate still counted as inside the corral.
OPTIMALITY_TOL = 1e-12
POSITIVE_TOL = 1e-14
MAX_ITER = 10_000


@dataclass(frozen=True)
class SimplexSolution:
    """``coords`` on the simplex, the residual ``M coords - y``, the objective and the KKT
    residual (largest violation of stationarity on the support or dual feasibility off it,
    relative to ``max_j |m_j - y|^2``)."""

    coords: np.ndarray
    residual: np.ndarray
    objective: float
    kkt: float
    iterations: int


def _affine_min_norm(P: np.ndarray) -> np.ndarray:
    """Weights ``alpha`` (summing to one) of the min-norm point of the affine hull of rows of P."""
    k = P.shape[0]
    system = np.zeros((k + 1, k + 1))
    system[:k, :k] = P @ P.T
    system[:k, k] = system[k, :k] = 1.0
    rhs = np.zeros(k + 1)
    rhs[k] = 1.0
    alpha = np.linalg.lstsq(system, rhs, rcond=None)[0][:k]
    return alpha / alpha.sum()


def kkt_residual(P: np.ndarray, coords: np.ndarray) -> float:
    """KKT violation of ``coords`` for ``min |sum_j a_j p_j|^2`` on the simplex (relative).

    With ``g_j = <p_j, x>`` (half the gradient) and ``nu = x.x`` the multiplier of the sum
    constraint: ``g_j = nu`` on the support, ``g_j >= nu`` elsewhere, ``a >= 0``, ``sum a = 1``.
    """
    scale = max(float((P * P).sum(1).max()), 1e-300)
    x = coords @ P
    g = P @ x
    nu = float(coords @ g)
    support = coords > 0
    stationarity = float(np.abs(g[support] - nu).max()) if support.any() else 0.0
    dual = max(0.0, float((nu - g).max()))
    primal = max(abs(float(coords.sum()) - 1.0) * scale, max(0.0, -float(coords.min())) * scale)
    return max(stationarity, dual, primal) / scale


def min_norm_point(P: Float[np.ndarray, "n d"]) -> tuple[np.ndarray, int]:
    """Wolfe's algorithm: simplex weights of the point of ``conv(rows of P)`` nearest 0."""
    n = P.shape[0]
    scale = float((P * P).sum(1).max())
    if scale == 0.0:
        return np.full(n, 1.0 / n), 0
    P = P / np.sqrt(scale)  # all |p_j| <= 1
    norms = (P * P).sum(1)
    corral = [int(norms.argmin())]
    lam = np.array([1.0])
    x = P[corral[0]].copy()
    iterations = 0
    for _ in range(MAX_ITER):
        iterations += 1
        g = P @ x
        j = int(g.argmin())
        if x @ x - g[j] <= OPTIMALITY_TOL or j in corral:
            break
        before = list(corral)
        corral.append(j)
        lam = np.append(lam, 0.0)
        while True:  # minor cycle: move towards the affine min-norm point, dropping points
            alpha = _affine_min_norm(P[corral])
            if (alpha > POSITIVE_TOL).all():
                lam = alpha
                break
            neg = alpha <= POSITIVE_TOL
            step = lam[neg] / np.maximum(lam[neg] - alpha[neg], 1e-300)
            theta = float(step.min())
            lam = (1 - theta) * lam + theta * alpha
            keep = lam > POSITIVE_TOL
            keep[np.flatnonzero(neg)[int(step.argmin())]] = False  # the blocking point leaves
            corral = [c for c, k in zip(corral, keep) if k]
            lam = lam[keep] / lam[keep].sum()
            if len(corral) == 1:
                lam = np.array([1.0])
                break
        x = lam @ P[corral]
        if corral == before:  # the new point was dropped at once: no progress is possible
            break
    coords = np.zeros(n)
    coords[corral] = lam
    return coords, iterations


def simplex_lstsq(M: Float[Tensor, "d n"], y: Float[Tensor, " d"]) -> SimplexSolution:
    """``argmin_{a in simplex} |M a - y|^2`` (columns of ``M`` are the vertices).

    Example:
        >>> import torch
        >>> M = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])   # vertices (0,0), (1,0), (0,1)
        >>> sol = simplex_lstsq(M, torch.tensor([1.0, 1.0]))
        >>> [round(float(a), 6) for a in sol.coords], round(sol.objective, 6)
        ([0.0, 0.5, 0.5], 0.5)
    """
    M64 = torch.as_tensor(M).detach().double().cpu().numpy()
    y64 = torch.as_tensor(y).detach().double().cpu().numpy()
    if M64.ndim != 2 or y64.ndim != 1 or M64.shape[0] != y64.shape[0] or M64.shape[1] == 0:
        raise TLDynamicsError(
            f"simplex_lstsq needs M [d, n] with n >= 1 and y [d]; got M "
            f"{tuple(M64.shape)} and y {tuple(y64.shape)}"
        )
    if not (np.isfinite(M64).all() and np.isfinite(y64).all()):
        raise TLDynamicsError("simplex_lstsq: M and y must be finite")
    P = M64.T - y64[None, :]
    coords, iterations = min_norm_point(P)
    residual = coords @ P
    return SimplexSolution(
        coords=coords,
        residual=residual,
        objective=float(residual @ residual),
        kkt=kkt_residual(P, coords),
        iterations=iterations,
    )
