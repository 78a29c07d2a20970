"""The QK-attribution section of the ``tl-dynamics report`` page: the heads the atlas marks."""

from __future__ import annotations

from tl_dynamics import viz
from tl_dynamics.adapter import Batch, ModelAdapter
from tl_dynamics.qk_attribution._collect import compute

TITLE = "Why each head attends where it does"
REPORT_ROLES = ("induction", "previous-token", "copy-suppression", "sink")
MAX_HEADS = 6  # heads shown (the atlas's marked heads, by role order)
REPORT_POSITIONS = 128  # destinations drawn per head at most (the first prompt's)


def report_section(page: viz.Page, adapter: ModelAdapter, batch: Batch) -> None:
    """Add the QK-attribution section to ``page``: for the heads the atlas marks (induction,
    previous-token, copy-suppression, sinks), each destination's key-side and query-side
    component shares and its top pair, on the report's first prompt. The heads are those the
    page's atlas section marked (``page.results["atlas"]``); without one, the atlas runs here
    on its own probes.

    Models whose residual stream cannot be split exactly raise ``TLDynamicsError`` naming why,
    and the page says so.

    Args:
        page: the ``viz.Page`` to add the section to.
        adapter: the model's ``ModelAdapter``.
        batch: the report's tokenized prompts.

    Example:
        >>> from tl_dynamics import qk_attribution, testing, viz
        >>> from tl_dynamics.adapter import ModelAdapter
        >>> ad, page = ModelAdapter(testing.tiny_model("gpt2")), viz.Page("report")
        >>> qk_attribution.report_section(page, ad, ad.tokenize("a b c a b c"))
        >>> page.sections[0].title
        'Why each head attends where it does'
    """
    marks = page.results.get("atlas")  # the atlas section's own, on this page: the same heads
    heads: list[tuple[int, int]] = []
    if marks is None:  # this section alone (no atlas on the page): the last layer's heads
        last = adapter.attention_layers[-1]
        heads = [(last, h) for h in range(adapter.n_heads)] if last > 0 else []
    for role in REPORT_ROLES if marks is not None else ():
        for key in marks.heads_with(role):
            if key not in heads and key[0] > 0:  # layer 0 reads only the embeddings
                heads.append(key)
    heads = heads[:MAX_HEADS]
    first = Batch(
        batch.tokens[:1, :REPORT_POSITIONS],
        batch.key_valid[:1, :REPORT_POSITIONS],
        batch.padding_side,
    )
    intro = (
        "Each score of a head is split exactly over the components that wrote its query and its "
        "key (token and positional embeddings, every earlier head's output, MLP outputs, biases), "
        "with the layer's norm scale frozen at this pass's own value: an exact decomposition of "
        "this pass, not a counterfactual (docs/math.md §10). Shown: the heads the atlas marks "
        f"({', '.join(REPORT_ROLES)}) beyond layer 0, on the first prompt"
        + (
            f" (its first {REPORT_POSITIONS} positions)"
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
    items = []
    for layer in sorted({l for l, _ in heads}):
        hs = [h for l, h in heads if l == layer]
        result = compute(adapter, first, layers=layer, heads=hs)
        for h in hs:
            items.append(result.show(layer, h))
    page.add_section(TITLE, items, intro=intro, math="docs/math.md §10")
