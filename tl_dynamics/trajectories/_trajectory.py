"""``Trajectory``: per-token trajectories of one batch (what ``compute`` returns), ``build`` from
one pass's point statistics and ``join`` of several passes."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import pandas as pd
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from tl_dynamics import viz
from tl_dynamics.adapter import Batch, ModelAdapter
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.trajectories._points import Config, in_depth_order, point_labels, point_roles
from tl_dynamics.trajectories._reduce import reduce_batch
from tl_dynamics.trajectories._stats import TrajectoryStats
from tl_dynamics.trajectories._lens import VIEW_POSITIONS, expand_view, view_points
from tl_dynamics.trajectories._views import lens_view, token_views
from tl_dynamics.trajectories._meta import lens_note, stats_meta


@dataclass(frozen=True)
class Trajectory(viz.Result):
    """Each token's path through depth, for a batch of prompts or every pass inside ``attach``.

    What ``compute`` returns (and ``attach``'s ``result()``, passes stacked). Points are the
    residual stream before each block and after the last (``labels``, e.g.
    ``resid_pre0 .. resid_post1``), with the mid-block points interleaved when ``flattened``.
    Per-token arrays are ``[batch, point(, -1 or -2), pos]`` with NaN (floats) or -1 (ints) at
    padding; per-prompt particle statistics use only ``particle_mask`` tokens.

    Attributes:
        norm, cos_final: ``|z|`` and ``cos(z, z_final)`` per point.
        step, rel_step: ``|z^(p+1) - z^(p)|`` and that divided by ``|z^(p)|`` (``point - 1``).
        turning: angle in degrees between consecutive steps (``point - 2``).
        rank: logit-lens rank of the true next token (0 = top-1), -1 without a next token or
            where the lens was not read (``lens_cells``).
        lens_top, lens_top_logit: ``[batch, point, pos, k]`` the lens's top ``k`` token ids and
            their logits (-1 and NaN where it was not read); ``lens_words`` their strings.
        lens_cells: ``[batch, point, pos]`` where the lens was read: the cells the view shows
            (``lens="view"``) or every real token (``lens="full"``).
        cos_embed, dist_embed, cos_unembed, dist_unembed: the final-normalised state against
            ``W_E[next]`` and ``W_U[:, next]`` (``lens="full"`` only).
        settling: first point from which the next token stays top-1; ``n_points`` if never
            (``lens="full"`` only: it reads every point).
        cos_hist: pairwise-cosine counts in ``N_BINS`` fixed bins on [-1, 1].
        clusters: ``[batch, eps, point]`` connected components of ``cos > 1 - eps``;
            merges/splits: ``[batch, eps, point - 1]`` events between consecutive points.
        erank: effective rank of the prompt's unit-vector cloud.
        stats: this batch's ``TrajectoryStats``, exactly what ``stream`` gives on it.

    Example:
        >>> from tl_dynamics import testing, trajectories
        >>> traj = trajectories.compute(testing.tiny_model("gpt2"), "def f(x): return x")
        >>> traj.labels, traj.norm.shape  # [batch, point, pos]
        (('resid_pre0', 'resid_pre1', 'resid_post1'), torch.Size([1, 3, 8]))
    """

    architecture: str
    labels: tuple[str, ...]
    eps: tuple[float, ...]
    str_tokens: tuple[tuple[str, ...], ...]
    tokens: Int[Tensor, "batch pos"]
    key_valid: Bool[Tensor, "batch pos"]
    particle_mask: Bool[Tensor, "batch pos"]
    norm: Float[Tensor, "batch point pos"]
    step: Float[Tensor, "batch step pos"]
    rel_step: Float[Tensor, "batch step pos"]
    turning: Float[Tensor, "batch turn pos"]
    cos_final: Float[Tensor, "batch point pos"]
    rank: Int[Tensor, "batch point pos"] | None
    cos_embed: Float[Tensor, "batch point pos"] | None
    dist_embed: Float[Tensor, "batch point pos"] | None
    cos_unembed: Float[Tensor, "batch point pos"] | None
    dist_unembed: Float[Tensor, "batch point pos"] | None
    settling: Int[Tensor, "batch pos"] | None
    lens_note: str
    cos_hist: Int[Tensor, "batch point bins"]
    mean_cos: Float[Tensor, "batch point"]
    clusters: Int[Tensor, "batch eps point"]
    merges: Int[Tensor, "batch eps step"]
    splits: Int[Tensor, "batch eps step"]
    erank: Float[Tensor, "batch point"]
    stats: TrajectoryStats
    bos: tuple[bool, ...] = ()  # per prompt: its first real token is the tokenizer's BOS
    lens_top: Int[Tensor, "batch point pos k"] | None = None
    lens_top_logit: Float[Tensor, "batch point pos k"] | None = None
    lens_cells: Bool[Tensor, "batch point pos"] | None = None
    lens_words: dict[int, str] = field(default_factory=dict)

    @property
    def n_points(self) -> int:
        """Number of trajectory points (``len(labels)``).

        Example:
            >>> from tl_dynamics import testing, trajectories
            >>> traj = trajectories.compute(testing.tiny_model("gpt2"), "def f(x): return x")
            >>> traj.n_points
            3
        """
        return len(self.labels)

    def __repr__(self) -> str:
        return (
            f"Trajectory({self.architecture}, batch={self.tokens.shape[0]}, "
            f"pos={self.tokens.shape[1]}, points={self.n_points}, lens={not self.lens_note})"
        )

    def to_dataframe(self) -> pd.DataFrame:
        """One row per (prompt, point, real token) with every per-token statistic.

        Returns:
            A pandas DataFrame with ``prompt, pos, token, bos`` (whether the prompt begins with
            the BOS token, beside its first token's statistics), ``point, norm, cos_final, step,
            rel_step, turning_deg`` (``point`` an ordered categorical in depth order) and, with the
            lens, ``lens_rank`` (the logit-lens rank of the true next token; -1 where there is
            none or the lens was not read), ``lens_top1`` (the lens's top token id, -1 where not
            read), ``settling`` (``lens="full"``), ``cos_embed, dist_embed, cos_unembed,
            dist_unembed``.

        Example:
            >>> from tl_dynamics import testing, trajectories
            >>> traj = trajectories.compute(testing.tiny_model("gpt2"), "def f(x): return x")
            >>> traj.to_dataframe().shape  # 8 tokens x 3 points
            (24, 12)
            >>> trajectories.compute(testing.tiny_model("gpt2"), "def f(x): return x",
            ...                      lens="full").to_dataframe().shape  # + settling, approach
            (24, 17)
        """
        rows = []
        approach = ("cos_embed", "dist_embed", "cos_unembed", "dist_unembed")
        for b in range(self.tokens.shape[0]):
            for t in self.key_valid[b].nonzero().flatten().tolist():
                for p in range(self.n_points):
                    row = {
                        "prompt": b,
                        "pos": t,
                        "token": self.str_tokens[b][t],
                        "bos": bool(self.bos[b]) if self.bos else False,
                        "point": self.labels[p],
                        "norm": float(self.norm[b, p, t]),
                        "cos_final": float(self.cos_final[b, p, t]),
                        "step": float(self.step[b, p - 1, t]) if p >= 1 else np.nan,
                        "rel_step": float(self.rel_step[b, p - 1, t]) if p >= 1 else np.nan,
                        "turning_deg": float(self.turning[b, p - 2, t]) if p >= 2 else np.nan,
                    }
                    if self.rank is not None:  # -1: no next token, or the lens not read here
                        row["lens_rank"] = int(self.rank[b, p, t])
                    if self.lens_top is not None:
                        row["lens_top1"] = int(self.lens_top[b, p, t, 0])
                    if self.settling is not None:
                        row["settling"] = int(self.settling[b, t])
                    for name in approach:
                        values = getattr(self, name)
                        if values is not None:
                            row[name] = float(values[b, p, t])
                    rows.append(row)
        frame = pd.DataFrame(rows)
        if len(frame):  # sorts in depth order (resid_pre0 before resid_post1)
            frame["point"] = in_depth_order(self.labels, [r["point"] for r in rows])
        return frame

    def show(self, row: int = 0) -> viz.Group:
        """Per-token views of one prompt, then the batch's particle statistics.

        Settling point, step sizes and cosine to the final state of prompt ``row``, then
        ``stats.show()``.

        Args:
            row: which prompt of the batch.

        Returns:
            A ``viz.Group``.

        Example:
            >>> from tl_dynamics import testing, trajectories
            >>> traj = trajectories.compute(testing.tiny_model("gpt2"), "def f(x): return x")
            >>> type(traj.show()).__name__
            'Group'
        """
        if not 0 <= row < self.tokens.shape[0]:
            raise TLDynamicsError(
                f"row {row} is out of range: the batch has {self.tokens.shape[0]} prompts"
            )
        real = self.key_valid[row].nonzero().flatten()
        tokens = [self.str_tokens[row][t] for t in real.tolist()]
        views = token_views(
            self.architecture,
            row,
            tokens,
            self.labels,
            None if self.settling is None else self.settling[row, real].numpy(),
            self.lens_note,
            steps=self.step[row][:, real].T.numpy(),
            cos_final=self.cos_final[row][:, real].T.numpy(),
        )
        lens = self._lens_view(row, real.tolist())
        return viz.group(
            *views.components, *lens, *self.stats.show().components, caption=views.caption
        )

    def _lens_view(self, row: int, real: list[int]) -> list[viz.Component]:
        """The logit lens at the cells the view shows (``_lens.view_points`` x the last
        ``VIEW_POSITIONS`` real positions of prompt ``row``), where it was read."""
        if self.lens_top is None or self.lens_top_logit is None or self.rank is None:
            return []
        points = view_points(self.n_points)
        shown = real[-VIEW_POSITIONS:]
        if self.lens_cells is None or not bool(self.lens_cells[row][points][:, shown].all()):
            return []
        strs = self.str_tokens[row]
        after = {t: real[i + 1] for i, t in enumerate(real[:-1])}
        caption = (
            f"logit lens, prompt {row}: the top token at each point (rows) and the last "
            f"{len(shown)} positions (columns, 'position:token'), coloured by the rank of the true "
            "next token (green: top-1, light green: top 5, yellow: top 100, red: below; none: "
            "no next token); hover a cell for its top tokens and their logits"
        )
        return [
            lens_view(
                [self.labels[p] for p in points],
                [f"{t}:{viz.visible_token(strs[t])}" for t in shown],
                [strs[after[t]] if t in after else None for t in shown],
                self.rank[row][points][:, shown].numpy(),
                self.lens_top[row][points][:, shown].numpy(),
                self.lens_top_logit[row][points][:, shown].numpy(),
                self.lens_words,
                caption,
            )
        ]


def _pad(x: Tensor, valid: Tensor, fill: float) -> Tensor:
    return x.masked_fill(~valid[:, None, :], fill)


def build(
    adapter: ModelAdapter, cfg: Config, raw: dict[str, Tensor], batch: Batch | None
) -> Trajectory:
    """Assemble a ``Trajectory`` from one pass's ``point_statistics`` (on the CPU). Without ``batch``
    (a forward pass ``attach`` saw without being told its tokens) every position is real and
    the token ids and strings are unknown (-1 and "")."""
    b, n_pos = raw["norm"].shape[0], raw["norm"].shape[2]
    if "view_long" in raw:  # lens="view": its packed rows laid out as the full lens's arrays
        raw = {**raw, **expand_view(raw, raw["norm"].shape[1])}
    if batch is None:
        valid = torch.ones(b, n_pos, dtype=torch.bool)
        tokens = torch.full((b, n_pos), -1, dtype=torch.long)
        rows = tuple(("",) * n_pos for _ in range(b))
    else:
        valid, tokens = batch.key_valid.cpu(), batch.tokens.cpu()
        rows = tuple(tuple(adapter.str_tokens(batch, r)) for r in range(b))
    mask = valid & ~(valid.long().cumsum(-1) == 1) if cfg.skip_first else valid
    nan = math.nan
    lens = {
        k: _pad(raw[k], valid, nan) if k in raw else None
        for k in ("cos_embed", "dist_embed", "cos_unembed", "dist_unembed")
    }
    pairs = raw["n_pairs"]
    empty_turn = torch.empty(b, 0, n_pos)
    note = lens_note(adapter, cfg.lens, batch)
    return Trajectory(
        architecture=adapter.info.architecture,
        labels=point_labels(point_roles(adapter, cfg.flattened, cfg.layers)),
        eps=tuple(cfg.eps),
        str_tokens=rows,
        tokens=tokens,
        key_valid=valid,
        particle_mask=mask,
        norm=_pad(raw["norm"], valid, nan),
        step=_pad(raw["step"], valid, nan),
        rel_step=_pad(raw["rel_step"], valid, nan),
        turning=_pad(raw["turning"], valid, nan) if "turning" in raw else empty_turn,
        cos_final=_pad(raw["cos_final"], valid, nan),
        rank=raw.get("rank"),
        settling=raw.get("settling"),
        lens_note=note,
        cos_hist=raw["cos_hist"],
        mean_cos=torch.where(pairs > 0, raw["cos_sum"] / pairs.clamp_min(1), nan).float(),
        clusters=raw["clusters"],
        merges=raw["merges"],
        splits=raw["splits"],
        erank=raw["erank"].float(),
        stats=reduce_batch(raw, valid, stats_meta(adapter, cfg, note)),
        bos=() if batch is None else batch.begins_with_bos(_bos_id(adapter)),
        lens_top=raw.get("lens_top"),
        lens_top_logit=raw.get("lens_top_logit"),
        lens_cells=raw.get("lens_cells"),
        lens_words=_view_words(adapter, raw, valid),
        **lens,
    )


def _view_words(adapter: ModelAdapter, raw: dict[str, Tensor], valid: Tensor) -> dict[int, str]:
    """The strings of the top tokens at the cells the view shows (what ``show`` writes)."""
    top = raw.get("lens_top")
    if top is None:
        return {}
    top, real = top.numpy(), valid.numpy()
    points = view_points(top.shape[1])
    ids: set[int] = set()
    for row in range(top.shape[0]):
        shown = np.flatnonzero(real[row])[-VIEW_POSITIONS:]
        ids.update(int(t) for t in top[row][points][:, shown].reshape(-1) if t >= 0)
    ordered = sorted(ids)
    return dict(zip(ordered, adapter.decode(ordered)))


def _bos_id(adapter: ModelAdapter) -> int | None:
    bos = getattr(adapter.tokenizer, "bos_token_id", None)
    return bos if isinstance(bos, int) else None


# per-token fields, padded along their last axis (positions) when batches are joined
_PADS = {
    "tokens": -1,
    "key_valid": False,
    "particle_mask": False,
    "norm": math.nan,
    "step": math.nan,
    "rel_step": math.nan,
    "turning": math.nan,
    "cos_final": math.nan,
    "rank": -1,
    "cos_embed": math.nan,
    "dist_embed": math.nan,
    "cos_unembed": math.nan,
    "dist_unembed": math.nan,
    "settling": -1,
    "lens_cells": False,
}
_TOP = {"lens_top": -1, "lens_top_logit": math.nan}  # [batch, point, pos, k]: pos is dim 2
_BY_PROMPT = ("cos_hist", "mean_cos", "clusters", "merges", "splits", "erank")


def join(parts: Sequence[Trajectory], stats: TrajectoryStats) -> Trajectory:
    """Several batches' trajectories as one: prompts stacked, positions padded to the longest
    (NaN, -1 or False, as padding is everywhere else); ``stats`` is their merged statistics."""
    first = parts[0]
    n_pos = max(p.tokens.shape[1] for p in parts)

    def padded(t: Tensor, fill: float | int | bool) -> Tensor:
        return (
            torch.nn.functional.pad(t, (0, n_pos - t.shape[-1]), value=fill)
            if t.dtype != torch.bool
            else torch.cat(
                [t, torch.zeros(*t.shape[:-1], n_pos - t.shape[-1], dtype=torch.bool)], -1
            )
        )

    fields: dict[str, Any] = {}
    for name, fill in _PADS.items():
        values = [getattr(p, name) for p in parts]
        fields[name] = None if values[0] is None else torch.cat([padded(v, fill) for v in values])
    for name in _BY_PROMPT:
        fields[name] = torch.cat([getattr(p, name) for p in parts])
    for name, fill in _TOP.items():
        values = [getattr(p, name) for p in parts]
        fields[name] = (
            None
            if values[0] is None
            else torch.cat([torch.nn.functional.pad(v, (0, 0, 0, n_pos - v.shape[2]), value=fill)
                            for v in values])
        )  # fmt: skip
    fields["lens_words"] = {k: v for p in parts for k, v in p.lens_words.items()}
    rows = tuple(row + ("",) * (n_pos - len(row)) for p in parts for row in p.str_tokens)
    return Trajectory(
        architecture=first.architecture,
        labels=first.labels,
        eps=first.eps,
        str_tokens=rows,
        lens_note=first.lens_note,
        stats=stats,
        bos=tuple(b for p in parts for b in (p.bos or (False,) * p.tokens.shape[0])),
        **fields,
    )
