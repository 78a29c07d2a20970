"""Per-point statistics of the residual stream, for every trajectory point of a pass at once.

Directional quantities of a zero state (e.g. a zero embedding row) are NaN and left out of
means; in the particle statistics a zero state is an isolated point (cosine 0 to every other).

``point_statistics`` receives every residual state of one forward pass (the collector keeps
them while the pass runs) and computes every point's statistics at once, batched over points,
keeping only per-token scalars and per-prompt particle statistics, so memory is bounded by one
batch's residual states, never by the number of prompts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence, cast

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from tl_dynamics import sphere
from tl_dynamics.collect import Collector
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.trajectories import _cloud
from tl_dynamics.trajectories._lens import LensMode, cosine, point_lens

if TYPE_CHECKING:
    import pandas as pd
    from tl_dynamics.adapter import ModelAdapter


@dataclass(frozen=True)
class Standardizer:
    """Dataset-level per-dimension ``mean``/``std`` per trajectory point (``[point, d_model]``),
    e.g. from ``TrajectoryStats.standardizer()`` of a first streaming pass."""

    mean: Float[Tensor, "point d_model"]
    std: Float[Tensor, "point d_model"]

    def apply(self, p: int, z: Tensor, mask: Tensor) -> Tensor:
        return (z - self.mean[p].to(z)) / self.std[p].to(z).clamp_min(1e-6) * mask[..., None].to(z)


StandardizeArg = Standardizer | str | bool | None


@dataclass(frozen=True)
class Config:
    """What to compute. ``lens`` (``_lens.lens_mode``: ``"view"``, ``"full"`` or None) is
    dropped (None targets) for encoders or unknown tokens; ``layers`` (None: all) picks the
    blocks whose input is a trajectory point."""

    eps: tuple[float, ...] = sphere.TRAJECTORY_EPS_GRID
    layers: tuple[int, ...] | None = None
    flattened: bool = False
    lens: LensMode | None = "full"
    standardize: StandardizeArg = None
    skip_first: bool = False


def check_config(adapter: "ModelAdapter", cfg: Config) -> None:
    if not cfg.eps or any(not isinstance(e, (int, float)) or not 0.0 < e <= 2.0 for e in cfg.eps):
        raise TLDynamicsError(
            f"eps must be a non-empty sequence of cluster thresholds in (0, 2] "
            f"(tokens i, j link when cos > 1 - eps), got {cfg.eps!r}"
        )
    if cfg.standardize not in (None, False, True, "prompt") and not isinstance(
        cfg.standardize, Standardizer
    ):
        raise TLDynamicsError(
            f"standardize must be None, 'prompt' or TrajectoryStats.standardizer()'s result, got "
            f"{cfg.standardize!r}"
        )
    if cfg.layers is not None and not cfg.layers:
        raise TLDynamicsError(
            f"layers must name at least one layer (valid: 0..{adapter.n_layers - 1}) "
            "or be None (all layers), got an empty selection"
        )
    if cfg.flattened and any(
        adapter.hook_name("resid_mid", layer) is None for layer in range(adapter.n_layers)
    ):
        raise TLDynamicsError(
            f"the flattened trajectory is not available for {adapter.info.architecture}: its "
            "blocks run attention and MLP in parallel, so there is no residual state between "
            "them (no 'resid_mid' point); use flattened=False"
        )


def point_roles(
    adapter: "ModelAdapter", flattened: bool, layers: tuple[int, ...] | None = None
) -> list[tuple[str, int]]:
    """The (role, layer) of each trajectory point, in depth order: the input of each selected
    block (and its mid-block state when ``flattened``), then the output of the last block."""
    roles: list[tuple[str, int]] = []
    for layer in range(adapter.n_layers) if layers is None else sorted(set(layers)):
        roles.append(("resid_pre", layer))
        if flattened:
            roles.append(("resid_mid", layer))
    roles.append(("resid_post", adapter.n_layers - 1))
    return roles


def point_labels(roles: list[tuple[str, int]]) -> tuple[str, ...]:
    return tuple(f"{role}{layer}" for role, layer in roles)


def in_depth_order(labels: "Sequence[str]", values: "Sequence[str]") -> "pd.Categorical":
    """``values`` (point labels) as an ordered categorical whose order is ``labels``' (the
    points' depth order), so sorting puts ``resid_pre0`` before ``resid_post1``, not after.

    >>> list(in_depth_order(["resid_pre0", "resid_post1"], ["resid_post1", "resid_pre0"]).sort_values())
    ['resid_pre0', 'resid_post1']
    """
    import pandas as pd

    return pd.Categorical(list(values), categories=list(labels), ordered=True)


def next_tokens(
    tokens: Int[Tensor, "batch pos"], key_valid: Bool[Tensor, "batch pos"]
) -> Int[Tensor, "batch pos"]:
    """The true next token at each position, -1 where there is none (last token, padding)."""
    nxt = torch.full_like(tokens, -1)
    has = key_valid[:, :-1] & key_valid[:, 1:]
    nxt[:, :-1] = torch.where(has, tokens[:, 1:], -1)
    return nxt


_cos = cosine  # (trajectories._lens.cosine)


# Memory for one group of points' particle statistics (cosines, eps-adjacency, labels; about
# 30 bytes per token pair and point): points are processed in groups within it.
POINT_BUDGET_BYTES = 512 << 20
# ... on the CPU (not launch-bound), groups small enough to stay near the cache
CPU_POINT_BUDGET_BYTES = 16 << 20
# ... and the cosines of every point kept for one clustering call (sphere.TREE_MAX_POINTS)
TREE_COS_BYTES = 64 << 20


def point_statistics(
    adapter: "ModelAdapter",
    cfg: Config,
    zs: list[Tensor],
    key_valid: Bool[Tensor, "batch pos"],
    targets: Int[Tensor, "batch pos"] | None,
) -> dict[str, Tensor]:
    """Every point's statistics of one forward pass at once (``zs``: the residual states in
    depth order, each ``[batch, pos, d_model]``), batched over points: the same launches for
    12 points as for one. Per-token ones are ``[batch, point, pos]``, per-prompt ones
    ``[batch, point]`` (clusters ``[batch, eps, point]``); left on the device."""
    n_points, (b, n, d) = len(zs), tuple(zs[0].shape)
    if (b, n) != tuple(key_valid.shape):
        raise TLDynamicsError(
            f"residual state has shape {(b, n, d)} but the batch mask is "
            f"{tuple(key_valid.shape)}: pass the batch that is being run"
        )
    # a GPU takes every point in one sequence of launches; the CPU takes groups of points
    # whose temporaries stay below glibc's mmap threshold (a fresh mapping for every larger one,
    # page-faulted in at every pass: 70,000 faults per pass at 1 x 1,024 tokens, 13 points)
    if Collector.launch_bound(zs[0].device):
        group = n_points
    else:
        group = max(1, CPU_POINT_BUDGET_BYTES // max(1, 8 * b * n * d))  # their float64 sums
    z = _Points(zs, group)
    res, unit = _elementwise(z, key_valid)
    if targets is not None and cfg.lens is not None:
        res.update(point_lens(adapter, cfg.lens, z, key_valid, targets))
    res.update(_particles(cfg, z, key_valid, unit))
    if cfg.lens == "full" and targets is not None:  # every point read: when each settles
        res["settling"] = settling_point(res["rank"], targets)
    return res


class _Points:
    """The residual states of a pass as ``[point, batch, pos, d]`` float32, stacked a group of
    points at a time (``group``: every point at once where that is the plan)."""

    def __init__(self, zs: list[Tensor], group: int, whole: Tensor | None = None):
        self.zs, self.group = zs, group
        if whole is None and group >= len(zs):
            whole = torch.stack(zs).float()
        self.whole = whole
        self.shape = tuple(whole.shape) if whole is not None else (len(zs), *zs[0].shape)
        self.device = zs[0].device if whole is None else whole.device

    def __getitem__(self, points: slice) -> Tensor:
        if self.whole is not None:
            return self.whole[points]
        picked = self.zs[points]
        if len(picked) == 1:  # a view where no conversion is needed
            return picked[0].float()[None]
        return torch.stack(picked).float()


def _elementwise(z: _Points, key_valid: Tensor) -> tuple[dict[str, Tensor], _Points]:
    """Per-token statistics of every point (norms, steps, turning angles, cosine to the last
    point) and the float64 state sums, in groups of ``z.group`` points; and every point's unit
    vectors (``sphere.unit``, from the same norms)."""
    n_points = z.shape[0]
    z_last = z[n_points - 1 : n_points][0]
    last, last_defined = sphere.unit(z_last), z_last.norm(dim=-1) > sphere.NORM_FLOOR
    kv = key_valid.double()[None, :, :, None]
    out: dict[str, list[Tensor]] = {}
    units: list[Tensor] = []
    for p0 in range(0, n_points, z.group):
        p1 = min(n_points, p0 + z.group)
        ext = z[p0 : min(n_points, p1 + 2)]  # two points more: the steps and turns from p1 - 1
        zg = ext[: p1 - p0]
        # float64 sums over real tokens (float32 squares are exact in float64), in place
        zd = zg.double().mul_(kv)
        out.setdefault("state_sum", []).append(zd.sum((1, 2)))
        out.setdefault("state_sumsq", []).append(zd.square_().sum((1, 2)))
        del zd
        norm = ext.norm(dim=-1)  # [points, b, n]
        out.setdefault("norm", []).append(norm[: p1 - p0])
        unit = zg / norm[: p1 - p0, ..., None].clamp_min(sphere.NORM_FLOOR)  # sphere.unit
        units.append(unit)
        defined = (norm[: p1 - p0] > sphere.NORM_FLOOR) & last_defined
        cos_final = (unit * last).sum(-1)
        out.setdefault("cos_final", []).append(torch.where(defined, cos_final, math.nan))
        n_steps = min(p1, n_points - 1) - p0  # steps p0 .. from point p to p + 1
        if n_steps > 0:
            step_vec = ext[1:] - ext[:-1]
            step_all = step_vec.norm(dim=-1)
            step, prev = step_all[:n_steps], norm[:n_steps]
            out.setdefault("step", []).append(step)
            out.setdefault("rel_step", []).append(
                torch.where(
                    prev > sphere.NORM_FLOOR, step / prev.clamp_min(sphere.NORM_FLOOR), math.nan
                )
            )
            n_turns = min(p1, n_points - 2) - p0
            if n_turns > 0:  # consecutive steps, with the norms above
                after, before = slice(1, n_turns + 1), slice(0, n_turns)
                c = _cos(step_vec[after], step_vec[before], step_all[after], step_all[before])
                out.setdefault("turning", []).append(torch.rad2deg(torch.acos(c.clamp(-1.0, 1.0))))
    res: dict[str, Tensor] = {}
    for name, parts in out.items():
        got = torch.cat(parts)
        res[name] = got if name.startswith("state_") else got.transpose(0, 1)
    if z.whole is not None:
        return res, _Points([], z.group, whole=units[0])
    return res, _Points([u for group in units for u in group.unbind(0)], z.group)


def _particles(cfg: Config, z: _Points, key_valid: Tensor, unit: _Points) -> dict[str, Tensor]:
    """The token cloud's statistics at every point: cosine histograms and sums, effective rank,
    eps-clusters and the merge events between consecutive points (groups of points within
    ``POINT_BUDGET_BYTES``). ``unit`` holds ``sphere.unit(z)``, used where nothing is
    standardised."""
    n_points, b, n, _ = z.shape
    mask = key_valid
    if cfg.skip_first:
        mask = mask & ~(mask.long().cumsum(-1) == 1)
    pairs = sphere.pair_mask(mask)
    n_pairs = pairs.sum((1, 2))
    std = cfg.standardize
    budget = POINT_BUDGET_BYTES if Collector.launch_bound(z.device) else CPU_POINT_BUDGET_BYTES
    group = max(1, budget // max(1, 30 * b * n * n))
    # the CPU reads clusters off spanning trees (n rounds per call, whatever the points): the
    # points' cosines are kept and clustered together, as many as fit TREE_COS_BYTES
    together = not Collector.launch_bound(z.device) and n <= sphere.TREE_MAX_POINTS
    slots = min(n_points * b, max(1, TREE_COS_BYTES // (4 * n * n))) if together else 0
    pending = torch.empty(slots, n, n, device=z.device) if slots else None
    kept: list[Tensor] = []  # the masks of the slices in ``pending``
    out: dict[str, list[Tensor]] = {}
    last: Tensor | None = None  # the labels of the group before's last point

    def cluster(cos: Tensor, flat_mask: Tensor, last: Tensor | None) -> Tensor:
        labels = sphere.cluster_labels_grid(cos, cfg.eps, flat_mask)
        return _events(out, labels.reshape(len(cfg.eps), -1, b, n), last)

    def flush(last: Tensor | None) -> Tensor | None:
        if not kept or pending is None:
            return last
        flat_mask = torch.cat(kept) if len(kept) > 1 else kept[0]
        kept.clear()
        return cluster(pending[: flat_mask.shape[0]], flat_mask, last)

    for p0 in range(0, n_points, group):
        if std is True or std == "prompt":
            zg = z[p0 : p0 + group]
            ug = sphere.unit(torch.stack([_cloud.standardize_prompt(x, mask) for x in zg]))
        elif isinstance(std, Standardizer):
            zg = z[p0 : p0 + group]
            ug = sphere.unit(torch.stack([std.apply(p0 + i, x, mask) for i, x in enumerate(zg)]))
        else:
            ug = unit[p0 : p0 + group]
        g = ug.shape[0]
        flat_mask = mask.expand(g, -1, -1).reshape(g * b, n)
        u = ug.reshape(g * b, n, -1) * flat_mask[..., None]
        held = sum(m.shape[0] for m in kept)
        if pending is not None and held + g * b > slots:
            last, held = flush(last), 0
        fits = pending is not None and g * b <= slots  # written where it waits for the trees
        cos = sphere.cosines(u, out=cast(Tensor, pending)[held : held + g * b] if fits else None)
        flat_pairs = pairs.expand(g, -1, -1, -1).reshape(g * b, n, n)
        out.setdefault("cos_hist", []).append(
            _cloud.cos_histogram(cos, flat_pairs).reshape(g, b, -1)
        )
        erank, cos_sum = _cloud.rank_and_pair_sum(u.double())  # u is zero off the mask
        out.setdefault("cos_sum", []).append(cos_sum.reshape(g, b))
        out.setdefault("erank", []).append(erank.reshape(g, b))
        if fits:
            kept.append(flat_mask)
        else:
            last = cluster(cos, flat_mask, last)
    flush(last)
    res = {"n_pairs": n_pairs[:, None].expand(b, n_points).contiguous()}
    for name in ("cos_hist", "cos_sum", "erank"):  # [P, b, ...] -> [b, P, ...]
        res[name] = torch.cat(out[name]).transpose(0, 1)
    for name in ("clusters", "merges", "splits"):  # [E, P, b] -> [b, E, P]
        if name in out:
            res[name] = torch.cat(out[name], 1).permute(2, 0, 1)
        else:
            res[name] = torch.zeros(b, len(cfg.eps), 0, dtype=torch.long, device=z.device)
    return res


def _events(out: dict[str, list[Tensor]], labels: Tensor, last: Tensor | None) -> Tensor:
    """A group of points' cluster counts and the merge events into and within it (``labels``
    ``[E, g, b, n]``; ``last``: the labels of the point before the group); returns its last
    point's labels."""
    out.setdefault("clusters", []).append(sphere.count_clusters(labels))  # [E, g, b]
    chain = labels if last is None else torch.cat([last, labels], 1)
    if chain.shape[1] > 1:
        events = sphere.merge_events(chain[:, :-1], chain[:, 1:])
        out.setdefault("merges", []).append(events.merges)
        out.setdefault("splits", []).append(events.splits)
    return labels[:, -1:]


def settling_point(
    rank: Int[Tensor, "batch point pos"], targets: Tensor
) -> Int[Tensor, "batch pos"]:
    """First point from which the true next token stays top-1 (rank 0) through the last point.

    ``n_points`` where it is not top-1 at the last point; -1 where there is no next token.
    """
    n_points = rank.shape[1]
    top1 = rank == 0
    # stays[p] = top1 at p and at every later point (reverse cumulative AND)
    stays = torch.flip(torch.cumprod(torch.flip(top1, [1]).long(), dim=1), [1]).bool()
    first = torch.where(stays.any(1), stays.long().argmax(1), n_points)
    return torch.where(targets >= 0, first, -1)
