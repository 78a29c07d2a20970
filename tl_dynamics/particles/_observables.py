"""Observables of particle configurations ``x: [..., n, d]`` (unit vectors, any leading axes).

Checked entry points on states; the work is ``tl_dynamics.sphere`` (pairwise cosines, the
eps-close graph and its clusters, labelled by the smallest particle index in each, so labels
are canonical and comparable across time).
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor

from tl_dynamics import sphere
from tl_dynamics.particles._checks import Problems, check_eps


def _gram_checked(where: str, x: Tensor, eps: float) -> tuple[Tensor, float]:
    p = Problems(where)
    if not isinstance(x, torch.Tensor) or x.ndim < 2:
        p.add(f"x must be a tensor [..., n, d], got {getattr(x, 'shape', type(x).__name__)}")
    checked = check_eps(p, eps)
    p.raise_if_any()
    (e,) = checked
    return sphere.gram(x), e


def mean_cosine(x: Float[Tensor, "*batch n d"]) -> Float[Tensor, "*batch"]:
    """Mean of ``<x_i, x_j>`` over pairs ``i < j``: ``[..., n, d] -> [...]``.

    >>> x = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]])
    >>> mean_cosine(x)
    tensor([0.3333], dtype=torch.float64)
    """
    g, _ = _gram_checked("mean_cosine", x, sphere.CLUSTER_EPS)
    return sphere.mean_cosine(g)


def close_fraction(
    x: Float[Tensor, "*batch n d"], eps: float = sphere.CLUSTER_EPS
) -> Float[Tensor, "*batch"]:
    """Fraction of pairs ``i < j`` that are eps-close: ``[..., n, d] -> [...]``.

    >>> x = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]])
    >>> close_fraction(x, 1e-2)
    tensor([0.3333], dtype=torch.float64)
    """
    g, e = _gram_checked("close_fraction", x, eps)
    return sphere.close_fraction(g, e)


def cluster_labels(
    x: Float[Tensor, "*batch n d"], eps: float = sphere.CLUSTER_EPS
) -> Int[Tensor, "*batch n"]:
    """Cluster of each particle (smallest index in its eps-connected component): ``[..., n]``.

    >>> x = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]])
    >>> cluster_labels(x).tolist()
    [[0, 1, 0]]
    """
    g, e = _gram_checked("cluster_labels", x, eps)
    return sphere.cluster_labels(g, e)


def cluster_count(
    x: Float[Tensor, "*batch n d"], eps: float = sphere.CLUSTER_EPS
) -> Int[Tensor, "*batch"]:
    """Number of eps-clusters (connected components of ``<x_i, x_j> > 1 - eps``): ``[...]``.

    >>> x = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]])
    >>> cluster_count(x).tolist()
    [2]
    """
    return sphere.count_clusters(cluster_labels(x, eps))
