"""``TrajectoryStats``: dataset-level statistics that add up exactly across batches and runs
(int64 counts and ``ExactSum`` totals: ``a.merge(b)`` equals one run over both, bit for bit).
Its per-point read-outs are in ``_stats_readouts`` (its base class)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd
import torch

from tl_dynamics import viz
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.trajectories._cloud import BIN_EDGES
from tl_dynamics.collect import ExactSum
from tl_dynamics.trajectories._points import Standardizer, in_depth_order
from tl_dynamics.trajectories._stats_readouts import StatsReadouts
from tl_dynamics.trajectories._views import stats_views


@dataclass(frozen=True, eq=False)
class TrajectoryStats(StatsReadouts, viz.Result):
    """Streamed trajectory statistics over many prompts (see ``stream`` and ``attach``).

    ``meta`` records what was computed (architecture, point labels, eps, options); runs merge
    only when it matches. Means are over real tokens (per-token statistics), over prompts
    (cluster counts, events, effective rank) or over token pairs (cosines).

    Attributes:
        meta: what was computed (architecture, labels, eps, options, lens note).
        ints: exact integer counts (histograms, ranks, clusters, events) by name.
        sums: exact float sums (``ExactSum``) by name.

    Example:
        >>> from tl_dynamics import testing, trajectories
        >>> stats = trajectories.compute(testing.tiny_model("gpt2"), "def f(x): return x").stats
        >>> stats.n_prompts, stats.n_tokens, stats.labels
        (1, 8, ('resid_pre0', 'resid_pre1', 'resid_post1'))
    """

    meta: dict[str, Any]
    ints: dict[str, np.ndarray] = field(default_factory=dict)
    sums: dict[str, ExactSum] = field(default_factory=dict)

    def merge(self, other: "TrajectoryStats") -> "TrajectoryStats":
        """The statistics of both runs together, exactly (integer and exact-sum addition).

        Args:
            other: statistics computed with the same settings (an empty run is the identity).

        Returns:
            The merged ``TrajectoryStats``.

        Example:
            >>> from tl_dynamics import testing, trajectories
            >>> m = testing.tiny_model("gpt2")
            >>> a = trajectories.stream(m, ["a = 1", "b = 2"], batch_size=2, progress=False)
            >>> b = trajectories.stream(m, ["c = 3", "d = 4"], batch_size=2, progress=False)
            >>> a.merge(b) == trajectories.stream(m, ["a = 1", "b = 2", "c = 3", "d = 4"],
            ...                                   batch_size=2, progress=False)  # bit for bit
            True
        """
        if not isinstance(other, TrajectoryStats):
            raise TLDynamicsError(f"can only merge TrajectoryStats, got {type(other).__name__}")
        if not self.ints or not other.ints:  # an empty run (no forward pass) is the identity
            mine = {k: v for k, v in self.meta.items() if k != "lens_note"}
            if mine == {k: v for k, v in other.meta.items() if k != "lens_note"}:
                return self if not other.ints else other
        if self.meta != other.meta:
            diff = sorted(
                k for k in set(self.meta) | set(other.meta) if self.meta.get(k) != other.meta.get(k)
            )
            raise TLDynamicsError(
                f"cannot merge statistics computed differently: they differ in "
                f"{diff} ({[self.meta.get(k) for k in diff]} vs "
                f"{[other.meta.get(k) for k in diff]})"
            )
        if set(self.ints) != set(other.ints) or set(self.sums) != set(other.sums):
            raise TLDynamicsError(
                "cannot merge: one run has next-token statistics and the other "
                "does not (pass batch=... to attach, or the same lens option)"
            )
        return replace(
            self,
            ints={k: v + other.ints[k] for k, v in self.ints.items()},
            sums={k: v + other.sums[k] for k, v in self.sums.items()},
        )

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, TrajectoryStats)
            and self.meta == other.meta
            and set(self.ints) == set(other.ints)
            and all(np.array_equal(v, other.ints[k]) for k, v in self.ints.items())
            and self.sums == other.sums
        )

    __hash__ = None  # type: ignore[assignment]

    @property
    def labels(self) -> tuple[str, ...]:
        """The trajectory points' names, e.g. ``("resid_pre0", ..., "resid_post1")``.

        Example:
            >>> from tl_dynamics import testing, trajectories
            >>> stats = trajectories.compute(testing.tiny_model("gpt2"), "def f(x): return x").stats
            >>> stats.labels
            ('resid_pre0', 'resid_pre1', 'resid_post1')
        """
        return tuple(self.meta["labels"])

    @property
    def eps(self) -> tuple[float, ...]:
        """The cluster thresholds computed (link tokens with ``cos > 1 - eps``).

        Example:
            >>> from tl_dynamics import testing, trajectories
            >>> stats = trajectories.compute(testing.tiny_model("gpt2"), "def f(x): return x").stats
            >>> stats.eps
            (0.01, 0.05, 0.1, 0.25)
        """
        return tuple(self.meta["eps"])

    @property
    def n_prompts(self) -> int:
        """Number of prompts seen.

        Example:
            >>> from tl_dynamics import testing, trajectories
            >>> stats = trajectories.compute(testing.tiny_model("gpt2"), "def f(x): return x").stats
            >>> stats.n_prompts
            1
        """
        return int(self.ints.get("n_prompts", 0))

    @property
    def n_tokens(self) -> int:
        """Number of real (non-padding) tokens seen.

        Example:
            >>> from tl_dynamics import testing, trajectories
            >>> stats = trajectories.compute(testing.tiny_model("gpt2"), "def f(x): return x").stats
            >>> stats.n_tokens
            8
        """
        return int(self.ints.get("n_tokens", 0))

    @property
    def has_lens(self) -> bool:
        """Whether the next-token (logit-lens) statistics were computed.

        Example:
            >>> from tl_dynamics import testing, trajectories
            >>> stats = trajectories.compute(testing.tiny_model("gpt2"), "def f(x): return x",
            ...                               lens="full").stats
            >>> stats.has_lens
            True
        """
        return "rank_sum" in self.ints

    def __repr__(self) -> str:
        return (
            f"TrajectoryStats({self.meta['architecture']}, prompts={self.n_prompts}, "
            f"tokens={self.n_tokens}, points={len(self.labels)}, lens={self.has_lens})"
        )

    def standardizer(self) -> Standardizer:
        """Dataset per-dimension mean and std per point, for a second, standardised pass.

        Returns:
            A ``Standardizer`` (``mean``, ``std``: ``[point, d_model]``) for ``standardize=``.

        Example:
            >>> from tl_dynamics import testing, trajectories
            >>> stats = trajectories.compute(testing.tiny_model("gpt2"), "def f(x): return x").stats
            >>> stats.standardizer().mean.shape
            torch.Size([3, 64])
        """
        n = max(self.n_tokens, 1)
        mean = self.sums["state_sum"].value() / n
        var = np.maximum(self.sums["state_sumsq"].value() / n - mean**2, 0.0)
        return Standardizer(
            torch.tensor(mean, dtype=torch.float32), torch.tensor(np.sqrt(var), dtype=torch.float32)
        )

    def to_dataframe(self) -> pd.DataFrame:
        """One row per trajectory point with every mean statistic.

        Returns:
            A pandas DataFrame indexed by point (an ordered categorical in depth order; means;
            clusters and merges per ``eps``; lens).

        Example:
            >>> from tl_dynamics import testing, trajectories
            >>> stats = trajectories.compute(testing.tiny_model("gpt2"), "def f(x): return x",
            ...                               lens="full").stats
            >>> stats.to_dataframe().shape
            (3, 23)
        """
        labels = list(self.labels)
        n = len(labels)

        def shifted(values: np.ndarray, offset: int) -> list[float]:
            return [np.nan] * offset + list(values)

        data: dict[str, Any] = {
            "point": in_depth_order(labels, labels),
            "mean_norm": self.mean("norm"),
            "mean_step": shifted(self.mean("step"), 1),
            "mean_rel_step": shifted(self.mean("rel_step"), 1),
            "mean_turning_deg": shifted(self.mean("turning"), 2) if n > 2 else [np.nan] * n,
            "mean_cos_final": self.mean("cos_final"),
            "mean_pairwise_cos": self.mean_pairwise_cos(),
            "effective_rank": self.effective_rank(),
        }
        for eps in self.eps:
            data[f"clusters_eps{eps:g}"] = self.cluster_counts(eps)
            data[f"merges_eps{eps:g}"] = shifted(self.mean_merges(eps), 1)
        if self.has_lens:
            data["mean_rank"] = self.mean_rank()
            data["mean_log1p_rank"] = self.mean("log_rank")
            data["top1_rate"] = self.top1_rate()
            for name in ("cos_embed", "cos_unembed", "dist_embed", "dist_unembed"):
                data[f"mean_{name}"] = self.mean(name)
            data["settling_count"] = self.settling_histogram()[:n]
        return pd.DataFrame(data).set_index("point")

    def show(self) -> viz.Group:
        """Per-point plots (pairwise-cosine histograms, cluster counts) and the table of means.

        Returns:
            A ``viz.Group``.

        Example:
            >>> from tl_dynamics import testing, trajectories
            >>> stats = trajectories.compute(testing.tiny_model("gpt2"), "def f(x): return x").stats
            >>> type(stats.show()).__name__
            'Group'
        """
        return stats_views(
            labels=self.labels,
            bin_edges=BIN_EDGES.numpy(),
            density=self.cos_histogram(),
            clusters={eps: self.cluster_counts(eps) for eps in self.eps},
            frame=self.to_dataframe(),
            caption=(
                f"{self.meta['architecture']}: {self.n_prompts} prompts, {self.n_tokens} "
                f"tokens; standardize={self.meta['standardize']}"
            ),
            lens_note=None if self.has_lens else self.meta.get("lens_note", ""),
        )
