"""The attribution arithmetic of one head (docs/math.md §10.3-10.5): pure tensors, no model.

``Q`` ``[A, batch, pos, d_head]`` and ``K`` ``[B, batch, pos, d_head]`` are the per-component
parts of the head's rotated queries and keys (``ResidualSplit.queries``/``keys``), so
``s_ij = c sum_ab <Q^a_i, K^b_j> + p_ij``. Per row ``i`` with weights ``w_ij`` over its keys (the
pattern ``p``, or the uniform ``u`` over the allowed keys):

    key side   K_i^b = c <q_i, sum_j w_ij K^b_j>      query side  Q_i^a = c <Q^a_i, sum_j w_ij k_j>

each summing over components to ``sum_j w_ij (s_ij - p_ij)``. The pattern-weighted minus the
uniform-weighted value is the component's *lift*: what it adds to the attended keys' scores
over the row's average key, which is what the softmax sees (a part equal on every key cancels).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# Bytes of float32 temporaries per chunk of rows in the pair products (cache-sized on the CPU).
PAIR_BUDGET = 32 * 2**20


@dataclass(frozen=True)
class HeadRows:
    """One head's per-row attribution over a batch (every array ``[batch, pos, ...]``)."""

    query_w: Tensor  # [b, pos, A] pattern-weighted query-side parts
    query_u: Tensor  # [b, pos, A] uniform-weighted
    key_w: Tensor  # [b, pos, B]
    key_u: Tensor
    pos_w: Tensor  # [b, pos] the position term, pattern- and uniform-weighted
    pos_u: Tensor
    chosen: Tensor  # [b, pos] each row's most attended key
    chosen_p: Tensor  # [b, pos] its attention
    top_a: Tensor  # [b, pos, k] query component of each top pair at the chosen key
    top_b: Tensor  # [b, pos, k] key component
    top_v: Tensor  # [b, pos, k] the pair's lift c <Q^a_i, K^b_j* - mean_j K^b_j>
    prior: Tensor  # [b, pos, B] key-prior lift at the chosen key per key component
    like_q: Tensor  # [b, pos, A] distance-likelihood lift per query component
    like_k: Tensor  # [b, pos, B] per key component
    rows: Tensor  # [b, pos] bool: valid rows with at least two allowed keys
    n_keys: Tensor  # [b, pos] the number of keys each row may attend to


def uniform(allowed: Tensor) -> Tensor:
    """The uniform weights over each row's allowed keys (zero rows stay zero)."""
    a = allowed.float()
    return a / a.sum(-1, keepdim=True).clamp_min(1.0)


def _weighted(w: Tensor, K: Tensor, chunk: int) -> Tensor:
    """``sum_j w_ij K^b_j`` for every component, ``[B, b, rows, d]`` (``w``: ``[b, rows, pos]``),
    ``chunk`` components at a time (their ``[b, pos, chunk * d]`` copy is the only temporary)."""
    B, b, n, d = K.shape
    rows = w.shape[1]  # the query rows (every position, or the rows a caller reads)
    out = K.new_empty(B, b, rows, d)
    for c0 in range(0, B, chunk):
        part = K[c0 : c0 + chunk]
        flat = part.permute(1, 2, 0, 3).reshape(b, n, -1)
        out[c0 : c0 + chunk] = torch.bmm(w, flat).reshape(b, rows, -1, d).permute(2, 0, 1, 3)
    return out


def _chunk(n: int, d: int) -> int:
    """Components per chunk of ``PAIR_BUDGET`` bytes of ``[pos, d]`` float32 parts."""
    return max(1, PAIR_BUDGET // max(1, 4 * n * d))


def head_rows(
    Q: Tensor,
    K: Tensor,
    pattern: Tensor,
    allowed: Tensor,
    query_valid: Tensor,
    scale: float,
    bias: Tensor | None,
    top_k: int,
    pairs: bool = True,
) -> HeadRows:
    """The marginals, top pairs and odds-ratio parts of one head (docs/math.md §10.3-10.5).

    Args:
        Q: Query parts ``[A, batch, pos, d]``.
        K: Key parts ``[B, batch, pos, d]``.
        pattern: The head's pattern ``[batch, pos, pos]``.
        allowed: ``[batch, pos, pos]`` bool.
        query_valid: ``[batch, pos]`` bool.
        scale: The score scale ``c``.
        bias: The position term ``[batch, pos, pos]`` or None.
        top_k: Pairs kept per row.
        pairs: Also the top pairs and the odds-ratio parts (False: the marginals and the chosen
            key only, the pair fields empty ``[batch, pos, 0]``; what the atlas reads).

    Returns:
        A ``HeadRows``.
    """
    q, k = Q.sum(0), K.sum(0)
    u = uniform(allowed)
    chunk = _chunk(q.shape[0] * q.shape[1], q.shape[-1])
    ku = _weighted(u, K, chunk)  # [B, b, pos, d]: kept (the baselines of pairs and likelihood)
    key_u = scale * torch.einsum("bid,nbid->bin", q, ku)
    kut = ku.sum(0)
    key_w = torch.empty_like(key_u)
    kpt = torch.zeros_like(q)
    for c0 in range(0, K.shape[0], chunk):  # pattern-weighted, a chunk at a time
        kp = _weighted(pattern, K[c0 : c0 + chunk], chunk)
        key_w[..., c0 : c0 + chunk] = scale * torch.einsum("bid,nbid->bin", q, kp)
        kpt += kp.sum(0)
    query_w = scale * torch.einsum("abid,bid->bia", Q, kpt)
    query_u = scale * torch.einsum("abid,bid->bia", Q, kut)
    if bias is None:
        pos_w = pos_u = torch.zeros_like(q[..., 0])
    else:
        pos_w, pos_u = (pattern * bias).sum(-1), (u * bias).sum(-1)
    chosen_p, chosen = pattern.max(-1)
    rows = query_valid & (allowed.sum(-1) >= 2)
    if not pairs:
        none = q.new_zeros(*q.shape[:2], 0)
        return HeadRows(
            query_w, query_u, key_w, key_u, pos_w, pos_u, chosen, chosen_p,
            none.long(), none.long(), none, none, none, none, rows, allowed.sum(-1).float(),
        )  # fmt: skip
    bidx = torch.arange(q.shape[0], device=q.device)[:, None]
    Kstar = K[:, bidx, chosen]  # [B, b, pos, d]: each row's chosen key's parts
    kstar = Kstar.sum(0)
    # odds-ratio parts (docs/math.md §10.5): key prior (c/2)<K^b_j, k_j>, its row mean
    prior_j = 0.5 * scale * torch.einsum("nbjd,bjd->bjn", K, k)
    prior_star = prior_j[bidx, chosen]
    prior_mean = torch.bmm(u, prior_j)
    diff = q - kstar
    like_q = (
        -0.5
        * scale
        * (torch.einsum("abid,bid->bia", Q, diff) - torch.einsum("abid,bid->bia", Q, q - kut))
    )
    like_k = 0.5 * scale * torch.einsum("nbid,bid->bin", Kstar, diff) - (
        0.5 * scale * torch.einsum("nbid,bid->bin", ku, q) - prior_mean
    )
    Kstar -= ku  # in place: the pairs' lifts are against the row's average key
    del ku
    top_a, top_b, top_v = _top_pairs(Q, Kstar, scale, top_k)
    return HeadRows(
        query_w, query_u, key_w, key_u, pos_w, pos_u, chosen, chosen_p,
        top_a, top_b, top_v, prior_star - prior_mean, like_q, like_k, rows,
        allowed.sum(-1).float(),
    )  # fmt: skip


def _top_pairs(Q: Tensor, Kd: Tensor, scale: float, top_k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per row the ``top_k`` largest ``c <Q^a_i, Kd^b_i>`` (``Kd`` ``[B, b, pos, d]``), in chunks
    of rows of at most ``PAIR_BUDGET`` bytes of products."""
    A, b, n, d = Q.shape
    B = Kd.shape[0]
    k = min(top_k, A * B)
    step = max(1, PAIR_BUDGET // max(1, 4 * A * B))
    vals, idx = [], []
    for row in range(b):
        for i0 in range(0, n, step):
            Qr = Q[:, row, i0 : i0 + step].transpose(0, 1)  # [rows, A, d]
            Kr = Kd[:, row, i0 : i0 + step].permute(1, 2, 0)  # [rows, d, B]
            m = torch.bmm(Qr, Kr)
            v, i = (scale * m).reshape(m.shape[0], A * B).topk(k, dim=-1)
            vals.append(v)
            idx.append(i)
    v, i = torch.cat(vals).reshape(b, n, k), torch.cat(idx).reshape(b, n, k)
    return i // B, i % B, v


def pair_matrix(Qi: Tensor, Kj: Tensor, scale: float) -> Tensor:
    """The full component x component matrix ``c <Q^a_i, K^b_j>`` ``[A, B]`` of one pair."""
    return scale * Qi @ Kj.T


def odds_parts(Qi: Tensor, Kj: Tensor, scale: float) -> dict[str, Tensor]:
    """The odds-ratio parts of one score per component (docs/math.md §10.5): query term
    ``(c/2)<Q^a, q>``, key prior ``(c/2)<K^b, k>``, distance likelihood ``-(c/2)<Q^a, q - k>``
    and ``(c/2)<K^b, q - k>``; they sum to ``c <q, k>``."""
    q, k = Qi.sum(0), Kj.sum(0)
    half = 0.5 * scale
    return {
        "query_term": half * Qi @ q,
        "key_prior": half * Kj @ k,
        "likelihood_query": -half * Qi @ (q - k),
        "likelihood_key": half * Kj @ (q - k),
    }
