"""Clusters at every threshold from one maximum spanning tree (the CPU's plan of
``sphere.cluster_labels_grid``).

The eps-clusters at threshold ``t`` are the connected components of the graph of pairs with
cosine above ``t``; they are the components of a maximum spanning tree of the complete graph
(weights: the cosines) cut at its edges of weight ``<= t``, for every ``t`` at once (the cut
property: a pair above ``t`` joins two parts of the tree only through tree edges at least as
heavy). Prim's algorithm runs over every slice (prompt and point) together: ``n`` rounds of a
few ``[slices, n]`` numpy operations (a torch operation costs several times more at this size),
where label propagation took rounds of ``[slices, n, n]`` passes; the canonical labels (each point's cluster's smallest index) are then read off the
tree by pointer jumping, the same labels propagation reaches.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

NO_LINK = -2.0  # below every cosine: the weight of a pair that is never linked (padding)


def spanning_tree(cos: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """A maximum spanning tree of each slice's real points (Prim's algorithm from the first).

    Args:
        cos: ``[slices, n, n]`` symmetric cosines.
        mask: ``[slices, n]`` real points (None: all); a point that is not real joins nothing
            (its edge weighs ``NO_LINK``).

    Returns:
        ``parent [slices, n]`` (the point each joined the tree through; the first point its
        own) and ``weight [slices, n]`` (that edge's cosine; -inf for the first point).

    Example:
        >>> c = torch.tensor([[[1.0, 0.9, 0.1], [0.9, 1.0, 0.5], [0.1, 0.5, 1.0]]])
        >>> parent, weight = spanning_tree(c)
        >>> parent.tolist(), weight.tolist()
        ([[0, 0, 1]], [[-inf, 0.8999999761581421, 0.5]])
    """
    c = cos.detach().cpu().numpy()  # n rounds of small steps: numpy's are cheaper than torch's
    s, n = c.shape[0], c.shape[-1]
    rows = np.arange(s)
    best = np.full((s, n), NO_LINK, dtype=c.dtype)
    best_from = np.zeros((s, n), dtype=np.int64)
    dead = np.zeros((s, n), dtype=c.dtype)
    first = np.zeros(s, dtype=np.int64)
    if mask is not None:
        m = mask.cpu().numpy()
        dead[~m] = -np.inf  # padding never joins through a real edge
        first = m.argmax(-1)
    v = first
    cand, key = np.empty_like(best), np.empty_like(best)
    better = np.empty((s, n), dtype=bool)
    for _ in range(n - 1):
        dead[rows, v] = -np.inf
        np.add(c[rows, v], dead, out=cand)
        np.greater(cand, best, out=better)
        np.copyto(best, cand, where=better)
        np.copyto(best_from, v[:, None], where=better)
        v = np.add(best, dead, out=key).argmax(-1)
    best[rows, first] = -np.inf
    best_from[rows, first] = first
    return torch.from_numpy(best_from), torch.from_numpy(best)


def tree_labels(
    parent: Tensor, weight: Tensor, thresholds: Tensor, mask: Tensor | None = None
) -> Tensor:
    """The canonical cluster labels at each threshold: the components of the tree's edges
    heavier than it, each point labelled with its component's smallest index (-1: not real).

    Args:
        parent: ``[slices, n]`` from ``spanning_tree``.
        weight: ``[slices, n]`` from ``spanning_tree``.
        thresholds: ``[eps]`` (points link when their cosine is above one).
        mask: ``[slices, n]`` real points (None: all).

    Returns:
        ``[eps, slices, n]`` int64 labels.

    Example:
        >>> c = torch.tensor([[[1.0, 0.9, 0.1], [0.9, 1.0, 0.5], [0.1, 0.5, 1.0]]])
        >>> tree_labels(*spanning_tree(c), torch.tensor([0.95, 0.6, 0.0])).tolist()
        [[[0, 1, 2]], [[0, 0, 2]], [[0, 0, 0]]]
    """
    n = parent.shape[-1]
    own = torch.arange(n, device=parent.device)
    keep = weight[None] > thresholds.to(weight.dtype)[:, None, None]  # [eps, slices, n]
    root = torch.where(keep, parent[None], own)
    for _ in range(max(1, math.ceil(math.log2(max(n, 2))))):  # a tree n deep: log2 n jumps
        root = root.gather(-1, root)
    smallest = torch.full_like(root, n).scatter_reduce_(-1, root, own.expand_as(root), "amin")
    labels = smallest.gather(-1, root)
    return labels if mask is None else torch.where(mask[None], labels, -1)
