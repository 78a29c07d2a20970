"""``HeadStats``: per-head aggregates of the odds-ratio split (streamed), its labels."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import pandas as pd

from tl_dynamics import viz
from tl_dynamics.collect import ExactSum
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.odds_ratio import _views
from tl_dynamics.odds_ratio._headtable import head_records
from tl_dynamics.odds_ratio._boot import Replicates
from tl_dynamics.odds_ratio._labels import KEEP, LABEL_THRESHOLD, SHARP
from tl_dynamics.odds_ratio._verdicts import LabelEvidence, label_evidence
from tl_dynamics.odds_ratio._sinkeps import SINK_SUM_KEYS, check_sink_keys, sink_epsilon_summary
from tl_dynamics.odds_ratio._stats import BOOT_KEYS, SINK_DOMINANCE, SINK_EPSILON, SUM_KEYS


@dataclass(frozen=True)
class HeadStats(viz.Result):
    """Per-head aggregates of the odds-ratio split over every prompt seen.

    ``sums[name]`` and ``sink_sums[name]`` are ``[len(layers), len(heads)]`` float64 arrays of
    running sums (see ``HeadStats.SUM_KEYS``); the properties divide them out. Row statistics use
    valid query rows with at least two allowed keys, and so do the sink statistics
    (``sink_first_share`` also needs the sink to dominate: docs/math.md §2.3); the variance
    split is of the pre-cap score ``r = c<q,k> + p`` (``softcapped``: layers that soft-cap).

    Two decompositions of the row-centred variance ``Var(r)`` are given, because the key
    prior and the log-likelihood are strongly anti-correlated along a row:
    ``var_*`` + ``cov_prior_loglik`` + ``cov_bias`` (the covariance terms shown) add to one;
    the additive attribution ``attr_* = Cov(term, r) / Var(r)`` also adds to one, term by
    term, and is what ``label`` uses, with the counterfactuals' ``agreement()``.

    ``exact`` holds the same sums exactly (``[layer, key, head]``, keys ``sum_keys`` then
    ``SINK_SUM_KEYS``), so ``merge`` is order-independent and bit-identical: merging the
    statistics of two halves of the batches equals one run over all of them.

    Class attributes: ``SUM_KEYS`` and ``SINK_SUM_KEYS`` name the exact sums (the statistics
    file stores them in this order); ``SINK_DOMINANCE``: how many times the next-largest column
    a sink must take; ``SINK_EPSILON``: Gu et al.'s threshold on the first key's alpha.

    Attributes:
        model: the model's name (its architecture).
        layers: the analysed layers.
        heads: the analysed heads (in every analysed layer).
        scale: each layer's score scale ``c`` (``[len(layers)]``).
        softcap: each layer's soft-cap, or None.
        n_prompts: prompts seen.
        sums: ``{name: [len(layers), len(heads)]}`` running row sums (float64).
        sink_sums: ``{name: [len(layers), len(heads)]}`` running sink sums (float64).
        exact: the same sums exactly, ``[len(layers), n_sums, len(heads)]``.
        sum_keys: the names of the row sums in ``exact``.
        sink_keys: the names of the sink sums after them (``SINK_SUM_KEYS``; statistics files of
            format version 1 hold the first five, without the first key's ``alpha``).
        sink_eps: the ``eps`` the count ``sink_alpha_over`` was taken at (``SINK_EPSILON``).

    Example:
        >>> from tl_dynamics import odds_ratio, testing
        >>> stats = odds_ratio.compute(testing.tiny_model("gpt2"), "a = 1", keep_tensors=False).stats
        >>> stats.layers, stats.heads, stats.n_prompts
        ((0, 1), (0, 1, 2, 3), 1)
    """

    SUM_KEYS: ClassVar[tuple[str, ...]] = SUM_KEYS
    SINK_SUM_KEYS: ClassVar[tuple[str, ...]] = SINK_SUM_KEYS
    SINK_DOMINANCE: ClassVar[float] = SINK_DOMINANCE
    SINK_EPSILON: ClassVar[float] = SINK_EPSILON
    BOOT_KEYS: ClassVar[tuple[str, ...]] = BOOT_KEYS

    model: str
    layers: tuple[int, ...]
    heads: tuple[int, ...]
    scale: tuple[float, ...]
    softcap: tuple[float | None, ...]
    n_prompts: int
    sums: dict[str, np.ndarray] = field(repr=False)
    sink_sums: dict[str, np.ndarray] = field(repr=False)
    exact: ExactSum | None = field(default=None, repr=False, compare=False)
    sum_keys: tuple[str, ...] = field(default=(), repr=False)
    sink_keys: tuple[str, ...] = field(default=SINK_SUM_KEYS, repr=False)
    sink_eps: float = field(default=SINK_EPSILON, repr=False)
    boot: Replicates | None = field(default=None, repr=False, compare=False)

    @staticmethod
    def from_exact(
        model: str,
        layers: tuple[int, ...],
        heads: tuple[int, ...],
        scale: tuple[float, ...],
        softcap: tuple[float | None, ...],
        n_prompts: int,
        exact: ExactSum,
        sum_keys: tuple[str, ...],
        sink_keys: tuple[str, ...] = SINK_SUM_KEYS,
        sink_eps: float = SINK_EPSILON,
        boot: Replicates | ExactSum | None = None,
        boot_seed: int = 0,
    ) -> "HeadStats":
        """Statistics from exact sums ``[layer, key, head]`` (keys ``sum_keys + sink_keys``).

        How saved statistics are rebuilt (``scale.load_stats``) and how ``merge`` forms its result.

        Args:
            model: the model's name.
            layers: the analysed layers.
            heads: the analysed heads.
            scale: each layer's score scale ``c``.
            softcap: each layer's soft-cap, or None.
            n_prompts: prompts the sums cover.
            exact: ``ExactSum`` ``[len(layers), len(sum_keys) + len(sink_keys), len(heads)]``.
            sum_keys: names of the row sums (``HeadStats.SUM_KEYS``).
            sink_keys: names of the sink sums (``HeadStats.SINK_SUM_KEYS``, or its first five).
            sink_eps: the ``eps`` of the ``sink_alpha_over`` count.
            boot: bootstrap replicates of the label sums over prompts (docs/math.md §9):
                ``[n_boot, len(layers), len(BOOT_KEYS), len(heads)]`` exact sums (drawn with
                ``boot_seed``), or None (labels are then undecided).
            boot_seed: the generator key the replicates were drawn with.

        Returns:
            A ``HeadStats`` whose float sums are the exact sums' values.

        Example:
            >>> from tl_dynamics import odds_ratio, testing
            >>> s = odds_ratio.compute(testing.tiny_model("gpt2"), "a = 1", keep_tensors=False).stats
            >>> t = odds_ratio.HeadStats.from_exact(s.model, s.layers, s.heads, s.scale, s.softcap,
            ...                                     s.n_prompts, s.exact, s.sum_keys)
            >>> bool((t.sums["var_r"] == s.sums["var_r"]).all())
            True
        """
        keys = tuple(sum_keys) + check_sink_keys(sink_keys)
        if exact.shape != (len(layers), len(keys), len(heads)):
            raise TLDynamicsError(
                f"exact sums of shape {exact.shape} do not fit {len(layers)} "
                f"layers, {len(keys)} sums and {len(heads)} heads"
            )
        values = exact.value()
        sums = {k: values[:, i] for i, k in enumerate(sum_keys)}
        sink = {k: values[:, len(sum_keys) + i] for i, k in enumerate(sink_keys)}
        return HeadStats(
            model,
            tuple(layers),
            tuple(heads),
            tuple(scale),
            tuple(softcap),
            int(n_prompts),
            sums,
            sink,
            exact,
            tuple(sum_keys),
            tuple(sink_keys),
            float(sink_eps),
            Replicates(boot, BOOT_KEYS, int(boot_seed)) if isinstance(boot, ExactSum) else boot,
        )

    def merge(self, other: "HeadStats") -> "HeadStats":
        """Both runs' statistics together, exactly (any order gives the same bits).

        Args:
            other: statistics of the same model, layers, heads and settings.

        Returns:
            A ``HeadStats`` over the prompts of both.

        Example:
            >>> from tl_dynamics import odds_ratio, testing
            >>> m = testing.tiny_model("gpt2")
            >>> a, b = (odds_ratio.compute(m, t, keep_tensors=False).stats for t in ("a = 1", "b = 2"))
            >>> ab = a.merge(b)
            >>> ab.n_prompts, bool((ab.sums["var_r"] == b.merge(a).sums["var_r"]).all())
            (2, True)
        """
        if not isinstance(other, HeadStats):
            raise TLDynamicsError(f"can only merge HeadStats, got {type(other).__name__}")
        if self.exact is None or other.exact is None:
            raise TLDynamicsError(
                "cannot merge HeadStats without exact sums (build them with "
                "odds_ratio.compute/attach or HeadStats.from_exact)"
            )
        names = ("model", "layers", "heads", "scale", "softcap", "sum_keys", "sink_keys")
        names += ("sink_eps",)
        mine, theirs = ([getattr(s, n) for n in names] for s in (self, other))
        if mine != theirs:
            diff = [n for n, a, b in zip(names, mine, theirs) if a != b]
            raise TLDynamicsError(
                f"cannot merge odds-ratio statistics computed differently: they differ in {diff}"
            )
        return HeadStats.from_exact(
            self.model,
            self.layers,
            self.heads,
            self.scale,
            self.softcap,
            self.n_prompts + other.n_prompts,
            self.exact + other.exact,
            self.sum_keys,
            self.sink_keys,
            self.sink_eps,
            None if self.boot is None or other.boot is None else self.boot.merge(other.boot),
        )

    def __repr__(self) -> str:
        heads, n = f"layers={list(self.layers)}, heads={list(self.heads)}", self.n_prompts
        return f"HeadStats({self.model}, {heads}, prompts={n})"

    def _ratio(self, num: np.ndarray, den: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)

    @property
    def sigma2(self) -> np.ndarray:
        """Effective temperature ``1/c`` per layer (``[len(layers)]``).

        Example:
            >>> from tl_dynamics import odds_ratio, testing
            >>> stats = odds_ratio.compute(testing.tiny_model("gpt2"), "a = 1").stats
            >>> stats.sigma2.tolist()  # c = 1/sqrt(d_head) = 1/4
            [4.0, 4.0]
        """
        return np.array([1.0 / c for c in self.scale])

    def shares(self) -> dict[str, np.ndarray]:
        """Variance shares of the split, per head.

        Pooled over rows: sums of row covariances over the sum of row variances. ``attr_prior``,
        ``attr_loglik``, ``attr_bias`` add to one; so do ``var_prior``, ``var_loglik``,
        ``var_bias``, ``cov_prior_loglik`` and ``cov_bias``.

        Returns:
            ``{name: [len(layers), len(heads)] array}`` (NaN where no row had two keys).

        Example:
            >>> import numpy as np
            >>> from tl_dynamics import odds_ratio, testing
            >>> sh = odds_ratio.compute(testing.tiny_model("gpt2"), "a = b + c").stats.shares()
            >>> total = sh["attr_prior"] + sh["attr_loglik"] + sh["attr_bias"]
            >>> total.shape, bool(np.allclose(total, 1.0))
            ((2, 4), True)
        """
        s = self.sums
        var_r = s["var_r"]
        cov_r_loglik = var_r - s["cov_r_prior"] - s["cov_r_bias"]
        var_loglik = (
            var_r
            + s["var_prior"]
            + s["var_bias"]
            - 2 * s["cov_r_prior"]
            - 2 * s["cov_r_bias"]
            + 2 * s["cov_prior_bias"]
        )
        cov_prior_loglik = s["cov_r_prior"] - s["var_prior"] - s["cov_prior_bias"]
        cov_bias_loglik = s["cov_r_bias"] - s["cov_prior_bias"] - s["var_bias"]
        raw = {
            "attr_prior": s["cov_r_prior"],
            "attr_loglik": cov_r_loglik,
            "attr_bias": s["cov_r_bias"],
            "var_prior": s["var_prior"],
            "var_loglik": var_loglik,
            "var_bias": s["var_bias"],
            "cov_prior_loglik": 2 * cov_prior_loglik,
            "cov_bias": 2 * (s["cov_prior_bias"] + cov_bias_loglik),
        }
        return {k: self._ratio(v, var_r) for k, v in raw.items()}

    def means(self) -> dict[str, np.ndarray]:
        """Mean per-row KL divergences and entropy of every head.

        Returns:
            ``{name: [len(layers), len(heads)] array}``: mean over rows of ``kl_prior``
            (``KL(real || prior-only)``), ``kl_loglik`` (``KL(real || likelihood-only)``),
            ``entropy`` (nats) and ``learned_sink_mass`` (the mass a learned sink absorbs; zero
            on layers without one).

        Example:
            >>> from tl_dynamics import odds_ratio, testing
            >>> mn = odds_ratio.compute(testing.tiny_model("gpt2"), "a = b + c").stats.means()
            >>> sorted(mn), bool((mn["kl_prior"] >= 0).all())
            (['entropy', 'kl_loglik', 'kl_prior', 'learned_sink_mass'], True)
        """
        rows = self.sums["rows"]
        out = {k: self._ratio(self.sums[k], rows) for k in ("kl_prior", "kl_loglik", "entropy")}
        out["learned_sink_mass"] = self._ratio(
            self.sums.get("learned_sink", np.zeros_like(rows)), rows
        )
        return out

    def agreement(self) -> dict[str, np.ndarray]:
        """Whether each part alone reproduces the head (docs/math.md §2.2, ``_labels``).

        Returns:
            ``{name: [len(layers), len(heads)] array}``: ``top_real``, the mean mass of the real
            pattern on each row's top key; ``agree_prior`` and ``agree_loglik``, the mass the
            prior-only and the likelihood-only pattern put on that key over the real pattern's
            (pooled over rows; the labels read the mass each keeps, ``label_evidence``).

        Example:
            >>> from tl_dynamics import odds_ratio, testing
            >>> ag = odds_ratio.compute(testing.tiny_model("gpt2"), "a = b + c").stats.agreement()
            >>> sorted(ag), bool((ag["top_real"] <= 1).all())
            (['agree_loglik', 'agree_prior', 'top_real'], True)
        """
        s = self.sums
        return {
            "top_real": self._ratio(s["top_real"], s["rows"]),
            "agree_prior": self._ratio(s["top_prior"], s["top_real"]),
            "agree_loglik": self._ratio(s["top_loglik"], s["top_real"]),
        }

    def sink_epsilon(self) -> dict[str, Any] | None:
        """Gu et al.'s Sink^eps of the first key over the prompts seen (docs/math.md §2.3).

        Returns:
            None without the first key's alpha (a format version 1 file); else ``epsilon``,
            ``alpha`` (``[layer, head]``, its mean over prompts), ``share`` (the fraction of
            prompts with ``alpha > epsilon``), ``sink_epsilon`` (Gu et al.'s metric: the mean of
            ``share`` over heads), ``of_mean_alpha`` (the share of heads whose mean alpha is above).

        Example:
            >>> from tl_dynamics import odds_ratio, testing
            >>> se = odds_ratio.compute(testing.tiny_model("gpt2"), "a = 1").stats.sink_epsilon()
            >>> se["epsilon"], se["alpha"].shape
            (0.3, (2, 4))
        """
        return sink_epsilon_summary(self.sink_sums, self.n_prompts, self.sink_eps)

    def labels(self) -> np.ndarray:
        """Each head's label: a claim, a "no" or ``"undecided"`` (docs/math.md §2.2, §9).

        Returns:
            ``[len(layers), len(heads)]`` object array of ``_labels.LABELS`` (``label_evidence``).

        Example:
            >>> from tl_dynamics import odds_ratio, testing
            >>> labs = odds_ratio.compute(testing.tiny_model("gpt2"), "a = b + c").stats.labels()
            >>> labs.shape, set(labs.flat)  # one prompt: too few units for any verdict
            ((2, 4), {'undecided'})
        """
        return self.label_evidence().label.copy()

    def label_evidence(self, control: "HeadStats | None" = None) -> LabelEvidence:
        """Each label's evidence: its quantities' intervals, thresholds and verdicts (§9).

        Args:
            control: the same heads' statistics on a control model (docs/math.md §9.3), or None.

        Returns:
            A ``LabelEvidence``; ``.to_dataframe()`` gives one row per head.

        Example:
            >>> from tl_dynamics import odds_ratio, testing
            >>> ev = odds_ratio.compute(testing.tiny_model("gpt2"), "a = b").stats.label_evidence()
            >>> ev.units, ev.undecided_on[0, 0], ev.thresholds["kept_loglik"]  # one prompt
            (1, 'too few prompts', 0.5)
        """
        return label_evidence(self, control)

    def to_dataframe(self) -> pd.DataFrame:
        """One row per head: shares, agreement, KLs, entropy, label and sink summary.

        Returns:
            A pandas DataFrame indexed by head name (``"L1H0"``), with ``layer``, ``head_index``,
            ``sigma2``, ``softcap``, ``rows``, the ``shares()``, the ``agreement()``, the
            ``means()``, ``label``, the per-prompt sink means (``sink_mass``, ...), and the
            first key's mean ``sink_alpha`` and ``sink_alpha_share`` (``sink_epsilon()``; NaN
            where not kept).

        Example:
            >>> from tl_dynamics import odds_ratio, testing
            >>> frame = odds_ratio.compute(testing.tiny_model("gpt2"), "a = 1").stats.to_dataframe()
            >>> frame.index[:2].tolist(), frame.shape[0]
            (['L0H0', 'L0H1'], 8)
        """
        return pd.DataFrame.from_records(head_records(self)).set_index("head_name")

    def show(self, max_rows: int = 60) -> viz.Component:
        """A table of the per-head statistics (``tl_dynamics.viz`` component).

        Args:
            max_rows: heads shown at most.

        Returns:
            A ``viz.Component`` (a table with a caption on the labels and soft-capped layers).

        Example:
            >>> from tl_dynamics import odds_ratio, testing
            >>> view = odds_ratio.compute(testing.tiny_model("gpt2"), "a = 1").stats.show()
            >>> "L1H3" in view.html
            True
        """
        capped = [layer for layer, cap in zip(self.layers, self.softcap) if cap is not None]
        thresholds = (LABEL_THRESHOLD, SHARP, KEEP)
        return _views.stats_view(
            self.to_dataframe(), self.model, self.n_prompts, capped, thresholds, max_rows
        )
