"""Observables of particle configurations: pairwise cosines, eps-close pairs, clusters.

All functions take unit vectors ``x: [..., n, d]`` (any leading axes, e.g. ``[T, runs]``)
or, for the ``*_from_gram`` forms, their Gram matrices ``[..., n, n]``. Two particles
are *eps-close* when ``<x_i, x_j> > 1 - eps`` (for small eps: angle below ``sqrt(2 eps)``).
Clusters are the connected components of the eps-close graph, labelled by the smallest
particle index in the component (so labels are canonical and comparable across time).
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor

from ._checks import Problems, check_eps

#: Default closeness threshold: angle below ~8.1 degrees.
DEFAULT_EPS = 1e-2


def gram(x: Float[Tensor, "*batch n d"]) -> Float[Tensor, "*batch n n"]:
    """``<x_i, x_j>`` for all pairs: ``[..., n, d] -> [..., n, n]``."""
    return x @ x.transpose(-1, -2)


def _pairs_mean(m: Tensor) -> Tensor:
    """Mean over the ``n(n-1)/2`` unordered pairs ``i < j`` of a symmetric ``[..., n, n]``."""
    n = m.shape[-1]
    if n < 2:
        return torch.ones(m.shape[:-2], dtype=torch.float64)
    iu = torch.triu_indices(n, n, 1)
    return m[..., iu[0], iu[1]].to(torch.float64).mean(-1)


def mean_cosine_from_gram(G: Float[Tensor, "*batch n n"]) -> Float[Tensor, "*batch"]:
    return _pairs_mean(G)


def close_fraction_from_gram(G: Float[Tensor, "*batch n n"], eps: float) -> Float[Tensor, "*batch"]:
    return _pairs_mean(G > 1 - eps)


def cluster_labels_from_gram(G: Float[Tensor, "*batch n n"], eps: float) -> Int[Tensor, "*batch n"]:
    """Connected components of ``G > 1 - eps``: ``[..., n]`` int64, smallest index per component.

    Min-label propagation with pointer jumping: a few passes over ``[..., n, n]`` for
    clustered configurations, at most ``O(log n)`` more than the graph diameter.
    """
    lead, n = G.shape[:-2], G.shape[-1]
    adj = (G > 1 - eps).reshape(-1, n, n)
    adj = adj | torch.eye(n, dtype=torch.bool)
    lab = torch.arange(n).expand(adj.shape[0], n).contiguous()
    big = torch.full_like(adj, n, dtype=torch.int64)
    for _ in range(2 * n + 2):
        nb = torch.where(adj, lab[:, None, :], big).amin(-1)
        nb = torch.gather(nb, 1, nb)
        if torch.equal(nb, lab):
            break
        lab = nb
    return lab.reshape(*lead, n)


def count_from_labels(labels: Int[Tensor, "*batch n"]) -> Int[Tensor, "*batch"]:
    """Number of clusters from canonical labels ``[..., n] -> [...]``."""
    n = labels.shape[-1]
    return (labels == torch.arange(n)).sum(-1)


def _x_checked(where: str, x: Tensor, eps) -> float:
    p = Problems(where)
    if not isinstance(x, torch.Tensor) or x.ndim < 2:
        p.add(f"x must be a tensor [..., n, d], got {getattr(x, 'shape', type(x).__name__)}")
    (e,) = check_eps(p, eps) or (None,)
    p.raise_if_any()
    return e


def mean_cosine(x: Float[Tensor, "*batch n d"]) -> Float[Tensor, "*batch"]:
    """Mean of ``<x_i, x_j>`` over pairs ``i < j``: ``[..., n, d] -> [...]``.

    >>> x = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]])
    >>> mean_cosine(x)
    tensor([0.3333], dtype=torch.float64)
    """
    _x_checked("mean_cosine", x, DEFAULT_EPS)
    return mean_cosine_from_gram(gram(x))


def close_fraction(x: Float[Tensor, "*batch n d"], eps: float = DEFAULT_EPS) -> Float[Tensor, "*batch"]:
    """Fraction of pairs ``i < j`` that are eps-close: ``[..., n, d] -> [...]``.

    >>> x = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]])
    >>> close_fraction(x, 1e-2)
    tensor([0.3333], dtype=torch.float64)
    """
    e = _x_checked("close_fraction", x, eps)
    return close_fraction_from_gram(gram(x), e)


def cluster_labels(x: Float[Tensor, "*batch n d"], eps: float = DEFAULT_EPS) -> Int[Tensor, "*batch n"]:
    """Cluster of each particle (smallest index in its eps-connected component): ``[..., n]``.

    >>> x = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]])
    >>> cluster_labels(x).tolist()
    [[0, 1, 0]]
    """
    e = _x_checked("cluster_labels", x, eps)
    return cluster_labels_from_gram(gram(x), e)


def cluster_count(x: Float[Tensor, "*batch n d"], eps: float = DEFAULT_EPS) -> Int[Tensor, "*batch"]:
    """Number of eps-clusters (connected components of ``<x_i, x_j> > 1 - eps``): ``[...]``.

    >>> x = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]])
    >>> cluster_count(x).tolist()
    [2]
    """
    return count_from_labels(cluster_labels(x, eps))
