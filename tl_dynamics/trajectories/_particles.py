"""Tokens of a prompt as particles on the sphere: pure tensor functions (no model).

Every function takes the valid-token mask ``mask [batch, pos]`` so padded rows never count.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

N_BINS = 40
"""Pairwise-cosine histograms use ``N_BINS`` equal bins on ``[-1, 1]`` (width 0.05), the same
for every layer and model, so histograms are comparable and merge by adding counts."""
BIN_EDGES = torch.linspace(-1.0, 1.0, N_BINS + 1, dtype=torch.float64)
DEFAULT_EPS = (0.01, 0.05, 0.1, 0.25)
"""Cluster thresholds: tokens ``i, j`` are linked when ``cos(i, j) > 1 - eps``."""
NORM_FLOOR = 1e-12  # below this a state counts as the zero vector (its direction is undefined)


def unit(z: Float[Tensor, "... d"]) -> Float[Tensor, "... d"]:
    """``z / |z|`` (zero vectors stay zero)."""
    return z / z.norm(dim=-1, keepdim=True).clamp_min(NORM_FLOOR)


def standardize_prompt(z: Float[Tensor, "batch pos d"], mask: Bool[Tensor, "batch pos"]
                       ) -> Float[Tensor, "batch pos d"]:
    """Per prompt and dimension, subtract the mean and divide by the std over valid tokens.

    Tames "rogue dimensions" (a few coordinates with huge variance dominating cosines).
    """
    w = mask[..., None].to(z.dtype)
    n = w.sum(1, keepdim=True).clamp_min(1.0)
    mean = (z * w).sum(1, keepdim=True) / n
    var = (((z - mean) * w) ** 2).sum(1, keepdim=True) / n
    return (z - mean) / var.sqrt().clamp_min(1e-6) * w


def pair_mask(mask: Bool[Tensor, "batch pos"]) -> Bool[Tensor, "batch pos pos"]:
    """Pairs ``i < j`` of valid tokens."""
    n = mask.shape[1]
    upper = torch.ones(n, n, dtype=torch.bool, device=mask.device).triu(1)
    return mask[:, :, None] & mask[:, None, :] & upper


def cosines(u: Float[Tensor, "batch pos d"]) -> Float[Tensor, "batch pos pos"]:
    """Pairwise cosines of unit vectors, clamped to ``[-1, 1]``."""
    return (u @ u.transpose(1, 2)).clamp(-1.0, 1.0)


def cos_histogram(cos: Float[Tensor, "batch pos pos"], pairs: Bool[Tensor, "batch pos pos"]
                  ) -> Int[Tensor, "batch bins"]:
    """Counts of pairwise cosines per fixed bin (``BIN_EDGES``), per prompt."""
    b = cos.shape[0]
    idx = ((cos.double() + 1.0) * (N_BINS / 2.0)).floor().long().clamp(0, N_BINS - 1)
    flat = (idx + N_BINS * torch.arange(b, device=cos.device)[:, None, None])[pairs]
    return torch.bincount(flat, minlength=b * N_BINS).reshape(b, N_BINS)


def cluster_labels(cos: Float[Tensor, "batch pos pos"], mask: Bool[Tensor, "batch pos"],
                   eps: float) -> Int[Tensor, "batch pos"]:
    """Connected components of the graph ``cos > 1 - eps`` over valid tokens.

    Each valid token gets the smallest position in its component (min-label propagation, at
    most ``pos`` rounds); padding gets -1.
    """
    n = cos.shape[1]
    adj = (cos > 1.0 - eps) & mask[:, :, None] & mask[:, None, :]
    adj = adj | torch.eye(n, dtype=torch.bool, device=cos.device)[None]
    big = n
    labels = torch.where(mask, torch.arange(n, device=cos.device)[None], big)
    for _ in range(n):
        new = torch.where(adj, labels[:, None, :], big).amin(-1)
        new = torch.where(mask, new, big)
        if torch.equal(new, labels):
            break
        labels = new
    return torch.where(mask, labels, -1)


def n_clusters(labels: Int[Tensor, "batch pos"]) -> Int[Tensor, " batch"]:
    """Number of components: tokens that are their component's representative."""
    pos = torch.arange(labels.shape[1], device=labels.device)
    return (labels == pos[None]).sum(-1)


def merges_splits(before: Int[Tensor, "batch pos"], after: Int[Tensor, "batch pos"]
                  ) -> tuple[Int[Tensor, " batch"], Int[Tensor, " batch"]]:
    """Merge and split events between two clusterings of the same tokens.

    With ``D`` the number of distinct (before, after) label pairs: ``merges = D - clusters
    after`` (each cluster after that gathers ``k`` clusters before counts ``k - 1``), and
    ``splits = D - clusters before``.
    """
    b, n = before.shape
    valid = before >= 0
    dev = before.device
    code = (before.clamp_min(0) * n + after.clamp_min(0)) + (n * n) * torch.arange(b, device=dev)[:, None]
    seen = torch.zeros(b * n * n, dtype=torch.bool, device=dev)
    seen[code[valid]] = True
    distinct = seen.reshape(b, n * n).sum(-1)
    return distinct - n_clusters(after), distinct - n_clusters(before)


def effective_rank(u: Float[Tensor, "batch pos d"], mask: Bool[Tensor, "batch pos"]
                   ) -> Float[Tensor, " batch"]:
    """Effective rank ``exp(H(sigma / sum sigma))`` of the prompt's unit-vector cloud.

    The singular values ``sigma`` of the (uncentred) unit vectors are the square roots of the
    Gram matrix's eigenvalues (in float64: a float32 Gram's rounding noise ~1e-7 would become
    singular values ~3e-4 of a rank-deficient cloud); 1 for a cloud collapsed to one point.
    """
    ud = u.double() * mask[..., None]
    gram = ud @ ud.transpose(1, 2)
    sigma = torch.linalg.eigvalsh(gram).clamp_min(0.0).sqrt()
    p = sigma / sigma.sum(-1, keepdim=True).clamp_min(NORM_FLOOR)
    ent = -(p * torch.log(p.clamp_min(1e-300))).sum(-1)
    return torch.exp(ent)
