"""The in-context regression section of the ``tl-dynamics report`` page."""

from __future__ import annotations

from tl_dynamics import viz
from tl_dynamics.adapter import Batch, ModelAdapter
from tl_dynamics.regression._collect import compute

TITLE = "Attention as in-context regression"
REPORT_DESTINATIONS = 256  # at most about this many destinations per prompt (a stride beyond)


def report_section(page: viz.Page, adapter: ModelAdapter, batch: Batch) -> None:
    """Add the regression section to ``page``: every attention layer's heads on the report's
    prompts.

    Layers the analysis does not model (gated outputs, learned sinks, masks whose visible keys
    are not an interval) raise ``TLDynamicsError`` naming them, and the page says so.

    Args:
        page: the ``viz.Page`` to add the section to.
        adapter: the model's ``ModelAdapter``.
        batch: the report's tokenized prompts.

    Example:
        >>> from tl_dynamics import regression, testing, viz
        >>> from tl_dynamics.adapter import ModelAdapter
        >>> ad, page = ModelAdapter(testing.tiny_model("gpt2")), viz.Page("report")
        >>> regression.report_section(page, ad, ad.tokenize("def f(x):\\n    return x * 2 + 1\\n" * 3))
        >>> page.sections[0].title
        'Attention as in-context regression'
    """
    stride = max(1, -(-batch.tokens.shape[1] // REPORT_DESTINATIONS))
    result = compute(adapter, batch, n_boot=100, stride=stride)
    claimed = result.claims()
    counts = claimed.reading.value_counts()
    n_like, n_linear = int(counts.get("regression", 0)), int(counts.get("linear", 0))
    held = int(result.n_held[0, -1].max()) if result.n_held.size else 0
    intro = (
        "Each head's output z (before W_O) against what in-context regression of its values on "
        "its keys would give: linear attention, ridge over a lambda path and at the GCV pick, "
        "gradient descent from zero, and the controls (mean of the visible values, the first "
        "value, v_t, v_{t-1}), each with one fitted gain (docs/math.md §8). "
        f"Of {len(claimed)} heads, {n_like} read as regression beyond their linear and control "
        f"predictors and {n_linear} as linear attention beyond their controls (held-out "
        f"destinations in the claim band: {held}; none means no claim is made). {result.notice}"
        + (f" Every {stride}th destination is measured (all keys are used)." if stride > 1 else "")
    )
    page.add_section(TITLE, [result.show()], intro=intro, math="docs/math.md §8")
