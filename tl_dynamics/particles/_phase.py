"""Phase diagrams: the fraction of eps-close pairs over (t, beta), as Geshkovski et al. plot it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from tl_dynamics import sphere, viz
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.particles._checks import Problems, check_dynamics, check_eps
from tl_dynamics.particles._dynamics import random_init
from tl_dynamics.particles._simulation import simulate
from tl_dynamics.particles._views import phase_panels

#: Local error tolerance for phase diagrams: global errors stay ~1e-4 or below (see
#: ``simulate``), far under the eps = 1e-2 closeness scale the diagram thresholds at.
PHASE_TOL = 1e-5


@dataclass(frozen=True)
class PhaseParams:
    """How a phase diagram was made: dynamics, sizes, threshold, tolerance, step counts."""

    dynamics: str
    n: int
    d: int
    runs: int
    eps: float
    tol: float
    iterations: int = 0
    rejected: int = 0


@dataclass(frozen=True)
class PhaseDiagram(viz.Result):
    """Mean fraction of eps-close pairs for each ``(beta, t)``.

    Attributes:
        betas: ``[B]``; times: ``[T]``.
        fraction: ``[B, T]`` mean over runs of the fraction of pairs with ``<x_i, x_j> > 1 - eps``.
        sem: ``[B, T]`` its standard error over runs.
        params: how it was made (``PhaseParams``).
    """

    betas: Float[Tensor, " B"]
    times: Float[Tensor, " T"]
    fraction: Float[Tensor, "B T"]
    sem: Float[Tensor, "B T"]
    params: PhaseParams

    def __repr__(self) -> str:
        p = self.params
        return (
            f"PhaseDiagram({p.dynamics}, n={p.n}, d={p.d}, runs={p.runs}, "
            f"eps={p.eps}, {len(self.betas)} betas x {len(self.times)} times)"
        )

    def to_dataframe(self) -> pd.DataFrame:
        """Long form: one row per ``(beta, time)`` with ``fraction`` and its standard error ``fraction_sem``."""
        B, T = self.fraction.shape
        return pd.DataFrame(
            {
                "beta": self.betas.repeat_interleave(T).numpy(),
                "time": self.times.repeat(B).numpy(),
                "fraction": self.fraction.reshape(-1).numpy(),
                "fraction_sem": self.sem.reshape(-1).numpy(),
            }
        )

    def show(self) -> viz.Component:
        """A heat map (t across, beta up)."""
        return phase_figure(self)


def phase_figure(*diagrams: PhaseDiagram) -> viz.Component:
    """Heat maps of the eps-close pair fraction over (t, beta), side by side.

    Args:
        *diagrams: one or more results of ``phase_diagram`` (e.g. (SA) and (USA)).

    Returns:
        A ``viz.Component`` (a figure, one panel per diagram).

    Example:
        >>> sa = phase_diagram([0.0, 4.0], [0.0, 2.0], n=8, runs=2, generator=torch.Generator().manual_seed(0))
        >>> "data:image/png" in phase_figure(sa).html
        True
    """
    if not diagrams or not all(isinstance(d, PhaseDiagram) for d in diagrams):
        raise TLDynamicsError(
            f"phase_figure: give one or more results of particles.phase_diagram, got "
            f"{[type(d).__name__ for d in diagrams]}"
        )
    panels, caps = [], []
    for pd_ in diagrams:
        p, t, b = pd_.params, pd_.times.numpy(), pd_.betas.numpy()
        panels.append(
            (t, b, pd_.fraction.numpy(), f"({p.dynamics}) n={p.n}, d={p.d}, {p.runs} runs", p.eps)
        )
        caps.append(
            f"({p.dynamics}) beta in [{b.min():g}, {b.max():g}], t in [{t.min():g}, {t.max():g}]"
        )
    return phase_panels(panels, "Phase diagram, Q=K=V=I: " + "; ".join(caps))


def phase_diagram(
    betas: Sequence[float],
    times: Sequence[float],
    n: int = 32,
    d: int = 2,
    runs: int = 16,
    dynamics: str = "SA",
    eps: float = sphere.CLUSTER_EPS,
    generator: torch.Generator | None = None,
    tol: float = PHASE_TOL,
    dtype: torch.dtype = torch.float64,
) -> PhaseDiagram:
    """Fraction of eps-close pairs at ``times`` for each beta, with ``Q = K = V = I``.

    Every beta starts from the same ``runs`` random initial conditions (common random
    numbers, so differences along beta are not sampling noise), and all betas are
    integrated in one batch with per-run adaptive steps. (SA) is cheap at any beta;
    (USA) needs about ``e^beta`` steps per unit time (see ``tl_dynamics.particles._integrators``), so keep
    its betas moderate: from beta = 4 to beta = 6 its cost grows about e^2-fold.

    Args:
        betas: inverse temperatures (finite, ``>= 0``).
        times: record times.
        n: particles per run.
        d: dimension.
        runs: random initial conditions per beta.
        dynamics: ``"SA"`` or ``"USA"``.
        eps: the closeness threshold (``<x_i, x_j> > 1 - eps``).
        generator: a seeded ``torch.Generator`` for the initial conditions.
        tol: the adaptive integrator's local error tolerance.
        dtype: the simulation's dtype.

    Returns:
        ``PhaseDiagram``: ``fraction`` and ``sem`` ``[len(betas), len(times)]``.

    Example:
        >>> pd_ = phase_diagram([1.0, 4.0], [0.0, 5.0], n=8, runs=4, generator=torch.Generator().manual_seed(0))
        >>> tuple(pd_.fraction.shape), bool(pd_.fraction[:, 1].ge(pd_.fraction[:, 0]).all())
        ((2, 2), True)
    """
    p = Problems("phase_diagram")
    check_dynamics(p, dynamics)
    check_eps(p, eps)
    try:
        b = torch.as_tensor(betas, dtype=torch.float64).reshape(-1)
    except (TypeError, ValueError):
        b = None
    if b is None or b.numel() == 0 or not bool(torch.isfinite(b).all()) or bool((b < 0).any()):
        p.add(f"betas must be a non-empty sequence of finite numbers >= 0, got {betas!r}")
    for name, v, low in (("n", n, 2), ("d", d, 2), ("runs", runs, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            p.add(f"{name} must be an int >= {low}, got {v!r}")
    b = p.raise_or(b)
    x0 = random_init(runs, n, d, generator, dtype)
    B = b.numel()
    run = simulate(
        x0.repeat(B, 1, 1),
        b.repeat_interleave(runs),
        dynamics=dynamics,
        times=times,
        tol=tol,
        keep_states=False,
        eps=eps,
    )
    frac = run.close_fraction[0].reshape(len(run.times), B, runs).permute(1, 0, 2)
    sem = frac.std(-1, unbiased=True) / runs**0.5 if runs > 1 else torch.zeros_like(frac[..., 0])
    params = PhaseParams(
        dynamics=dynamics,
        n=n,
        d=d,
        runs=runs,
        eps=float(eps),
        tol=tol,
        iterations=run.params.iterations,
        rejected=run.params.rejected,
    )
    return PhaseDiagram(b, run.times, frac.mean(-1), sem, params)
