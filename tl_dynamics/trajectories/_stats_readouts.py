"""``TrajectoryStats``'s read-outs: the per-point means, lens rates, histograms, cluster counts
and merges that its exact counts and sums give (a base class of ``TrajectoryStats``, which holds
the fields these read)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.trajectories._cloud import N_BINS

if TYPE_CHECKING:
    from tl_dynamics.collect import ExactSum

# per-token float statistics, and the next-token (lens) ones
_TOKEN_FLOATS = ("norm", "step", "rel_step", "turning", "cos_final")
_LENS_FLOATS = ("cos_embed", "dist_embed", "cos_unembed", "dist_unembed")


class StatsReadouts:
    """Per-point means and counts of a ``TrajectoryStats`` (its base class)."""

    if TYPE_CHECKING:  # fields and properties of TrajectoryStats
        meta: dict[str, Any]
        ints: dict[str, np.ndarray]
        sums: dict[str, ExactSum]
        eps: tuple[float, ...]
        n_prompts: int
        has_lens: bool

    def _mean(self, name: str, count: int | np.ndarray) -> np.ndarray:
        return self.sums[name].value() / np.maximum(count, 1)

    def mean(self, name: str) -> np.ndarray:
        """Mean over real tokens of a per-token statistic, per point.

        Args:
            name: ``norm``, ``step``, ``rel_step``, ``turning``, ``cos_final``, or with the lens
                ``cos_embed``, ``dist_embed``, ``cos_unembed``, ``dist_unembed``, ``log_rank``.

        Returns:
            ``[point]`` means (``[point - 1]`` for steps, ``[point - 2]`` for turning).

        Example:
            >>> from tl_dynamics import testing, trajectories
            >>> stats = trajectories.compute(testing.tiny_model("gpt2"), "def f(x): return x").stats
            >>> stats.mean("norm").shape, stats.mean("step").shape
            ((3,), (2,))
        """
        if name in _TOKEN_FLOATS:
            return self._mean(name, self.ints[f"count_{name}"])
        if name in _LENS_FLOATS:
            self._need_lens(name)
            return self._mean(name, self.ints[f"count_{name}"])
        if name == "log_rank":
            self._need_lens(name)
            return self._mean(name, int(self.ints["n_lens_tokens"]))
        raise TLDynamicsError(
            f"unknown statistic {name!r}; valid: "
            f"{list(_TOKEN_FLOATS + _LENS_FLOATS + ('log_rank',))}"
        )

    def _need_lens(self, what: str) -> None:
        if not self.has_lens:
            raise TLDynamicsError(
                f"{what} needs the next-token statistics, which this run does "
                f"not have: {self.meta.get('lens_note') or 'lens off'}"
            )

    def mean_rank(self) -> np.ndarray:
        """Mean logit-lens rank of the true next token per point (0 = always top-1).

        Returns:
            ``[point]`` mean ranks (needs the lens).

        Example:
            >>> from tl_dynamics import testing, trajectories
            >>> stats = trajectories.compute(testing.tiny_model("gpt2"), "def f(x): return x",
            ...                               lens="full").stats
            >>> stats.mean_rank().shape
            (3,)
        """
        self._need_lens("mean_rank")
        return self.ints["rank_sum"] / max(int(self.ints["n_lens_tokens"]), 1)

    def top1_rate(self) -> np.ndarray:
        """Share of tokens whose true next token is the logit lens's top-1, per point.

        Returns:
            ``[point]`` rates in ``[0, 1]`` (needs the lens).

        Example:
            >>> from tl_dynamics import testing, trajectories
            >>> stats = trajectories.compute(testing.tiny_model("gpt2"), "def f(x): return x",
            ...                               lens="full").stats
            >>> stats.top1_rate().shape
            (3,)
        """
        self._need_lens("top1_rate")
        return self.ints["top1"] / max(int(self.ints["n_lens_tokens"]), 1)

    def settling_histogram(self) -> np.ndarray:
        """Counts of tokens by settling point; the last bin counts tokens that never settle.

        Returns:
            ``[point + 1]`` int64 counts (needs the lens).

        Example:
            >>> from tl_dynamics import testing, trajectories
            >>> stats = trajectories.compute(testing.tiny_model("gpt2"), "def f(x): return x",
            ...                               lens="full").stats
            >>> int(stats.settling_histogram().sum()) == stats.n_tokens - 1  # the last has no next
            True
        """
        self._need_lens("settling_histogram")
        return self.ints["settling"].copy()

    def cos_histogram(self, density: bool = True) -> np.ndarray:
        """Pairwise-cosine histogram per point on the fixed bins ``BIN_EDGES`` (40 bins on [-1, 1]).

        Args:
            density: normalise each point's counts to a density (else raw counts).

        Returns:
            ``[point, N_BINS]`` array.

        Example:
            >>> from tl_dynamics import testing, trajectories
            >>> stats = trajectories.compute(testing.tiny_model("gpt2"), "def f(x): return x").stats
            >>> stats.cos_histogram().shape
            (3, 40)
        """
        h = self.ints["cos_hist"]
        if not density:
            return h.copy()
        return h / np.maximum(h.sum(1, keepdims=True), 1) / (2.0 / N_BINS)

    def mean_pairwise_cos(self) -> np.ndarray:
        """Mean cosine over token pairs of a prompt, per point.

        Returns:
            ``[point]`` mean cosines.

        Example:
            >>> from tl_dynamics import testing, trajectories
            >>> stats = trajectories.compute(testing.tiny_model("gpt2"), "def f(x): return x").stats
            >>> stats.mean_pairwise_cos().shape
            (3,)
        """
        return self.sums["cos_sum"].value() / np.maximum(self.ints["n_pairs"], 1)

    def effective_rank(self) -> np.ndarray:
        """Mean effective rank of the prompts' token clouds, per point.

        Returns:
            ``[point]`` mean effective ranks.

        Example:
            >>> from tl_dynamics import testing, trajectories
            >>> stats = trajectories.compute(testing.tiny_model("gpt2"), "def f(x): return x").stats
            >>> stats.effective_rank().shape
            (3,)
        """
        return self.sums["erank"].value() / max(self.n_prompts, 1)

    def _eps_index(self, eps: float) -> int:
        for i, e in enumerate(self.eps):
            if abs(e - eps) < 1e-12:
                return i
        raise TLDynamicsError(
            f"eps={eps!r} was not computed; valid: {list(self.eps)} (pass eps=... when streaming)"
        )

    def cluster_counts(self, eps: float) -> np.ndarray:
        """Mean number of clusters per prompt at each point, threshold ``cos > 1 - eps``.

        Args:
            eps: one of the computed thresholds (``eps``).

        Returns:
            ``[point]`` mean cluster counts (index ``p`` is depth ``p`` when not flattened).

        Example:
            >>> from tl_dynamics import testing, trajectories
            >>> stats = trajectories.compute(testing.tiny_model("gpt2"), "def f(x): return x").stats
            >>> stats.cluster_counts(0.01).shape
            (3,)
        """
        return self.ints["clusters"][self._eps_index(eps)] / max(self.n_prompts, 1)

    def mean_merges(self, eps: float) -> np.ndarray:
        """Mean merge events per prompt between consecutive points (``sphere.merge_events``).

        Args:
            eps: one of the computed thresholds (``eps``).

        Returns:
            ``[point - 1]`` means (a cluster gathering ``k`` of the point before counts ``k - 1``).

        Example:
            >>> from tl_dynamics import testing, trajectories
            >>> stats = trajectories.compute(testing.tiny_model("gpt2"), "def f(x): return x").stats
            >>> stats.mean_merges(0.01).shape
            (2,)
        """
        return self.ints["merges"][self._eps_index(eps)] / max(self.n_prompts, 1)
