"""The streaming path for the common case (no position bias, no soft-cap): few passes over
``[batch, head, q, k]``, in query chunks sized by a memory budget, with no host synchronisation.

Identities used (``A`` the allowed mask, ``P_j`` the key prior, ``p`` the pattern,
``lse_i`` the row's log-partition):

- ``sum_j A_ij r_ij = c <q_i, sum_j A_ij k_j>``: the row means come from a matrix product of
  the mask with the keys before any score is formed, so each chunk centres its scores in place
  and the second moments have no cancellation;
- the likelihood-only and prior-only log-partitions (``log sum_j A_ij exp(r_ij - P_j)``,
  ``log sum_j A_ij exp(P_j)``) are masked log-sum-exps over the chunk, exact whatever the
  spread of the key priors.

Which keys a chunk of queries may see follows from the mask's kind (causal, window), not from
reading the mask, so nothing waits for the device. The heads axis may hold several layers'
heads side by side (``OddsRatioCollector`` concatenates a pass's layers): every statistic is
per head.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence, cast

import torch
from torch import Tensor

from tl_dynamics.collect import Collector
from tl_dynamics.odds_ratio._scratch import LIK_FLOOR, _Scratch, first_max  # noqa: F401

# Score-sized temporaries of one chunk, in units of one layer's full [batch, head, q, k] scores
# (what the forward itself forms): chunks are sized by this memory budget, so a pass's layers
# concatenated take (layers / SCORE_BUDGET_LAYERS) chunks whatever the heads and tokens.
SCORE_BUDGET_LAYERS = 2
# ... and never more than this many bytes per score-sized temporary (long contexts: at 4,096
# tokens one GPT-2-small layer's scores are 805 MB), so memory stays a fraction of the forward's.
MAX_CHUNK_BYTES = 256 << 20
# On the CPU (not launch-bound: ``tl_dynamics.collect.Collector.launch_bound``) a chunk's scores
# are this many elements, about 2 MB of float32, so its passes run in cache ...
CPU_CHUNK_ELEMENTS = 1 << 19
# ... taken over a group of heads with this many query rows each: a chunk of a few rows over
# every head re-reads all keys per few queries (one thread, 144 heads: row_facts took 1.05 s at
# 1 x 1,024 tokens and 0.48 s at 4 x 256 with 8-row chunks over all heads, 0.66 s and 0.31 s
# with 64-row chunks over groups of 8 heads; 32 to 128 rows were within 10% of that)
CPU_CHUNK_ROWS = 64


@dataclass(frozen=True, eq=False)
class MaskFacts:
    """What the statistics need of a layer's masks, formed once per forward pass for every
    layer that shares the same ``allowed`` and ``query_valid`` (the adapter's masks are one
    tensor per mask kind and pass)."""

    allowed: Tensor  # [b, i, j]
    query_valid: Tensor  # [b, i]
    n_allowed: Tensor  # [b, i]: allowed keys per row
    n_safe: Tensor  # [b, 1, i] float, at least 1
    key_valid: Tensor  # [b, j]
    prefix: Tensor | None  # key_valid where the mask is causal (row sums are prefix sums)
    valid_f: Tensor  # [b, i] float: rows that choose among >= 2 keys (sinks, §2.3)
    causal: bool
    window: int | None

    @functools.cached_property
    def allowed_f(self) -> Tensor:
        """``[b, i, j]`` the mask as floats (formed when first read: the CPU's causal chunks
        without padding never read it, and at 4,096 tokens it is 64 MB)."""
        return self.allowed.float()

    @functools.cached_property
    def additive(self) -> Tensor:
        """``[b, i, j]``: 0 on allowed keys, -inf elsewhere (0 on rows with none)."""
        additive = torch.zeros(self.allowed.shape, device=self.allowed.device).masked_fill(
            ~self.allowed, float("-inf")
        )
        return additive.masked_fill_((self.n_allowed == 0)[..., None], 0.0)  # never counted

    @classmethod
    def of(
        cls, allowed: Tensor, query_valid: Tensor, causal: bool = False, window: int | None = None
    ) -> "MaskFacts":
        """``causal`` and ``window`` describe how ``allowed`` was built (the layer's spec):
        they bound the keys a query may see, and a causal mask without a window makes row sums
        prefix sums."""
        n_allowed = allowed.sum(-1)
        key_valid = allowed.any(1)
        return cls(
            allowed=allowed,
            query_valid=query_valid,
            n_allowed=n_allowed,
            n_safe=n_allowed.float().clamp(min=1.0)[:, None],
            key_valid=key_valid,
            prefix=key_valid if causal and window is None else None,
            valid_f=(query_valid & (n_allowed >= 2)).float(),
            causal=causal,
            window=window,
        )

    @functools.cached_property
    def lower_triangular(self) -> bool:
        """Whether ``allowed`` is the plain causal mask (every row ``i`` sees keys ``0 .. i``,
        no padding): a read of the device, asked on the CPU only."""
        n = self.n_allowed.shape[-1]
        rows = torch.arange(1, n + 1, device=self.n_allowed.device)
        return self.causal and self.window is None and bool((self.n_allowed == rows).all())

    def matches(self, allowed: Tensor, query_valid: Tensor) -> bool:
        """Whether these are the facts of ``allowed`` and ``query_valid`` (the same tensors)."""
        return allowed is self.allowed and query_valid is self.query_valid

    def band(self, i0: int, i1: int, n_pos: int) -> tuple[int, int]:
        """The keys ``[j0, j1)`` queries ``i0 .. i1 - 1`` may see under this mask kind."""
        j1 = i1 if self.causal else n_pos
        j0 = max(0, i0 - self.window + 1) if self.window is not None else 0
        return j0, max(j1, j0 + 1)


def row_facts(
    q: "Tensor | Sequence[Tensor]",
    k: "Tensor | Sequence[Tensor]",
    scale: float,
    allowed: Tensor,
    query_valid: Tensor,
    masks: MaskFacts | None = None,
    layer_heads: int | None = None,
    launch_bound: bool | None = None,
) -> dict[str, Tensor]:
    """Row statistics like ``_stats._direct_row_facts``, without a position bias or soft-cap.
    ``masks`` are the facts of ``allowed`` and ``query_valid`` when known already;
    ``layer_heads`` is the number of heads of one layer when ``q`` holds several layers' (one
    tensor, or the layers' tensors side by side: on the CPU each group of heads is joined
    alone, never the whole pass). ``launch_bound`` picks the plan (None: the device's,
    ``Collector.launch_bound``; a compiled caller decides it outside the compiled region)."""
    first = q if isinstance(q, Tensor) else q[0]
    n_batch, n_pos, n_heads = first.shape[0], first.shape[1], n_heads_of(q)
    if masks is None or not masks.matches(allowed, query_valid):
        masks = MaskFacts.of(allowed, query_valid)
    if launch_bound is None:
        launch_bound = Collector.launch_bound(first.device)
    group = max(1, CPU_CHUNK_ELEMENTS // (CPU_CHUNK_ROWS * n_batch * n_pos))
    if n_heads > group and not launch_bound:  # the CPU: heads in groups
        groups = [
            row_facts(
                heads(q, h0, h0 + group),
                heads(k, h0, h0 + group),
                scale,
                allowed,
                query_valid,
                masks,
            )
            for h0 in range(0, n_heads, group)
        ]
        return {name: torch.cat([g[name] for g in groups], 1) for name in groups[0]}
    q, k = heads(q, 0, n_heads), heads(k, 0, n_heads)
    qh = q.permute(0, 2, 1, 3).contiguous()  # [b, h, i, d]: each chunk's product reads it
    kh = k.permute(0, 2, 1, 3).contiguous()  # in place (a strided view was copied per chunk)
    prior = (scale / 2.0) * kh.pow(2).sum(-1)  # [b, h, j]
    key_valid, prefix, n_safe = masks.key_valid, masks.prefix, masks.n_safe
    kv = key_valid[:, None]
    p_min = prior.masked_fill(~kv, float("inf")).amin(-1, keepdim=True)

    d = kh.shape[-1]
    # row means of r through the keys, no [b, h, i, j] pass: on a GPU always; on the CPU where
    # the row sums of the keys are prefix sums (causal, no window: O(pos) work), else each
    # chunk sums its rows (a [pos, pos] product of the mask with the keys would cost more)
    mean_r = (
        scale * (qh * _row_sums(masks, kh, prefix)).sum(-1) / n_safe
        if launch_bound or prefix is not None
        else None
    )
    p64 = prior.double()
    sum_p = _row_sums(masks, p64, prefix)
    var_prior = _row_sums(masks, p64 * p64, prefix) - sum_p * sum_p / n_safe.double()
    mean_p = sum_p / n_safe.double()
    valid_f = masks.valid_f
    # the CPU, causal without padding: a chunk's masked keys are the upper triangle of its last
    # c x c block alone, so only that block is masked (with the least float, whose exponential
    # is 0 as -inf's, and whose product with a 0 is 0), not every key of the chunk, and the
    # float masks are never formed
    clean = not launch_bound and masks.lower_triangular

    shifted_prior = prior - p_min
    if launch_bound:
        # chunks: one per SCORE_BUDGET_LAYERS layers (the same count whatever the heads and
        # tokens), more only where a chunk would pass MAX_CHUNK_BYTES
        step = -(-n_pos // min(n_pos, launch_chunks(n_batch, n_heads, n_pos, layer_heads)))
    else:  # the CPU: chunks that stay in cache (a launch costs next to nothing there)
        step = max(8, CPU_CHUNK_ELEMENTS // max(1, n_batch * n_heads * n_pos))
    # [batch * head, pos, d] with the scale folded into q once: each chunk's scores are one bmm
    qs = (qh * scale).reshape(n_batch * n_heads, n_pos, d)
    kt = kh.reshape(n_batch * n_heads, n_pos, d).transpose(1, 2)
    names = ("sum_sq", "cov_rp", "sum_pr", "pattern_prior", "lse_lik", "lse_prior")
    names += ("logp_top", "r_top_row", "top_j")
    names += ("mean_r",) if mean_r is None else ()
    parts: dict[str, list[Tensor]] = {n: [] for n in names}
    if prefix is not None:  # causal, no window: each row's keys are a prefix, one pass for all
        parts["lse_prior"].append(torch.logcumsumexp(prior.masked_fill(~kv, float("-inf")), -1))
    column = torch.zeros(n_batch, n_heads, n_pos, device=q.device)
    # the rows that choose (valid_f) per head, laid out for one bmm with each chunk's pattern
    valid_rows = valid_f[:, None, None].expand(-1, n_heads, 1, -1).reshape(-1, 1, n_pos)
    # formed once per pass, sliced per chunk: the per-key prior columns the chunk products read,
    # and the masks and priors with a heads (or rows) axis
    prior_col = prior.view(-1, n_pos, 1)
    prior_r = prior[:, :, None]
    allowed_h = additive_h = None  # [b, 1, i, j]; read only where not clean
    if not clean:
        allowed_h, additive_h = masks.allowed_f[:, None], masks.additive[:, None]
    shifted_col = shifted_prior.view(-1, n_pos, 1)
    scratch = _Scratch(
        not launch_bound, n_batch * n_heads * step * n_pos, qs, shifted_prior, kv, prior
    )
    upper: dict[int, Tensor] = {}
    for i0 in range(0, n_pos, step):
        i1 = min(n_pos, i0 + step)
        j0, j1 = masks.band(i0, i1, n_pos)
        c, m = i1 - i0, j1 - j0
        shape = (n_batch, n_heads, c, m)
        flat = (n_batch * n_heads, c, m)
        r = torch.bmm(qs[:, i0:i1], kt[:, :, j0:j1], out=scratch.get(0, flat)).view(shape)
        add = None if clean else cast(Tensor, additive_h)[..., i0:i1, j0:j1]
        if clean:  # keys j0 = 0 .. i1 - 1: the masked ones are j > i in the last c columns
            if c not in upper:
                upper[c] = torch.ones(c, c, dtype=torch.bool, device=r.device).triu(1)
            s = r
            s[..., i0:i1].masked_fill_(upper[c], torch.finfo(r.dtype).min)
        else:
            s = torch.add(r, cast(Tensor, add), out=scratch.get(1, shape))
        # each row's top key under the real pattern: its log-mass, score and index (the row's
        # log-partition is r - log p at any allowed key; the top one loses no precision)
        if scratch.reuse:  # the CPU: the pattern in one pass, the top key's log-mass from it
            p = torch.softmax(s, dim=-1, out=scratch.get(2, shape))
            p_top, top_j = first_max(p)
            logp_top = p_top.log()
        else:
            log_p = torch.log_softmax(s, dim=-1)
            logp_top, top_j = log_p.max(-1, keepdim=True)
            p = log_p.exp_()  # the pattern, in place of its log
        r_top_row = r.gather(-1, top_j)
        parts["logp_top"].append(logp_top)
        parts["r_top_row"].append(r_top_row)
        parts["top_j"].append(top_j if j0 == 0 else top_j + j0)
        lse_c = (r_top_row - logp_top).squeeze(-1) if scratch.reuse else None
        pr = prior_r[..., j0:j1]
        parts["sum_pr"].append(scratch.vecdot(p, r))
        if scratch.reuse:  # both of the pattern's products with a per-key column in one pass
            both = torch.bmm(p.view(-1, c, m), scratch.cols[:, j0:j1]).view(n_batch, n_heads, c, 2)
            parts["pattern_prior"].append(both[..., 0])
            lik = both[..., 1]
        else:
            parts["pattern_prior"].append(
                torch.bmm(p.view(-1, c, m), prior_col[:, j0:j1]).view(n_batch, n_heads, c)
            )
            lik = None
        if prefix is None:
            parts["lse_prior"].append(torch.logsumexp(pr + cast(Tensor, add), -1))
        parts["lse_lik"].append(scratch.lse_lik(s, pr, p, lse_c, p_min, j0, j1, lik, own=not clean))
        summed = torch.bmm(valid_rows[..., i0:i1], p.view(-1, c, m))  # [b * h, 1, m]
        column[..., j0:j1] += summed.view(n_batch, n_heads, m)
        # centred in place (the row means are known already): no cancellation in the moments
        allowed_c = None if allowed_h is None else allowed_h[..., i0:i1, j0:j1]
        if mean_r is None:
            mean_c = scratch.vecdot(r, cast(Tensor, allowed_c)) / n_safe[..., i0:i1]
            parts["mean_r"].append(mean_c)
        else:
            mean_c = mean_r[..., i0:i1]
        if clean:
            r.sub_(mean_c[..., None])[..., i0:i1].masked_fill_(upper[c], 0.0)
        else:
            r.sub_(mean_c[..., None]).mul_(cast(Tensor, allowed_c))
        parts["sum_sq"].append(torch.linalg.vector_norm(r, dim=-1).square())
        parts["cov_rp"].append(
            torch.bmm(r.view(-1, c, m), shifted_col[:, j0:j1]).view(n_batch, n_heads, c)
        )
    # per-row values are [b, h, c] or (the top key's) [b, h, c, 1]: joined along the rows
    got = {n: v[0] if len(v) == 1 else torch.cat(v, 2) for n, v in parts.items()}
    sum_pr, pattern_prior = got["sum_pr"], got["pattern_prior"]
    lse = (got["r_top_row"] - got["logp_top"]).squeeze(-1)
    mean_r = got["mean_r"] if mean_r is None else mean_r

    var_r, cov_r_prior = got["sum_sq"].double(), got["cov_rp"].double()
    neg_entropy = sum_pr - lse
    top = column.argmax(-1)  # [b, h]
    k_top = kh.gather(2, top[:, :, None, None].expand(-1, -1, 1, d))  # [b, h, 1, d]
    r_top = scale * (qh * k_top).sum(-1)
    allowed_top = allowed.gather(2, top[:, None, :].expand(-1, n_pos, -1)).transpose(
        1, 2
    )  # [b, h, i]
    pattern_top = torch.exp(r_top - lse) * allowed_top.float()
    return {
        "var_r": var_r,
        "var_prior": var_prior,
        "cov_r_prior": cov_r_prior,
        "mean_r": mean_r,
        "mean_prior": mean_p,
        "prior": prior,
        "kl_prior": neg_entropy - pattern_prior + got["lse_prior"],
        "kl_loglik": neg_entropy - (sum_pr - pattern_prior) + got["lse_lik"],
        "neg_entropy": neg_entropy,
        "column": column,
        "top": top,
        "r_top": r_top,
        "pattern_top": pattern_top,
        "tops": row_tops(got, prior, lse, got["lse_prior"], got["lse_lik"]),
    }


def launch_chunks(n_batch: int, n_heads: int, n_pos: int, layer_heads: int | None) -> int:
    """The query chunks of the launch-bound plan: one per ``SCORE_BUDGET_LAYERS`` layers (the
    same count whatever the heads and tokens), more only where a chunk would pass
    ``MAX_CHUNK_BYTES``."""
    n_layers = max(1, n_heads // (layer_heads or n_heads))
    return max(
        -(-n_layers // SCORE_BUDGET_LAYERS),
        -(-(4 * n_batch * n_heads * n_pos * n_pos) // MAX_CHUNK_BYTES),
    )


def row_tops(
    got: dict[str, Tensor], prior: Tensor, lse: Tensor, lse_prior: Tensor, lse_lik: Tensor
) -> Tensor:
    """``[b, h, i, 3]``: the mass the real, the prior-only and the likelihood-only pattern put
    on each row's top key under the real pattern (docs/math.md §2.2, agreement), from that key's
    log-mass ``logp_top``, score ``r_top_row`` and index ``top_j`` (``[b, h, i, 1]`` each)."""
    p_top = prior.gather(-1, got["top_j"].squeeze(-1))
    r_top = got["r_top_row"].squeeze(-1)
    logs = (got["logp_top"].squeeze(-1), p_top - lse_prior, r_top - p_top - lse_lik)
    return torch.stack(logs, -1).exp()


def as_float(x: "Tensor | Sequence[Tensor]") -> "Tensor | list[Tensor]":
    """``x.float()``, part by part where ``x`` is several layers' tensors."""
    return x.float() if isinstance(x, Tensor) else [t.float() for t in x]


def n_heads_of(x: "Tensor | Sequence[Tensor]") -> int:
    """The heads of ``x`` (``[batch, pos, head, d]``, or several such side by side)."""
    return x.shape[2] if isinstance(x, Tensor) else sum(t.shape[2] for t in x)


def heads(x: "Tensor | Sequence[Tensor]", h0: int, h1: int) -> Tensor:
    """Heads ``h0 .. h1 - 1`` of ``x``: a ``[batch, pos, head, d]`` tensor, or several layers'
    side by side along heads (joined here, only the heads asked for)."""
    if isinstance(x, Tensor):
        return x if (h0, h1) == (0, x.shape[2]) else x[:, :, h0:h1]
    picked, start = [], 0
    for part in x:
        lo, hi = max(h0, start), min(h1, start + part.shape[2])
        if lo < hi:
            picked.append(part[:, :, lo - start : hi - start])
        start += part.shape[2]
    return picked[0] if len(picked) == 1 else torch.cat(picked, 2)


def _row_sums(masks: "MaskFacts | Tensor", values: Tensor, prefix: Tensor | None) -> Tensor:
    """``sum_j allowed[b, i, j] values[b, h, j, ...]`` for every row ``i`` (``masks``: the
    facts, or the float mask itself). With ``prefix`` (the valid keys ``[b, j]`` of a causal
    mask without a window) a float64 prefix sum: O(pos) rather than a ``[pos, pos]`` product,
    which at 4,096 tokens was 26 GFLOP per layer for the keys."""
    if prefix is None:
        allowed_f = masks.allowed_f if isinstance(masks, MaskFacts) else masks
        if values.dim() == 3:
            return torch.einsum("bij,bhj->bhi", allowed_f.to(values.dtype), values)
        return torch.einsum("bij,bhjd->bhid", allowed_f.to(values.dtype), values)
    kv = prefix.to(torch.float64)[:, None]
    if values.dim() == 3 or values.device.type != "cpu":
        kv = kv if values.dim() == 3 else kv[..., None]
        return torch.cumsum(values.double() * kv, dim=2).to(values.dtype)
    # [b, h, j, d] on the CPU: scanned with j as the contiguous last axis (a scan along an
    # inner axis ran element by element: 3x slower), the same sequential sums, the same bits
    b, h, j, d = values.shape
    scan = torch.empty(b, h, d, j, dtype=torch.float64, device=values.device)
    scan.copy_(values.transpose(2, 3)).mul_(kv[:, :, None])
    return scan.cumsum_(-1).transpose(2, 3).to(values.dtype)
