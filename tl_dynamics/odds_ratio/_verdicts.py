"""``LabelEvidence``: every head's label with what it rests on (docs/math.md §2.2, §9).

The quantities behind a label are ratios of pooled sums (``_stats.BOOT_KEYS``); the same ratios
of the bootstrap replicates' sums (``_boot.Replicates``: Poisson weights per prompt) give each a
95% expanded percentile interval over the prompts, and ``evidence.decide`` a verdict per
criterion. Without replicates (an old statistics file) or with fewer than ``evidence.MIN_UNITS``
prompts every label is ``"undecided"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from tl_dynamics import viz
from tl_dynamics.evidence import MIN_UNITS, decide, interval
from tl_dynamics.odds_ratio._labels import KEEP, LABEL_THRESHOLD, SHARP, rule

# criterion -> (quantity, threshold)
CRITERIA = {
    "choice": ("top_real", SHARP),
    "attr_prior": ("attr_prior", LABEL_THRESHOLD),
    "attr_loglik": ("attr_loglik", LABEL_THRESHOLD),
    "kept_prior": ("kept_prior", KEEP),
    "kept_loglik": ("kept_loglik", KEEP),
}
FEW = "too few prompts"
NO_INTERVALS = "no intervals (statistics without bootstrap replicates)"


def quantities(s: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The label quantities from sums (any leading axes): the additive shares of the row-centred
    score variance, the real pattern's mean top-key mass and what each counterfactual keeps.

    >>> q = quantities(dict(rows=np.array(4.0), var_r=np.array(2.0), cov_r_prior=np.array(0.5),
    ...     cov_r_bias=np.array(0.0), top_real=np.array(3.0), top_prior=np.array(1.0),
    ...     top_loglik=np.array(2.0)))
    >>> [round(float(q[k]), 2) for k in ("attr_prior", "attr_loglik", "top_real", "kept_loglik")]
    [0.25, 0.75, 0.75, 0.5]
    """
    with np.errstate(invalid="ignore", divide="ignore"):
        var = np.where(s["var_r"] > 0, s["var_r"], np.nan)
        rows = np.where(s["rows"] > 0, s["rows"], np.nan)
        attr_prior, attr_bias = s["cov_r_prior"] / var, s["cov_r_bias"] / var
        return dict(
            attr_prior=attr_prior,
            attr_loglik=1.0 - attr_prior - attr_bias,
            top_real=s["top_real"] / rows,
            kept_prior=s["top_prior"] / rows,
            kept_loglik=s["top_loglik"] / rows,
        )


@dataclass(frozen=True)
class LabelEvidence(viz.Result):
    """Per head (``[layer, head]`` arrays): the label, each quantity with its 95% interval over
    prompts, each criterion's verdict, and what an undecided label waits on.

    Attributes:
        layers, heads: the analysed heads.
        label: the labels (``_labels.LABELS``).
        estimate, low, high: ``{quantity: [layer, head]}`` (``quantities``).
        verdicts: ``{criterion: [layer, head]}`` of ``"yes"``/``"no"``/``"undecided"``.
        undecided_on: ``""`` or the criterion left open (``"choice"``, ``"prior"``,
            ``"likelihood"``, ``"kept mass"``, ``"too few prompts"``, ``"no intervals ..."``).
        units: the prompts behind the intervals.
    """

    layers: tuple[int, ...]
    heads: tuple[int, ...]
    label: np.ndarray
    estimate: dict[str, np.ndarray]
    low: dict[str, np.ndarray]
    high: dict[str, np.ndarray]
    verdicts: dict[str, np.ndarray]
    undecided_on: np.ndarray
    units: int

    def to_dataframe(self) -> pd.DataFrame:
        """One row per head: ``layer``, ``head_index``, ``label``, ``undecided_on``, ``units``
        and each quantity with ``_low`` and ``_high``.

        Example:
            >>> from tl_dynamics import odds_ratio, testing
            >>> st = odds_ratio.compute(testing.tiny_model("gpt2"), ["a = 1"] * 2).stats
            >>> st.label_evidence().to_dataframe().columns[:5].tolist()
            ['layer', 'head_index', 'label', 'undecided_on', 'units']
        """
        rows = []
        for i, layer in enumerate(self.layers):
            for j, head in enumerate(self.heads):
                row: dict[str, Any] = dict(
                    layer=layer,
                    head_index=head,
                    label=self.label[i, j],
                    undecided_on=self.undecided_on[i, j],
                    units=self.units,
                )
                for name, est in self.estimate.items():
                    row[name] = float(est[i, j])
                    row[f"{name}_low"] = float(self.low[name][i, j])
                    row[f"{name}_high"] = float(self.high[name][i, j])
                rows.append(row)
        return pd.DataFrame(rows)


def label_evidence(stats: Any) -> LabelEvidence:
    """The labels of a ``HeadStats`` and their evidence."""
    est = quantities(stats.sums)
    shape = est["top_real"].shape
    units = int(stats.n_prompts)
    if stats.boot is not None:
        low, high = {}, {}
        reps = quantities(stats.boot.values())
        for name, r in reps.items():
            low[name], high[name] = interval(r, units)
    else:
        low = {k: np.full(shape, np.nan) for k in est}
        high = {k: np.full(shape, np.nan) for k in est}
    verdicts = {c: decide(low[q], high[q], t, units) for c, (q, t) in CRITERIA.items()}
    label, waits = rule(verdicts)
    if stats.boot is None or units < MIN_UNITS:
        waits[:] = NO_INTERVALS if stats.boot is None else FEW
    return LabelEvidence(
        tuple(stats.layers), tuple(stats.heads), label, est, low, high, verdicts, waits, units
    )
