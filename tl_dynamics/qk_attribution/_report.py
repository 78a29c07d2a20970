"""The QK-attribution section of the ``tl-dynamics report`` page: the heads that matter, the atlas's
strongest head of each role across all layers, explained on the report's prompts."""

from __future__ import annotations

from typing import Any

import numpy as np

from tl_dynamics import viz
from tl_dynamics.adapter import Batch, ModelAdapter
from tl_dynamics.qk_attribution._collect import compute
from tl_dynamics.qk_attribution._prompts import over_prompts

TITLE = "Why each head attends where it does"
# roles whose strongest head (largest margin over its control) the section explains, in order
REPORT_ROLES = (
    "induction",
    "previous-token",
    "duplicate-token",
    "copy-suppression",
    "copying",
    "negative copying",
    "sink",
)
MAX_HEADS = 6  # heads shown
REPORT_POSITIONS = 128  # destinations per prompt at most
ROWS = "focused"  # the rows read: where the head attends a key other than the first


def strongest_heads(marks: Any, roles: tuple[str, ...] = REPORT_ROLES, limit: int = MAX_HEADS):
    """``[(layer, head, role)]``: the heads of ``marks`` (a ``HeadAtlas``) holding each role, the
    one whose score clears its control by the most first, taken a role at a time in turn (the
    strongest of every role, then the second strongest, ...), skipping layer 0 (it reads only the
    embeddings) and heads already taken; at most ``limit``.

    Example:
        >>> from tl_dynamics import atlas, zoo
        >>> strongest_heads(atlas.compute(zoo.load("induction-2l"), causal=False), limit=3)
        [(1, 1, 'induction'), (1, 0, 'sink'), (1, 3, 'induction')]
    """
    ranked: list[list[tuple[int, int]]] = []
    for role in roles:
        gaps = []
        for layer, head in marks.heads_with(role):
            entry = marks.roles[(layer, head)]
            i = entry.roles.index(role)
            gap = float(entry.scores[i] - entry.baselines[i])
            if layer > 0 and np.isfinite(gap):
                gaps.append((-gap, layer, head))
        ranked.append([(layer, head) for _, layer, head in sorted(gaps)])
    out: list[tuple[int, int, str]] = []
    taken: set[tuple[int, int]] = set()
    depth = 0
    while len(out) < limit and any(depth < len(r) for r in ranked):
        for role, heads in zip(roles, ranked):
            if depth < len(heads) and heads[depth] not in taken and len(out) < limit:
                taken.add(heads[depth])
                out.append((*heads[depth], role))
        depth += 1
    return out


def _first_positions(batch: Batch) -> Batch:
    return Batch(
        batch.tokens[:, :REPORT_POSITIONS],
        batch.key_valid[:, :REPORT_POSITIONS],
        batch.padding_side,
    )


def _one_prompt_sentence(result: Any, layer: int, head: int, role: str) -> str:
    """What one prompt shows of a head's focused rows, without an interval (one unit)."""
    mask = result.row_mask(layer, head)
    n = int(mask.sum())
    if n == 0:
        return f"L{layer}H{head} ({role}): no row attends a key other than the first here."
    parts = []
    for side in ("key", "query"):
        lead = result.leaders(layer, head, side)[mask]
        names = result.names(layer, side)
        top = int(np.bincount(lead[lead >= 0], minlength=len(names)).argmax())
        parts.append(f"the {side} side by {names[top]} on {np.mean(lead == top):.0%}")
    return (
        f"L{layer}H{head} ({role}), on its {n} focused rows of this prompt: "
        f"{' and '.join(parts)} of them (one prompt: no interval)."
    )


def report_section(page: viz.Page, adapter: ModelAdapter, batch: Batch) -> None:
    """Add the QK-attribution section to ``page``: for the atlas's strongest head of each role
    (``strongest_heads``; the page's atlas section, ``page.results["atlas"]``), across all
    layers, which components wrote the attended keys and the queries on the rows where the head
    attends a key other than the first (``positions="focused"``). With two prompts or more, one
    sentence per head and side gives the leading component's mean share with its 95% interval
    over the prompts beside the weight-shuffled control (``over_prompts``); each head's per-row
    view is on the first prompt. Without an atlas on the page, the last layer's heads.

    Models whose residual stream cannot be split exactly raise ``TLDynamicsError`` naming why,
    and the page says so.

    Args:
        page: the ``viz.Page`` to add the section to.
        adapter: the model's ``ModelAdapter``.
        batch: the report's tokenized prompts (every row is used).

    Example:
        >>> from tl_dynamics import qk_attribution, testing, viz
        >>> from tl_dynamics.adapter import ModelAdapter
        >>> ad, page = ModelAdapter(testing.tiny_model("gpt2")), viz.Page("report")
        >>> qk_attribution.report_section(page, ad, ad.tokenize("a b c a b c"))
        >>> page.sections[0].title
        'Why each head attends where it does'
    """
    marks = page.results.get("atlas")  # the atlas section's own, on this page: the same heads
    if marks is not None:
        heads = strongest_heads(marks)
    else:  # this section alone (no atlas on the page): the last layer's heads
        last = adapter.check_attention_layers(None)[-1]  # none: refused by name
        heads = [(last, h, "no atlas") for h in range(adapter.n_heads)][:MAX_HEADS] if last else []
    shown = _first_positions(batch)
    n_prompts = int(shown.tokens.shape[0])
    intro = (
        "Each score of a head is split exactly over the components that wrote its query and its "
        "key (token and positional embeddings, every earlier head's output, MLP outputs, biases), "
        "with the layer's norm scale frozen at this pass's own value: an exact decomposition of "
        "this pass, not a counterfactual (docs/math.md §10). Shown: the atlas's strongest head "
        f"of each role ({', '.join(REPORT_ROLES)}) across all layers beyond layer 0, read on "
        "the rows where it attends a key other than the first at least twice the row's uniform "
        "share (its 'focused' rows, where it does its work; rows resting on the first token "
        "would dilute the shares)"
        + (
            f", each prompt cut to {REPORT_POSITIONS} positions"
            if batch.tokens.shape[1] > REPORT_POSITIONS
            else ""
        )
        + "."
    )
    if not heads:
        page.add_section(
            TITLE,
            [viz.text("The atlas marks no head beyond layer 0 with these roles on this model.")],
            intro=intro,
            math="docs/math.md §10",
        )
        return
    items: list[Any] = []
    sentences: list[str] = []
    first = Batch(shown.tokens[:1], shown.key_valid[:1], shown.padding_side)
    for layer in sorted({l for l, _, _ in heads}):
        here = [(h, role) for l, h, role in heads if l == layer]
        hs = [h for h, _ in here]
        result = compute(adapter, first, layers=layer, heads=hs, positions=ROWS)
        if n_prompts >= 2:
            summary = over_prompts(adapter, shown, layer, hs, positions=ROWS)
            sentences.append(summary.summary())
        else:
            sentences += [_one_prompt_sentence(result, layer, h, role) for h, role in here]
        items += [result.show(layer, h) for h in hs]
    page.add_section(
        TITLE, [viz.text(" ".join(sentences)), *items], intro=intro, math="docs/math.md §10"
    )
