"""The report's first section: every layer's attention, re-exported by ``tl_dynamics.report``.

Per-head statistics as layer x head maps, a thumbnail of every head and full patterns for the
heads singled out (``attention_section``), and the sentence naming the heads that do most of
one thing (``top_heads_sentence``).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from tl_dynamics import viz
from tl_dynamics._heads import EXPLAINED, SINK_EPSILON, STATISTICS, HeadSummaries, sink_epsilon
from tl_dynamics.adapter import Batch, ModelAdapter
from tl_dynamics.errors import TLDynamicsError

ATTENTION_INTRO = (
    "How each head spreads its attention over earlier tokens. The maps give one number per head "
    "(rows: layers, columns: heads); the grid shows every head's pattern as a thumbnail "
    "(destination token down, source token across, darker = more weight); click one to see it "
    "large, with tokens on hover. Patterns are recomputed exactly from the model's own queries "
    "and keys (scale, rotary, grouped heads, masks and soft-caps as the model scores)."
)


LEARNED_SINK_CAPTION = (
    "mean weight the head's learned sink absorbs (a per-head logit in every softmax "
    "denominator: each row of the pattern sums to 1 minus this; docs/math.md §1.4)"
)


def checked_heads(
    heads: Sequence[tuple[int, int]] | None, adapter: ModelAdapter
) -> set[tuple[int, int]]:
    """``heads`` (``(layer, head)`` pairs) checked against ``adapter``'s shape, as a set."""
    out = set()
    for layer, head in heads or ():
        out.add((adapter.check_layer(layer), adapter.check_head(head, layer=layer)))
    return out


def attention_section(
    page: viz.Page,
    adapter: ModelAdapter,
    batch: Batch,
    layers: Sequence[int] | None = None,
    heads: Sequence[tuple[int, int]] | None = None,
) -> None:
    """Per-head statistics, thumbnails of every head, full patterns for the heads singled out
    (and for ``heads``, ``(layer, head)`` pairs), streamed one layer at a time.

    Args:
        page: The page the section is added to.
        adapter: The model's adapter.
        batch: One prompt (``ModelAdapter.tokenize``); the first row is shown.
        layers: The layers shown (None: every attention layer).
        heads: ``(layer, head)`` pairs whose full pattern is shown besides those singled out.

    Example:
        >>> from tl_dynamics import testing, viz
        >>> ad = ModelAdapter(testing.cached_model("gpt2"))
        >>> page = viz.Page("attention")
        >>> attention_section(page, ad, ad.tokenize("a b a b"), heads=[(1, 0)])
        >>> "L1H0" in page.to_html()
        True
    """
    chosen = adapter.check_attention_layers(layers)
    forced = checked_heads(heads, adapter)
    outside = sorted(k for k in forced if k[0] not in chosen)
    if outside:
        raise TLDynamicsError(
            f"heads {[f'L{a}H{b}' for a, b in outside]} are in layers not shown "
            f"(layers {chosen}): add their layers or drop them"
        )
    valid = batch.key_valid[0]
    tokens = [t for t, keep in zip(adapter.str_tokens(batch), valid.tolist()) if keep]
    ids = batch.tokens[0][valid]
    summary = HeadSummaries(adapter.n_heads, len(tokens), forced)
    causal = [True]
    sunk: dict[int, Any] = {}  # layer -> [head] mean mass its learned sinks absorb (GPT-OSS)

    every = bool(valid.all())

    def on_layer(la: Any) -> None:
        pattern, allowed = la.pattern()[0].float(), la.allowed[0]
        if not every:  # padding: keep the real tokens only
            pattern, allowed = pattern[:, valid][:, :, valid], allowed[valid][:, valid]
        causal[0] = causal[0] and bool(la.spec.causal)
        if la.sink_logit is not None:  # rows sum to 1 - (what the learned sink absorbs)
            sunk[la.layer] = (1.0 - pattern.sum(-1)).mean(-1).numpy()
        summary.add_layer(la.layer, pattern, allowed, ids)

    # learned sinks are part of the model's pattern: shown as it is, their mass as one more map
    with torch.no_grad(), adapter.capture(on_layer, layers=chosen, batch=batch, sinks=True):
        adapter.forward(batch)
    rows = [f"L{layer}" for layer in summary.layers]
    cols = [f"H{h}" for h in range(adapter.n_heads)]
    maps = []
    for name in STATISTICS:
        values = summary.matrix(name)
        if not torch.isfinite(torch.as_tensor(values)).any():
            continue
        maps.append(
            viz.heatmap(
                values,
                rows,
                cols,
                title=name.replace("_", " "),
                row_title="layer",
                col_title="head",
                min_value=0.0,
                max_value=1.0,
                cmap="viridis",
                value_name="normalised entropy" if name == "entropy" else "weight",
                cell_px=28,
                caption=EXPLAINED[name],
            )
        )
    if sunk:
        values = np.array(
            [sunk.get(layer, np.full(adapter.n_heads, np.nan)) for layer in summary.layers]
        )
        maps.append(
            viz.heatmap(
                values,
                rows,
                cols,
                title="learned sink",
                row_title="layer",
                col_title="head",
                min_value=0.0,
                max_value=1.0,
                cmap="viridis",
                value_name="weight",
                cell_px=28,
                caption=LEARNED_SINK_CAPTION,
            )
        )
    full = summary.full_patterns()
    index = {
        key: i
        for i, key in enumerate(
            (layer, h) for layer in summary.layers for h in range(adapter.n_heads)
        )
    }
    picked = summary.singled_out()
    first = picked.get("previous_token") or next(iter(full), (summary.layers[0], 0))
    names = [f"L{layer}H{h}" for layer, h in index]
    grid = viz.attention_grid(
        summary.thumbs,
        {index[k]: p for k, p in full.items()},
        tokens,
        names,
        columns=adapter.n_heads,
        row_names=rows,
        selected=index[first],
        mask_upper_tri=causal[0],
        caption=f"{len(names)} heads; full patterns kept for {len(full)}",
    )
    items: list[Any] = [
        viz.group(
            *maps, caption="Per-head statistics (one cell per head; hover for the value)", row=True
        ),
        grid,
    ]
    items.append(viz.text(sink_epsilon_sentence(summary.matrix("sink_alpha"), adapter, ids)))
    singled = top_heads_sentence(summary.top_values())
    if singled:
        items.append(viz.text(singled))
    page.add_section("Attention patterns", items, intro=ATTENTION_INTRO, math="docs/math.md §1.4")


def sink_epsilon_sentence(alpha: np.ndarray, adapter: ModelAdapter, ids: torch.Tensor) -> str:
    """Gu et al.'s Sink^epsilon of the first key beside the first-token map, naming whether that
    key is a prepended BOS token (the first real token is the tokenizer's BOS id)."""
    bos = getattr(adapter.tokenizer, "bos_token_id", None)
    first = int(ids[0]) if len(ids) else None
    prepended = bos is not None and first == bos
    word = "is the BOS token (prepended)" if prepended else "is not a BOS token (none prepended)"
    value = sink_epsilon(alpha)
    return (
        f"Sink^eps of the first key (Gu et al. 2025): {value:.2f}, the fraction of the "
        f"{alpha.size} heads whose mean weight on it over the queries that may see it exceeds "
        f"{SINK_EPSILON:g} on this prompt; the first key {word}. The odds-ratio section's sink "
        "statistics (docs/math.md §2.3) say where each head's largest column is and how it wins."
    )


# A head is named for a statistic only when that is where most of its attention goes: the maps
# show every head's value, and a "top head" at, say, 0.04 would name a head that does not do it.
NAMED_SHARE = 0.5


def top_heads_sentence(tops: dict[str, tuple[tuple[int, int], float]]) -> str:
    """One sentence naming, per statistic, the head with the largest mean weight there, only
    where that weight is at least ``NAMED_SHARE`` (otherwise it says no head does it).

    Example:
        >>> print(top_heads_sentence({"previous_token": ((0, 2), 0.91), "induction": ((1, 0), 0.04)}))
        At least half of a head's attention: previous token L0H2 (0.91). No head reaches half for: induction (largest L1H0, 0.04). These describe this prompt; the labels of the sections below are verdicts over prompts (docs/math.md §9).
    """
    named = [
        f"{name.replace('_', ' ')} L{k[0]}H{k[1]} ({v:.2f})"
        for name, (k, v) in tops.items()
        if v >= NAMED_SHARE
    ]
    below = [
        f"{name.replace('_', ' ')} (largest L{k[0]}H{k[1]}, {v:.2f})"
        for name, (k, v) in tops.items()
        if v < NAMED_SHARE
    ]
    parts = []
    if named:
        parts.append("At least half of a head's attention: " + "; ".join(named) + ".")
    if below:
        parts.append("No head reaches half for: " + "; ".join(below) + ".")
    if parts:  # one prompt: a description of it, not a label (docs/math.md §9)
        parts.append(
            "These describe this prompt; the labels of the sections below are verdicts over "
            "prompts (docs/math.md §9)."
        )
    return " ".join(parts)
