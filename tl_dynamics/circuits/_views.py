"""Heat maps for per-head and per-pair scores (matplotlib, via ``viz.figure``)."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

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
    from matplotlib.figure import Figure  # imported when drawn: importing the package stays light

    fig = Figure(
        figsize=(sum(widths) + 0.8 * len(panels), height), layout="constrained"
    )  # room for colour bars
    axes = fig.subplots(1, len(panels), squeeze=False, gridspec_kw={"width_ratios": widths})
    for n, (ax, p) in enumerate(zip(axes[0], panels)):
        lo, hi = p.limits or symmetric_limits([p.values])
        image = ax.imshow(
            np.ma.masked_invalid(p.values),
            cmap="RdBu_r",
            vmin=lo,
            vmax=hi,
            aspect="auto",
            interpolation="nearest",
        )
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


def score_maps(panels: Sequence[Panel], caption: str, cell_px: int = 16) -> viz.Group:
    """The panels as page heat maps side by side (``viz.heatmap``: compact, drawn when scrolled
    to, each with its own colour legend and hover read-out); NaN cells are grey.

    Example:
        >>> panel = Panel("scores", np.eye(2), ["L0", "L1"], ["H0", "H1"], "head", "layer")
        >>> score_maps([panel], caption="two heads").components[0].name
        'Heatmap'
    """
    maps = []
    for p in panels:
        lo, hi = p.limits or symmetric_limits([p.values])
        maps.append(
            viz.heatmap(
                np.asarray(p.values, dtype=np.float32),
                list(p.row_labels),
                list(p.col_labels),
                title=p.title,
                row_title=p.ylabel or "row",
                col_title=p.xlabel or "column",
                value_name=p.title,
                min_value=lo,
                max_value=hi,
                cmap="rdbu",
                cell_px=cell_px,
            )
        )
    return viz.group(*maps, caption=caption, row=True)


def topk_table(frame, rows: int, caption: str) -> viz.Component:
    """A ``TokenTopK.to_dataframe()`` as one line per row token: the columns it scores highest
    and lowest, each with its value (first ``rows`` row tokens).

    Example:
        >>> import pandas as pd
        >>> f = pd.DataFrame(dict(row=[0, 0], row_label=["a", "a"], side=["top", "bottom"],
        ...                       top_rank=[0, 0], col=[1, 2], col_label=["b", "c"], value=[2.0, -1.0]))
        >>> topk_table(f, 10, "read-out").caption
        'read-out'
    """
    import pandas as pd

    lines = []
    for _, part in frame.groupby("row", sort=False):
        if len(lines) == rows:
            break
        cells = {
            side: ", ".join(
                f"{viz.visible_token(c)} ({v:+.2g})"
                for c, v in zip(group["col_label"], group["value"])
            )
            for side, group in part.sort_values("top_rank").groupby("side")
        }
        lines.append(
            {
                "token": viz.visible_token(part["row_label"].iloc[0]),
                "raises most (logit)": cells.get("top", ""),
                "lowers most (logit)": cells.get("bottom", ""),
            }
        )
    return viz.table(pd.DataFrame(lines), caption=caption, max_rows=rows)
