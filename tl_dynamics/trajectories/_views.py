"""Tables, plots and coloured tokens for trajectories, and the report section."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from tl_dynamics.trajectories._stats import TrajectoryStats
    from tl_dynamics.trajectories._trajectory import Trajectory



def trajectory_frame(traj: "Trajectory") -> Any:
    """Long table: one row per (prompt, point, real token)."""
    import pandas as pd

    rows = []
    n_points = traj.n_points
    for b in range(traj.tokens.shape[0]):
        for t in traj.key_valid[b].nonzero().flatten().tolist():
            for p in range(n_points):
                row = {"prompt": b, "pos": t, "token": traj.str_tokens[b][t],
                       "point": traj.labels[p], "norm": float(traj.norm[b, p, t]),
                       "cos_final": float(traj.cos_final[b, p, t]),
                       "step": float(traj.step[b, p - 1, t]) if p >= 1 else np.nan,
                       "rel_step": float(traj.rel_step[b, p - 1, t]) if p >= 1 else np.nan,
                       "turning_deg": float(traj.turning[b, p - 2, t]) if p >= 2 else np.nan}
                if traj.rank is not None:
                    row.update(rank=int(traj.rank[b, p, t]), settling=int(traj.settling[b, t]),
                               cos_embed=float(traj.cos_embed[b, p, t]),
                               dist_embed=float(traj.dist_embed[b, p, t]),
                               cos_unembed=float(traj.cos_unembed[b, p, t]),
                               dist_unembed=float(traj.dist_unembed[b, p, t]))
                rows.append(row)
    return pd.DataFrame(rows)


def show_trajectory(traj: "Trajectory", row: int = 0) -> Any:
    from tl_dynamics import viz
    from tl_dynamics.errors import TLDynamicsError

    if not 0 <= row < traj.tokens.shape[0]:
        raise TLDynamicsError(f"row {row} is out of range: the batch has {traj.tokens.shape[0]} "
                              "prompts")
    real = traj.key_valid[row].nonzero().flatten()
    tokens = [traj.str_tokens[row][t] for t in real.tolist()]
    parts = []
    if traj.settling is not None:
        settle = traj.settling[row, real].float().numpy()
        settle = np.where(settle < 0, np.nan, settle)
        parts.append(viz.colored_tokens(
            tokens, np.nan_to_num(settle, nan=float(traj.n_points)), min_value=0.0,
            max_value=float(traj.n_points),
            caption=f"settling point of the next-token prediction (0..{traj.n_points - 1}; "
                    f"{traj.n_points} = never top-1 or no next token); points: "
                    + ", ".join(f"{i}={lab}" for i, lab in enumerate(traj.labels))))
    else:
        parts.append(viz.text(f"next-token statistics: {traj.lens_note}"))
    steps = traj.step[row][:, real].T.numpy()  # [tokens, steps]
    parts.append(viz.colored_tokens_multi(
        tokens, steps, labels=[f"|step| {traj.labels[p]}->{traj.labels[p + 1]}"
                               for p in range(traj.n_points - 1)],
        caption="step size per transition"))
    parts.append(viz.colored_tokens_multi(
        tokens, traj.cos_final[row][:, real].T.numpy(),
        labels=[f"cos to final @ {lab}" for lab in traj.labels], caption="cosine to the final state"))
    return viz.group(*parts, caption=f"{traj.architecture}: token trajectories, prompt {row}")


def stats_frame(stats: "TrajectoryStats") -> Any:
    import pandas as pd

    labels = list(stats.labels)
    n = len(labels)

    def shifted(values: np.ndarray, offset: int) -> list[float]:
        return [np.nan] * offset + list(values)

    data: dict[str, Any] = {"point": labels, "mean_norm": stats.mean("norm"),
                            "mean_step": shifted(stats.mean("step"), 1),
                            "mean_rel_step": shifted(stats.mean("rel_step"), 1),
                            "mean_turning_deg": shifted(stats.mean("turning"), 2) if n > 2 else
                            [np.nan] * n,
                            "mean_cos_final": stats.mean("cos_final"),
                            "mean_pairwise_cos": stats.mean_pairwise_cos(),
                            "effective_rank": stats.effective_rank()}
    for eps in stats.eps:
        data[f"clusters_eps{eps:g}"] = stats.cluster_counts(eps)
        data[f"merges_eps{eps:g}"] = shifted(stats.merge_events(eps), 1)
    if stats.has_lens:
        data["mean_rank"] = stats.mean_rank()
        data["mean_log1p_rank"] = stats.mean("log_rank")
        data["top1_rate"] = stats.top1_rate()
        for name in ("cos_embed", "cos_unembed", "dist_embed", "dist_unembed"):
            data[f"mean_{name}"] = stats.mean(name)
        data["settling_count"] = stats.settling_histogram()[:n]
    return pd.DataFrame(data).set_index("point")


def histogram_figure(stats: "TrajectoryStats") -> Any:
    import matplotlib
    from matplotlib.figure import Figure  # no pyplot: no global state, no backend switch

    from tl_dynamics.trajectories._particles import BIN_EDGES

    hist = stats.cos_histogram(density=True)
    centres = ((BIN_EDGES[:-1] + BIN_EDGES[1:]) / 2).numpy()
    fig = Figure(figsize=(10, 3.4))
    axes = fig.subplots(1, 2)
    cmap = matplotlib.colormaps["viridis"]
    for p, lab in enumerate(stats.labels):
        axes[0].plot(centres, hist[p], color=cmap(p / max(len(stats.labels) - 1, 1)), label=lab)
    axes[0].set_xlabel("pairwise cosine")
    axes[0].set_ylabel("density")
    axes[0].set_title("pairwise cosines per point")
    axes[0].legend(fontsize=6, ncol=2)
    x = np.arange(len(stats.labels))
    for eps in stats.eps:
        axes[1].plot(x, stats.cluster_counts(eps), marker="o", label=f"eps={eps:g}")
    axes[1].set_xticks(x, stats.labels, rotation=60, fontsize=6)
    axes[1].set_ylabel("clusters per prompt")
    axes[1].set_title("clusters (cos > 1 - eps)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    return fig


def show_stats(stats: "TrajectoryStats") -> Any:
    from tl_dynamics import viz

    parts = [viz.figure(histogram_figure(stats), close=False, caption=(
        f"{stats.meta['architecture']}: {stats.n_prompts} prompts, {stats.n_tokens} tokens; "
        f"standardize={stats.meta['standardize']}"))]
    parts.append(viz.table(stats_frame(stats), caption="per-point means"))
    if not stats.has_lens:
        parts.append(viz.text(f"next-token statistics: {stats.meta.get('lens_note')}"))
    return viz.group(*parts)


def report_section(page: Any, adapter: Any, batch: Any) -> Any:
    """Add the trajectories section (per-token views and particle statistics) to ``page``."""
    from tl_dynamics import viz
    from tl_dynamics.trajectories._points import Config
    from tl_dynamics.trajectories._stats import reduce_batch
    from tl_dynamics.trajectories._stream import _meta
    from tl_dynamics.trajectories._trajectory import build, lens_note
    from tl_dynamics.trajectories._walk import Walker

    cfg = Config()
    holder: dict[str, Any] = {}
    Walker(adapter, cfg, lambda raw, b: holder.__setitem__("raw", raw), batch).run(batch)
    traj = build(adapter, cfg, holder["raw"], batch, batch.key_valid)
    stats = reduce_batch(holder["raw"], batch.key_valid,
                         _meta(adapter, cfg, lens_note(adapter, cfg.lens, batch)))
    intro = ("Each token's residual state before every block and after the last, as a particle on "
             "the sphere (docs/math.md section 4). First: per-token settling point of the "
             "next-token prediction under the logit lens, step sizes, cosine to the final state. "
             "Then: pairwise-cosine histograms (fixed bins, comparable across layers and models), "
             "cluster counts, merge events, effective rank, for the prompts of this batch.")
    return page.add_section("Depth-wise trajectories", [traj.show(0), stats.show()], intro=intro)
