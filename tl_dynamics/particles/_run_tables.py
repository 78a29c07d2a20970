"""``ParticleRun``'s observables as pandas tables: merge events, plateaus of the cluster count
and the per-(time, run) frame (a base class of ``ParticleRun``, which holds the fields these
read)."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from tl_dynamics import sphere, viz


class RunTables(viz.Result):
    """Merge events, plateaus and the observables' DataFrame of a ``ParticleRun`` (its base
    class)."""

    if TYPE_CHECKING:  # fields and methods of ParticleRun
        times: Float[Tensor, " T"]
        mean_cosine: Float[Tensor, "T runs"]

        def _eps(self, eps: float | None, where: str) -> float: ...
        def labels_at(self, eps: float | None = None) -> Int[Tensor, "T runs n"]: ...
        def cluster_counts(self, eps: float | None = None) -> Int[Tensor, "T runs"]: ...
        def close_fractions(self, eps: float | None = None) -> Float[Tensor, "T runs"]: ...

    def merge_events(self, eps: float | None = None) -> pd.DataFrame:
        """Records at which a run's cluster count changes.

        Args:
            eps: the threshold (default: the first recorded).

        Returns:
            A pandas DataFrame: ``run``, ``time`` (first record with the new count), ``before``,
            ``after``, ``merged = before - after`` (> 1: several merges between two records;
            < 0: a split, only when a pair sits at the threshold), and the ``merges`` and
            ``splits`` behind it (``sphere.merge_events``; ``merged = merges - splits``).

        Example:
            >>> import torch
            >>> from tl_dynamics.particles import random_init, simulate
            >>> run = simulate(random_init(3, 8, 2, torch.Generator().manual_seed(0)), beta=1.0, t_max=20.0)
            >>> events = run.merge_events()
            >>> bool((events["merged"] == events["merges"] - events["splits"]).all())
            True
        """
        labels = self.labels_at(eps)
        counts = sphere.count_clusters(labels)
        events = sphere.merge_events(labels[:-1], labels[1:])
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
        df["merges"] = events.merges[k, r].numpy()
        df["splits"] = events.splits[k, r].numpy()
        return df.sort_values(["run", "time"], kind="stable").reset_index(drop=True)

    def plateaus(self, eps: float | None = None) -> pd.DataFrame:
        """Maximal time intervals with a constant cluster count, per run.

        Args:
            eps: the threshold (default: the first recorded).

        Returns:
            A pandas DataFrame: ``run``, ``n_clusters``, ``start``/``end`` (first/last record with
            that count), ``length`` and ``open`` (lasts to the last record: a lower bound).

        Example:
            >>> import torch
            >>> from tl_dynamics.particles import random_init, simulate
            >>> run = simulate(random_init(3, 8, 2, torch.Generator().manual_seed(0)), beta=1.0, t_max=20.0)
            >>> last = run.plateaus().groupby("run").tail(1)
            >>> last["n_clusters"].tolist(), last["open"].tolist()
            ([1, 1, 1], [True, True, True])
        """
        counts = self.cluster_counts(eps).numpy()
        times = self.times.numpy()
        rows = []
        for r in range(counts.shape[1]):
            c = counts[:, r]
            starts = [0] + [k for k in range(1, len(c)) if c[k] != c[k - 1]]
            for a, b in zip(starts, starts[1:] + [len(c)]):
                rows.append(
                    (r, int(c[a]), times[a], times[b - 1], times[b - 1] - times[a], b == len(c))
                )
        return pd.DataFrame(rows, columns=["run", "n_clusters", "start", "end", "length", "open"])

    def to_dataframe(self, eps: float | None = None, aggregate: bool = False) -> pd.DataFrame:
        """Per-(time, run) observables; ``aggregate=True`` averages over runs per time.

        Args:
            eps: the threshold (default: the first recorded).
            aggregate: average over runs per record time.

        Returns:
            A pandas DataFrame with columns ``time``, ``run``, ``mean_cosine``,
            ``close_fraction``, ``n_clusters`` (aggregated: ``time``, the three means and
            ``n_clusters_min/max``).

        Example:
            >>> import torch
            >>> from tl_dynamics.particles import random_init, simulate
            >>> run = simulate(random_init(3, 8, 2, torch.Generator().manual_seed(0)), beta=1.0, t_max=20.0)
            >>> run.to_dataframe().shape, run.to_dataframe(aggregate=True).shape  # 101 records
            ((303, 5), (101, 6))
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
        out = cast(
            pd.DataFrame, g[["mean_cosine", "close_fraction", "n_clusters"]].mean()
        ).reset_index()
        out["n_clusters_min"] = np.asarray(g["n_clusters"].min())  # a Series: one per time
        out["n_clusters_max"] = np.asarray(g["n_clusters"].max())
        out.attrs["eps"] = e
        return out
