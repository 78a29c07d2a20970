"""The views of QK attribution (``tl_dynamics.viz`` only): the component x component map of one
score, and per-destination strips of the components' shares (docs/math.md §10)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from tl_dynamics import viz

MAX_STRIP_COMPONENTS = 12  # columns of a share strip: the components that lead most often
MAX_PAIR_COMPONENTS = 24  # rows/columns of a pair map: the components with the largest parts


def share_strips(
    shares: np.ndarray, names: Sequence[str], tokens: Sequence[str], title: str
) -> viz.Component:
    """``[rows, components]`` shares as a map: one row per destination (its token), the columns
    the components with the largest mean |share| (at most ``MAX_STRIP_COMPONENTS``)."""
    if shares.size == 0:
        return viz.text(f"{title}: no destination has at least two keys.")
    score = np.nan_to_num(np.abs(shares)).mean(0)
    keep = np.sort(np.argsort(-score)[:MAX_STRIP_COMPONENTS])
    return viz.heatmap(
        shares[:, keep],
        row_labels=list(tokens),
        col_labels=[str(names[c]) for c in keep],
        title=title,
        row_title="destination",
        col_title="component",
        value_name="share",
        caption=(
            f"{title}: each component's share of the row's lift, its attention-weighted score "
            f"above the row's average key (a row's shares over all components sum to 1; a "
            f"component working against the attended key has a negative share, so others can "
            f"exceed 1; the {len(keep)} largest shown); docs/math.md §10.4."
        ),
    )


def pair_map(
    matrix: np.ndarray,
    query_labels: Sequence[str],
    key_labels: Sequence[str],
    title: str,
    caption: str,
) -> viz.Component:
    """The component x component map of one score (the largest |parts| rows and columns)."""
    rows = np.sort(np.argsort(-np.abs(matrix).sum(1))[:MAX_PAIR_COMPONENTS])
    cols = np.sort(np.argsort(-np.abs(matrix).sum(0))[:MAX_PAIR_COMPONENTS])
    return viz.heatmap(
        matrix[np.ix_(rows, cols)],
        row_labels=[str(query_labels[r]) for r in rows],
        col_labels=[str(key_labels[c]) for c in cols],
        title=title,
        row_title="query component",
        col_title="key component",
        value_name="score part",
        caption=caption,
    )
