"""Points on the unit sphere: unit vectors, pairwise cosines, eps-clusters and merge events.

The one kernel behind the depth-wise token clouds of ``tl_dynamics.trajectories`` and the
idealised particle system of ``tl_dynamics.particles`` (definitions: docs/math.md §5.5).
Pure tensor functions, batched over any leading axes, on the tensors' own device.

Two points are *eps-close* when ``cos(x_i, x_j) > 1 - eps`` (for small eps: an angle below
about ``sqrt(2 eps)``). Clusters are the connected components of the eps-close graph, each
point labelled by the smallest index in its component, so labels are canonical: equal
clusterings give equal labels, and labels compare across time or depth.

Example:
    >>> import torch
    >>> from tl_dynamics import sphere
    >>> x = torch.tensor([[1.0, 0.0], [0.999, 0.04], [0.0, 1.0]])
    >>> labels = sphere.cluster_labels(sphere.cosines(sphere.unit(x)), sphere.CLUSTER_EPS)
    >>> labels.tolist(), sphere.count_clusters(labels).item()
    ([0, 0, 2], 2)
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from tl_dynamics import _spanning
from tl_dynamics.collect import Collector
from tl_dynamics.errors import TLDynamicsError

__all__ = [
    "CLUSTER_EPS",
    "MergeEvents",
    "NORM_FLOOR",
    "TRAJECTORY_EPS_GRID",
    "close_fraction",
    "cluster_labels",
    "cluster_labels_grid",
    "cosines",
    "count_clusters",
    "gram",
    "mean_cosine",
    "merge_events",
    "pair_mask",
    "unit",
]

CLUSTER_EPS: float = 1e-2
"""One closeness threshold, the particle system's default: an angle below about 8.1 degrees."""
TRAJECTORY_EPS_GRID: tuple[float, ...] = (0.01, 0.05, 0.1, 0.25)
"""The thresholds the depth-wise trajectory statistics record by default, tightest first."""
NORM_FLOOR = 1e-12
"""Below this norm a vector counts as zero: it has no direction (its unit vector is zero)."""


def unit(z: Float[Tensor, "*batch d"]) -> Float[Tensor, "*batch d"]:
    """The unit vectors ``z / |z|`` along the last axis; zero vectors stay zero.

    Args:
        z: Vectors, ``[*batch, d]``.

    Returns:
        The unit vectors, ``[*batch, d]``.

    Example:
        >>> unit(torch.tensor([[3.0, 4.0], [0.0, 0.0]])).tolist()
        [[0.6000000238418579, 0.800000011920929], [0.0, 0.0]]
    """
    return z / z.norm(dim=-1, keepdim=True).clamp_min(NORM_FLOOR)


def gram(x: Float[Tensor, "*batch n d"]) -> Float[Tensor, "*batch n n"]:
    """The inner products ``<x_i, x_j>`` of every pair (for unit vectors: the cosines, unclamped).

    Args:
        x: Points, ``[*batch, n, d]``.

    Returns:
        The Gram matrices, ``[*batch, n, n]``.

    Example:
        >>> gram(torch.eye(2)[None]).tolist()
        [[[1.0, 0.0], [0.0, 1.0]]]
    """
    return x @ x.transpose(-1, -2)


def cosines(
    u: Float[Tensor, "*batch n d"], out: Tensor | None = None
) -> Float[Tensor, "*batch n n"]:
    """Pairwise cosines of unit vectors: ``gram(u)`` clamped to ``[-1, 1]`` (rounding).

    Args:
        u: Unit vectors, ``[*batch, n, d]``.
        out: where to write them (a buffer of that shape), or None.

    Returns:
        The cosines, ``[*batch, n, n]``.

    Example:
        >>> cosines(torch.tensor([[1.0, 0.0], [-1.0, 0.0]])).tolist()
        [[1.0, -1.0], [-1.0, 1.0]]
    """
    if out is None:
        return gram(u).clamp(-1.0, 1.0)
    return torch.matmul(u, u.transpose(-1, -2), out=out).clamp_(-1.0, 1.0)


def pair_mask(mask: Bool[Tensor, "*batch n"]) -> Bool[Tensor, "*batch n n"]:
    """The unordered pairs ``i < j`` of valid points.

    Args:
        mask: Which points are real, ``[*batch, n]``.

    Returns:
        True on pairs ``i < j`` of real points, ``[*batch, n, n]``.

    Example:
        >>> pair_mask(torch.tensor([True, True, False])).sum().item()
        1
    """
    n = mask.shape[-1]
    upper = torch.ones(n, n, dtype=torch.bool, device=mask.device).triu(1)
    return mask[..., :, None] & mask[..., None, :] & upper


def _pairs_mean(m: Tensor) -> Float[Tensor, "*batch"]:
    """Float64 mean over the ``n (n - 1) / 2`` pairs ``i < j`` of a symmetric ``[..., n, n]``."""
    n = m.shape[-1]
    if n < 2:
        return torch.ones(m.shape[:-2], dtype=torch.float64, device=m.device)
    iu = torch.triu_indices(n, n, 1, device=m.device)
    return m[..., iu[0], iu[1]].to(torch.float64).mean(-1)


def mean_cosine(cos: Float[Tensor, "*batch n n"]) -> Float[Tensor, "*batch"]:
    """Mean cosine over the pairs ``i < j`` (float64; 1 for a single point).

    Args:
        cos: Pairwise cosines, ``[*batch, n, n]``.

    Returns:
        The means, ``[*batch]``.

    Example:
        >>> x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
        >>> round(mean_cosine(gram(x)).item(), 4)
        0.3333
    """
    return _pairs_mean(cos)


def close_fraction(cos: Float[Tensor, "*batch n n"], eps: float) -> Float[Tensor, "*batch"]:
    """Fraction of the pairs ``i < j`` that are eps-close (float64; 1 for a single point).

    Args:
        cos: Pairwise cosines, ``[*batch, n, n]``.
        eps: Closeness threshold: a pair is close when ``cos > 1 - eps``.

    Returns:
        The fractions, ``[*batch]``.

    Example:
        >>> x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
        >>> round(close_fraction(gram(x), CLUSTER_EPS).item(), 4)
        0.3333
    """
    return _pairs_mean(cos > 1 - eps)


def cluster_labels(
    cos: Float[Tensor, "*batch n n"], eps: float, mask: Bool[Tensor, "*batch n"] | None = None
) -> Int[Tensor, "*batch n"]:
    """Connected components of the eps-close graph ``cos > 1 - eps``, batched.

    Each point gets the smallest index in its component (int64); with ``mask``, only valid points
    link and invalid ones (padding) get -1. Min-label propagation with pointer jumping: each round
    takes the smallest label among a point's neighbours, then that label's own label, so labels
    only fall and stop, within ``diameter + 1`` rounds, exactly at the component minimum.

    Args:
        cos: Pairwise cosines, ``[*batch, n, n]``.
        eps: Closeness threshold, in ``(0, 2]``.
        mask: Which points are real, ``[*batch, n]`` (None: all).

    Returns:
        The canonical labels, ``[*batch, n]``.

    Example:
        >>> x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
        >>> cluster_labels(gram(x), 0.01).tolist()
        [0, 1, 0]
        >>> cluster_labels(gram(x), 0.01, mask=torch.tensor([True, True, False])).tolist()
        [0, 1, -1]
    """
    return cluster_labels_grid(cos, (eps,), mask)[0]


# Rounds of label propagation between two reads of "did anything change?" (each read waits for
# the device): rounds after convergence change nothing, so checking rarely is exact.
CHECK_EVERY = 4
# Up to this many points the CPU reads clusters off a spanning tree (``_spanning``: n rounds
# of [prompts, n] work); above it, by label propagation
TREE_MAX_POINTS = 8192
# On the CPU, label look-ups (``labels[labels]``) per propagation round: each is a cheap [n]
# gather, and every one can halve the rounds a long chain of points needs.
JUMPS = 4


def cluster_labels_grid(
    cos: Float[Tensor, "*batch n n"],
    eps: Sequence[float],
    mask: Bool[Tensor, "*batch n"] | None = None,
) -> Int[Tensor, "eps *batch n"]:
    """``cluster_labels`` at several thresholds at once.

    On a GPU every threshold and batch element is propagated together (the same launches for
    four thresholds as for one), with one read from the device every ``CHECK_EVERY`` rounds. On
    the CPU, thresholds and prompts with no pair that close are settled from the closest pair
    alone, and only the others propagate (the same labels).

    Args:
        cos: Pairwise cosines, ``[*batch, n, n]``.
        eps: Closeness thresholds, each in ``(0, 2]``.
        mask: Which points are real, ``[*batch, n]`` (None: all).

    Returns:
        The canonical labels per threshold, ``[len(eps), *batch, n]``.

    Example:
        >>> x = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]])
        >>> cluster_labels_grid(gram(x), (0.01, 0.5)).tolist()
        [[0, 1, 2], [0, 0, 0]]
    """
    eps = tuple(float(e) for e in eps)
    if not eps or any(not 0.0 < e <= 2.0 for e in eps):
        raise TLDynamicsError(
            f"eps must be in (0, 2] (points are close when cos > 1 - eps), got {eps!r}"
        )
    lead, n = cos.shape[:-2], cos.shape[-1]
    flat = cos.reshape(-1, n, n)
    thresholds = torch.tensor([1.0 - e for e in eps], dtype=cos.dtype, device=cos.device)
    # narrow ints while propagating: the [batch, n, n] minimum is the cost, and it scales with
    # the width (int16 below 32,768 points; benchmarks/trajectories_bench.py --kernel)
    width = torch.int16 if n < (1 << 15) - 1 else torch.int32
    if Collector.launch_bound(cos.device):  # every threshold and prompt in one propagation
        adj = _links(flat[None] > thresholds[:, None, None, None], mask, n)
        labels = torch.arange(n, dtype=width, device=cos.device).expand(adj.shape[0], n)
        labels = _propagate(adj, labels, CHECK_EVERY, 1)
    else:
        labels = _cpu_labels(flat, thresholds, mask, width)
    labels = labels.long().reshape(len(eps), *lead, n)
    return labels if mask is None else torch.where(mask, labels, -1)


def _links(adj: Tensor, mask: Tensor | None, n: int) -> Tensor:
    """``adj [eps, batch, n, n]`` (cosine above the threshold) restricted to pairs of real
    points, each point linked to itself, as ``[eps * batch, n, n]``."""
    if mask is not None:  # the pairs of real points, formed once for every threshold
        m = mask.reshape(-1, n)
        adj &= (m[:, :, None] & m[:, None, :])[None]
    adj = adj.reshape(-1, n, n)
    adj.diagonal(dim1=-2, dim2=-1).fill_(True)  # every point links to itself (no [n, n] eye)
    return adj


def _cpu_labels(
    flat: Tensor, thresholds: Tensor, mask: Tensor | None, width: torch.dtype
) -> Tensor:
    """``cluster_labels_grid`` on the CPU, where reading a value costs nothing: a (threshold,
    prompt) slice with no pair closer than the threshold is all singletons, found from each
    prompt's closest pair (one pass, no links formed); the others are read off one maximum
    spanning tree per prompt (``_spanning``, up to ``TREE_MAX_POINTS`` points) or, above that,
    propagated: the first round is each row's first neighbour (no [n, n] labels written) and
    each round follows labels ``JUMPS`` times. Labels only fall and stay a node of the same
    cluster, so the fixed point is the one the GPU's propagation reaches (tests/test_collect.py
    compares them)."""
    n_eps, (n_batch, n) = len(thresholds), (flat.shape[0], flat.shape[-1])
    labels = torch.arange(n, dtype=width).repeat(n_eps * n_batch, 1)
    todo = torch.arange(n_eps * n_batch)
    if (mask is None or bool(mask.all())) and float(thresholds.min()) >= 0.0:
        # each prompt's closest pair: the largest entry off the diagonal (set below any cosine)
        diagonal = flat.diagonal(dim1=-2, dim2=-1)
        kept = diagonal.clone()
        diagonal.fill_(-2.0)
        closest = flat.amax((-2, -1))
        diagonal.copy_(kept)
        todo = (closest[None, :] > thresholds[:, None]).flatten().nonzero().flatten()
        if len(todo) == 0:
            return labels
    e, b = todo // n_batch, todo % n_batch
    if n <= TREE_MAX_POINTS:  # one spanning tree per prompt serves every threshold
        prompts, slot = torch.unique(b, return_inverse=True)
        sub_mask = None if mask is None else mask.reshape(-1, n)[prompts]
        tree = _spanning.spanning_tree(flat[prompts], sub_mask)
        found = _spanning.tree_labels(*tree, thresholds, sub_mask)  # [eps, prompts, n]
        labels[todo] = found[e, slot].clamp_min(0).to(width)  # padding: masked by the caller
        return labels
    m = None if mask is None else mask.reshape(-1, n)[b]
    adj = _links((flat[b] > thresholds[e][:, None, None])[None], m, n)
    sub = adj.view(torch.uint8).argmax(-1).to(width)  # labels 0..n-1: the first True per row
    for _ in range(JUMPS):
        sub = torch.gather(sub, 1, sub.long())
    # a slice whose first neighbours are the points themselves has no link j < i in any row:
    # a round of minima would change nothing, it is done
    going = (sub != torch.arange(n, dtype=width)).any(-1).nonzero().flatten()
    if len(going):
        sub[going] = _propagate(adj[going], sub[going], 1, JUMPS)
    labels[todo] = sub
    return labels


def _propagate(adj: Tensor, labels: Tensor, every: int, jumps: int) -> Tensor:
    """Minimum-label propagation over ``adj [batch, n, n]`` from ``labels [batch, n]`` (each
    a point of its own cluster) to the fixed point: every point labelled with its cluster's
    smallest index. Reads "did anything change?" every ``every`` rounds; follows labels
    ``jumps`` times per round. Labels only fall and stay a node of the same cluster, so the
    fixed point is the same whatever the start, ``every`` and ``jumps``."""
    n = adj.shape[-1]
    for r in range(n + 1):
        new = torch.where(adj, labels[:, None, :], n).amin(-1)
        for _ in range(jumps):
            new = torch.gather(new, 1, new.long())
        if (r + 1) % every == 0 or r == n:
            if torch.equal(new, labels):
                break
        labels = new
    return labels


def count_clusters(labels: Int[Tensor, "*batch n"]) -> Int[Tensor, "*batch"]:
    """Number of clusters in canonical labels: the points that are their cluster's smallest index.

    Padding, labelled -1, never counts.

    Args:
        labels: Canonical labels, ``[*batch, n]``.

    Returns:
        The counts, ``[*batch]``.

    Example:
        >>> count_clusters(torch.tensor([[0, 0, 2, -1]])).tolist()
        [2]
    """
    pos = torch.arange(labels.shape[-1], device=labels.device)
    return (labels == pos).sum(-1)


class MergeEvents(NamedTuple):
    """Events between two clusterings of the same points: ``merges`` and ``splits`` (int64).

    With ``D`` the number of distinct (before, after) label pairs, ``merges = D - clusters after``
    (a cluster after that gathers ``k`` clusters before counts ``k - 1``) and ``splits = D -
    clusters before``; ``merges - splits`` is the fall in the cluster count. Made by
    ``merge_events``.

    Attributes:
        merges: Merge events, ``[*batch]``.
        splits: Split events, ``[*batch]``.

    Example:
        >>> ev = merge_events(torch.tensor([0, 0, 2]), torch.tensor([0, 1, 1]))
        >>> ev
        MergeEvents(merges=tensor(1), splits=tensor(1))
    """

    merges: Int[Tensor, "*batch"]
    splits: Int[Tensor, "*batch"]


def merge_events(before: Int[Tensor, "*batch n"], after: Int[Tensor, "*batch n"]) -> MergeEvents:
    """Merge and split events from canonical labels ``before`` to ``after`` (-1: not a point).

    Args:
        before: Canonical labels, ``[*batch, n]``.
        after: Canonical labels of the same points, ``[*batch, n]``.

    Returns:
        ``MergeEvents`` with ``merges`` and ``splits``, each ``[*batch]``.

    Example:
        >>> ev = merge_events(torch.tensor([0, 1, 2, 3]), torch.tensor([0, 0, 2, 2]))
        >>> ev.merges.item(), ev.splits.item()
        (2, 0)
    """
    if before.shape != after.shape:
        raise TLDynamicsError(
            f"merge_events needs two labellings of the same points, got shapes "
            f"{tuple(before.shape)} and {tuple(after.shape)}"
        )
    n = before.shape[-1]
    valid = before >= 0
    code = torch.where(valid, before.long().clamp_min(0) * n + after.long().clamp_min(0), -1)
    code = code.sort(-1).values
    prev = torch.cat([torch.full_like(code[..., :1], -1), code[..., :-1]], -1)
    distinct = ((code >= 0) & (code != prev)).sum(-1)
    return MergeEvents(distinct - count_clusters(after), distinct - count_clusters(before))
