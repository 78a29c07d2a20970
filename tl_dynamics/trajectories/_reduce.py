"""``reduce_batch``: one pass's point statistics summed into a ``TrajectoryStats`` (exact
integer counts and ``ExactSum`` totals, so batches and runs merge bit for bit)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from tl_dynamics.collect import ExactSum
from tl_dynamics.trajectories._stats import TrajectoryStats
from tl_dynamics.trajectories._stats_readouts import _LENS_FLOATS, _TOKEN_FLOATS


def _valid_sum(x: Tensor, valid: Tensor) -> tuple[Tensor, np.ndarray]:
    """Sum (float64) and count over batch and position of ``x [batch, point, pos]`` at valid
    tokens where it is defined (not NaN)."""
    v = valid[:, None, :].expand_as(x) & ~torch.isnan(x)
    return x.double().masked_fill(~v, 0.0).sum((0, 2)), v.sum((0, 2)).numpy().astype(np.int64)


def _add_float(ints: dict, sums: dict, name: str, x: Tensor, valid: Tensor) -> None:
    total, count = _valid_sum(x, valid)
    sums[name] = ExactSum.of(total)
    ints[f"count_{name}"] = count


def reduce_batch(
    raw: dict[str, Tensor], key_valid: Tensor, meta: dict[str, Any]
) -> "TrajectoryStats":
    """The statistics of one batch (one pass's ``point_statistics``, on the CPU)."""
    ints: dict[str, np.ndarray] = {}
    sums: dict[str, ExactSum] = {}
    n_tok = int(key_valid.sum())
    ints["n_tokens"] = np.array(n_tok, dtype=np.int64)
    ints["n_prompts"] = np.array(key_valid.shape[0], dtype=np.int64)
    for name in _TOKEN_FLOATS:
        if name in raw:
            _add_float(ints, sums, name, raw[name], key_valid)
    sums["state_sum"] = ExactSum.of(raw["state_sum"])
    sums["state_sumsq"] = ExactSum.of(raw["state_sumsq"])
    if "settling" in raw:  # the full lens: every point's rank at every token
        rank = raw["rank"]
        has = rank >= 0  # [batch, point, pos]
        ints["n_lens_tokens"] = np.array(int(has[:, 0].sum()), dtype=np.int64)
        ints["rank_sum"] = torch.where(has, rank, 0).sum((0, 2)).numpy().astype(np.int64)
        ints["top1"] = (rank == 0).sum((0, 2)).numpy().astype(np.int64)
        sums["log_rank"] = ExactSum.of(
            torch.where(has, torch.log1p(rank.double()), 0.0).sum((0, 2))
        )
        settle = raw["settling"][has[:, 0]]
        n_points = rank.shape[1]
        ints["settling"] = torch.bincount(settle, minlength=n_points + 1).numpy().astype(np.int64)
        for name in _LENS_FLOATS:  # the approach, at every token with a next token (else NaN)
            _add_float(ints, sums, name, raw[name], key_valid)
    ints["cos_hist"] = raw["cos_hist"].sum(0).numpy().astype(np.int64)
    ints["n_pairs"] = raw["n_pairs"].sum(0).numpy().astype(np.int64)
    sums["cos_sum"] = ExactSum.of(raw["cos_sum"].sum(0))
    sums["erank"] = ExactSum.of(raw["erank"].double().sum(0))
    for name in ("clusters", "merges", "splits"):
        ints[name] = raw[name].sum(0).numpy().astype(np.int64)
    return TrajectoryStats(meta=dict(meta), ints=ints, sums=sums)
