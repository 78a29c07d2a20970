"""Views of odds-ratio results, built from plain data (tables, tensors, token strings) with
``tl_dynamics.viz`` components only. Results slice their tensors and call these; nothing here
imports a result, so there is no import circle."""

from __future__ import annotations

from typing import Sequence

import pandas as pd
from jaxtyping import Bool, Float
from torch import Tensor

from tl_dynamics import viz

STATS_COLUMNS = [
    "label",
    "label_waits_on",
    "top_real",
    "top_real_ci",
    "attr_prior",
    "attr_prior_ci",
    "attr_loglik",
    "attr_loglik_ci",
    "attr_bias",
    "kept_prior",
    "kept_prior_ci",
    "kept_loglik",
    "kept_loglik_ci",
    "var_prior",
    "var_loglik",
    "cov_prior_loglik",
    "kl_prior",
    "kl_loglik",
    "entropy",
    "sink_mass",
    "sink_first_share",
    "sink_by_prior_share",
    "sink_alpha",
    "learned_sink_mass",
    "sigma2",
]
# The three counterfactual patterns, in the order they are shown.
PATTERNS = ("real", "prior-only", "likelihood-only")
# The score parts, their captions' formulas, in the order they are shown.
PARTS = (
    ("query_term", "query term (c/2)|q_i|^2"),
    ("key_prior", "key prior (c/2)|k_j|^2"),
    ("loglik", "log-likelihood -(c/2)|q_i-k_j|^2"),
)


def stats_view(
    df: pd.DataFrame,
    model: str,
    n_prompts: int,
    capped_layers: Sequence[int],
    thresholds: tuple[float, float, float],
    max_rows: int = 60,
) -> viz.Component:
    """The per-head table (``HeadStats.to_dataframe()``), with the columns that carry information;
    ``thresholds``: the share a one-part label needs, the top-key mass of a head that makes a
    choice, and the mass its counterfactual must keep there."""
    threshold, sharp, keep = thresholds
    columns = [
        c
        for c in STATS_COLUMNS
        if c in df.columns
        and not (c == "attr_bias" and bool((df[c].abs() < 1e-12).all()))
        and not (c == "learned_sink_mass" and bool((df[c].fillna(0.0) == 0.0).all()))
        and not (c == "sink_alpha" and bool(df[c].isna().all()))  # files from before it
        and not (c == "label_waits_on" and bool((df[c] == "").all()))
    ]
    learned = "learned_sink_mass" in columns
    capped = list(capped_layers)
    note = f" Layers {capped} soft-cap: the split is of the pre-cap score." if capped else ""
    return viz.table(
        df[columns],
        max_rows=max_rows,
        caption=(
            f"Per-head odds-ratio statistics over {n_prompts} prompt(s) of {model}, one row per "
            f"head. attr_prior, attr_loglik, attr_bias: the share of each row's score "
            f"variation that the key prior, the distance log-likelihood and the position bias carry "
            f"(Cov(term, r)/Var(r), adding to 1). top_real: the mean attention on each row's top "
            f"key; a head makes a choice at {sharp:.2f} or more (else it is diffuse). kept_prior, "
            f"kept_loglik: the mean attention the prior-only (likelihood-only) pattern keeps on "
            f"that key; that part alone reproduces the choice at {keep:.2f} or more. label: prior- "
            f"or likelihood-driven when the head makes a choice, that share is at least "
            f"{threshold:.2f} and that part alone reproduces it; needs both when neither part "
            f"alone does; mixed otherwise; undecided where a 95% interval over the prompts "
            f"(the _ci columns) straddles a threshold or there are fewer than 8 prompts, and "
            f"label_waits_on names the criterion left open (docs/math.md §2.2, §9). "
            f"var_* and cov_prior_loglik: the same variance split "
            f"with its covariance term (prior and likelihood are anti-correlated). kl_prior, "
            f"kl_loglik: how far (KL in nats per row) the prior-only and likelihood-only patterns are "
            f"from the real one. entropy: of the real pattern, nats per row. The sink is the key that "
            f"takes the most attention over rows with at least two allowed keys (a first row that can "
            f"only see itself is left out): sink_mass is the attention a query gives it on average; "
            f"sink_first_share the fraction of prompts whose sink is their first token and takes at "
            f"least twice the next key's attention; sink_by_prior_share the fraction of prompts "
            f"whose sink wins by a loud key (prior) rather than by sitting close to the queries "
            f"(likelihood). sigma2 = 1/c: the temperature (docs/math.md §2.3)."
            + note
            + (
                " sink_alpha: Gu et al.'s alpha of the first token, its mean weight over the "
                "queries that may see it (single-key rows included, no dominance asked), "
                "averaged over prompts (docs/math.md §2.3)."
                if "sink_alpha" in columns
                else ""
            )
            + (
                " learned_sink_mass: the attention a query gives the layer's learned sink on "
                "average, a virtual key with its own prior and no likelihood; it joins the "
                "entropy and both KLs and a real sink must dominate it too (docs/math.md §2.6)."
                if learned
                else ""
            )
        ),
    )


MAX_SHOWN_POSITIONS = 128  # the maps show at most this many leading positions (readable cells)


def decomposition_view(
    layer: int,
    tokens: list[str],
    names: list[str],
    causal: bool,
    allowed: Bool[Tensor, "q k"],
    patterns: dict[str, Float[Tensor, "head q k"]],
    parts: dict[str, Float[Tensor, "head q k"]],
    key_prior: Float[Tensor, "k head"],
    sigma2: float,
    precap: bool,
    learned_sink: bool = False,
) -> viz.Group:
    """One layer's split on one prompt's real positions, per head: a row of maps with its real
    pattern and the two counterfactuals (``patterns`` keyed by ``PATTERNS``), a row with the
    score parts (``parts`` keyed by ``PARTS``' names, zero where not allowed), then the key
    prior per token. Maps show the first ``MAX_SHOWN_POSITIONS`` queries and keys."""
    n = min(len(tokens), MAX_SHOWN_POSITIONS)
    cut = "" if n == len(tokens) else f"; the first {n} of {len(tokens)} positions"
    labels = [f"{k}:{viz.visible_token(t)}" for k, t in enumerate(tokens[:n])]
    keep = allowed[:n, :n]
    capped = " (split of the pre-cap score)" if precap else ""
    if learned_sink:
        capped += (
            "; the learned sink is a virtual key in all three (prior-only: its prior; "
            "likelihood-only: logit 0), so rows sum to less than 1 (docs/math.md §2.6)"
        )
    items: list[viz.Component | viz.Group] = []
    for k, name in enumerate(names):
        maps = [
            viz.heatmap(
                patterns[what][k][:n, :n].masked_fill(~keep, float("nan")),
                labels,
                labels,
                title=f"{name} {what}",
                row_title="query",
                col_title="key",
                value_name="attention",
                min_value=0.0,
                max_value=1.0,
                cmap="blues",
                mask_upper_tri=causal,
                cell_px=6,
            )
            for what in PATTERNS
        ]
        items.append(
            viz.group(
                *maps,
                row=True,
                caption=(
                    f"Layer {layer}, {name}: the model's pattern, the prior-only softmax(key_prior + p) "
                    f"and the likelihood-only softmax(loglik + p) patterns, in that order{capped}{cut}; "
                    "grey: keys the query may not see."
                ),
            )
        )
        maps = []
        for key, what in PARTS:
            block = parts[key][k][:n, :n]
            shown = block[keep] if n else block
            lo, hi = (float(shown.min()), float(shown.max())) if shown.numel() else (0.0, 1.0)
            maps.append(
                viz.heatmap(
                    block.masked_fill(~keep, float("nan")),
                    labels,
                    labels,
                    title=f"{name} {what}",
                    row_title="query",
                    col_title="key",
                    value_name=key,
                    min_value=lo,
                    max_value=max(hi, lo + 1e-9),
                    cmap="viridis",
                    mask_upper_tri=causal,
                    cell_px=6,
                )
            )
        items.append(
            viz.group(
                *maps,
                row=True,
                caption=(
                    f"Layer {layer}, {name}: the score parts in that order (query term: constant along a "
                    f"row; key prior: constant down a column; distance log-likelihood), each on its own "
                    f"colour scale{cut}."
                ),
            )
        )
    items.append(
        viz.colored_tokens_multi(
            tokens,
            key_prior,
            names,
            caption=f"Layer {layer}: key prior (c/2)|k_j|^2 per token (pick a head)",
        )
    )
    return viz.group(
        *items, caption=f"Odds-ratio decomposition, layer {layer}, sigma^2 = 1/c = {sigma2:.4g}"
    )


def result_view(stats: viz.Component, layers: Sequence[viz.Group], model: str) -> viz.Group:
    """The per-head table followed by each layer's decomposition."""
    items: list[viz.Component | viz.Group] = [stats]
    items += [c for group in layers for c in group.components]
    return viz.group(*items, caption=f"Odds-ratio decomposition of {model}")


def extremes_view(
    stats: viz.Component,
    picks: Sequence[tuple[str, str, float, str, float, viz.Group]],
    model: str,
    thresholds: tuple[float, float, float],
) -> viz.Group:
    """The per-head table, then for each pick ``(head name, share name, share, label, kept mass,
    decomposition)`` a line saying why the head was picked and its decomposition. A head is called
    the most prior- (likelihood-) driven only if it carries that label (its evidence decided over
    the prompts: docs/math.md §9); otherwise the line says that no head is, and why."""
    threshold, _, keep = thresholds
    items: list[viz.Component | viz.Group] = [stats]
    for name, key, value, head_label, kept, group in picks:
        what = "prior" if key == "attr_prior" else "likelihood"
        part = f"{what}-only pattern keeps {kept:.2f} of the attention on the head's top key"
        if head_label == f"{what}-driven":
            line = (
                f"{name}: the head most driven by the {what} ({key} = {value:.3f}, at least "
                f"{threshold:.2f}, and its {part}, at least {keep:.2f}, both over their whole "
                f"95% interval: {what}-driven)."
            )
        elif value < threshold:
            line = (
                f"No head is {what}-driven: the largest {key} is {value:.3f} ({name}, shown "
                f"below), under the {threshold:.2f} a {what}-driven head needs."
            )
        elif head_label == "undecided":
            line = (
                f"{name} has the largest {key}, {value:.3f}, and its {part}, but its label is "
                "undecided: an interval over the prompts straddles a threshold, or there are "
                "too few prompts (the table's label_waits_on says which)."
            )
        else:
            line = (
                f"No head is {what}-driven: the largest {key} is {value:.3f} ({name}, shown "
                f"below), but its {part}: the {what} alone does not reproduce its choice "
                f"({head_label})."
            )
        items.append(viz.text(line))
        items.extend(group.components)
    return viz.group(
        *items,
        caption=f"Odds-ratio decomposition of {model}: the heads with the "
        "largest prior and likelihood shares",
    )
