"""The logit lens of a pass's trajectory points, read where it is read (docs/math.md §5.3).

A cell is one (point, prompt, position). At each cell the lens reads the true next token's rank
and the ``TOP_K`` tokens with the largest lens logits (ids and logits), from the final-normalised
state ``x = N_f(z)``: ``l = x W_U + b_U`` (soft-capped where the model caps its logits). Which
cells (``LensMode``):

- ``"view"`` (``compute`` and ``attach``'s default): the cells the view shows
  (``Trajectory.show``): the last ``VIEW_POSITIONS`` real positions of every prompt at
  ``view_points`` (every point up to ``VIEW_POINTS``, else that many spread over depth, the first
  and last included). Cost: ``len(view_points) x VIEW_POSITIONS`` (at most 64) unembeddings per
  prompt, in blocks of ``ROW_BLOCK`` rows;
- ``"full"`` (``True``; ``stream``'s default): every point and real position, with the approach
  of ``x`` to the next token's embedding and unembedding and the settling point. Cost: one
  unembedding per point and token, ``n_points`` times the model's own head;
- ``False``: none.

The states go in blocks of ``ROW_BLOCK`` rows (the last one padded with zeros) and the
vocabulary in chunks (``vocab_chunk``), so memory stays at one block's chunk of logits whatever
the vocabulary, the tokens and the points, and every block is the same matrix product in both
modes: a cell that both modes read gets the same bits (a BLAS may round a product of a few rows
differently from a larger one, so the block size never depends on how many cells are read).
The rank counts the vocabulary entries whose logit is strictly above the target's, which is
``x . W_U[:, tau] + b_U[tau]`` (``target_logits``), the target itself never counted.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch import Tensor

from tl_dynamics import sphere
from tl_dynamics.collect import Collector
from tl_dynamics.errors import TLDynamicsError

if TYPE_CHECKING:
    from tl_dynamics.adapter import ModelAdapter

LensMode = Literal["view", "full"]
LensArg = bool | str | None
PointStates = Any  # ``_points._Points``: ``.shape``, ``.group`` and slices of points

VIEW_POSITIONS = 8  # the last real positions of each prompt the view shows
VIEW_POINTS = 8  # the points the view shows at most
TOP_K = 5  # the tokens read at each cell
# Rows of one product (states), the same in both modes; on the CPU a block's chunk of logits
# is about 2 MB (cache-sized), on a launch-bound device one block and chunk holds a pass's view
ROW_BLOCK = 64
GPU_ROW_BLOCK = 1024
CPU_CHUNK_ELEMENTS = 1 << 19
GPU_CHUNK_BYTES = 256 << 20


def lens_mode(lens: LensArg) -> LensMode | None:
    """``lens`` as a mode: ``"view"``, ``"full"`` (also ``True``) or None (``False``, None).

    Example:
        >>> lens_mode(True), lens_mode("view"), lens_mode(False)
        ('full', 'view', None)
    """
    if lens is True or lens == "full":
        return "full"
    if lens == "view":
        return "view"
    if lens is False or lens is None:
        return None
    raise TLDynamicsError(
        f"lens must be 'view' (the cells the view shows), 'full' (every point and token; True "
        f"is the same) or False, got {lens!r}"
    )


def view_points(n_points: int) -> list[int]:
    """The points the view shows: all up to ``VIEW_POINTS``, else ``VIEW_POINTS`` of them
    spread evenly over depth, the first and the last included.

    Example:
        >>> view_points(3), view_points(31)[:4], view_points(31)[-1]
        ([0, 1, 2], [0, 4, 9, 13], 30)
    """
    if n_points <= VIEW_POINTS:
        return list(range(n_points))
    step = (n_points - 1) / (VIEW_POINTS - 1)
    return sorted({round(i * step) for i in range(VIEW_POINTS)})


def view_positions(key_valid: Tensor) -> tuple[Tensor, Tensor]:
    """``[batch, VIEW_POSITIONS]`` indices of each prompt's last real positions (in order) and
    whether each is real (a prompt shorter than that has fewer): fixed shapes, no host read."""
    n = key_valid.shape[1]
    w = min(VIEW_POSITIONS, n)
    order = torch.arange(1, n + 1, device=key_valid.device) * key_valid
    top, idx = order.topk(w, dim=1, sorted=True)  # the largest real indices, last first
    return idx.flip(1), (top > 0).flip(1)


def vocab_chunk(n_vocab: int, launch_bound: bool) -> int:
    """Vocabulary entries per product: a cache-sized block of logits on the CPU, one chunk of
    at most ``GPU_CHUNK_BYTES`` on a launch-bound device (the same in both modes)."""
    if launch_bound:
        return min(n_vocab, max(1, GPU_CHUNK_BYTES // (4 * GPU_ROW_BLOCK)))
    return min(n_vocab, max(256, CPU_CHUNK_ELEMENTS // ROW_BLOCK))


def target_logits(adapter: "ModelAdapter", x: Tensor, targets: Tensor) -> Tensor:
    """``x . W_U[:, tau] + b_U[tau]`` for each row (``x [rows, d]``, ``targets [rows]`` >= 0),
    soft-capped as the model caps its logits."""
    w = adapter.W_U.T[targets]  # [rows, d]
    logit = (x * w).sum(-1) + adapter.b_U[targets]
    cap = adapter.final_softcap
    return logit if cap is None else cap * torch.tanh(logit / cap)


def read_rows(adapter: "ModelAdapter", x: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The lens at each row of ``x [rows, d]`` (final-normalised states): the rank of
    ``targets [rows]`` (-1 where a target is < 0) and the ``TOP_K`` ids and logits, in blocks
    of ``ROW_BLOCK`` rows (zero-padded) and chunks of the vocabulary."""
    launch_bound = Collector.launch_bound(x.device)
    block = GPU_ROW_BLOCK if launch_bound else ROW_BLOCK
    w_u, b_u, cap = adapter.W_U, adapter.b_U, adapter.final_softcap
    n_vocab = w_u.shape[1]
    chunk = vocab_chunk(n_vocab, launch_bound)
    k = min(TOP_K, n_vocab)
    rows = x.shape[0]
    padded = -(-rows // block) * block
    if padded != rows:
        x = torch.nn.functional.pad(x, (0, 0, 0, padded - rows))
        targets = torch.nn.functional.pad(targets, (0, padded - rows), value=-1)
    safe = targets.clamp_min(0)
    t_all = target_logits(adapter, x, safe)  # row by row: the same bits in any block
    ranks, ids, logits = [], [], []
    for r0 in range(0, padded, block):
        one = padded == block
        xb, tb = (x, safe) if one else (x[r0 : r0 + block], safe[r0 : r0 + block])
        t = (t_all if one else t_all[r0 : r0 + block])[:, None]
        count = top_v = top_i = None
        for v0 in range(0, n_vocab, chunk):
            v1 = min(n_vocab, v0 + chunk)
            whole = (v0, v1) == (0, n_vocab)
            lg = torch.addmm(b_u, xb, w_u) if whole else torch.addmm(b_u[v0:v1], xb, w_u[:, v0:v1])
            if cap is not None:
                lg = cap * torch.tanh(lg / cap)
            above = lg > t
            if whole:  # the target itself is never counted
                above.scatter_(1, tb[:, None], False)
                count = above.sum(-1)
            else:
                inside = (tb >= v0) & (tb < v1)
                own = above.gather(1, (tb - v0).clamp(0, v1 - v0 - 1)[:, None]).squeeze(1)
                part = above.sum(-1) - (own & inside).long()
                count = part if count is None else count + part
            cv, ci = lg.topk(min(k, v1 - v0), dim=-1)
            if top_v is None or top_i is None:
                top_v, top_i = cv, ci if v0 == 0 else ci + v0
            else:  # earlier chunks first: ties keep the smaller id
                top_v, pick = torch.cat([top_v, cv], 1).topk(k, dim=-1)
                top_i = torch.cat([top_i, ci + v0], 1).gather(1, pick)
        ranks.append(count)
        ids.append(top_i)
        logits.append(top_v)
    if len(ranks) == 1:
        rank, top_i, top_v = ranks[0], ids[0], logits[0]
    else:
        rank, top_i, top_v = torch.cat(ranks), torch.cat(ids), torch.cat(logits)
    if padded != rows:
        rank, top_i, top_v, targets = rank[:rows], top_i[:rows], top_v[:rows], targets[:rows]
    return torch.where(targets >= 0, rank, -1), top_i, top_v


def cosine(a: Tensor, b: Tensor, na: Tensor | None = None, nb: Tensor | None = None) -> Tensor:
    """Cosine along the last axis; NaN where either vector is zero (no direction). ``na`` and
    ``nb`` are the vectors' norms where known already."""
    na = a.norm(dim=-1) if na is None else na
    nb = b.norm(dim=-1) if nb is None else nb
    c = (a * b).sum(-1) / (na * nb).clamp_min(sphere.NORM_FLOOR)
    return torch.where(torch.minimum(na, nb) > sphere.NORM_FLOOR, c, math.nan)


APPROACH = ("cos_embed", "cos_unembed", "dist_embed", "dist_unembed")


def approach(adapter: "ModelAdapter", x: Tensor, targets: Tensor) -> Tensor:
    """``APPROACH`` of the final-normalised states ``x [..., d]`` against their targets'
    embedding and unembedding (``targets`` broadcast to ``x``'s leading axes; NaN where it is
    -1), stacked along a new first axis: ``[4, ...]``."""
    has, safe = targets >= 0, targets.clamp_min(0)
    ref = torch.stack([adapter.W_E[safe].float(), adapter.W_U.T[safe]])  # [2, *targets, d]
    if x.dim() > targets.dim() + 1:  # x has leading axes of its own (points)
        ref = ref.view(2, *([1] * (x.dim() - 1 - targets.dim())), *ref.shape[1:])
    cos = cosine(x[None], ref, x.norm(dim=-1)[None])
    dist = (x[None] - ref).norm(dim=-1)
    return torch.where(has, torch.cat([cos, dist]), math.nan)


def point_lens(
    adapter: "ModelAdapter", mode: LensMode, z: "PointStates", key_valid: Tensor, targets: Tensor
) -> dict[str, Tensor]:
    """The next-token statistics of a pass at ``mode``'s cells, from the final-normalised
    states (``z``: the pass's states, a group of points at a time). ``"full"``: ``rank
    [batch, point, pos]``, ``lens_top``/``lens_top_logit`` ``[batch, point, pos, k]`` and the
    ``APPROACH`` arrays; ``"view"``: the rank and top tokens of its rows, packed for one read
    (``expand_view`` lays them out as those arrays on the host)."""
    n_points, b, n, d = z.shape
    if mode == "view":
        pos, real = view_positions(key_valid)
        points = view_points(n_points)
        rows_b = torch.arange(b, device=pos.device)[:, None]
        if getattr(z, "whole", None) is not None:  # every point at once: one gather
            pts = torch.tensor(points, device=pos.device)[:, None, None]
            states = z.whole[pts, rows_b, pos]
        else:
            states = torch.stack([z[p : p + 1][0][rows_b, pos] for p in points])
        x = adapter.final_norm(states.reshape(-1, d))  # [points x batch x w, d]
        tg = torch.where(real, targets[rows_b, pos], -1).repeat(len(points), 1).reshape(-1)
        rank, ids, logits = read_rows(adapter, x, tg)
        return {
            "view_long": torch.cat([rank[:, None], ids], 1),
            "view_logit": logits,
            "view_pos": torch.where(real, pos, -1),
        }
    out: dict[str, list[Tensor]] = {}
    for p0 in range(0, n_points, z.group):
        x = adapter.final_norm(z[p0 : p0 + z.group])  # [g, batch, pos, d]
        g = x.shape[0]
        for name, v in zip(APPROACH, approach(adapter, x, targets)):
            out.setdefault(name, []).append(v)
        rows = targets[None].expand(g, -1, -1).reshape(-1)
        rank, ids, logits = read_rows(adapter, x.reshape(-1, d), rows)
        out.setdefault("rank", []).append(rank.view(g, b, n))
        out.setdefault("lens_top", []).append(ids.view(g, b, n, -1))
        out.setdefault("lens_top_logit", []).append(logits.view(g, b, n, -1))
    res = {k: torch.cat(v).transpose(0, 1) for k, v in out.items()}
    cells = key_valid[:, None].expand(-1, n_points, -1)  # every real token at every point
    res["rank"] = torch.where(cells, res["rank"], -1)
    res["lens_top"] = torch.where(cells[..., None], res["lens_top"], -1)
    res["lens_top_logit"] = torch.where(cells[..., None], res["lens_top_logit"], math.nan)
    res["lens_cells"] = cells
    return res


def expand_view(raw: dict[str, Tensor], n_points: int) -> dict[str, Tensor]:
    """The packed view rows of ``point_lens`` (read to the host) as ``[batch, point, pos(, k)]``
    arrays (-1, NaN or False where the lens was not read), ``lens_cells`` among them; laid out
    with numpy, no torch op."""
    pos = raw["view_pos"].numpy()  # [b, w], -1 where not real
    b, w = pos.shape
    n = raw["norm"].shape[-1]
    points = np.array(view_points(n_points))
    longs = raw["view_long"].numpy().reshape(len(points), b, w, -1)
    logits = raw["view_logit"].numpy().reshape(len(points), b, w, -1)
    b_idx, w_idx = np.nonzero(pos >= 0)
    index = (b_idx[None], points[:, None], pos[b_idx, w_idx][None])  # [points, cells]
    cells = np.zeros((b, n_points, n), dtype=bool)
    cells[index] = True
    out = {"lens_cells": torch.from_numpy(cells)}
    for name, fill, values in (
        ("rank", -1, longs[..., 0]),
        ("lens_top", -1, longs[..., 1:]),
        ("lens_top_logit", np.nan, logits),
    ):
        full = np.full((b, n_points, n) + values.shape[3:], fill, dtype=values.dtype)
        full[index] = values[:, b_idx, w_idx]
        out[name] = torch.from_numpy(full)
    return out
