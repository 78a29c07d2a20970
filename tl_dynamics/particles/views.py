"""Figures for particle runs and phase diagrams (matplotlib, rendered in memory, no pyplot state)."""

from __future__ import annotations

import base64
import html
import io
from typing import Optional

import matplotlib
import matplotlib.ticker
import numpy as np
from matplotlib.figure import Figure

from tl_dynamics.errors import TLDynamicsError

_DPI = 90
_MAX_RUN_LINES = 24


class FigureView:
    """A rendered figure that notebooks display (PNG), with its caption and the matplotlib figure."""

    def __init__(self, figure: Figure, caption: str) -> None:
        self.figure = figure
        self.caption = caption
        self._png: Optional[bytes] = None

    def png(self) -> bytes:
        if self._png is None:
            buf = io.BytesIO()
            self.figure.savefig(buf, format="png", dpi=_DPI, bbox_inches="tight")
            self._png = buf.getvalue()
        return self._png

    def svg(self) -> str:
        buf = io.StringIO()
        self.figure.savefig(buf, format="svg", bbox_inches="tight")
        return buf.getvalue()

    def save(self, path: str) -> None:
        self.figure.savefig(path, dpi=_DPI, bbox_inches="tight")

    def html(self) -> str:
        """``<figure>`` with the PNG inline (base64) and the HTML-escaped caption."""
        b64 = base64.b64encode(self.png()).decode("ascii")
        cap = html.escape(self.caption)
        return f'<figure><img alt="{cap}" src="data:image/png;base64,{b64}"/><figcaption>{cap}</figcaption></figure>'

    def _repr_png_(self) -> bytes:
        return self.png()

    def __repr__(self) -> str:
        return f"FigureView({self.caption!r})"


# --------------------------------------------------------------------------- captions
def _beta_str(beta) -> str:
    if isinstance(beta, list):
        return f"{min(beta):g}..{max(beta):g}" if len(set(beta)) > 1 else f"{beta[0]:g}"
    return f"{beta:g}"


def run_caption(run, eps: float) -> str:
    p = run.params
    src = p.get("source") or {}
    qkv = "Q=K=V=I" if p.get("qkv") == "identity" else "custom Q, K, V"
    if src.get("kind") == "head":
        qkv = f"Q, K, V from {src.get('model')} L{src.get('layer')}H{src.get('head')}"
    counts = run.cluster_counts(eps)
    c0, c1 = np.median(counts[0].numpy()), np.median(counts[-1].numpy())
    return (
        f"({p.get('dynamics')}) {qkv}, beta={_beta_str(p.get('beta'))}, n={run.n}, d={run.d}, "
        f"{run.n_runs} runs, t in [{float(run.times[0]):g}, {float(run.times[-1]):g}]; "
        f"eps={eps:g} clusters (median over runs): {c0:g} -> {c1:g}"
    )


# --------------------------------------------------------------------------- panels
def _angles(states: np.ndarray) -> np.ndarray:
    return np.unwrap(np.arctan2(states[..., 1], states[..., 0]), axis=0)


def plot_circle(ax, run, run_index: int = 0, eps: Optional[float] = None) -> None:
    """d = 2 on a polar axis: angle = position on the circle, radius = time (t = 0 at the centre)."""
    st = run.states[:, run_index].numpy()
    th = _angles(st)
    t = run.times.numpy()
    r = 0.15 + 0.85 * (t - t[0]) / max(t[-1] - t[0], 1e-300)
    labels = run.labels_at(eps)[-1, run_index].numpy()
    cmap = _cmap()
    uniq = {l: k for k, l in enumerate(sorted(set(labels.tolist())))}
    for i in range(st.shape[1]):
        color = cmap(uniq[labels[i]] % 10)
        ax.plot(th[:, i], r, lw=0.8, color=color)
        ax.plot([th[-1, i]], [r[-1]], "o", ms=4, color=color)
    ax.set_rticks([])
    ax.set_title(f"run {run_index}: circle (radius = time)", fontsize=9)


def plot_sphere(ax, run, run_index: int = 0, eps: Optional[float] = None) -> None:
    """d = 3 on a 3-D axis: a wire sphere, each particle's path, final positions as dots."""
    st = run.states[:, run_index].numpy()
    u, v = np.mgrid[0 : 2 * np.pi : 24j, 0 : np.pi : 12j]
    ax.plot_wireframe(np.cos(u) * np.sin(v), np.sin(u) * np.sin(v), np.cos(v), color="0.85", lw=0.4)
    labels = run.labels_at(eps)[-1, run_index].numpy()
    cmap = _cmap()
    uniq = {l: k for k, l in enumerate(sorted(set(labels.tolist())))}
    for i in range(st.shape[1]):
        color = cmap(uniq[labels[i]] % 10)
        ax.plot(st[:, i, 0], st[:, i, 1], st[:, i, 2], lw=0.8, color=color)
        ax.scatter([st[-1, i, 0]], [st[-1, i, 1]], [st[-1, i, 2]], s=10, color=color)
    ax.set_box_aspect((1, 1, 1))
    ax.set_axis_off()
    ax.set_title(f"run {run_index}: sphere", fontsize=9)


def plot_cluster_counts(ax, run, eps: Optional[float] = None) -> None:
    """Cluster count over time: one thin step line per run (up to 24) and the mean."""
    counts = run.cluster_counts(eps).numpy().astype(float)
    t = run.times.numpy()
    for r in range(min(counts.shape[1], _MAX_RUN_LINES)):
        ax.step(t, counts[:, r], where="post", lw=0.7, alpha=0.5)
    ax.plot(t, counts.mean(1), color="k", lw=1.6, label="mean over runs")
    if t[0] >= 0 and len(t) > 2 and t[-1] / max(t[1], 1e-300) > 100:
        ax.set_xscale("symlog", linthresh=max(t[1], 1e-3))
    ax.set_yscale("log", base=2)
    top = int(max(counts.max(), 1))
    ax.set_yticks([2**k for k in range(top.bit_length() + 1) if 2**k <= 2 * top])
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("t")
    ax.set_ylabel(f"clusters (eps={run._eps(eps, 'show'):g})")
    ax.legend(fontsize=8, loc="upper right")


def plot_mean_cosine(ax, run) -> None:
    t = run.times.numpy()
    m = run.mean_cosine.numpy()
    ax.plot(t, m, lw=0.6, alpha=0.4)
    ax.plot(t, m.mean(1), color="k", lw=1.6)
    ax.set_xlabel("t")
    ax.set_ylabel("mean <x_i, x_j>")


def _cmap():
    return matplotlib.colormaps["tab10"]


# --------------------------------------------------------------------------- figures
def run_figure(run_obj, eps: Optional[float] = None, run: int = 0) -> FigureView:
    """Trajectories (d = 2: circle, d = 3: sphere, when states were kept) beside cluster counts."""
    e = run_obj._eps(eps, "show")
    if not 0 <= run < run_obj.n_runs:
        raise TLDynamicsError(f"ParticleRun.show: run must be in [0, {run_obj.n_runs}), got {run}")
    fig = Figure(figsize=(10, 4))
    has_traj = run_obj.states is not None and run_obj.d in (2, 3)
    if has_traj and run_obj.d == 2:
        plot_circle(fig.add_subplot(1, 2, 1, projection="polar"), run_obj, run, e)
    elif has_traj:
        plot_sphere(fig.add_subplot(1, 2, 1, projection="3d"), run_obj, run, e)
    else:
        plot_mean_cosine(fig.add_subplot(1, 2, 1), run_obj)
    plot_cluster_counts(fig.add_subplot(1, 2, 2), run_obj, e)
    fig.tight_layout()
    return FigureView(fig, run_caption(run_obj, e))


def phase_figure(*diagrams) -> FigureView:
    """Heat maps of the eps-close pair fraction over (t, beta), side by side.

    >>> import torch
    >>> from tl_dynamics.particles import phase_diagram
    >>> sa = phase_diagram([0.0, 4.0], [0.0, 2.0], n=8, runs=2, generator=torch.Generator().manual_seed(0))
    >>> phase_figure(sa).png()[:4]
    b'\\x89PNG'
    """
    if not diagrams:
        raise TLDynamicsError("phase_figure: give at least one PhaseDiagram")
    fig = Figure(figsize=(4.6 * len(diagrams), 3.8))
    caps = []
    for k, pd_ in enumerate(diagrams):
        ax = fig.add_subplot(1, len(diagrams), k + 1)
        t, b = pd_.times.numpy(), pd_.betas.numpy()
        im = ax.pcolormesh(_edges(t), _edges(b), pd_.fraction.numpy(), vmin=0, vmax=1, cmap="magma", shading="flat")
        p = pd_.params
        ax.set_title(f"({p['dynamics']}) n={p['n']}, d={p['d']}, {p['runs']} runs", fontsize=9)
        ax.set_xlabel("t")
        ax.set_ylabel("beta")
        fig.colorbar(im, ax=ax, label=f"fraction of eps-close pairs (eps={p['eps']:g})")
        caps.append(f"({p['dynamics']}) beta in [{b.min():g}, {b.max():g}], t in [{t.min():g}, {t.max():g}]")
    fig.tight_layout()
    return FigureView(fig, "Phase diagram, Q=K=V=I: " + "; ".join(caps))


def _edges(c: np.ndarray) -> np.ndarray:
    if len(c) == 1:
        return np.array([c[0] - 0.5, c[0] + 0.5])
    mid = (c[1:] + c[:-1]) / 2
    return np.concatenate([[c[0] - (mid[0] - c[0])], mid, [c[-1] + (c[-1] - mid[-1])]])


# --------------------------------------------------------------------------- report
def report_html(obj, title: Optional[str] = None) -> str:
    """An HTML fragment (``<section>`` with an inline PNG and caption; all text escaped).

    ``obj``: a :class:`ParticleRun`, a :class:`PhaseDiagram`, a sequence of phase
    diagrams (drawn side by side) or a :class:`FigureView`.

    >>> import torch
    >>> from tl_dynamics.particles import random_init, simulate
    >>> run = simulate(random_init(2, 6, 2, torch.Generator().manual_seed(0)), 4.0, t_max=2.0)
    >>> html = report_html(run, title="beta = 4 & d = 2")
    >>> html[:76]
    '<section class="tl-dynamics-particles"><h3>beta = 4 &amp; d = 2</h3><figure>'
    """
    from .phase import PhaseDiagram
    from .result import ParticleRun

    if isinstance(obj, FigureView):
        view = obj
    elif isinstance(obj, ParticleRun):
        view = run_figure(obj)
    elif isinstance(obj, PhaseDiagram):
        view = phase_figure(obj)
    elif isinstance(obj, (list, tuple)) and obj and all(isinstance(o, PhaseDiagram) for o in obj):
        view = phase_figure(*obj)
    else:
        raise TLDynamicsError(
            f"report_html: expected a ParticleRun, PhaseDiagram(s) or FigureView, got {type(obj).__name__}"
        )
    head = html.escape(title if title is not None else "Idealised particle dynamics")
    return f'<section class="tl-dynamics-particles"><h3>{head}</h3>{view.html()}</section>'
