"""Coloured tokens, plots and tables for trajectories, from plain arrays (no result types)."""

from __future__ import annotations

from typing import Mapping, Sequence

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.figure import Figure  # no pyplot: no global state, no backend switch

from tl_dynamics import viz


def token_views(architecture: str, row: int, tokens: Sequence[str], labels: Sequence[str],
                settling: np.ndarray | None, lens_note: str, steps: np.ndarray,
                cos_final: np.ndarray) -> viz.Group:
    """One prompt's real tokens coloured by settling point, step sizes and cosine to the final
    state (``steps [token, point - 1]``, ``cos_final [token, point]``, ``settling [token]`` with
    -1 where there is no next token)."""
    n_points = len(labels)
    parts = []
    if settling is not None:
        settle = np.where(settling < 0, np.nan, settling.astype(float))
        parts.append(viz.colored_tokens(
            list(tokens), np.nan_to_num(settle, nan=float(n_points)), min_value=0.0,
            max_value=float(n_points),
            caption=f"settling point of the next-token prediction (0..{n_points - 1}; "
                    f"{n_points} = never top-1 or no next token); points: "
                    + ", ".join(f"{i}={lab}" for i, lab in enumerate(labels))))
    else:
        parts.append(viz.text(f"next-token statistics: {lens_note}"))
    parts.append(viz.colored_tokens_multi(
        list(tokens), steps, labels=[f"|step| {labels[p]}->{labels[p + 1]}"
                                     for p in range(n_points - 1)],
        caption="step size per transition"))
    parts.append(viz.colored_tokens_multi(
        list(tokens), cos_final, labels=[f"cos to final @ {lab}" for lab in labels],
        caption="cosine to the final state"))
    return viz.group(*parts, caption=f"{architecture}: token trajectories, prompt {row}")


def histogram_figure(labels: Sequence[str], bin_edges: np.ndarray, density: np.ndarray,
                     clusters: Mapping[float, np.ndarray]) -> Figure:
    """Pairwise-cosine densities per point (``density [point, bins]``) beside the mean cluster
    count per prompt at each threshold (``clusters[eps] [point]``)."""
    centres = (bin_edges[:-1] + bin_edges[1:]) / 2
    fig = Figure(figsize=(10, 3.4))
    axes = fig.subplots(1, 2)
    cmap = matplotlib.colormaps["viridis"]
    for p, lab in enumerate(labels):
        axes[0].plot(centres, density[p], color=cmap(p / max(len(labels) - 1, 1)), label=lab)
    axes[0].set_xlabel("pairwise cosine")
    axes[0].set_ylabel("density")
    axes[0].set_title("pairwise cosines per point")
    axes[0].legend(fontsize=6, ncol=2)
    x = np.arange(len(labels))
    for eps, counts in clusters.items():
        axes[1].plot(x, counts, marker="o", label=f"eps={eps:g}")
    axes[1].set_xticks(x, list(labels), rotation=60, fontsize=6)
    axes[1].set_ylabel("clusters per prompt")
    axes[1].set_title("clusters (cos > 1 - eps)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    return fig


def stats_views(labels: Sequence[str], bin_edges: np.ndarray, density: np.ndarray,
                clusters: Mapping[float, np.ndarray], frame: pd.DataFrame, caption: str,
                lens_note: str | None) -> viz.Group:
    """The statistics' plots, their table of per-point means, and why the next-token
    statistics are missing when they are (``lens_note``)."""
    parts = [viz.figure(histogram_figure(labels, bin_edges, density, clusters), close=False,
                        caption=caption),
             viz.table(frame, caption="per-point means")]
    if lens_note is not None:
        parts.append(viz.text(f"next-token statistics: {lens_note}"))
    return viz.group(*parts)
