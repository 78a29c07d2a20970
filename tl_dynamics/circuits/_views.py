"""Heat maps for per-head and per-pair scores (matplotlib, via ``viz.figure``)."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
from matplotlib.figure import Figure

from tl_dynamics import viz

MAX_TICKS = 48  # beyond this many rows/columns, label every n-th only


class Panel(NamedTuple):
    title: str
    values: np.ndarray
    row_labels: Sequence[str]
    col_labels: Sequence[str]
    xlabel: str = ""
    ylabel: str = ""
    limits: tuple[float, float] | None = None  # default: symmetric around 0


def heatmaps(panels: Sequence[Panel], caption: str) -> viz.Component:
    """Heat maps side by side in one figure; NaN cells are left blank.

    Drawn on a standalone ``matplotlib.figure.Figure`` (no pyplot state, no backend switch).

    Example:
        >>> panel = Panel("scores", np.eye(2), ["L0", "L1"], ["H0", "H1"])
        >>> heatmaps([panel], caption="two heads").caption
        'two heads'
    """
    widths = [min(5.5, 1.5 + 0.25 * len(p.col_labels)) for p in panels]
    height = max(min(5.5, 1.2 + 0.25 * len(p.row_labels)) for p in panels)
    fig = Figure(figsize=(sum(widths), height))
    axes = fig.subplots(1, len(panels), squeeze=False, gridspec_kw={"width_ratios": widths})
    for n, (ax, p) in enumerate(zip(axes[0], panels)):
        lo, hi = p.limits or symmetric_limits([p.values])
        image = ax.imshow(np.ma.masked_invalid(p.values), cmap="RdBu_r", vmin=lo, vmax=hi,
                          aspect="auto", interpolation="nearest")
        ax.set_title(p.title, fontsize=8)
        for labels, set_ticks in ((p.col_labels, ax.set_xticks), (p.row_labels, ax.set_yticks)):
            step = max(1, -(-len(labels) // MAX_TICKS))
            ticks = list(range(0, len(labels), step))
            set_ticks(ticks, [str(labels[t]) for t in ticks], fontsize=5)
        ax.tick_params(axis="x", labelrotation=90)
        ax.set_xlabel(p.xlabel, fontsize=7)
        ax.set_ylabel(p.ylabel, fontsize=7)
        if n + 1 == len(panels) or panels[n + 1].limits != p.limits or p.limits is None:
            fig.colorbar(image, ax=ax, fraction=0.046, pad=0.02)  # one per run of shared limits
    return viz.figure(fig, caption=caption)


def symmetric_limits(arrays: Sequence[np.ndarray]) -> tuple[float, float]:
    finite = np.concatenate([a[np.isfinite(a)].ravel() for a in arrays])
    lim = float(np.abs(finite).max()) if finite.size else 1.0
    return (-lim, lim) if lim > 0 else (-1.0, 1.0)


def head_labels(layers: Sequence[int], n_heads: int) -> list[str]:
    return [f"L{l}H{h}" for l in layers for h in range(n_heads)]
