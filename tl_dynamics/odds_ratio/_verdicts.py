"""``LabelEvidence``: every head's label with what it rests on (docs/math.md §2.2, §9).

The quantities behind a label are ratios of pooled sums (``_stats.BOOT_KEYS``); the same ratios
of the bootstrap replicates' sums (``_boot.Replicates``: Poisson weights per prompt) give each a
95% expanded percentile interval over the prompts, and ``evidence.decide`` a verdict per
criterion. Without replicates (an old statistics file) or with fewer than ``evidence.MIN_UNITS``
prompts every label is ``"undecided"``. Each quantity is shown with its threshold and, where a
control's statistics are given (the same prompts on ``adapter.shuffled_weights``, the control of
docs/math.md §9.3), with the control head's value and label.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from tl_dynamics import viz
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.evidence import decide, interval, too_few
from tl_dynamics.odds_ratio._labels import KEEP, LABEL_THRESHOLD, SHARP, rule

# criterion -> (quantity, threshold)
CRITERIA = {
    "choice": ("top_real", SHARP),
    "attr_prior": ("attr_prior", LABEL_THRESHOLD),
    "attr_loglik": ("attr_loglik", LABEL_THRESHOLD),
    "kept_prior": ("kept_prior", KEEP),
    "kept_loglik": ("kept_loglik", KEEP),
}
THRESHOLDS = {q: t for q, t in CRITERIA.values()}  # quantity -> its threshold
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
    prompts and its threshold, each criterion's verdict, what an undecided label waits on, and
    the control head's value and label where a control was given.

    Attributes:
        layers, heads: the analysed heads.
        label: the labels (``_labels.LABELS``).
        estimate, low, high: ``{quantity: [layer, head]}`` (``quantities``).
        verdicts: ``{criterion: [layer, head]}`` of ``evidence.Verdict``.
        undecided_on: ``""`` or the criterion left open (``"choice"``, ``"prior"``,
            ``"likelihood"``, ``"kept mass"``, ``"too few prompts"``, ``"no intervals ..."``).
        units: the prompts behind the intervals.
        thresholds: ``{quantity: threshold}`` (``CRITERIA``): a criterion is yes where the
            quantity's whole interval lies above its threshold.
        control: None, or ``{quantity: [layer, head]}``: the same quantities of the same heads
            on the control (``control_label`` its labels, ``control_units`` its prompts).
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
    thresholds: dict[str, float] = field(default_factory=lambda: dict(THRESHOLDS))
    control: dict[str, np.ndarray] | None = None
    control_label: np.ndarray | None = None
    control_units: int = 0

    def to_dataframe(self) -> pd.DataFrame:
        """One row per head: ``layer``, ``head_index``, ``label``, ``undecided_on``, ``units``
        and each quantity with ``_low``, ``_high``, ``_threshold`` and ``_verdict`` (its
        criterion's); with a control, each quantity's ``_control``, ``label_control`` and
        ``control_units``.

        Example:
            >>> from tl_dynamics import odds_ratio, testing
            >>> from tl_dynamics.adapter import ModelAdapter, shuffled_weights
            >>> ad = ModelAdapter(testing.tiny_model("gpt2"))
            >>> st = odds_ratio.compute(ad, ["a = 1"] * 2).stats
            >>> control = odds_ratio.compute(shuffled_weights(ad, seed=1), ["a = 1"] * 2).stats
            >>> frame = st.label_evidence(control=control).to_dataframe()
            >>> frame.columns[:5].tolist()
            ['layer', 'head_index', 'label', 'undecided_on', 'units']
            >>> row = frame.iloc[0]
            >>> float(row.kept_loglik_threshold), row.kept_loglik_verdict, row.label_control
            (0.5, 'undecided', 'undecided')
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
                    row[f"{name}_threshold"] = self.thresholds[name]
                    row[f"{name}_verdict"] = str(self.verdicts[_CRITERION[name]][i, j])
                    if self.control is not None:
                        row[f"{name}_control"] = float(self.control[name][i, j])
                if self.control_label is not None:
                    row["label_control"] = self.control_label[i, j]
                    row["control_units"] = self.control_units
                rows.append(row)
        return pd.DataFrame(rows)


_CRITERION = {q: c for c, (q, _) in CRITERIA.items()}  # quantity -> its criterion


def label_evidence(stats: Any, control: Any = None) -> LabelEvidence:
    """The labels of a ``HeadStats`` and their evidence, beside ``control`` (a ``HeadStats`` of
    the same heads on a control model, or None)."""
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
    if stats.boot is None or too_few(units):
        waits[:] = NO_INTERVALS if stats.boot is None else FEW
    ctl: dict[str, Any] = {}
    if control is not None:
        if (tuple(control.layers), tuple(control.heads)) != (
            tuple(stats.layers),
            tuple(stats.heads),
        ):
            raise TLDynamicsError(
                f"label_evidence: the control has layers {list(control.layers)} and heads "
                f"{list(control.heads)}, the statistics {list(stats.layers)} and "
                f"{list(stats.heads)}: compute both on the same heads"
            )
        ev = label_evidence(control)
        ctl = dict(control=ev.estimate, control_label=ev.label, control_units=ev.units)
    return LabelEvidence(
        tuple(stats.layers),
        tuple(stats.heads),
        label,
        est,
        low,
        high,
        verdicts,
        waits,
        units,
        **ctl,
    )
