"""Per-head statistics of the split, computed from one layer's q and k, vectorised over heads.

Everything here is a sum over valid query rows, so batches and prompts stream: add the sums
of every forward pass and divide at the end. Only the raw scores ``r = c<q,k> + p`` and a few
``[batch, head, q, k]`` passes are needed, because along a row the centred log-likelihood is
``r - key_prior - bias`` (the query term is constant along the row) and the
likelihood-only softmax is ``softmax(r - key_prior)`` for the same reason.

Row statistics use the keys each query may attend to (causal, window, padding); rows with
fewer than two allowed keys (the first position of a causal head) carry no information about
*which* key wins and are left out.
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float
from torch import Tensor

# Sums kept per head (names of the streaming accumulators).
SUM_KEYS = ("rows", "var_r", "var_prior", "var_bias", "cov_r_prior", "cov_r_bias",
            "cov_prior_bias", "kl_prior", "kl_loglik", "entropy")
SINK_KEYS = ("sink_mass", "sink_position", "sink_prior_adv", "sink_loglik_adv",
             "sink_bias_adv", "sink_prior_rank")


def _masked_lse(x: Tensor, allowed: Tensor) -> Tensor:
    return torch.logsumexp(x.masked_fill(~allowed, float("-inf")), dim=-1)


def _key_lse(values: Float[Tensor, "batch head k"], allowed_f: Float[Tensor, "batch q k"],
             allowed: Bool[Tensor, "batch head q k"]) -> Float[Tensor, "batch head q"]:
    """Masked log-sum-exp over keys of a per-key value, as a matrix product (cheap)."""
    top = values.max(-1, keepdim=True).values
    summed = torch.einsum("bij,bhj->bhi", allowed_f, (values - top).exp())
    out = top + summed.log()
    if not torch.isfinite(out).all():  # every allowed key underflowed: do it the long way
        out = _masked_lse(values[:, :, None, :].expand(allowed.shape), allowed)
    return out


def layer_sums(q: Float[Tensor, "batch pos head d_head"], k: Float[Tensor, "batch pos head d_head"],
               scale: float, bias: Float[Tensor, "batch head pos pos"] | None,
               allowed: Bool[Tensor, "batch pos pos"], query_valid: Bool[Tensor, "batch pos"],
               softcap: float | None = None) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Per-head sums over this batch's valid rows, and per-prompt sink facts.

    Returns ``(sums, sinks)``: ``sums[name]`` is ``[head]`` float64 (names ``SUM_KEYS``);
    ``sinks[name]`` is ``[batch, head]`` (names ``SINK_KEYS``): the source position (counted
    in real tokens) taking the most attention per valid query row, that mass, and its score
    advantage over the row mean split into prior, log-likelihood and bias parts (averaged over
    query rows weighted by their attention to it), and the rank of its key prior among the
    prompt's keys (0 = loudest key).
    """
    q, k = q.float(), k.float()
    n_batch = q.shape[0]
    half = scale / 2.0
    r = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if bias is not None:
        bias = bias.float().expand_as(r)
        r = r + bias
    prior = half * k.pow(2).sum(-1).transpose(1, 2)  # [b, h, j]
    allowed_f = allowed.float()
    n_keys = allowed_f.sum(-1)  # [b, i]
    rows = (query_valid & (n_keys >= 2)).float()  # [b, i]
    n_safe = n_keys.clamp(min=1.0)[:, None]  # [b, 1, i]
    mask = allowed[:, None].expand_as(r)

    # --- centred second moments along rows (two-pass for r; float64 for the per-key parts)
    r_masked = r.masked_fill(~mask, 0.0)
    mean_r = r_masked.sum(-1) / n_safe
    r_c = (r - mean_r[..., None]).masked_fill(~mask, 0.0)
    var_r = torch.einsum("bhij,bhij->bhi", r_c, r_c)
    cov_r_prior = torch.einsum("bhij,bhj->bhi", r_c, prior)
    p64, a64 = prior.double(), allowed_f.double()
    sum_p = torch.einsum("bij,bhj->bhi", a64, p64)
    var_prior = torch.einsum("bij,bhj->bhi", a64, p64 * p64) - sum_p * sum_p / n_safe.double()
    if bias is not None:
        b_masked = bias.masked_fill(~mask, 0.0)
        b_c = (bias - (b_masked.sum(-1) / n_safe)[..., None]).masked_fill(~mask, 0.0)
        var_bias = torch.einsum("bhij,bhij->bhi", b_c, b_c)
        cov_r_bias = torch.einsum("bhij,bhij->bhi", r_c, b_c)
        cov_prior_bias = torch.einsum("bhij,bhj->bhi", b_c, prior)
    else:
        var_bias = cov_r_bias = cov_prior_bias = torch.zeros_like(var_r)

    # --- KL(real || counterfactual) = sum S log S - sum S x + lse(x)
    s = r if softcap is None else softcap * torch.tanh(r / softcap)
    lse_s = _masked_lse(s, mask)
    log_s = (s - lse_s[..., None]).masked_fill(~mask, float("-inf"))
    pattern = log_s.exp()
    s_dot = torch.einsum("bhij,bhij->bhi", pattern, s.masked_fill(~mask, 0.0))
    neg_entropy = s_dot - lse_s
    pattern_prior = torch.einsum("bhij,bhj->bhi", pattern, prior)
    r_dot = s_dot if softcap is None else torch.einsum("bhij,bhij->bhi", pattern, r_masked)
    lse_lik = _masked_lse(r - prior[:, :, None, :], mask)
    kl_loglik = neg_entropy - (r_dot - pattern_prior) + lse_lik
    if bias is None:
        kl_prior = neg_entropy - pattern_prior + _key_lse(prior, allowed_f, mask)
    else:
        logits = prior[:, :, None, :] + bias
        kl_prior = (neg_entropy - torch.einsum("bhij,bhij->bhi", pattern, logits.masked_fill(~mask, 0.0))
                    + _masked_lse(logits, mask))

    w = rows[:, None, :].double()  # [b, 1, i]

    def total(x: Tensor) -> Tensor:  # rows without keys hold inf/nan: drop them, not weight them
        return torch.where(w > 0, x.double() * w, torch.zeros((), dtype=torch.float64)).sum(dim=(0, 2))

    sums = {"rows": w.expand(n_batch, q.shape[2], -1).sum(dim=(0, 2)), "var_r": total(var_r),
            "var_prior": total(var_prior), "var_bias": total(var_bias),
            "cov_r_prior": total(cov_r_prior), "cov_r_bias": total(cov_r_bias),
            "cov_prior_bias": total(cov_prior_bias), "kl_prior": total(kl_prior.clamp(min=0)),
            "kl_loglik": total(kl_loglik.clamp(min=0)), "entropy": total(-neg_entropy)}
    sinks = _sinks(r, prior, bias, pattern, mean_r, sum_p / n_safe.double(), mask,
                   query_valid, allowed)
    return sums, sinks


def _sinks(r: Tensor, prior: Tensor, bias: Tensor | None, pattern: Tensor, mean_r: Tensor,
           mean_p: Tensor, mask: Tensor, query_valid: Tensor, allowed: Tensor) -> dict[str, Tensor]:
    valid = query_valid[:, None, :, None].float()  # [b, 1, i, 1]
    n_rows = query_valid.float().sum(-1).clamp(min=1.0)[:, None, None]  # [b, 1, 1]
    column = (pattern * valid).sum(2) / n_rows  # [b, h, j]: mean attention received
    mass, top = column.max(-1)  # [b, h]
    key_valid = allowed.any(1)  # [b, j]
    first_real = key_valid.float().argmax(-1)  # [b]
    position = top - first_real[:, None].long()

    idx = top[:, :, None, None].expand(-1, -1, r.shape[2], 1)
    weight = pattern.gather(-1, idx).squeeze(-1) * query_valid[:, None].float()  # [b, h, i]
    weight = weight / weight.sum(-1, keepdim=True).clamp(min=1e-30)
    r_adv = r.gather(-1, idx).squeeze(-1) - mean_r
    p_top = prior.gather(-1, top[..., None])  # [b, h, 1]
    p_adv = (p_top.double() - mean_p).float()
    if bias is not None:
        b_masked = bias.masked_fill(~mask, 0.0)
        n_safe = mask.float().sum(-1).clamp(min=1.0)
        b_adv = bias.gather(-1, idx).squeeze(-1) - b_masked.sum(-1) / n_safe
    else:
        b_adv = torch.zeros_like(r_adv)
    l_adv = r_adv - p_adv - b_adv
    prior_key = prior.masked_fill(~key_valid[:, None], float("-inf"))
    rank = (prior_key > p_top).sum(-1)  # [b, h]: keys louder than the sink
    return {"sink_mass": mass, "sink_position": position,
            "sink_prior_adv": (weight * p_adv).sum(-1), "sink_loglik_adv": (weight * l_adv).sum(-1),
            "sink_bias_adv": (weight * b_adv).sum(-1), "sink_prior_rank": rank}
