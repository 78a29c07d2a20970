"""Coloured tokens, plots and tables for trajectories, from plain arrays (no result types)."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import pandas as pd

from tl_dynamics import viz


def token_views(
    architecture: str,
    row: int,
    tokens: Sequence[str],
    labels: Sequence[str],
    settling: np.ndarray | None,
    lens_note: str,
    steps: np.ndarray,
    cos_final: np.ndarray,
) -> viz.Group:
    """One prompt's real tokens coloured by settling point, step sizes and cosine to the final
    state (``steps [token, point - 1]``, ``cos_final [token, point]``, ``settling [token]`` with
    -1 where there is no next token)."""
    n_points = len(labels)
    parts = []
    if settling is not None:
        settle = np.where(settling < 0, np.nan, settling.astype(float))
        parts.append(
            viz.colored_tokens(
                list(tokens),
                np.nan_to_num(settle, nan=float(n_points)),
                min_value=0.0,
                max_value=float(n_points),
                caption=f"settling point of the next-token prediction (0..{n_points - 1}; "
                f"{n_points} = never top-1 or no next token); points: "
                + ", ".join(f"{i}={lab}" for i, lab in enumerate(labels)),
            )
        )
    elif lens_note:
        parts.append(viz.text(f"next-token statistics: {lens_note}"))
    parts.append(
        viz.colored_tokens_multi(
            list(tokens),
            steps,
            labels=[f"|step| {labels[p]}->{labels[p + 1]}" for p in range(n_points - 1)],
            caption="step size per transition",
        )
    )
    parts.append(
        viz.colored_tokens_multi(
            list(tokens),
            cos_final,
            labels=[f"cos to final @ {lab}" for lab in labels],
            caption="cosine to the final state",
        )
    )
    return viz.group(*parts, caption=f"{architecture}: token trajectories, prompt {row}")


# A lens cell's colour by the rank of the true next token (docs/math.md §5.3).
RANK_COLOURS = ((0, "#59a14f"), (5, "#b6d7a8"), (100, "#ffe599"), (None, "#f4cccc"))


def rank_colour(rank: int) -> str:
    """The colour of a lens cell whose next token has ``rank`` ("" without one).

    Example:
        >>> rank_colour(0), rank_colour(3), rank_colour(-1)
        ('#59a14f', '#b6d7a8', '')
    """
    if rank < 0:
        return ""
    return next(c for bound, c in RANK_COLOURS if bound is None or rank <= bound)


def lens_view(
    labels: Sequence[str],
    columns: Sequence[str],
    nexts: Sequence[str | None],
    rank: np.ndarray,
    top: np.ndarray,
    top_logit: np.ndarray,
    words: Mapping[int, str],
    caption: str,
) -> viz.Component:
    """The logit lens at a grid of cells: one row per point (``labels``), one column per position
    (``columns``, with its true next token ``nexts``; None: none), each cell its top token,
    coloured by the next token's rank, its hover the top tokens and their logits (``rank
    [point, pos]``, ``top``/``top_logit [point, pos, k]``, ``words``: id -> string).

    Example:
        >>> c = lens_view(["p0"], ["0:a"], ["b"], np.array([[0]]), np.array([[[7, 8]]]),
        ...               np.array([[[2.0, 1.0]]]), {7: "b", 8: "c"}, "lens")
        >>> 'style="background:#59a14f"' in c.html
        True
    """
    cells, colours, titles = {}, {}, {}
    for j, name in enumerate(columns):
        shown, colour, title = [], [], []
        for i in range(len(labels)):
            ids = [int(t) for t in top[i, j] if t >= 0]
            if not ids:
                shown.append("")
                colour.append("")
                title.append("not read")
                continue
            shown.append(viz.visible_token(words.get(ids[0], str(ids[0]))))
            colour.append(rank_colour(int(rank[i, j])))
            tops = ", ".join(
                f"{viz.visible_token(words.get(t, str(t)))} ({v:.2f})"
                for t, v in zip(ids, top_logit[i, j])
            )
            nxt = nexts[j]
            said = (
                f"next token {viz.visible_token(nxt)} at rank {int(rank[i, j])}"
                if nxt is not None and rank[i, j] >= 0
                else "no next token"
            )
            title.append(f"{labels[i]}: {said}; top {len(ids)}: {tops}")
        cells[name], colours[name], titles[name] = shown, colour, title
    index = pd.Index(list(labels), name="point")
    return viz.table(
        pd.DataFrame(cells, index=index),
        caption=caption,
        max_rows=len(labels) + 1,
        colours=pd.DataFrame(colours, index=index),
        titles=pd.DataFrame(titles, index=index),
    )


def histogram_views(
    labels: Sequence[str],
    bin_edges: np.ndarray,
    density: np.ndarray,
    clusters: Mapping[float, np.ndarray],
    caption: str,
) -> viz.Group:
    """Pairwise-cosine densities per point (``density [point, bins]``) beside the mean cluster
    count per prompt at each threshold (``clusters[eps] [point]``).

    Example:
        >>> views = histogram_views(["p0", "p1"], np.linspace(-1, 1, 3), np.ones((2, 2)),
        ...                         {0.1: np.array([2.0, 1.0])}, "two points")
        >>> len(views.components)
        2
    """
    centres = [f"{c:.2f}" for c in (bin_edges[:-1] + bin_edges[1:]) / 2]
    return viz.group(
        viz.line_plot(
            centres,
            {lab: density[p] for p, lab in enumerate(labels)},
            title="pairwise cosines per point",
            y_title="density",
            ordered=True,
            caption="x: cosine between two tokens' states; one line per depth point "
            "(dark: early, yellow: late)",
        ),
        viz.line_plot(
            list(labels),
            {f"eps={eps:g}": counts for eps, counts in clusters.items()},
            title="clusters (cos > 1 - eps)",
            y_title="clusters per prompt",
            caption="x: depth point; one line per threshold eps",
        ),
        caption=caption,
        row=True,
    )


# What each per-point column means (the legend beside the plot of the per-point means).
COLUMN_MEANINGS = (
    ("mean_norm", "mean length |z| of the tokens' residual states"),
    ("mean_step", "mean distance |z(p) - z(p-1)| moved since the previous point"),
    ("mean_rel_step", "that step divided by the previous length |z(p-1)|"),
    ("mean_turning_deg", "mean angle, in degrees, between a token's two latest steps"),
    ("mean_cos_final", "mean cosine between a token's state and its final state"),
    ("mean_pairwise_cos", "mean cosine between two tokens' states (1: all aligned)"),
    (
        "effective_rank",
        "effective rank exp(entropy of the normalised singular values) of the "
        "tokens' unit vectors: how many directions they spread over",
    ),
    ("clusters_eps*", "number of clusters: groups of tokens linked by cosine above 1 - eps"),
    ("merges_eps*", "mean number of cluster merges since the previous point"),
    ("mean_rank", "logit lens: mean rank of the true next token (0: the top prediction)"),
    ("mean_log1p_rank", "logit lens: mean log(1 + rank), less swayed by a few large ranks"),
    ("top1_rate", "logit lens: fraction of tokens whose next token is the top prediction"),
    (
        "mean_cos_embed, mean_cos_unembed",
        "mean cosine of the final-normalised state with the "
        "next token's embedding W_E[next] / unembedding "
        "W_U[:, next]",
    ),
    ("mean_dist_embed, mean_dist_unembed", "the same as distances"),
    (
        "settling_count",
        "number of tokens whose next-token prediction settles at this point "
        "(top-1 from here to the end)",
    ),
)
STANDARDIZE_MEANINGS = {
    "none": "the raw residual states",
    "prompt": "each dimension z-scored over the prompt's tokens (against rogue dimensions)",
}
MAX_PANELS = 24


def means_view(frame: pd.DataFrame, caption: str = "") -> viz.Component:
    """One small plot per numeric column of ``frame`` (per-point means, indexed or keyed by
    ``point``) against the point, at most ``MAX_PANELS``.

    Example:
        >>> f = pd.DataFrame({"point": ["resid_pre0", "resid_post0"], "mean_norm": [1.0, 2.0]})
        >>> means_view(f).html.count("<polyline")
        1
    """
    frame = frame.reset_index() if "point" not in frame.columns else frame
    labels = [str(x) for x in frame["point"]]
    names = [c for c in frame.columns if c != "point" and pd.api.types.is_numeric_dtype(frame[c])][
        :MAX_PANELS
    ]
    return viz.small_multiples(
        labels,
        {name: frame[name].to_numpy(dtype=float) for name in names},
        columns=4,
        caption=caption,
    )


def stats_views(
    labels: Sequence[str],
    bin_edges: np.ndarray,
    density: np.ndarray,
    clusters: Mapping[float, np.ndarray],
    frame: pd.DataFrame,
    caption: str,
    lens_note: str | None,
) -> viz.Group:
    """The statistics' plots, the per-point means as small plots with a legend saying what each
    statistic is, and why the next-token statistics are missing when they are (``lens_note``).
    A ``standardize=...`` in ``caption`` is explained after it."""
    for value, meaning in STANDARDIZE_MEANINGS.items():
        if f"standardize={value}" in caption:
            caption += f" (standardize={value}: the particle statistics use {meaning})"
    shown = set(frame.columns)
    legend = pd.DataFrame(
        [
            {"statistic": name, "meaning": meaning}
            for name, meaning in COLUMN_MEANINGS
            if any(_matches(part.strip(), shown) for part in name.split(","))
        ]
    )
    parts = [
        histogram_views(labels, bin_edges, density, clusters, caption),
        means_view(
            frame,
            caption="The per-point means over the prompt's tokens, one plot "
            "per statistic (x: depth point, as above; hover a point "
            "for its value); what each is:",
        ),
        viz.table(legend, max_rows=len(legend) + 1),
    ]
    if lens_note is not None:
        parts.append(viz.text(f"next-token statistics: {lens_note}"))
    return viz.group(*parts)


def _matches(pattern: str, columns: set[str]) -> bool:
    if pattern.endswith("*"):
        return any(c.startswith(pattern[:-1]) for c in columns)
    return pattern in columns
