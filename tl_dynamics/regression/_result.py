"""``RegressionResult``: R² of every predictor per head and band, the fitted gains, and each
head's claim (docs/math.md §8.4)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import pandas as pd

from tl_dynamics import viz
from tl_dynamics.regression._measure import CLAIM, EXPLAINED, MARGIN, Scores

NOTICE = (
    "Claims are restricted to destinations that see at least {claim:g} d_head = {n} keys "
    "(the band 'claim'). Below that, ridge interpolates: with fewer keys than dimensions any "
    "value can be fitted exactly, and copying and induction heads look like regression."
)


@dataclass(frozen=True)
class RegressionResult(viz.Result):
    """How close each head's output ``z`` is to in-context regression of values on keys.

    Arrays are indexed ``[layer, band, head, predictor]`` (``r2``, ``r2_low``, ``r2_high``,
    ``gain``, ``fit_r2``) or ``[layer, head]`` (the claim). The last band, ``bands[-1]``, is the
    claim band: destinations that see at least ``2 d_head`` keys. ``regression_like`` is True
    where the held-out R² of the head's best regression predictor (linear attention, ridge, GD;
    chosen on the fitting units) beats its best control (the baselines) by more than ``MARGIN``
    at the lower end of the bootstrap interval (docs/math.md §8.4).
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
    best_regression: np.ndarray  # [layer, head]: predictor indices chosen on the fitting units
    best_linear: np.ndarray
    best_control: np.ndarray
    best_rival: np.ndarray  # the best linear or control predictor
    delta_regression: np.ndarray  # [layer, head, 3]: held-out R² difference, 95% interval
    delta_linear: np.ndarray
    z_error: tuple[float, ...]  # per layer: float64 softmax row vs the model's z (relative)
    units: str
    n_units: tuple[int, int]  # fitting, held out
    stride: int

    @classmethod
    def build(cls, *, scores: Sequence[Scores], **fields: Any) -> "RegressionResult":
        """Stack one ``Scores`` per layer."""

        def stack(name: str) -> np.ndarray:
            return np.stack([getattr(s, name) for s in scores])

        names = "gain r2 r2_low r2_high fit_r2 n_fit n_held".split()
        best = {
            f"best_{k}": np.stack([s.best[f] for s in scores])
            for k, f in (
                ("regression", "regression"),
                ("linear", "linear"),
                ("control", "control"),
                ("rival", "baseline_or_linear"),
            )
        }
        delta = {
            f"delta_{k}": np.stack([s.delta[k] for s in scores]) for k in ("regression", "linear")
        }
        arrays: dict[str, Any] = {n: stack(n) for n in names} | best | delta
        return cls(**fields, **arrays)

    @property
    def min_visible(self) -> int:
        """The visible keys from which claims are made (``2 d_head``)."""
        return int(np.ceil(CLAIM * self.d_head))

    @property
    def notice(self) -> str:
        """The restriction every claim carries."""
        return NOTICE.format(claim=CLAIM, n=self.min_visible)

    @property
    def regression_like(self) -> np.ndarray:
        """``[layer, head]``: the best ridge or GD predictor beats the best of the linear and
        control predictors by more than ``MARGIN`` R² at the lower end of its bootstrap
        interval, in the claim band."""
        return np.nan_to_num(self.delta_regression[..., 1], nan=-np.inf) > MARGIN

    @property
    def linear_like(self) -> np.ndarray:
        """``[layer, head]``: the best linear-attention predictor beats the best control by more
        than ``MARGIN`` R² at the lower end of its bootstrap interval, in the claim band (the
        near-linear regime of softmax, docs/math.md §8.4)."""
        return np.nan_to_num(self.delta_linear[..., 1], nan=-np.inf) > MARGIN

    def reading(self) -> np.ndarray:
        """``[layer, head]``: ``"regression"`` or ``"linear"`` where the head is that beyond its
        controls, else the name of its best control; ``"unexplained"`` where the predictor
        read explains less than ``EXPLAINED`` of z's variance (held-out R², claim band)."""
        out = np.array([[self.names[c] for c in row] for row in self.best_control], dtype=object)
        best = self.best_control.copy()
        out[self.linear_like], best[self.linear_like] = "linear", self.best_linear[self.linear_like]
        like = self.regression_like
        out[like], best[like] = "regression", self.best_regression[like]
        r2 = np.take_along_axis(self.r2[:, -1], best[..., None], axis=-1)[..., 0]
        out[~(np.nan_to_num(r2, nan=-np.inf) >= EXPLAINED)] = "unexplained"
        return out

    def r2_of(self, layer: int, head: int, predictor: str, band: int = -1) -> float:
        """Held-out R² of one predictor (claim band by default)."""
        return float(
            self.r2[
                self.layers.index(layer), band, self.heads.index(head), self.names.index(predictor)
            ]
        )

    def claims(self) -> pd.DataFrame:
        """One row per head: its reading, its best regression, linear and control predictors
        (chosen on the fitting units) with their held-out R² in the claim band, and the two
        differences (regression over the best linear or control predictor, linear over the best
        control) with the lower ends of their bootstrap intervals."""
        rows = []
        reading = self.reading()
        for i, layer in enumerate(self.layers):
            for j, head in enumerate(self.heads):
                row: dict = dict(layer=layer, head_index=head, reading=reading[i, j])
                for fam in ("regression", "linear", "control"):
                    k = int(getattr(self, f"best_{fam}")[i, j])
                    row[f"best_{fam}"] = self.names[k]
                    row[f"r2_{fam}"] = self.r2[i, -1, j, k]
                for fam in ("regression", "linear"):
                    d = getattr(self, f"delta_{fam}")[i, j]
                    row.update({f"delta_{fam}": d[0], f"delta_{fam}_low": d[1]})
                row["n_held"] = int(self.n_held[i, -1, j])
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

    def show(self) -> viz.Group:
        """The claim per head as a layer x head map, the claims table, and the notice."""
        caption = (
            f"Held-out R² of each head's best ridge or GD predictor minus its best linear or "
            "control predictor, "
            f"destinations with at least {self.min_visible} visible keys; units: {self.units} "
            f"({self.n_units[0]} fitting, {self.n_units[1]} held out); docs/math.md §8.4."
        )
        table = viz.table(self.claims(), caption="Each head's claim (claim band)")
        if not np.isfinite(self.delta_regression[..., 0]).any():  # nothing to draw: say why
            held = int(self.n_held[:, -1].max()) if self.n_held.size else 0
            why = (
                f"No head has a held-out R² in the claim band, so no map is drawn: held-out "
                f"destinations that see at least {self.min_visible} keys: {held}. Give prompts "
                f"longer than {self.min_visible} tokens (several of them, for held-out units)."
            )
            return viz.group(viz.text(self.notice), viz.text(why), table)
        heat = viz.heatmap(
            self.delta_regression[..., 0],
            row_labels=[f"L{layer}" for layer in self.layers],
            col_labels=[f"H{h}" for h in self.heads],
            title="Regression over control (R²)",
            row_title="layer",
            col_title="head",
            value_name="delta R²",
            caption=caption,
        )
        return viz.group(viz.text(self.notice), heat, table)
