"""Views of odds-ratio results, built from plain data (tables, tensors, token strings) with
``tl_dynamics.viz`` components only. Results slice their tensors and call these; nothing here
imports a result, so there is no import circle."""

from __future__ import annotations

from typing import Sequence

import pandas as pd
import torch
from jaxtyping import Bool, Float
from torch import Tensor

from tl_dynamics import viz

STATS_COLUMNS = ["label", "attr_prior", "attr_loglik", "attr_bias", "var_prior", "var_loglik",
                 "cov_prior_loglik", "kl_prior", "kl_loglik", "entropy", "sink_mass",
                 "sink_first_share", "sink_by_prior_share", "sigma2"]
# The three counterfactual patterns, in the order they are shown.
PATTERNS = ("real", "prior-only", "likelihood-only")
# The score parts, their captions' formulas, in the order they are shown.
PARTS = (("query_term", "query term (c/2)|q_i|^2"), ("key_prior", "key prior (c/2)|k_j|^2"),
         ("loglik", "log-likelihood -(c/2)|q_i-k_j|^2"))


def stats_view(df: pd.DataFrame, model: str, n_prompts: int, capped_layers: Sequence[int],
               threshold: float, max_rows: int = 60) -> viz.Component:
    """The per-head table (``HeadStats.to_dataframe()``), with the columns that carry information."""
    columns = [c for c in STATS_COLUMNS if c in df.columns and not (c == "attr_bias" and
                                                                      (df[c].abs() < 1e-12).all())]
    capped = list(capped_layers)
    note = f" Layers {capped} soft-cap: the split is of the pre-cap score." if capped else ""
    return viz.table(df[columns], max_rows=max_rows, caption=(
        f"Per-head odds-ratio statistics over {n_prompts} prompt(s) of {model}. "
        f"attr_* = Cov(term, r)/Var(r) (adds to 1; label at >= {threshold:.2f}); var_* and "
        f"cov_prior_loglik: the variance split with its covariance term (prior and likelihood are "
        f"anti-correlated); kl_* = KL(real || counterfactual) in nats per row; sigma2 = 1/c. "
        f"sink_*: the key with the most attention over rows with at least two allowed keys (a "
        f"first row that can only see itself is left out); sink_first_share counts a prompt only "
        f"when that key is its first token and takes at least twice the next key's attention "
        f"(docs/math.md §2.3)." + note))


def decomposition_view(layer: int, tokens: list[str], names: list[str], causal: bool,
                       allowed: Bool[Tensor, "q k"], patterns: dict[str, Float[Tensor, "head q k"]],
                       parts: dict[str, Float[Tensor, "head q k"]],
                       key_prior: Float[Tensor, "k head"], sigma2: float,
                       precap: bool) -> viz.Group:
    """One layer's split on one prompt's real positions: each head's real pattern beside the two
    counterfactuals (``patterns`` keyed by ``PATTERNS``), the score parts (``parts`` keyed by
    ``PARTS``' names, zero where not allowed) and the key prior per token."""
    grid, grid_names = [], []
    for k, name in enumerate(names):
        for what in PATTERNS:
            grid.append(patterns[what][k])
            grid_names.append(f"{name} {what}")
    capped = " (split of the pre-cap score)" if precap else ""
    items = [viz.attention_heads(torch.stack(grid), tokens, grid_names, mask_upper_tri=causal,
                                 caption=f"Layer {layer}: the model's pattern beside the "
                                         f"prior-only softmax(key_prior + p) and likelihood-only "
                                         f"softmax(loglik + p) patterns{capped}")]
    for key, what in PARTS:
        block = parts[key]
        shown = block[allowed.expand_as(block)] if len(tokens) else block
        lo, hi = (float(shown.min()), float(shown.max())) if shown.numel() else (0.0, 1.0)
        items.append(viz.attention_heads(block, tokens, names, min_value=lo, max_value=max(hi, lo + 1e-9),
                                         mask_upper_tri=causal,
                                         caption=f"Layer {layer}: {what}, range [{lo:.3g}, {hi:.3g}]"))
    items.append(viz.colored_tokens_multi(tokens, key_prior, names,
                                          caption=f"Layer {layer}: key prior (c/2)|k_j|^2 per "
                                                  "token (pick a head)"))
    return viz.group(*items, caption=f"Odds-ratio decomposition, layer {layer}, "
                                     f"sigma^2 = 1/c = {sigma2:.4g}")


def result_view(stats: viz.Component, layers: Sequence[viz.Group], model: str) -> viz.Group:
    """The per-head table followed by each layer's decomposition."""
    items = [stats] + [c for group in layers for c in group.components]
    return viz.group(*items, caption=f"Odds-ratio decomposition of {model}")


def extremes_view(stats: viz.Component, picks: Sequence[tuple[str, str, float, viz.Group]],
                  model: str, threshold: float) -> viz.Group:
    """The per-head table, then for each pick ``(head name, share name, share, decomposition)``
    a line saying why the head was picked and its decomposition. A head is called the most
    prior- (likelihood-) driven only if its share reaches the label ``threshold``; otherwise the
    line says that no head is, and gives the largest share."""
    items = [stats]
    for name, key, value, group in picks:
        what = "prior" if key == "attr_prior" else "likelihood"
        if value >= threshold:
            line = (f"{name}: the head most driven by the {what} ({key} = {value:.3f}, at least "
                     f"{threshold:.2f}: {what}-driven).")
        else:
            line = (f"No head is {what}-driven: the largest {key} is {value:.3f} ({name}, shown "
                    f"below), under the {threshold:.2f} a {what}-driven head needs.")
        items.append(viz.text(line))
        items.extend(group.components)
    return viz.group(*items, caption=f"Odds-ratio decomposition of {model}: the heads with the "
                                     "largest prior and likelihood shares")
