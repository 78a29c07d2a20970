"""``ParticleRun``: what ``simulate`` returns, and its observables over time (their pandas tables
in ``_run_tables``, its base class); ``RunParams``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from jaxtyping import Float, Int
from torch import Tensor

from tl_dynamics import sphere, viz
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.particles._checks import Problems, check_eps
from tl_dynamics.particles._run_tables import RunTables
from tl_dynamics.particles._seeding import HeadSource
from tl_dynamics.particles._views import run_figure

_CHUNK = 64  # record times in memory at once when observables are recomputed from states


@dataclass(frozen=True)
class RunParams:
    """How a run was made: the dynamics, ``beta`` (one number, or one per run), sizes, whether
    ``Q, K, V`` are the identity, the integrator (``dt`` fixed or ``tol`` adaptive), its step
    counts, and where the parameters came from (``source``, for head-seeded runs)."""

    dynamics: str
    beta: float | list[float]
    runs: int
    n: int
    d: int
    qkv: str = "identity"
    causal: bool = False
    method: str = "cf4"
    dt: float | None = None
    tol: float | None = None
    dtype: str = "float64"
    iterations: int = 0
    rejected: int = 0
    source: HeadSource | None = None

    @property
    def beta_str(self) -> str:
        """``beta`` for captions: one number, or the range over runs."""
        if isinstance(self.beta, list):
            lo, hi = min(self.beta), max(self.beta)
            return f"{lo:g}..{hi:g}" if lo != hi else f"{lo:g}"
        return f"{self.beta:g}"


@dataclass(frozen=True)
class ParticleRun(RunTables):
    """Trajectories of ``runs`` independent particle systems at the record ``times``.

    Attributes:
        times: ``[T]`` record times (float64).
        states: ``[T, runs, n, d]`` positions, or ``None`` when ``keep_states=False``.
        eps: thresholds whose observables were recorded during the simulation.
        mean_cosine: ``[T, runs]`` mean ``<x_i, x_j>`` over pairs ``i < j``.
        close_fraction: ``[len(eps), T, runs]`` fraction of eps-close pairs.
        labels: ``[len(eps), T, runs, n]`` cluster labels (smallest index per cluster).
        params: how the run was made (``RunParams``).

    Observables at another eps are recomputed from ``states`` when they were kept.

    >>> from tl_dynamics.particles import simulate, random_init
    >>> run = simulate(random_init(3, 8, 2, torch.Generator().manual_seed(0)), beta=1.0, t_max=20.0)
    >>> run.cluster_counts()[-1].tolist()      # one cluster per run at t = 20
    [1, 1, 1]
    """

    times: Float[Tensor, " T"]
    states: Float[Tensor, "T runs n d"] | None
    eps: tuple[float, ...]
    mean_cosine: Float[Tensor, "T runs"]
    close_fraction: Float[Tensor, "E T runs"]
    labels: Int[Tensor, "E T runs n"]
    params: RunParams

    # ------------------------------------------------------------------ shape
    @property
    def n_runs(self) -> int:
        """Number of independent particle systems simulated together.

        Example:
            >>> import torch
            >>> from tl_dynamics.particles import random_init, simulate
            >>> run = simulate(random_init(3, 8, 2, torch.Generator().manual_seed(0)), beta=1.0, t_max=20.0)
            >>> run.n_runs
            3
        """
        return int(self.mean_cosine.shape[1])

    @property
    def n(self) -> int:
        """Number of particles per run.

        Example:
            >>> import torch
            >>> from tl_dynamics.particles import random_init, simulate
            >>> run = simulate(random_init(3, 8, 2, torch.Generator().manual_seed(0)), beta=1.0, t_max=20.0)
            >>> run.n
            8
        """
        return int(self.labels.shape[-1])

    @property
    def d(self) -> int:
        """Dimension of the space the particles live in (on ``S^{d-1}``).

        Example:
            >>> import torch
            >>> from tl_dynamics.particles import random_init, simulate
            >>> run = simulate(random_init(3, 8, 2, torch.Generator().manual_seed(0)), beta=1.0, t_max=20.0)
            >>> run.d
            2
        """
        return self.params.d

    def __repr__(self) -> str:
        kept = "states kept" if self.states is not None else "observables only"
        p = self.params
        return (
            f"ParticleRun({p.dynamics}, beta={p.beta}, runs={self.n_runs}, n={self.n}, d={self.d}, "
            f"t in [{float(self.times[0]):g}, {float(self.times[-1]):g}] ({len(self.times)} records), {kept})"
        )

    # ------------------------------------------------------------ observables
    def _eps(self, eps: float | None, where: str) -> float:
        if eps is None:
            return self.eps[0]
        p = Problems(f"ParticleRun.{where}")
        checked = check_eps(p, eps)
        p.raise_if_any()
        (e,) = checked
        if e not in self.eps and self.states is None:
            raise TLDynamicsError(
                f"ParticleRun.{where}: eps={e:g} was not recorded and states were not kept; "
                f"recorded eps: {list(self.eps)} (simulate with eps=[...] or keep_states=True)"
            )
        return e

    def _kept_states(self, where: str) -> Float[Tensor, "T runs n d"]:
        if self.states is None:  # _eps refused this already; the check narrows the type
            raise TLDynamicsError(f"ParticleRun.{where}: states were not kept (keep_states=True)")
        return self.states

    def labels_at(self, eps: float | None = None) -> Int[Tensor, "T runs n"]:
        """Cluster labels ``[T, runs, n]`` at threshold ``eps`` (default: the first recorded).

        Args:
            eps: a threshold recorded during the simulation, or any when states were kept.

        Returns:
            ``[T, runs, n]`` int64 labels (the smallest particle index of each cluster).

        Example:
            >>> import torch
            >>> from tl_dynamics.particles import random_init, simulate
            >>> run = simulate(random_init(3, 8, 2, torch.Generator().manual_seed(0)), beta=1.0, t_max=20.0)
            >>> run.labels_at()[-1].tolist()[0]  # one cluster at t = 20
            [0, 0, 0, 0, 0, 0, 0, 0]
        """
        e = self._eps(eps, "labels_at")
        if e in self.eps:
            return self.labels[self.eps.index(e)].to(torch.int64)
        states = self._kept_states("labels_at")
        out = [
            sphere.cluster_labels(sphere.gram(states[i : i + _CHUNK]), e)
            for i in range(0, len(self.times), _CHUNK)
        ]
        return torch.cat(out)

    def cluster_counts(self, eps: float | None = None) -> Int[Tensor, "T runs"]:
        """Number of eps-clusters, ``[T, runs]``.

        Args:
            eps: the threshold (default: the first recorded).

        Returns:
            ``[T, runs]`` int64 counts.

        Example:
            >>> import torch
            >>> from tl_dynamics.particles import random_init, simulate
            >>> run = simulate(random_init(3, 8, 2, torch.Generator().manual_seed(0)), beta=1.0, t_max=20.0)
            >>> run.cluster_counts()[-1].tolist()      # one cluster per run at t = 20
            [1, 1, 1]
        """
        return sphere.count_clusters(self.labels_at(eps))

    def close_fractions(self, eps: float | None = None) -> Float[Tensor, "T runs"]:
        """Fraction of eps-close pairs, ``[T, runs]``.

        Args:
            eps: the threshold (default: the first recorded).

        Returns:
            ``[T, runs]`` fractions in ``[0, 1]``.

        Example:
            >>> import torch
            >>> from tl_dynamics.particles import random_init, simulate
            >>> run = simulate(random_init(3, 8, 2, torch.Generator().manual_seed(0)), beta=1.0, t_max=20.0)
            >>> run.close_fractions()[-1].tolist()
            [1.0, 1.0, 1.0]
        """
        e = self._eps(eps, "close_fractions")
        if e in self.eps:
            return self.close_fraction[self.eps.index(e)]
        states = self._kept_states("close_fractions")
        out = [
            sphere.close_fraction(sphere.gram(states[i : i + _CHUNK]), e)
            for i in range(0, len(self.times), _CHUNK)
        ]
        return torch.cat(out)

    def time_to_clustering(self, eps: float | None = None) -> Float[Tensor, " runs"]:
        """First record time at which *all* pairs are eps-close, per run (``inf`` if never).

        Args:
            eps: the threshold (default: the first recorded).

        Returns:
            ``[runs]`` times (float64); the true time lies in ``(previous record, returned]``.

        Example:
            >>> import torch
            >>> from tl_dynamics.particles import random_init, simulate
            >>> run = simulate(random_init(3, 8, 2, torch.Generator().manual_seed(0)), beta=1.0, t_max=20.0)
            >>> [round(t, 1) for t in run.time_to_clustering().tolist()]
            [5.6, 7.2, 5.8]
        """
        done = self.close_fractions(eps) >= 1.0
        first = torch.where(
            done.any(0), done.to(torch.int64).argmax(0), torch.full((self.n_runs,), -1)
        )
        return torch.where(
            first >= 0,
            self.times[first.clamp_min(0)],
            torch.full((self.n_runs,), math.inf, dtype=torch.float64),
        )

    # ------------------------------------------------------------------ views
    def caption(self, eps: float | None = None) -> str:
        """One line: dynamics, where ``Q, K, V`` came from, sizes, and the cluster counts.

        Args:
            eps: the threshold (default: the first recorded).

        Returns:
            The caption text.

        Example:
            >>> import torch
            >>> from tl_dynamics.particles import random_init, simulate
            >>> run = simulate(random_init(3, 8, 2, torch.Generator().manual_seed(0)), beta=1.0, t_max=20.0)
            >>> run.caption()
            '(SA) Q=K=V=I, beta=1, n=8, d=2, 3 runs, t in [0, 20]; eps=0.01 clusters (median over runs): 6 -> 1'
        """
        e = self._eps(eps, "caption")
        p = self.params
        qkv = "Q=K=V=I" if p.qkv == "identity" else "custom Q, K, V"
        if p.source is not None:
            qkv = f"Q, K, V from {p.source.model} {p.source.name}"
        counts = self.cluster_counts(e)
        c0, c1 = np.median(counts[0].numpy()), np.median(counts[-1].numpy())
        return (
            f"({p.dynamics}) {qkv}, beta={p.beta_str}, n={self.n}, d={self.d}, "
            f"{self.n_runs} runs, t in [{float(self.times[0]):g}, {float(self.times[-1]):g}]; "
            f"eps={e:g} clusters (median over runs): {c0:g} -> {c1:g}"
        )

    def show(self, eps: float | None = None, run: int = 0) -> viz.Component:
        """Draw one run's trajectories beside the cluster counts of every run.

        d = 2: on the circle, d = 3: on the sphere (with kept states); else the mean cosine.

        Args:
            eps: the threshold (default: the first recorded).
            run: which run's trajectories to draw.

        Returns:
            A ``viz.Component`` (a figure).

        Example:
            >>> import torch
            >>> from tl_dynamics.particles import random_init, simulate
            >>> run = simulate(random_init(3, 8, 2, torch.Generator().manual_seed(0)), beta=1.0, t_max=20.0)
            >>> type(run.show()).__name__
            'Component'
        """
        e = self._eps(eps, "show")
        if not 0 <= run < self.n_runs:
            raise TLDynamicsError(f"ParticleRun.show: run must be in [0, {self.n_runs}), got {run}")
        states = None
        if self.states is not None and self.d in (2, 3):
            states = self.states[:, run].numpy()
        return run_figure(
            times=self.times.numpy(),
            states=states,
            final_labels=self.labels_at(e)[-1, run].numpy(),
            run=run,
            counts=self.cluster_counts(e).numpy().astype(float),
            mean_cosine=self.mean_cosine.numpy(),
            eps=e,
            caption=self.caption(e),
        )
