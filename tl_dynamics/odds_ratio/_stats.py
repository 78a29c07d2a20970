"""Per-head statistics of the split (docs/math.md §2.2, sinks §2.3), computed from one layer's q
and k, vectorised over heads.

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

from typing import TYPE_CHECKING, Sequence

import torch
from jaxtyping import Bool, Float
from torch import Tensor

if TYPE_CHECKING:
    from tl_dynamics.odds_ratio._fast import MaskFacts

# Sums kept per head (names of the streaming accumulators).
# ``learned_sink``: the mass a layer's learned attention sink absorbs (GPT-OSS; zero elsewhere).
# ``top_*``: the mass the real, prior-only and likelihood-only patterns put on each row's top key
# under the real pattern (the agreement of the counterfactuals, docs/math.md §2.2).
SUM_KEYS = (
    "rows",
    "var_r",
    "var_prior",
    "var_bias",
    "cov_r_prior",
    "cov_r_bias",
    "cov_prior_bias",
    "kl_prior",
    "kl_loglik",
    "entropy",
    "learned_sink",
    "top_real",
    "top_prior",
    "top_loglik",
)
SINK_KEYS = (
    "sink_mass",
    "sink_position",
    "sink_prior_adv",
    "sink_loglik_adv",
    "sink_bias_adv",
    "sink_prior_rank",
    "sink_dominance",
    "learned_sink_mass",
    "sink_alpha",
)
# A prompt's sink counts as a sink (``sink_first_share``) only when its column takes at least
# this many times the attention of the next-largest column: a previous-token head gives every
# key about one row's worth, so its largest column is a near-tie, not a sink (docs/math.md §2.3).
SINK_DOMINANCE = 2.0
# Gu et al.'s threshold on a head's first-key ``alpha`` (strict): Sink^eps (docs/math.md §2.3).
SINK_EPSILON = 0.3


def _masked_lse(x: Tensor, allowed: Tensor) -> Tensor:
    return torch.logsumexp(x.masked_fill(~allowed, float("-inf")), dim=-1)


def _key_lse(
    values: Float[Tensor, "batch head k"],
    allowed_f: Float[Tensor, "batch q k"],
    allowed: Bool[Tensor, "batch head q k"],
) -> Float[Tensor, "batch head q"]:
    """Masked log-sum-exp over keys of a per-key value, as a matrix product (cheap)."""
    top = values.max(-1, keepdim=True).values
    summed = torch.einsum("bij,bhj->bhi", allowed_f, (values - top).exp())
    out = top + summed.log()
    if not torch.isfinite(out).all():  # every allowed key underflowed: do it the long way
        out = _masked_lse(values[:, :, None, :].expand(allowed.shape), allowed)
    return out


def layer_sums(
    q: Float[Tensor, "batch pos head d_head"] | Sequence[Tensor],
    k: Float[Tensor, "batch pos head d_head"] | Sequence[Tensor],
    scale: float,
    bias: Float[Tensor, "batch head pos pos"] | None,
    allowed: Bool[Tensor, "batch pos pos"],
    query_valid: Bool[Tensor, "batch pos"],
    softcap: float | None = None,
    fast: bool = True,
    masks: "MaskFacts | None" = None,
    layer_heads: int | None = None,
    sink: Float[Tensor, " head"] | None = None,
    launch_bound: bool | None = None,
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Per-head sums over this batch's valid rows, and per-prompt sink facts.

    Returns ``(sums, sinks)``: ``sums[name]`` is ``[head]`` float64 (names ``SUM_KEYS``);
    ``sinks[name]`` is ``[batch, head]`` (names ``SINK_KEYS``): the source position (counted
    in real tokens) taking the most attention per query row with at least two allowed keys
    (a row with one key has no choice to make), that mass, its ``sink_dominance`` (its column
    over the next-largest column; ``first_sinks`` needs ``SINK_DOMINANCE``), and its score
    advantage over the row mean split into prior, log-likelihood and bias parts (averaged over
    query rows weighted by their attention to it), and the rank of its key prior among the
    prompt's keys (0 = loudest key); ``sink_alpha`` is Gu et al.'s ``alpha`` of the prompt's
    first real key, its mean weight over the valid queries that may see it (single-key rows
    included: ``first_key_alpha``).

    ``fast`` uses ``_fast.row_facts`` (query chunks, matrix products for the row moments)
    where it applies (no position bias, no soft-cap); it equals the direct computation here
    (tested). ``masks`` (``_fast.MaskFacts``) are the pass's mask facts, reused where
    ``allowed`` and ``query_valid`` are the same tensors; ``layer_heads`` is one layer's head
    count when the heads axis holds several layers' heads side by side.

    ``sink`` holds the per-head learned sink logits of a layer that has them (GPT-OSS): the
    sink is a virtual key with prior ``sink_h`` and no likelihood (docs/math.md §2.6). Its mass
    then enters the entropy and both divergences (over the real keys and the virtual one), the
    sink's dominance, ``learned_sink`` and ``learned_sink_mass``, and a row with one real key
    still chooses (between it and the sink). Such layers take the direct path.
    ``launch_bound`` picks the fast path's plan (None: the device's).
    """
    from tl_dynamics.odds_ratio import _fast

    q, k = _fast.as_float(q), _fast.as_float(k)
    if masks is None or not masks.matches(allowed, query_valid):
        masks = _fast.MaskFacts.of(allowed, query_valid)
    facts = None
    if fast and bias is None and softcap is None and sink is None:
        facts = _fast.row_facts(q, k, scale, allowed, query_valid, masks, layer_heads, launch_bound)
    if facts is None:
        n = _fast.n_heads_of(q)
        facts = _direct_row_facts(
            _fast.heads(q, 0, n),
            _fast.heads(k, 0, n),
            scale,
            bias,
            allowed,
            query_valid,
            softcap,
            sink,
        )
    return _finish(facts, masks)


def _direct_row_facts(
    q: Tensor,
    k: Tensor,
    scale: float,
    bias: Tensor | None,
    allowed: Tensor,
    query_valid: Tensor,
    softcap: float | None,
    sink: Tensor | None = None,
) -> dict[str, Tensor]:
    """Row statistics from the full ``[batch, head, q, k]`` scores (any bias, any soft-cap, any
    learned sink: a virtual key ``∅`` with logit ``sink_h``, prior ``sink_h``, likelihood-only
    logit 0, joining every partition; docs/math.md §2.6)."""
    half = scale / 2.0
    r = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if bias is not None:
        bias = bias.float().expand_as(r)
        r = r + bias
    prior = half * k.pow(2).sum(-1).transpose(1, 2)  # [b, h, j]
    allowed_f = allowed.float()
    n_safe = allowed_f.sum(-1).clamp(min=1.0)[:, None]  # [b, 1, i]
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
    out = {
        "var_r": var_r,
        "var_prior": var_prior,
        "cov_r_prior": cov_r_prior,
        "mean_r": mean_r,
        "mean_prior": sum_p / n_safe.double(),
        "prior": prior,
    }
    if bias is not None:
        b_masked = bias.masked_fill(~mask, 0.0)
        b_c = (bias - (b_masked.sum(-1) / n_safe)[..., None]).masked_fill(~mask, 0.0)
        out["var_bias"] = torch.einsum("bhij,bhij->bhi", b_c, b_c)
        out["cov_r_bias"] = torch.einsum("bhij,bhij->bhi", r_c, b_c)
        out["cov_prior_bias"] = torch.einsum("bhij,bhj->bhi", b_c, prior)

    # --- KL(real || counterfactual) = sum S log S - sum S x + lse(x)
    s = r if softcap is None else softcap * torch.tanh(r / softcap)
    lse_s = _masked_lse(s, mask)
    if sink is not None:  # the virtual key joins the partition (after any soft-cap)
        sink_logit = sink.float()[None, :, None].expand_as(lse_s)  # [b, h, i]
        lse_s = torch.logaddexp(lse_s, sink_logit)
    log_s = (s - lse_s[..., None]).masked_fill(~mask, float("-inf"))
    pattern = log_s.exp()
    s_dot = torch.einsum("bhij,bhij->bhi", pattern, s.masked_fill(~mask, 0.0))
    neg_entropy = s_dot - lse_s
    pattern_prior = torch.einsum("bhij,bhj->bhi", pattern, prior)
    r_dot = s_dot if softcap is None else torch.einsum("bhij,bhij->bhi", pattern, r_masked)
    lse_lik = _masked_lse(r - prior[:, :, None, :], mask)
    if sink is not None:  # the virtual key: S_i0 log S_i0 in the entropy, likelihood logit 0
        absorbed = (sink_logit - lse_s).exp()  # S_i0, the mass the sink absorbs
        sink_term = torch.where(absorbed > 0, absorbed * sink_logit, 0.0)  # 0 log 0 = 0
        neg_entropy = neg_entropy + sink_term
        lse_lik = torch.logaddexp(lse_lik, torch.zeros_like(lse_lik))
        out["learned_sink"] = absorbed
    out["kl_loglik"] = neg_entropy - (r_dot - pattern_prior) + lse_lik
    logits = (prior[:, :, None, :] if bias is None else prior[:, :, None, :] + bias).expand_as(r)
    if sink is not None:  # prior-only: the virtual key keeps its prior sink_h
        prior_dot = (
            torch.einsum("bhij,bhij->bhi", pattern, logits.masked_fill(~mask, 0.0)) + sink_term
        )
        lse_prior = torch.logaddexp(_masked_lse(logits, mask), sink_logit)
        out["kl_prior"] = neg_entropy - prior_dot + lse_prior
    elif bias is None:
        lse_prior = _key_lse(prior, allowed_f, mask)
        out["kl_prior"] = neg_entropy - pattern_prior + lse_prior
    else:
        lse_prior = _masked_lse(logits, mask)
        out["kl_prior"] = (
            neg_entropy
            - torch.einsum("bhij,bhij->bhi", pattern, logits.masked_fill(~mask, 0.0))
            + lse_prior
        )
    out["neg_entropy"] = neg_entropy

    # --- agreement: the mass each counterfactual puts on the real pattern's top key per row
    top_j = log_s.argmax(-1, keepdim=True)  # [b, h, i, 1]
    logs = [
        log_s.gather(-1, top_j),
        logits.gather(-1, top_j) - lse_prior[..., None],
        (r - prior[:, :, None, :]).gather(-1, top_j) - lse_lik[..., None],
    ]
    if sink is not None:  # the virtual key is the top where it absorbs more than any real key
        on_sink = (sink_logit - lse_s)[..., None] > logs[0]
        sink_logs = [sink_logit - lse_s, sink_logit - lse_prior, -lse_lik]
        logs = [torch.where(on_sink, x[..., None], y) for x, y in zip(sink_logs, logs)]
    out["tops"] = torch.cat(logs, -1).exp()  # [b, h, i, 3]

    # --- the sink: the column with the most attention, and each row's view of it
    valid = (query_valid & (allowed.sum(-1) >= 2))[:, None, :, None].float()  # >= 2 keys (§2.3)
    column = (pattern * valid).sum(2)
    if sink is not None:  # the virtual key's column, which a real sink must also dominate
        out["sink_column"] = (out["learned_sink"] * valid[..., 0]).sum(-1)
    top = column.argmax(-1)  # [b, h]
    idx = top[:, :, None, None].expand(-1, -1, r.shape[2], 1)
    out.update(
        column=column,
        top=top,
        r_top=r.gather(-1, idx).squeeze(-1),
        pattern_top=pattern.gather(-1, idx).squeeze(-1),
    )
    if bias is not None:
        b_masked = bias.masked_fill(~mask, 0.0)
        out["bias_adv"] = bias.gather(-1, idx).squeeze(-1) - b_masked.sum(-1) / n_safe
    return out


# The sums a head's label rests on (docs/math.md §2.2, §9): kept per prompt as well, so that every
# label has a bootstrap interval over prompts.
BOOT_KEYS = ("rows", "var_r", "cov_r_prior", "cov_r_bias", "top_real", "top_prior", "top_loglik")

# Per-row facts summed over rows per head: the sums of ``SUM_KEYS`` after the row count and
# before the top-key agreements (absent ones, a bias's without a bias or a learned sink's without
# one, sum to zero).
ROW_TOTALS = SUM_KEYS[SUM_KEYS.index("var_r") : SUM_KEYS.index("top_real")]


def _finish(
    facts: dict[str, Tensor], masks: "MaskFacts"
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    # rows that choose among at least two options: real keys, and the learned sink if any
    n_allowed = masks.n_allowed
    options = n_allowed + 1 if "learned_sink" in facts else n_allowed
    rows = (masks.query_valid & (options >= 2))[:, None, :].double()  # [b, 1, i]
    n_heads = facts["var_r"].shape[1]
    facts["kl_prior"] = facts["kl_prior"].clamp(min=0)
    facts["kl_loglik"] = facts["kl_loglik"].clamp(min=0)
    facts["entropy"] = -facts["neg_entropy"]
    # all row totals in one pass (stacked: float64, as var_prior is); rows without keys hold
    # inf/nan: dropped, not weighted
    present = [name for name in ROW_TOTALS if name in facts]
    weighted = torch.stack([facts[name] for name in present]).double() * rows
    by_prompt = torch.where(rows > 0, weighted, 0.0).sum(dim=3)  # [key, b, head]
    tops = (facts["tops"].double() * rows[..., None]).nan_to_num().sum(dim=2)  # [b, head, 3]
    n_rows = rows.expand(-1, n_heads, -1).sum(dim=2)  # [b, head]
    # every total is its per-prompt sums added up: one reduction over the batch for all of them
    per = torch.cat([n_rows[None], by_prompt, tops.permute(2, 0, 1)])  # [1 + keys + 3, b, head]
    totals = per.sum(1).unbind(0)
    zero = torch.zeros(n_heads, dtype=torch.float64, device=rows.device)
    sums = {name: zero for name in ROW_TOTALS} | dict(zip(present, totals[1:]))
    sums.update(rows=totals[0], top_real=totals[-3], top_prior=totals[-2], top_loglik=totals[-1])
    # the sums the labels rest on, per prompt ([b, BOOT_KEYS, head]): the units of their intervals
    order = ["rows", *present, "top_real", "top_prior", "top_loglik"]
    pick = [order.index(name) if name in order else -1 for name in BOOT_KEYS]
    if -1 in pick:  # a sum this layer does not have (a bias's without a bias) is zero
        per = torch.cat([per, torch.zeros_like(per[:1])])
    sums["per_prompt"] = per[pick].transpose(0, 1)
    sinks = _sinks(facts, masks)
    learned = facts.get("learned_sink")  # per prompt: its mean over the rows above
    sinks["learned_sink_mass"] = (
        torch.zeros_like(sinks["sink_mass"])
        if learned is None
        else ((learned.double() * rows).nan_to_num().sum(-1) / rows.sum(-1).clamp(min=1.0)).float()
    )
    return sums, sinks


def first_sinks(sinks: dict[str, Tensor]) -> Bool[Tensor, "batch head"]:
    """Prompts whose sink is their first real token and dominates (``SINK_DOMINANCE``).

    >>> import torch
    >>> s = {"sink_position": torch.tensor([[0, 0, 3]]),
    ...      "sink_dominance": torch.tensor([[5.0, 1.2, 9.0]])}
    >>> first_sinks(s).tolist()
    [[True, False, False]]
    """
    return (sinks["sink_position"] == 0) & (sinks["sink_dominance"] >= SINK_DOMINANCE)


def _sinks(facts: dict[str, Tensor], masks: "MaskFacts") -> dict[str, Tensor]:
    informative = masks.valid_f  # [b, i]: rows that choose among at least two keys (1.0)
    n_rows = informative.sum(-1).clamp(min=1.0)[:, None]  # [b, 1]
    top, prior = facts["top"], facts["prior"]
    mass = facts["column"].gather(-1, top[..., None]).squeeze(-1) / n_rows  # [b, h]
    key_valid = masks.key_valid  # [b, j]
    first_real = key_valid.float().argmax(-1)  # [b]
    position = top - first_real[:, None].long()

    weight = facts["pattern_top"] * informative[:, None]  # [b, h, i]
    weight = weight / weight.sum(-1, keepdim=True).clamp(min=1e-30)
    r_adv = facts["r_top"] - facts["mean_r"]
    p_top = prior.gather(-1, top[..., None])  # [b, h, 1]
    p_adv = (p_top.double() - facts["mean_prior"]).float()
    b_adv = facts.get("bias_adv")
    b_adv = torch.zeros_like(r_adv) if b_adv is None else b_adv
    l_adv = r_adv - p_adv - b_adv
    prior_key = prior.masked_fill(~key_valid[:, None], float("-inf"))
    rank = (prior_key > p_top).sum(-1)  # [b, h]: keys louder than the sink

    def avg(x: Tensor) -> Tensor:
        return torch.where(weight > 0, weight * x, torch.zeros(())).sum(-1)

    column = facts["column"]
    learned = facts.get("sink_column")  # a learned sink's column is one more to dominate
    if learned is not None:
        two = column.topk(min(2, column.shape[-1]), dim=-1).values
        second = two[..., 1] if two.shape[-1] > 1 else torch.zeros_like(two[..., 0])
        dominance = two[..., 0] / torch.maximum(second, learned)
    elif column.shape[-1] > 1:  # the sink's column over the next largest (inf: it takes all)
        two = column.topk(2, dim=-1).values
        dominance = two[..., 0] / two[..., 1]
    else:
        dominance = torch.full(top.shape, float("inf"), device=top.device)
    return {
        "sink_alpha": first_key_alpha(facts, masks, first_real),
        "sink_mass": mass,
        "sink_position": position,
        "sink_prior_adv": avg(p_adv),
        "sink_loglik_adv": avg(l_adv),
        "sink_bias_adv": avg(b_adv),
        "sink_prior_rank": rank,
        "sink_dominance": dominance,
    }


def first_key_alpha(
    facts: dict[str, Tensor], masks: "MaskFacts", first_real: Tensor
) -> Float[Tensor, "batch head"]:
    """Gu et al.'s ``alpha`` of each prompt's first real key ``f``: the mean of ``S[i, f]`` over
    the valid queries ``i`` that may see it (``allowed[i, f]``), as ``_heads.head_statistics``
    has it.

    The column ``facts["column"]`` already sums ``S[i, f]`` over the rows with at least two
    allowed keys (``masks.valid_f``); a row whose one key is ``f`` puts all its weight there (1,
    less what a learned sink absorbs), so those rows are added from the masks alone: no pass
    over the pattern, a few launches per pass.
    """
    f = first_real.view(-1, 1, 1)
    sees = masks.allowed_f.gather(2, f.expand(-1, masks.allowed_f.shape[1], 1))  # [b, i, 1]
    rows = torch.stack([masks.valid_f, masks.query_valid.float()], 1)  # [b, 2, i]
    multi, n_sees = torch.bmm(rows, sees).unbind(1)  # [b, 1]: rows that see f, of them choosing
    column = facts["column"]
    on_first = column.gather(-1, f.expand(-1, column.shape[1], 1)).squeeze(-1)  # [b, h]
    learned = facts.get("learned_sink")  # [b, h, i]: what a learned sink absorbs per row
    if learned is None:
        one_key = n_sees - multi  # valid rows that see f and nothing else
    else:
        single = (sees[..., 0] * rows[:, 1] - rows[:, 0] * sees[..., 0])[:, None]  # [b, 1, i]
        one_key = torch.where(single > 0, 1.0 - learned.float(), 0.0).sum(-1)
    return (on_first + one_key) / n_sees.clamp(min=1.0)
