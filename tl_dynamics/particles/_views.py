"""Figures for particle runs, phase diagrams and the flow beside a model, from plain arrays.

Matplotlib figures are drawn in memory (``Figure``, no pyplot state) and returned as ``viz``
components (an inline PNG with its caption).
"""

from __future__ import annotations

from typing import Any, Sequence

import matplotlib
import matplotlib.ticker
import numpy as np
from matplotlib.figure import Figure

from tl_dynamics import viz

_MAX_RUN_LINES = 24


def _cmap() -> Any:
    return matplotlib.colormaps["tab10"]


def _colors(final_labels: np.ndarray) -> list[Any]:
    """One colour per particle: its final cluster's."""
    cmap = _cmap()
    uniq = {lab: k for k, lab in enumerate(sorted(set(final_labels.tolist())))}
    return [cmap(uniq[lab] % 10) for lab in final_labels.tolist()]


def plot_circle(ax: Any, times: np.ndarray, states: np.ndarray, final_labels: np.ndarray,
                run: int) -> None:
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


def run_figure(times: np.ndarray, states: np.ndarray | None, final_labels: np.ndarray, run: int,
               counts: np.ndarray, mean_cosine: np.ndarray, eps: float,
               caption: str) -> viz.Component:
    """Trajectories of one run (``states [T, n, d]`` for d = 2 or 3; None: the mean cosine
    instead) beside the cluster counts of every run."""
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


def phase_panels(panels: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray, str, float]],
                 caption: str) -> viz.Component:
    """Heat maps side by side, one per ``(times, betas, fraction [beta, t], title, eps)``."""
    fig = Figure(figsize=(4.6 * len(panels), 3.8))
    for k, (t, b, fraction, title, eps) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), k + 1)
        im = ax.pcolormesh(_edges(t), _edges(b), fraction, vmin=0, vmax=1, cmap="magma",
                           shading="flat")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("t")
        ax.set_ylabel("beta")
        fig.colorbar(im, ax=ax, label=f"fraction of eps-close pairs (eps={eps:g})")
    fig.tight_layout()
    return viz.figure(fig, caption=caption, close=False)


def beside_figure(point_labels: Sequence[str], model_clusters: np.ndarray, n_tokens: int,
                  times: np.ndarray, run_clusters: np.ndarray, run_mean_cosine: np.ndarray,
                  run_names: Sequence[str], eps: float, caption: str) -> viz.Component:
    """The model's cluster count through depth (left) beside the idealised flow's over time
    (right, one line per seeded head, ``run_clusters [T, runs]``), on the same y scale, with the
    flow's mean pairwise cosine on a second axis (it moves even while the count holds)."""
    fig = Figure(figsize=(10, 3.8))
    left, right = fig.subplots(1, 2, sharey=True)
    x = np.arange(len(point_labels))
    left.plot(x, model_clusters, marker="o")
    left.set_xticks(x, list(point_labels), rotation=45, fontsize=7)
    left.set_xlabel("depth point")
    left.set_ylabel(f"clusters among the tokens (cos > 1 - {eps:g})")
    left.set_title(f"model: {n_tokens} tokens through depth", fontsize=9)
    cmap = _cmap()
    for r, name in enumerate(run_names[:_MAX_RUN_LINES]):
        right.plot(times, run_clusters[:, r], color=cmap(r % 10), label=name)
    right.set_xlabel("time t of the idealised flow")
    right.yaxis.set_tick_params(labelleft=True)
    right.set_ylabel(f"clusters (cos > 1 - {eps:g})")
    right.set_title("(SA) seeded from the head(s) and the tokens' states", fontsize=9)
    for ax in (left, right):
        ax.axhline(n_tokens, color="0.6", ls="--", lw=0.8)
        ax.set_ylim(0, n_tokens + max(1, n_tokens // 10))
    right.text(times[-1], n_tokens, "every token alone", ha="right", va="bottom", fontsize=7,
               color="0.4")
    cos_ax = right.twinx()
    for r in range(min(len(run_names), _MAX_RUN_LINES)):
        cos_ax.plot(times, run_mean_cosine[:, r], color=cmap(r % 10), ls=":", lw=1.0)
    cos_ax.set_ylabel("mean pairwise cosine (dotted)")
    cos_ax.set_ylim(-1.05, 1.05)
    right.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    return viz.figure(fig, caption=caption, close=False)
