"""The odds-ratio section of the ``tl-dynamics report`` page."""

from __future__ import annotations

import numpy as np

from tl_dynamics import viz
from tl_dynamics.evidence import MIN_UNITS
from tl_dynamics.adapter import Batch, ModelAdapter
from tl_dynamics.odds_ratio._collect import compute
from tl_dynamics.odds_ratio._labels import KEEP, LABEL_THRESHOLD, SHARP

TITLE = "Attention as odds ratios: key prior vs distance likelihood"
INTRO = (
    "Every attention score splits exactly into a query term (constant along the row), a key "
    "prior (c/2)|k_j|^2 and a distance log-likelihood -(c/2)|q_i-k_j|^2 (plus any position "
    "bias): attention is a posterior over source positions, prior times likelihood, at "
    "temperature sigma^2 = 1/c. A head makes a choice when it puts at least "
    f"{SHARP:.2f} of its attention on one key on average (else it is diffuse); it is "
    "prior-driven when, in addition, the key prior carries at least "
    f"{LABEL_THRESHOLD:.2f} of the row-centred score variance (additive attribution "
    "Cov(term, r)/Var(r)) and the prior-only pattern alone keeps at least "
    f"{KEEP:.2f} of the attention on the head's top key; likelihood-driven likewise; a head "
    "that neither part alone reproduces needs both. Each criterion is decided on a 95% interval "
    "over the prompts: with fewer than 8 prompts, or an interval across a threshold, the label "
    "is undecided (docs/math.md §2.1, §2.2, §9)."
)


def report_section(page: viz.Page, adapter: ModelAdapter, batch: Batch) -> None:
    """Add the odds-ratio section to ``page``: the per-head table and the two extreme heads.

    The per-head table of every head, and the decomposition of the heads with the largest
    prior and likelihood shares on the first prompt (named prior- or likelihood-driven only when
    they carry that label: share and agreement, ``_labels``).

    Args:
        page: the ``viz.Page`` to add the section to.
        adapter: the model's ``ModelAdapter``.
        batch: the report's tokenized prompts (``Batch``, ``[batch, pos]``).

    Example:
        >>> from tl_dynamics import odds_ratio, testing, viz
        >>> from tl_dynamics.adapter import ModelAdapter
        >>> ad, page = ModelAdapter(testing.tiny_model("gpt2")), viz.Page("report")
        >>> odds_ratio.report_section(page, ad, ad.tokenize("x = 1"))
        >>> page.sections[0].title
        'Attention as odds ratios: key prior vs distance likelihood'
    """
    result = compute(adapter, batch)
    page.add_section(
        TITLE,
        list(result.show_extremes(row=0).components),
        INTRO + " " + label_summary(result.stats),
        math="docs/math.md §2",
    )


def label_summary(stats) -> str:
    """The labels in plain words: how many heads carry each, and why the rest are undecided.

    Example:
        >>> from tl_dynamics import odds_ratio, testing
        >>> st = odds_ratio.compute(testing.tiny_model("gpt2"), "x = 1").stats
        >>> label_summary(st).startswith("Every label is undecided")
        True
    """
    n = int(stats.n_prompts)
    labels = stats.labels()
    if n < MIN_UNITS:
        return (
            f"Every label is undecided: a label is a verdict over prompts (docs/math.md §9), and "
            f"this page read {n} prompt{'s' if n != 1 else ''}, fewer than the {MIN_UNITS} a "
            "verdict needs. Give more: `--prompt` several times, or `tl-dynamics stats` over a "
            "corpus and `tl-dynamics report --stats`."
        )
    values, counts = np.unique(labels, return_counts=True)
    parts = ", ".join(f"{c} {v}" for v, c in zip(values, counts))
    return f"Labels over {n} prompts, each a verdict on 95% intervals (docs/math.md §9): {parts}."
