"""The streaming path for the common case (no position bias, no soft-cap): few passes over
``[batch, head, q, k]``, in query chunks that stay in cache.

Identities used (``A`` the allowed mask, ``P_j`` the key prior, ``p`` the pattern,
``lse_i`` the row's log-partition):

- ``sum_j A_ij r_ij = c <q_i, sum_j A_ij k_j>``: the row means come from a matrix product of
  the mask with the keys before any score is formed, so each chunk centres its scores in place
  and the second moments have no cancellation;
- ``lse_i = r_ii - log p_ii`` (a valid query may always attend to itself);
- ``log sum_j A_ij exp(r_ij - P_j) = lse_i + log sum_j p_ij exp(-P_j)``: the likelihood-only
  log-partition from the real pattern. Exact, but it loses keys whose ``p_ij`` underflows, so
  it is only used when the key priors of a prompt and head span less than ``MAX_PRIOR_SPREAD``
  nats (then no lost key can weigh more than ``exp(MAX_PRIOR_SPREAD - 87)`` of the sum).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

MAX_PRIOR_SPREAD = 60.0
# Scores of [batch, head, chunk, keys] formed at once: ~2 MB of float32, cache-sized; with a
# causal or sliding-window mask each chunk of queries only scores the band of keys it may see.
CHUNK_ELEMENTS = 1 << 19
# On a GPU a chunk is a few kernel launches and a host sync (the band's keys): cache-sized chunks
# made odds_ratio.attach 39x a 4,096-token forward on an H100; 16M elements (64 MB) each keep the
# launches few and the transient memory a fraction of the forward's own attention scores.
DEVICE_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True, eq=False)
class MaskFacts:
    """What the statistics need of a layer's masks, formed once for every layer that has the
    same ``allowed`` and ``query_valid`` (usually every layer of a forward pass: at 1,024
    tokens, forming them per layer was a quarter of the statistics' time; issue 15)."""

    allowed: Tensor  # [b, i, j]
    query_valid: Tensor  # [b, i]
    allowed_f: Tensor  # [b, i, j] float
    n_allowed: Tensor  # [b, i]: allowed keys per row
    n_safe: Tensor  # [b, 1, i] float, at least 1
    key_valid: Tensor  # [b, j]
    prefix: Tensor | None  # key_valid where the mask is causal (row sums are prefix sums)
    additive: Tensor  # [b, i, j]: 0 on allowed keys, -inf elsewhere (0 on rows with none)
    valid_f: Tensor  # [b, i] float: rows that choose among >= 2 keys (sinks, §2.3)
    key_span: Tensor  # [i, j]: keys some prompt's query i may attend to
    self_allowed: bool  # every valid query may attend to itself

    @classmethod
    def of(cls, allowed: Tensor, query_valid: Tensor) -> "MaskFacts":
        allowed_f = allowed.float()
        n_allowed = allowed.sum(-1)
        key_valid = allowed.any(1)
        additive = torch.zeros(allowed.shape, device=allowed.device).masked_fill(
            ~allowed, float("-inf"))
        additive[n_allowed == 0] = 0.0  # rows with no key: finite garbage, never counted
        diag = allowed.diagonal(dim1=1, dim2=2)
        return cls(allowed=allowed, query_valid=query_valid, allowed_f=allowed_f,
                   n_allowed=n_allowed, n_safe=allowed_f.sum(-1).clamp(min=1.0)[:, None],
                   key_valid=key_valid,
                   prefix=key_valid if _is_causal(allowed, key_valid) else None,
                   additive=additive, valid_f=(query_valid & (n_allowed >= 2)).float(),
                   key_span=allowed.any(0), self_allowed=bool(diag[query_valid].all()))

    def matches(self, allowed: Tensor, query_valid: Tensor) -> bool:
        """Whether these facts are those of ``allowed`` and ``query_valid``."""
        return (allowed is self.allowed or (allowed.shape == self.allowed.shape
                                            and torch.equal(allowed, self.allowed))) and \
            query_valid.shape == self.query_valid.shape and torch.equal(query_valid,
                                                                         self.query_valid)


def row_facts(q: Tensor, k: Tensor, scale: float, allowed: Tensor,
              query_valid: Tensor, masks: MaskFacts | None = None) -> dict[str, Tensor] | None:
    """Row statistics like ``_stats._direct_row_facts``, or None where this path does not apply.
    ``masks`` are the facts of ``allowed`` and ``query_valid`` when known already."""
    n_batch, n_pos, n_heads, _ = q.shape
    if masks is None or not masks.matches(allowed, query_valid):
        masks = MaskFacts.of(allowed, query_valid)
    if not masks.self_allowed:
        return None
    qh = q.permute(0, 2, 1, 3).contiguous()  # [b, h, i, d]: each chunk's product reads it
    kh = k.permute(0, 2, 1, 3).contiguous()  # in place (a strided view was copied per chunk)
    prior = (scale / 2.0) * kh.pow(2).sum(-1)  # [b, h, j]
    key_valid, prefix, allowed_f, n_safe = masks.key_valid, masks.prefix, masks.allowed_f, masks.n_safe
    kv = key_valid[:, None]
    p_min = prior.masked_fill(~kv, float("inf")).amin(-1, keepdim=True)
    p_max = prior.masked_fill(~kv, float("-inf")).amax(-1, keepdim=True)
    if bool(((p_max - p_min) > MAX_PRIOR_SPREAD).any()):
        return None

    # row means of r through the keys (no [b, h, i, j] pass)
    sum_k = _row_sums(allowed_f, kh, prefix)
    d = kh.shape[-1]
    sum_r = scale * (qh * sum_k).sum(-1)
    p64 = prior.double()
    sum_p = _row_sums(allowed_f, p64, prefix)
    var_prior = _row_sums(allowed_f, p64 * p64, prefix) - sum_p * sum_p / n_safe.double()
    mean_p = sum_p / n_safe.double()

    exp_neg_p = torch.exp(-(prior - p_min)).masked_fill(~kv, 0.0)  # [b, h, j], <= 1
    per_key = torch.stack([prior, exp_neg_p], -1)  # [b, h, j, 2]
    additive, valid_f, key_span = masks.additive, masks.valid_f, masks.key_span

    mean_r = sum_r / n_safe
    shifted_prior = prior - p_min
    sum_sq = torch.zeros(n_batch, n_heads, n_pos, device=q.device)
    cov_rp = torch.zeros_like(sum_sq)
    sum_pr, lse = torch.zeros_like(sum_sq), torch.zeros_like(sum_sq)
    pat_keys = torch.zeros(n_batch, n_heads, n_pos, 2, device=q.device)
    column = torch.zeros_like(sum_sq)
    chunk = CHUNK_ELEMENTS if q.device.type == "cpu" else DEVICE_CHUNK_ELEMENTS
    step = max(8, chunk // max(1, n_batch * n_heads * n_pos))
    k_t = kh.transpose(-1, -2)
    for i0 in range(0, n_pos, step):
        i1 = min(n_pos, i0 + step)
        cols = torch.nonzero(key_span[i0:i1].any(0)).flatten()
        if cols.numel() == 0:
            continue
        j0, j1 = int(cols[0]), int(cols[-1]) + 1  # causal/window: only this band of keys
        r = torch.matmul(qh[:, :, i0:i1], k_t[..., j0:j1]).mul_(scale)  # [b, h, c, m]
        log_p = torch.log_softmax(r + additive[:, None, i0:i1, j0:j1], dim=-1)
        p = log_p.exp()
        own = (torch.arange(i0, i1, device=q.device) - j0).clamp(0, j1 - j0 - 1)[None, None, :, None]
        own = own.expand(n_batch, n_heads, -1, 1)
        lse[..., i0:i1] = (r.gather(-1, own) - log_p.gather(-1, own)).squeeze(-1)
        sum_pr[..., i0:i1] = torch.linalg.vecdot(p, r)
        pat_keys[:, :, i0:i1] = torch.matmul(p, per_key[:, :, j0:j1])
        column[..., j0:j1] += torch.matmul(valid_f[:, None, None, i0:i1], p).squeeze(-2)
        # centred in place (the row means are known already): no cancellation in the moments
        r.sub_(mean_r[..., i0:i1, None]).mul_(allowed_f[:, None, i0:i1, j0:j1])
        sum_sq[..., i0:i1] = torch.linalg.vector_norm(r, dim=-1).square()
        cov_rp[..., i0:i1] = torch.matmul(r, shifted_prior[..., j0:j1, None]).squeeze(-1)

    var_r, cov_r_prior = sum_sq.double(), cov_rp.double()
    neg_entropy = sum_pr - lse
    pattern_prior = pat_keys[..., 0]
    lse_prior = p_max + torch.log(_row_sums(allowed_f, torch.exp(prior - p_max), prefix))
    lse_lik = lse - p_min + torch.log(pat_keys[..., 1].clamp(min=1e-38))
    top = column.argmax(-1)  # [b, h]
    k_top = kh.gather(2, top[:, :, None, None].expand(-1, -1, 1, d))  # [b, h, 1, d]
    r_top = scale * (qh * k_top).sum(-1)
    allowed_top = allowed.gather(2, top[:, None, :].expand(-1, n_pos, -1)).transpose(1, 2)  # [b, h, i]
    pattern_top = torch.exp(r_top - lse) * allowed_top.float()
    return {"var_r": var_r, "var_prior": var_prior, "cov_r_prior": cov_r_prior,
            "mean_r": mean_r, "mean_prior": mean_p, "prior": prior,
            "kl_prior": neg_entropy - pattern_prior + lse_prior,
            "kl_loglik": neg_entropy - (sum_pr - pattern_prior) + lse_lik,
            "neg_entropy": neg_entropy, "column": column, "top": top, "r_top": r_top,
            "pattern_top": pattern_top}


def _is_causal(allowed: Tensor, key_valid: Tensor) -> bool:
    """Whether ``allowed[b, i, j]`` is exactly ``key_valid[b, j] and j <= i`` (a causal mask
    with key padding), so sums over each row's allowed keys are prefix sums."""
    n = allowed.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device=allowed.device).tril()
    return torch.equal(allowed, causal & key_valid[:, None, :])


def _row_sums(allowed_f: Tensor, values: Tensor, prefix: Tensor | None) -> Tensor:
    """``sum_j allowed[b, i, j] values[b, h, j, ...]`` for every row ``i``. With ``prefix`` (the
    valid keys ``[b, j]`` of a causal mask, ``_is_causal``) a float64 prefix sum: O(pos) rather
    than a ``[pos, pos]`` product, which at 4,096 tokens was 26 GFLOP per layer for the keys."""
    if prefix is None:
        if values.dim() == 3:
            return torch.einsum("bij,bhj->bhi", allowed_f.to(values.dtype), values)
        return torch.einsum("bij,bhjd->bhid", allowed_f.to(values.dtype), values)
    kv = prefix.to(torch.float64)[:, None]
    kv = kv if values.dim() == 3 else kv[..., None]
    return torch.cumsum(values.double() * kv, dim=2).to(values.dtype)
