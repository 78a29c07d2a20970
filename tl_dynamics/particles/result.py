"""``ParticleRun``: what :func:`~.simulate.simulate` returns, and its observables over time."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import pandas as pd
import torch
from torch import Tensor

from tl_dynamics.errors import TLDynamicsError

from ._checks import Problems, check_eps
from .observables import close_fraction_from_gram, cluster_labels_from_gram, count_from_labels, gram

#: Record times in memory at once when observables are recomputed from kept states.
_CHUNK = 64


@dataclass(frozen=True)
class ParticleRun:
    """Trajectories of ``runs`` independent particle systems at the record ``times``.

    Attributes:
        times: ``[T]`` record times (float64).
        states: ``[T, runs, n, d]`` positions, or ``None`` when ``keep_states=False``.
        eps: thresholds whose observables were recorded during the simulation.
        mean_cosine: ``[T, runs]`` mean ``<x_i, x_j>`` over pairs ``i < j``.
        close_fraction: ``[len(eps), T, runs]`` fraction of eps-close pairs.
        labels: ``[len(eps), T, runs, n]`` cluster labels (smallest index per cluster).
        params: how the run was made (dynamics, beta, n, d, integrator, steps, source ...).

    Observables at another eps are recomputed from ``states`` when they were kept.

    >>> from tl_dynamics.particles import simulate, random_init
    >>> run = simulate(random_init(3, 8, 2, torch.Generator().manual_seed(0)), beta=1.0, t_max=20.0)
    >>> run.cluster_counts()[-1].tolist()      # one cluster per run at t = 20
    [1, 1, 1]
    """

    times: Tensor
    states: Optional[Tensor]
    eps: tuple[float, ...]
    mean_cosine: Tensor
    close_fraction: Tensor
    labels: Tensor
    params: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ shape
    @property
    def n_runs(self) -> int:
        return int(self.mean_cosine.shape[1])

    @property
    def n(self) -> int:
        return int(self.labels.shape[-1])

    @property
    def d(self) -> int:
        return int(self.params.get("d", -1))

    def __repr__(self) -> str:
        kept = "states kept" if self.states is not None else "observables only"
        p = self.params
        return (
            f"ParticleRun({p.get('dynamics')}, beta={p.get('beta')}, runs={self.n_runs}, n={self.n}, d={self.d}, "
            f"t in [{float(self.times[0]):g}, {float(self.times[-1]):g}] ({len(self.times)} records), {kept})"
        )

    # ------------------------------------------------------------ observables
    def _eps(self, eps: Optional[float], where: str) -> float:
        if eps is None:
            return self.eps[0]
        p = Problems(f"ParticleRun.{where}")
        (e,) = check_eps(p, eps) or (None,)
        p.raise_if_any()
        if e not in self.eps and self.states is None:
            raise TLDynamicsError(
                f"ParticleRun.{where}: eps={e:g} was not recorded and states were not kept; "
                f"recorded eps: {list(self.eps)} (simulate with eps=[...] or keep_states=True)"
            )
        return e

    def labels_at(self, eps: Optional[float] = None) -> Tensor:
        """Cluster labels ``[T, runs, n]`` at threshold ``eps`` (default: the first recorded)."""
        e = self._eps(eps, "labels_at")
        if e in self.eps:
            return self.labels[self.eps.index(e)].to(torch.int64)
        out = [cluster_labels_from_gram(gram(self.states[i : i + _CHUNK]), e) for i in range(0, len(self.times), _CHUNK)]
        return torch.cat(out)

    def cluster_counts(self, eps: Optional[float] = None) -> Tensor:
        """Number of eps-clusters, ``[T, runs]``."""
        return count_from_labels(self.labels_at(eps))

    def close_fractions(self, eps: Optional[float] = None) -> Tensor:
        """Fraction of eps-close pairs, ``[T, runs]``."""
        e = self._eps(eps, "close_fractions")
        if e in self.eps:
            return self.close_fraction[self.eps.index(e)]
        out = [close_fraction_from_gram(gram(self.states[i : i + _CHUNK]), e) for i in range(0, len(self.times), _CHUNK)]
        return torch.cat(out)

    def time_to_clustering(self, eps: Optional[float] = None) -> Tensor:
        """First record time at which *all* pairs are eps-close, per run (``inf`` if never): ``[runs]``.

        Resolution is the record spacing: the true time lies in ``(previous record, returned]``.
        """
        done = self.close_fractions(eps) >= 1.0
        first = torch.where(done.any(0), done.to(torch.int64).argmax(0), torch.full((self.n_runs,), -1))
        return torch.where(first >= 0, self.times[first.clamp_min(0)], torch.full((self.n_runs,), math.inf, dtype=torch.float64))

    def merge_events(self, eps: Optional[float] = None) -> pd.DataFrame:
        """Records at which a run's cluster count changes.

        Columns: ``run``, ``time`` (first record showing the new count), ``before``,
        ``after``, ``merged`` (``before - after``; > 1 when several merges fall between
        two records, < 0 for a split, which happens only when a pair sits at the threshold).
        """
        counts = self.cluster_counts(eps)
        change = counts[1:] != counts[:-1]
        k, r = torch.nonzero(change, as_tuple=True)
        df = pd.DataFrame(
            {
                "run": r.numpy(),
                "time": self.times[k + 1].numpy(),
                "before": counts[k, r].numpy(),
                "after": counts[k + 1, r].numpy(),
            }
        )
        df["merged"] = df["before"] - df["after"]
        return df.sort_values(["run", "time"], kind="stable").reset_index(drop=True)

    def plateaus(self, eps: Optional[float] = None) -> pd.DataFrame:
        """Maximal time intervals with a constant cluster count, per run.

        Columns: ``run``, ``n_clusters``, ``start``, ``end``, ``length`` and ``open``
        (True when the plateau lasts to the last record, so its length is a lower bound).
        ``start``/``end`` are the first/last record with that count.
        """
        counts = self.cluster_counts(eps).numpy()
        times = self.times.numpy()
        rows = []
        for r in range(counts.shape[1]):
            c = counts[:, r]
            starts = [0] + [k for k in range(1, len(c)) if c[k] != c[k - 1]]
            for a, b in zip(starts, starts[1:] + [len(c)]):
                rows.append((r, int(c[a]), times[a], times[b - 1], times[b - 1] - times[a], b == len(c)))
        return pd.DataFrame(rows, columns=["run", "n_clusters", "start", "end", "length", "open"])

    def to_dataframe(self, eps: Optional[float] = None, aggregate: bool = False) -> pd.DataFrame:
        """Per-(time, run) observables; ``aggregate=True`` averages over runs per time.

        Columns: ``time``, ``run``, ``mean_cosine``, ``close_fraction``, ``n_clusters``
        (aggregated: ``time``, the three means and ``n_clusters_min/max``).
        """
        e = self._eps(eps, "to_dataframe")
        T, R = self.mean_cosine.shape
        df = pd.DataFrame(
            {
                "time": self.times.repeat_interleave(R).numpy(),
                "run": torch.arange(R).repeat(T).numpy(),
                "mean_cosine": self.mean_cosine.reshape(-1).numpy(),
                "close_fraction": self.close_fractions(e).reshape(-1).numpy(),
                "n_clusters": self.cluster_counts(e).reshape(-1).numpy(),
            }
        )
        df.attrs["eps"] = e
        if not aggregate:
            return df
        g = df.groupby("time", sort=True)
        out = g[["mean_cosine", "close_fraction", "n_clusters"]].mean().reset_index()
        out["n_clusters_min"] = g["n_clusters"].min().to_numpy()
        out["n_clusters_max"] = g["n_clusters"].max().to_numpy()
        out.attrs["eps"] = e
        return out

    # ------------------------------------------------------------------ views
    def show(self, eps: Optional[float] = None, run: int = 0):
        """A notebook-displayable figure: the trajectories of ``run`` (d = 2, 3) and cluster counts."""
        from .views import run_figure

        return run_figure(self, eps=eps, run=run)
