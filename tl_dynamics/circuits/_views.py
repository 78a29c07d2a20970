"""Heat maps for per-head and per-pair scores (matplotlib, via ``viz.figure``)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from tl_dynamics import viz


def heatmaps(panels: Sequence[tuple[str, np.ndarray]], row_labels: Sequence[str],
             col_labels: Sequence[str], caption: str, xlabel: str = "", ylabel: str = "",
             symmetric: bool = True, vmin: float | None = None, vmax: float | None = None):
    """One or more heat maps side by side; NaN cells are left blank.

    Falls back to a table per panel when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        import pandas as pd

        return viz.group(*[viz.table(pd.DataFrame(values, index=list(row_labels),
                                                  columns=list(col_labels)), caption=f"{title}")
                           for title, values in panels], caption=caption + " (matplotlib is not "
                                                                          "installed: tables)")
    n = len(panels)
    width = min(6.0, 1.2 + 0.32 * len(col_labels))
    height = min(6.0, 1.0 + 0.3 * len(row_labels))
    fig, axes = plt.subplots(1, n, figsize=(width * n, height), squeeze=False)
    for ax, (title, values) in zip(axes[0], panels):
        finite = values[np.isfinite(values)]
        lim = float(np.abs(finite).max()) if finite.size else 1.0
        lo, hi = (vmin, vmax) if vmin is not None or vmax is not None else \
            ((-lim, lim) if symmetric else (float(finite.min()) if finite.size else 0.0, lim))
        image = ax.imshow(np.ma.masked_invalid(values), cmap="RdBu_r" if symmetric else "viridis",
                          vmin=lo, vmax=hi, aspect="auto", interpolation="nearest")
        ax.set_title(title, fontsize=9)
        ax.set_xticks(range(len(col_labels)), list(col_labels), rotation=90, fontsize=6)
        ax.set_yticks(range(len(row_labels)), list(row_labels), fontsize=6)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    return viz.figure(fig, caption=caption)


def head_labels(layers: Sequence[int], n_heads: int) -> list[str]:
    return [f"L{l}H{h}" for l in layers for h in range(n_heads)]
