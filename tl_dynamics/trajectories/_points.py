"""Per-point statistics, computed inside the residual hooks one trajectory point at a time.

Directional quantities of a zero state (e.g. a zero embedding row) are NaN and left out of
means; in the particle statistics a zero state is an isolated point (cosine 0 to every other).

A ``PointComputer`` receives the residual state ``z [batch, pos, d_model]`` at trajectory
point ``p`` and keeps only per-token scalars, per-prompt particle statistics, the previous
state and step (for step sizes and turning angles) and the unit vectors (for the cosine to the
final state), so memory is bounded by one batch, never by the number of prompts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from tl_dynamics import sphere
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.trajectories import _cloud

if TYPE_CHECKING:
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
    """What to compute. ``lens`` is dropped (None targets) for encoders or unknown tokens;
    ``layers`` (None: all) picks the blocks whose input is a trajectory point."""

    eps: tuple[float, ...] = sphere.TRAJECTORY_EPS_GRID
    layers: tuple[int, ...] | None = None
    flattened: bool = False
    lens: bool = True
    standardize: StandardizeArg = None
    skip_first: bool = False


def check_config(adapter: "ModelAdapter", cfg: Config) -> None:
    if not cfg.eps or any(not isinstance(e, (int, float)) or not 0.0 < e <= 2.0 for e in cfg.eps):
        raise TLDynamicsError(f"eps must be a non-empty sequence of cluster thresholds in (0, 2] "
                              f"(tokens i, j link when cos > 1 - eps), got {cfg.eps!r}")
    if cfg.standardize not in (None, False, True, "prompt") and not isinstance(cfg.standardize,
                                                                              Standardizer):
        raise TLDynamicsError(f"standardize must be None, 'prompt' or a Standardizer, got "
                              f"{cfg.standardize!r}")
    if cfg.layers is not None and not cfg.layers:
        raise TLDynamicsError(f"layers must name at least one layer (valid: 0..{adapter.n_layers - 1}) "
                              "or be None (all layers), got an empty selection")
    if cfg.flattened and any(adapter.hook_name("resid_mid", layer) is None
                             for layer in range(adapter.n_layers)):
        raise TLDynamicsError(
            f"the flattened trajectory is not available for {adapter.info.architecture}: its "
            "blocks run attention and MLP in parallel, so there is no residual state between "
            "them (no 'resid_mid' point); use flattened=False")


def point_roles(adapter: "ModelAdapter", flattened: bool,
                layers: tuple[int, ...] | None = None) -> list[tuple[str, int]]:
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


def next_tokens(tokens: Int[Tensor, "batch pos"], key_valid: Bool[Tensor, "batch pos"]
                ) -> Int[Tensor, "batch pos"]:
    """The true next token at each position, -1 where there is none (last token, padding)."""
    nxt = torch.full_like(tokens, -1)
    has = key_valid[:, :-1] & key_valid[:, 1:]
    nxt[:, :-1] = torch.where(has, tokens[:, 1:], -1)
    return nxt


def _cos(a: Tensor, b: Tensor) -> Tensor:
    """Cosine along the last axis; NaN where either vector is zero (no direction)."""
    na, nb = a.norm(dim=-1), b.norm(dim=-1)
    c = (a * b).sum(-1) / (na * nb).clamp_min(sphere.NORM_FLOOR)
    return torch.where((na > sphere.NORM_FLOOR) & (nb > sphere.NORM_FLOOR), c, math.nan)


@dataclass
class PointComputer:
    """Accumulates one forward pass's per-point statistics; ``finish()`` stacks them."""

    adapter: "ModelAdapter"
    cfg: Config
    key_valid: Bool[Tensor, "batch pos"]
    targets: Int[Tensor, "batch pos"] | None
    n_points: int
    out: dict[str, list[Any]] = field(default_factory=dict)
    prev: Tensor | None = None
    prev_step: Tensor | None = None
    prev_labels: list[Tensor] | None = None
    next_point: int = 0
    pairs: tuple[Tensor, Tensor, Tensor] | None = None  # (mask, pair mask, pair count), once

    def particle_mask(self) -> Tensor:
        mask = self.key_valid
        if self.cfg.skip_first:
            first = mask.long().cumsum(-1) == 1
            mask = mask & ~first
        return mask

    def _put(self, name: str, value: Any) -> None:
        self.out.setdefault(name, []).append(value)

    def add(self, p: int, z: Float[Tensor, "batch pos d_model"]) -> None:
        if p != self.next_point:
            raise TLDynamicsError(f"residual points arrived out of order: got point {p}, "
                                  f"expected {self.next_point}")
        self.next_point += 1
        z = z.detach().float()
        if tuple(z.shape[:2]) != tuple(self.key_valid.shape):
            raise TLDynamicsError(f"residual state has shape {tuple(z.shape)} but the batch mask is "
                                  f"{tuple(self.key_valid.shape)}: pass the batch that is being run")
        zd, w = z.double(), self.key_valid.double()
        self._put("state_sum", torch.einsum("bp,bpd->d", w, zd))
        self._put("state_sumsq", torch.einsum("bp,bpd->d", w, zd * zd))
        norm = z.norm(dim=-1)
        self._put("norm", norm)
        self._put("unit", sphere.unit(z))
        if self.prev is not None:
            step_vec = z - self.prev
            step = step_vec.norm(dim=-1)
            self._put("step", step)
            prev_norm = self.prev.norm(dim=-1)
            self._put("rel_step", torch.where(prev_norm > sphere.NORM_FLOOR,
                                              step / prev_norm.clamp_min(sphere.NORM_FLOOR),
                                              math.nan))
            if self.prev_step is not None:
                c = _cos(step_vec, self.prev_step).clamp(-1.0, 1.0)
                self._put("turning", torch.rad2deg(torch.acos(c)))
            self.prev_step = step_vec
        self.prev = z
        if self.targets is not None:
            self._lens(z)
        self._particles(p, z)

    def _lens(self, z: Tensor) -> None:
        ad, tgt = self.adapter, self.targets
        has = tgt >= 0
        safe = tgt.clamp_min(0)
        x = ad.final_norm(z)
        logits = ad.unembed(x)
        tgt_logit = logits.gather(-1, safe[..., None])
        rank = (logits > tgt_logit).sum(-1)
        del logits
        self._put("rank", torch.where(has, rank, -1))
        emb = ad.W_E[safe].float()
        unemb = ad.W_U.T[safe].float()
        nan = math.nan
        for name, ref in (("embed", emb), ("unembed", unemb)):
            self._put(f"cos_{name}", torch.where(has, _cos(x, ref), nan))
            self._put(f"dist_{name}", torch.where(has, (x - ref).norm(dim=-1), nan))

    def _particles(self, p: int, z: Tensor) -> None:
        if self.pairs is None:  # the same at every point of the pass
            mask = self.particle_mask()
            pairs = sphere.pair_mask(mask)
            self.pairs = (mask, pairs, pairs.sum((1, 2)))
        mask, pairs, n_pairs = self.pairs
        std = self.cfg.standardize
        if std is True or std == "prompt":
            z = _cloud.standardize_prompt(z, mask)
        elif isinstance(std, Standardizer):
            z = std.apply(p, z, mask)
        u = sphere.unit(z) * mask[..., None]
        cos = sphere.cosines(u)
        self._put("cos_hist", _cloud.cos_histogram(cos, pairs))
        self._put("cos_sum", (cos.double() * pairs).sum((1, 2)))
        self._put("n_pairs", n_pairs)
        self._put("erank", _cloud.effective_rank(u, mask))
        labels = [sphere.cluster_labels(cos, e, mask) for e in self.cfg.eps]
        self._put("clusters", torch.stack([sphere.count_clusters(lab) for lab in labels]))
        if self.prev_labels is not None:
            events = [sphere.merge_events(a, b) for a, b in zip(self.prev_labels, labels)]
            self._put("merges", torch.stack([e.merges for e in events]))
            self._put("splits", torch.stack([e.splits for e in events]))
        self.prev_labels = labels

    def finish(self) -> dict[str, Tensor]:
        """Stack every statistic along a point axis (per-token ones as ``[batch, point, pos]``)."""
        if self.next_point != self.n_points:
            raise TLDynamicsError(f"the forward pass delivered {self.next_point} of "
                                  f"{self.n_points} residual points")
        o = self.out
        res: dict[str, Tensor] = {}
        for name in ("state_sum", "state_sumsq"):
            res[name] = torch.stack(o[name])
        for name in ("norm", "step", "rel_step", "turning", "rank", "cos_embed", "cos_unembed",
                     "dist_embed", "dist_unembed", "cos_hist", "cos_sum", "n_pairs", "erank"):
            if name in o:
                res[name] = torch.stack(o[name], dim=1)
        for name in ("clusters", "merges", "splits"):  # [eps, batch] -> [batch, eps, point]
            if name in o:
                res[name] = torch.stack(o[name], dim=2).transpose(0, 1)
        units, norms = o["unit"], res["norm"]
        cos_final = torch.stack([(u * units[-1]).sum(-1) for u in units], dim=1)
        defined = (norms > sphere.NORM_FLOOR) & (norms[:, -1:] > sphere.NORM_FLOOR)
        res["cos_final"] = torch.where(defined, cos_final, math.nan)
        if "rank" in res:
            res["settling"] = settling_point(res["rank"], self.targets)
        return {k: v.cpu() for k, v in res.items()}  # small per-token/per-prompt summaries


def settling_point(rank: Int[Tensor, "batch point pos"], targets: Tensor) -> Int[Tensor, "batch pos"]:
    """First point from which the true next token stays top-1 (rank 0) through the last point.

    ``n_points`` where it is not top-1 at the last point; -1 where there is no next token.
    """
    n_points = rank.shape[1]
    top1 = rank == 0
    # stays[p] = top1 at p and at every later point (reverse cumulative AND)
    stays = torch.flip(torch.cumprod(torch.flip(top1, [1]).long(), dim=1), [1]).bool()
    first = torch.where(stays.any(1), stays.long().argmax(1), n_points)
    return torch.where(targets >= 0, first, -1)
