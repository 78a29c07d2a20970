"""Views of odds-ratio results, built only from ``tl_dynamics.viz`` components."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from tl_dynamics import viz
from tl_dynamics.odds_ratio._result import LABEL_THRESHOLD, head_name

if TYPE_CHECKING:
    from tl_dynamics.odds_ratio._result import Decomposition, HeadStats, OddsRatioResult

STATS_COLUMNS = ["label", "attr_prior", "attr_loglik", "attr_bias", "var_prior", "var_loglik",
                 "cov_prior_loglik", "kl_prior", "kl_loglik", "entropy", "sink_mass",
                 "sink_first_share", "sink_by_prior_share", "sigma2"]


def stats_view(stats: "HeadStats", max_rows: int = 60) -> viz.Component:
    df = stats.to_dataframe()
    columns = [c for c in STATS_COLUMNS if c in df.columns and not (c == "attr_bias" and
                                                                      (df[c].abs() < 1e-12).all())]
    capped = [layer for layer, cap in zip(stats.layers, stats.softcap) if cap is not None]
    note = f" Layers {capped} soft-cap: the split is of the pre-cap score." if capped else ""
    return viz.table(df[columns], max_rows=max_rows, caption=(
        f"Per-head odds-ratio statistics over {stats.n_prompts} prompt(s) of {stats.model}. "
        f"attr_* = Cov(term, r)/Var(r) (adds to 1; label at >= {LABEL_THRESHOLD:.2f}); var_* and "
        f"cov_prior_loglik: the variance split with its covariance term (prior and likelihood are "
        f"anti-correlated); kl_* = KL(real || counterfactual) in nats per row; sigma2 = 1/c." + note))


def _heads(dec: "Decomposition", heads: int | list[int] | None) -> list[int]:
    if heads is None:
        return list(dec.heads)
    heads = [heads] if isinstance(heads, int) else list(heads)
    for h in heads:
        dec.head_index(h)  # raises naming the decomposed heads
    return heads


def decomposition_view(dec: "Decomposition", heads: int | list[int] | None = None,
                       row: int = 0) -> viz.Group:
    from tl_dynamics.errors import TLDynamicsError

    if not 0 <= row < dec.tokens.shape[0]:
        raise TLDynamicsError(f"row {row!r} is out of range: the decomposition has "
                              f"{dec.tokens.shape[0]} prompts (valid: 0..{dec.tokens.shape[0] - 1})")
    chosen = _heads(dec, heads)
    idx = [dec.head_index(h) for h in chosen]
    real = torch.nonzero(dec.allowed[row].any(0)).flatten()
    tokens = list(dec.str_tokens[row]) if dec.str_tokens else [str(i) for i in range(dec.tokens.shape[1])]
    tokens = [tokens[i] for i in real.tolist()]
    names = [head_name(dec.layer, h) for h in chosen]
    allowed = dec.allowed[row][real][:, real]
    causal = bool((torch.triu(allowed.float(), diagonal=1) == 0).all())

    def sub(t: torch.Tensor) -> torch.Tensor:
        return t[row][idx][:, real][:, :, real].float().masked_fill(~allowed, 0.0)

    grid, grid_names = [], []
    for k, name in enumerate(names):
        for what, pat in (("real", dec.pattern), ("prior-only", dec.prior_pattern),
                          ("likelihood-only", dec.likelihood_pattern)):
            grid.append(sub(pat)[k])
            grid_names.append(f"{name} {what}")
    capped = " (split of the pre-cap score)" if dec.precap else ""
    items = [viz.attention_heads(torch.stack(grid), tokens, grid_names, mask_upper_tri=causal,
                                 caption=f"Layer {dec.layer}: the model's pattern beside the "
                                         f"prior-only softmax(key_prior + p) and likelihood-only "
                                         f"softmax(loglik + p) patterns{capped}")]
    parts = dec.parts
    n = len(real)
    for what, values in (
            ("query term (c/2)|q_i|^2", parts.query_term[..., :, None].expand_as(parts.loglik)),
            ("key prior (c/2)|k_j|^2", parts.key_prior[..., None, :].expand_as(parts.loglik)),
            ("log-likelihood -(c/2)|q_i-k_j|^2", parts.loglik)):
        block = sub(values)
        shown = block[allowed.expand_as(block)] if n else block
        lo, hi = (float(shown.min()), float(shown.max())) if shown.numel() else (0.0, 1.0)
        items.append(viz.attention_heads(block, tokens, names, min_value=lo, max_value=max(hi, lo + 1e-9),
                                         mask_upper_tri=causal,
                                         caption=f"Layer {dec.layer}: {what}, range [{lo:.3g}, {hi:.3g}]"))
    key_prior = parts.key_prior[row][idx][:, real].T.float()  # [tokens, heads]
    items.append(viz.colored_tokens_multi(tokens, key_prior, names,
                                          caption=f"Layer {dec.layer}: key prior (c/2)|k_j|^2 per "
                                                  "token (pick a head)"))
    return viz.group(*items, caption=f"Odds-ratio decomposition, layer {dec.layer}, "
                                     f"sigma^2 = 1/c = {parts.sigma2:.4g}")


def result_view(res: "OddsRatioResult", heads: int | list[int] | None = None, row: int = 0) -> viz.Group:
    items: list[Any] = [stats_view(res.stats)]
    if res.decompositions:
        for layer in sorted(res.decompositions[0]):
            items.extend(decomposition_view(res.decompositions[0][layer], heads, row).components)
    return viz.group(*items, caption=f"Odds-ratio decomposition of {res.stats.model}")
