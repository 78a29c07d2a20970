"""Clusters at every threshold from one maximum spanning tree (the CPU's plan of
``sphere.cluster_labels_grid``).

The eps-clusters at threshold ``t`` are the connected components of the graph of pairs with
cosine above ``t``; they are the components of a maximum spanning tree of the complete graph
(weights: the cosines) cut at its edges of weight ``<= t``, for every ``t`` at once (the cut
property: a pair above ``t`` joins two parts of the tree only through tree edges at least as
heavy). Prim's algorithm runs over every slice (prompt and point) together: ``n`` rounds of a
few ``[slices, n]`` operations, where label propagation took rounds of ``[slices, n, n]``
passes; the canonical labels (each point's cluster's smallest index) are then read off the
tree by pointer jumping, the same labels propagation reaches.
"""

from __future__ import annotations

import math

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
    s, n = cos.shape[0], cos.shape[-1]
    rows = torch.arange(s, device=cos.device)
    # a point's best edge into the tree so far, and where from; once a point joins, its entry
    # no longer changes (it is dead: -inf added to its candidates and its key)
    best = torch.full((s, n), NO_LINK, device=cos.device, dtype=cos.dtype)
    best_from = torch.zeros(s, n, dtype=torch.long, device=cos.device)
    dead = torch.zeros(s, n, device=cos.device, dtype=cos.dtype)
    if mask is not None:
        dead.masked_fill_(~mask, -math.inf)  # padding never joins through a real edge
    first = torch.zeros(s, dtype=torch.long, device=cos.device)
    if mask is not None:
        first = mask.long().argmax(-1)
    v = first
    for _ in range(n - 1):
        dead[rows, v] = -math.inf
        cand = cos[rows, v] + dead  # [s, n]: the open points' cosines to the one just joined
        better = cand > best
        best = torch.where(better, cand, best)
        best_from = torch.where(better, v[:, None], best_from)
        v = (best + dead).argmax(-1)  # the heaviest edge out of the tree
    best[rows, first] = -math.inf
    best_from[rows, first] = first
    return best_from, best


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
