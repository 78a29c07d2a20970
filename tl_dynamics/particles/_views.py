"""Figures for particle runs, phase diagrams and the flow beside a model, from plain arrays.

Runs and phase diagrams are matplotlib figures drawn in memory (``Figure``, no pyplot state)
and returned as ``viz`` components (an inline PNG with its caption); the flow beside a model is
inline SVG line plots.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from tl_dynamics import viz

_MAX_RUN_LINES = 24


def _cmap() -> Any:
    import matplotlib  # imported when drawn: importing the package stays light

    return matplotlib.colormaps["tab10"]


def _colors(final_labels: np.ndarray) -> list[Any]:
    """One colour per particle: its final cluster's."""
    cmap = _cmap()
    uniq = {lab: k for k, lab in enumerate(sorted(set(final_labels.tolist())))}
    return [cmap(uniq[lab] % 10) for lab in final_labels.tolist()]


def plot_circle(
    ax: Any, times: np.ndarray, states: np.ndarray, final_labels: np.ndarray, run: int
) -> None:
    """d = 2 on a polar axis: angle = position on the circle, radius = time (t = 0 at the centre).

    ``states [T, n, 2]``, ``final_labels [n]``.
    """
    th = np.unwrap(np.arctan2(states[..., 1], states[..., 0]), axis=0)
    r = 0.15 + 0.85 * (times - times[0]) / max(times[-1] - times[0], 1e-300)
    for i, color in enumerate(_colors(final_labels)):
        ax.plot(th[:, i], r, lw=0.8, color=color)
        ax.plot([th[-1, i]], [r[-1]], "o", ms=4, color=color)
    ax.set_rticks([])
    ax.set_title(f"run {run}: circle (radius = time)", fontsize=9)


def plot_sphere(ax: Any, states: np.ndarray, final_labels: np.ndarray, run: int) -> None:
    """d = 3 on a 3-D axis: a wire sphere, each particle's path, final positions as dots."""
    u, v = np.mgrid[0 : 2 * np.pi : 24j, 0 : np.pi : 12j]
    ax.plot_wireframe(np.cos(u) * np.sin(v), np.sin(u) * np.sin(v), np.cos(v), color="0.85", lw=0.4)
    for i, color in enumerate(_colors(final_labels)):
        ax.plot(states[:, i, 0], states[:, i, 1], states[:, i, 2], lw=0.8, color=color)
        ax.scatter([states[-1, i, 0]], [states[-1, i, 1]], [states[-1, i, 2]], s=10, color=color)
    ax.set_box_aspect((1, 1, 1))
    ax.set_axis_off()
    ax.set_title(f"run {run}: sphere", fontsize=9)


def plot_cluster_counts(ax: Any, times: np.ndarray, counts: np.ndarray, eps: float) -> None:
    """Cluster count over time (``counts [T, runs]``): one thin step line per run (up to 24)
    and the mean."""
    for r in range(min(counts.shape[1], _MAX_RUN_LINES)):
        ax.step(times, counts[:, r], where="post", lw=0.7, alpha=0.5)
    ax.plot(times, counts.mean(1), color="k", lw=1.6, label="mean over runs")
    if times[0] >= 0 and len(times) > 2 and times[-1] / max(times[1], 1e-300) > 100:
        ax.set_xscale("symlog", linthresh=max(times[1], 1e-3))
    ax.set_yscale("log", base=2)
    top = int(max(counts.max(), 1))
    ax.set_yticks([2**k for k in range(top.bit_length() + 1) if 2**k <= 2 * top])
    import matplotlib.ticker

    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("t")
    ax.set_ylabel(f"clusters (eps={eps:g})")
    ax.legend(fontsize=8, loc="upper right")


def plot_mean_cosine(ax: Any, times: np.ndarray, mean_cosine: np.ndarray) -> None:
    """Mean pairwise cosine over time, per run (``[T, runs]``) and its mean."""
    ax.plot(times, mean_cosine, lw=0.6, alpha=0.4)
    ax.plot(times, mean_cosine.mean(1), color="k", lw=1.6)
    ax.set_xlabel("t")
    ax.set_ylabel("mean <x_i, x_j>")


def run_figure(
    times: np.ndarray,
    states: np.ndarray | None,
    final_labels: np.ndarray,
    run: int,
    counts: np.ndarray,
    mean_cosine: np.ndarray,
    eps: float,
    caption: str,
) -> viz.Component:
    """Trajectories of one run (``states [T, n, d]`` for d = 2 or 3; None: the mean cosine
    instead) beside the cluster counts of every run."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    if states is not None and states.shape[-1] == 2:
        plot_circle(fig.add_subplot(1, 2, 1, projection="polar"), times, states, final_labels, run)
    elif states is not None:
        plot_sphere(fig.add_subplot(1, 2, 1, projection="3d"), states, final_labels, run)
    else:
        plot_mean_cosine(fig.add_subplot(1, 2, 1), times, mean_cosine)
    plot_cluster_counts(fig.add_subplot(1, 2, 2), times, counts, eps)
    fig.tight_layout()
    return viz.figure(fig, caption=caption, close=False)


def _edges(c: np.ndarray) -> np.ndarray:
    if len(c) == 1:
        return np.array([c[0] - 0.5, c[0] + 0.5])
    mid = (c[1:] + c[:-1]) / 2
    return np.concatenate([[c[0] - (mid[0] - c[0])], mid, [c[-1] + (c[-1] - mid[-1])]])


def phase_panels(
    panels: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray, str, float]], caption: str
) -> viz.Component:
    """Heat maps side by side, one per ``(times, betas, fraction [beta, t], title, eps)``."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.6 * len(panels), 3.8))
    for k, (t, b, fraction, title, eps) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), k + 1)
        im = ax.pcolormesh(
            _edges(t), _edges(b), fraction, vmin=0, vmax=1, cmap="magma", shading="flat"
        )
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("t")
        ax.set_ylabel("beta")
        fig.colorbar(im, ax=ax, label=f"fraction of eps-close pairs (eps={eps:g})")
    fig.tight_layout()
    return viz.figure(fig, caption=caption, close=False)


def beside_figure(
    point_labels: Sequence[str],
    model_clusters: np.ndarray,
    n_tokens: int,
    times: np.ndarray,
    run_clusters: np.ndarray,
    run_mean_cosine: np.ndarray,
    run_names: Sequence[str],
    eps: float,
    caption: str,
) -> viz.Group:
    """The model's cluster count through depth beside the idealised flow's over time (one line
    per seeded head, ``run_clusters [T, runs]``) on the same y scale, and the flow's mean
    pairwise cosine (it moves even while the count holds); inline SVG plots.

    Example:
        >>> view = beside_figure(["p0", "p1"], np.array([3.0, 2.0]), 3, np.array([0.0, 1.0]),
        ...                      np.array([[3.0], [1.0]]), np.array([[0.1], [0.9]]), ["L0H0"],
        ...                      0.1, "two points")
        >>> len(view.components)
        3
    """
    alone = f"{n_tokens}: every token alone"
    y_range = (0.0, float(n_tokens + max(1, n_tokens // 10)))
    y_title = f"clusters (cos > 1 - {eps:g})"
    shown = list(run_names[:_MAX_RUN_LINES])
    t_labels = [f"{t:.3g}" for t in times]
    model = viz.line_plot(
        list(point_labels),
        {alone: np.full(len(point_labels), n_tokens), "model": model_clusters},
        title=f"model: {n_tokens} tokens through depth",
        y_title=y_title,
        x_title="depth point",
        y_range=y_range,
        dashed=[alone],
        width=520,
    )
    flow = viz.line_plot(
        t_labels,
        {
            alone: np.full(len(times), n_tokens),
            **{name: run_clusters[:, r] for r, name in enumerate(shown)},
        },
        title="(SA) flow seeded from the head(s) and the tokens",
        y_title=y_title,
        x_title="time t of the idealised flow",
        x_values=times,
        y_range=y_range,
        dashed=[alone],
        width=520,
    )
    cosine = viz.line_plot(
        t_labels,
        {name: run_mean_cosine[:, r] for r, name in enumerate(shown)},
        title="(SA) flow: mean pairwise cosine",
        y_title="mean <x_i, x_j>",
        x_title="time t of the idealised flow",
        x_values=times,
        y_range=(-1.05, 1.05),
        width=520,
    )
    return viz.group(model, flow, cosine, caption=caption, row=True)
