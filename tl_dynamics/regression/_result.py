"""``RegressionResult``: R² of every predictor per head and band, the fitted gains, and each
head's claim (docs/math.md §8.4)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Sequence

import numpy as np
import pandas as pd

from tl_dynamics import viz
from tl_dynamics.regression._measure import CLAIM, Scores
from tl_dynamics.evidence import N_BOOT
from tl_dynamics.regression._readings import Reading, held_text, read, summary

NOTICE = (
    "Claims are restricted to destinations that see at least {claim:g} d_head = {n} keys "
    "(the band 'claim'). Below that, ridge interpolates: with fewer keys than dimensions any "
    "value can be fitted exactly, and copying and induction heads look like regression."
)


@dataclass(frozen=True)
class RegressionResult(viz.Result):
    """How close each head's output ``z`` is to in-context regression of values on keys.

    Arrays are indexed ``[layer, band, head, predictor]`` (``r2``, ``r2_low``, ``r2_high``,
    ``gain``, ``fit_r2``), ``[layer, band, head]`` (``n_fit``, ``n_held``: destinations;
    ``units_held``: held-out units) or ``[layer, head]`` (the claim). The last band,
    ``bands[-1]``, is the claim band: destinations that see at least ``2 d_head`` keys.
    Intervals are 95% expanded percentile intervals over held-out units (docs/math.md §9).

    ``reading()`` is a claim, a "no" or ``"undecided"`` for every head (docs/math.md §8.4):
    ``"regression"`` where the best ridge or GD predictor (chosen on the fitting units) beats
    the best linear or control predictor on the held-out units (``rival_regression``) by more
    than ``MARGIN`` R² over its whole interval and explains at least ``EXPLAINED`` of z;
    ``"linear"`` likewise against the best control (``rival_linear``); else the best control's
    name or ``"unexplained"``; ``"undecided"`` where an interval straddles its threshold or the
    claim band has fewer than ``evidence.MIN_UNITS`` held-out units. ``regression_like`` and
    ``linear_like`` are the heads whose reading is that claim.

    Example:
        >>> from tl_dynamics import regression, testing
        >>> res = regression.compute(testing.cached_model("gpt2"), "a b c d e f g h", layers=0)
        >>> sorted(set(res.reading().ravel()))  # 4 held-out blocks: too few units for a claim
        ['undecided']
    """

    architecture: str
    d_head: int
    layers: tuple[int, ...]
    heads: tuple[int, ...]
    names: tuple[str, ...]
    bands: tuple[str, ...]
    gain: np.ndarray
    r2: np.ndarray
    r2_low: np.ndarray
    r2_high: np.ndarray
    fit_r2: np.ndarray
    n_fit: np.ndarray  # [layer, band, head]
    n_held: np.ndarray
    units_held: np.ndarray  # [layer, band, head]
    best_regression: np.ndarray  # [layer, head]: predictor indices chosen on the fitting units
    best_linear: np.ndarray
    rival_regression: np.ndarray  # [layer, head]: the best linear or control predictor, held out
    rival_linear: np.ndarray  # the best control predictor, held out
    delta_regression: np.ndarray  # [layer, head, 3]: held-out R² difference, 95% interval
    delta_linear: np.ndarray
    z_error: tuple[float, ...]  # per layer: float64 softmax row vs the model's z (relative)
    units: str
    n_units: tuple[int, int]  # fitting, held out
    stride: int
    ablation: np.ndarray | None = None  # [layer, head, 3]: mean-ablation Δ loss (nats), 95%
    n_prompts: int = 0  # the prompts measured (0: not recorded)
    n_boot: int = N_BOOT  # bootstrap replicates behind every interval

    @classmethod
    def build(cls, *, scores: Sequence[Scores], **fields: Any) -> "RegressionResult":
        """Stack one ``Scores`` per layer."""

        def stack(name: str) -> np.ndarray:
            return np.stack([getattr(s, name) for s in scores])

        names = "gain r2 r2_low r2_high fit_r2 n_fit n_held units_held".split()
        arrays: dict[str, Any] = {n: stack(n) for n in names}
        for k in ("regression", "linear"):
            arrays[f"best_{k}"] = np.stack([s.best[k] for s in scores])
            arrays[f"rival_{k}"] = np.stack([s.rival[k] for s in scores])
            arrays[f"delta_{k}"] = np.stack([s.delta[k] for s in scores])
        return cls(**fields, **arrays)

    @property
    def min_visible(self) -> int:
        """The visible keys from which claims are made (``2 d_head``)."""
        return int(np.ceil(CLAIM * self.d_head))

    @property
    def notice(self) -> str:
        """The restriction every claim carries."""
        return NOTICE.format(claim=CLAIM, n=self.min_visible)

    @cached_property
    def _read(self) -> Reading:
        return read(self)

    @property
    def regression_like(self) -> np.ndarray:
        """``[layer, head]``: the heads that read ``"regression"`` (docs/math.md §8.4)."""
        return self._read.label == "regression"

    @property
    def linear_like(self) -> np.ndarray:
        """``[layer, head]``: the heads that read ``"linear"`` (the near-linear regime of
        softmax: small scores; untrained heads read it too, docs/math.md §8.5)."""
        return self._read.label == "linear"

    def reading(self) -> np.ndarray:
        """``[layer, head]``: ``"regression"``, ``"linear"``, the best control's name,
        ``"unexplained"`` or ``"undecided"`` (the class docstring gives the rule)."""
        return self._read.label.copy()

    def r2_of(self, layer: int, head: int, predictor: str, band: int = -1) -> float:
        """Held-out R² of one predictor (claim band by default)."""
        return float(
            self.r2[
                self.layers.index(layer), band, self.heads.index(head), self.names.index(predictor)
            ]
        )

    def claims(self) -> pd.DataFrame:
        """One row per head: its reading and the evidence it rests on, in the claim band.

        Columns: ``layer``, ``head_index``, ``reading``; ``predictor`` (what the reading rests
        on) with its held-out R² and interval (``r2``, ``r2_low``, ``r2_high``); ``rival`` (the
        predictor it was compared with, the best on the held-out units) and ``r2_rival``;
        ``delta`` with ``delta_low``, ``delta_high`` (predictor minus rival); ``undecided_on``
        (the step left open: ``regression``, ``linear`` or ``explained``), ``reason`` (the
        undecided criterion with its interval and threshold, in words) and ``units_needed``
        (roughly how many held-out units would decide it; NaN where that cannot be said, the
        estimate lying within a standard error of its threshold); ``units_held`` (the held-out units,
        prompts or blocks, in the claim band) and ``n_held`` (their destinations); with the
        ablation measured, ``ablation_dloss`` with ``ablation_low``, ``ablation_high``: the change
        in next-token loss (nats) at the measured destinations when the head is mean-ablated, the
        head's causal weight, which a reading does not claim (docs/math.md §9.5).
        """
        rd = self._read
        rows = []
        for i, layer in enumerate(self.layers):
            for j, head in enumerate(self.heads):
                row: dict = dict(layer=layer, head_index=head, reading=rd.label[i, j])
                k, r = int(rd.claimant[i, j]), int(rd.rival[i, j])
                row["predictor"] = self.names[k] if k >= 0 else ""
                for col, arr in (
                    ("r2", self.r2),
                    ("r2_low", self.r2_low),
                    ("r2_high", self.r2_high),
                ):
                    row[col] = float(arr[i, -1, j, k]) if k >= 0 else np.nan
                row["rival"] = self.names[r] if r >= 0 else ""
                row["r2_rival"] = float(self.r2[i, -1, j, r]) if r >= 0 else np.nan
                row.update(zip(("delta", "delta_low", "delta_high"), rd.delta[i, j].tolist()))
                row["undecided_on"] = rd.undecided_on[i, j]
                row["reason"] = rd.reason[i, j]
                row["units_needed"] = rd.units_needed[i, j]
                row["units_held"] = int(self.units_held[i, -1, j])
                row["n_held"] = int(self.n_held[i, -1, j])
                if self.ablation is not None:
                    row.update(
                        zip(
                            ("ablation_dloss", "ablation_low", "ablation_high"), self.ablation[i, j]
                        )
                    )
                rows.append(row)
        return pd.DataFrame(rows)

    def closest(self) -> pd.DataFrame:
        """Per head and band, the predictor with the highest held-out R² and that R²."""
        rows = []
        for i, layer in enumerate(self.layers):
            for b, band in enumerate(self.bands):
                for j, head in enumerate(self.heads):
                    r = self.r2[i, b, j]
                    if np.isnan(r).all():
                        continue
                    k = int(np.nanargmax(r))
                    rows.append(
                        dict(
                            layer=layer, head_index=head, band=band, closest=self.names[k], r2=r[k]
                        )
                    )
        return pd.DataFrame(rows)

    def to_dataframe(self) -> pd.DataFrame:
        """One row per layer, head, band and predictor: gain, held-out R² with its bootstrap
        interval, and the destinations fitted and held out."""
        L, B, H, P = self.r2.shape
        idx = np.indices((L, B, H, P)).reshape(4, -1)
        return pd.DataFrame(
            dict(
                layer=np.array(self.layers)[idx[0]],
                band=np.array(self.bands)[idx[1]],
                head_index=np.array(self.heads)[idx[2]],
                predictor=np.array(self.names)[idx[3]],
                gain=self.gain.reshape(-1),
                r2=self.r2.reshape(-1),
                r2_low=self.r2_low.reshape(-1),
                r2_high=self.r2_high.reshape(-1),
                n_fit=self.n_fit[idx[0], idx[1], idx[2]],
                n_held=self.n_held[idx[0], idx[1], idx[2]],
            )
        )

    def summary(self) -> str:
        """One paragraph in plain words: how many heads read each claim, how many are undecided
        and why, and what would decide them (docs/math.md §9)."""
        return summary(self, self._read)

    def show(self) -> viz.Group:
        """The notice, the plain-words summary, the regression comparison per head as a layer x
        head map, and the claims table (the evidence behind every reading). Where no head has a
        held-out destination in the claim band, the summary says why and no map or table of
        empty numbers is drawn."""
        text = [viz.text(self.notice), viz.text(self.summary())]
        if not np.isfinite(self.delta_regression[..., 0]).any():  # nothing measured: say so only
            return viz.group(*text)
        caption = (
            "Held-out R² of each head's best ridge or GD predictor (chosen on the fitting units) "
            "minus its best linear or control predictor on the held-out units, destinations with "
            f"at least {self.min_visible} visible keys; {held_text(self)}, "
            f"{self.n_boot} bootstrap replicates; docs/math.md §8.4."
        )
        heat = viz.heatmap(
            self.delta_regression[..., 0],
            row_labels=[f"L{layer}" for layer in self.layers],
            col_labels=[f"H{h}" for h in self.heads],
            title="Regression over its best rival (R²)",
            row_title="layer",
            col_title="head",
            value_name="delta R²",
            caption=caption,
        )
        frame = self.claims().round(3)
        table = viz.table(
            frame,
            caption=(
                "Each head's reading and its evidence (claim band): the predictor it rests on, "
                "its held-out R² with a 95% interval over held-out units, the rival it was "
                "compared with and the difference with its interval; 'undecided_on' names the "
                "step an interval left open, 'reason' the criterion with its interval and "
                "threshold, and 'units_needed' roughly how many held-out units would decide it "
                "(empty where that cannot be said); 'units_held': "
                f"{held_text(self)}, {self.n_boot} bootstrap replicates. ablation_dloss: the "
                "change in next-token loss (nats) at the measured destinations when the head's output is replaced by its mean over the "
                "prompt (its causal weight; a reading does not claim one)."
            ),
        )
        return viz.group(*text, heat, table)
