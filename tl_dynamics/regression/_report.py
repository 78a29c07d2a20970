"""The in-context regression section of the ``tl-dynamics report`` page."""

from __future__ import annotations

from tl_dynamics import viz
from tl_dynamics.adapter import Batch, ModelAdapter
from tl_dynamics.regression._collect import compute

TITLE = "Attention as in-context regression"
# At most about this many destinations per prompt (a stride beyond). 128 rather than 256: the
# section cost 19.4 s of a 31 s report at 12 x 12 heads and 512 tokens, 12.5 s at 128 (one
# eigendecomposition per destination and key/value head); a report of one prompt decides no
# reading either way (a verdict needs 8 held-out prompts, docs/math.md §9).
REPORT_DESTINATIONS = 128
# The report measures each head's ablation (one patched forward per head) up to this many heads,
# as the atlas's section does its interventions; `regression.compute` measures them all.
REPORT_ABLATION_HEADS = 64


def report_section(page: viz.Page, adapter: ModelAdapter, batch: Batch) -> None:
    """Add the regression section to ``page``: every attention layer's heads on the report's
    prompts.

    Layers the analysis does not model (gated outputs, masks whose visible keys are not an
    interval) raise ``TLDynamicsError`` naming them, and the page says so.

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
    n_heads = len(adapter.check_attention_layers(None)) * adapter.n_heads
    ablate = n_heads <= REPORT_ABLATION_HEADS
    result = compute(adapter, batch, stride=stride, ablation=ablate)  # evidence.N_BOOT
    intro = (
        "Each head's output z (before W_O) against what in-context regression of its values on "
        "its keys would give: linear attention, ridge over a lambda path and at the GCV pick, "
        "gradient descent from zero, and the controls (mean of the visible values, the first "
        "value, v_t, v_{t-1}), each with one fitted gain (docs/math.md §8). Every reading is a "
        "claim, a no or 'undecided', from 95% intervals over held-out units (docs/math.md §9)."
        + (
            " Beside each reading: the head's causal weight, the change in next-token loss when "
            "it is mean-ablated (a reading does not claim one, docs/math.md §9.5)."
            if ablate
            else f" The ablation column is measured up to {REPORT_ABLATION_HEADS} heads "
            "(regression.compute(..., ablation=True) measures them all)."
        )
        + (f" Every {stride}th destination is measured (all keys are used)." if stride > 1 else "")
    )
    page.add_section(TITLE, [result.show()], intro=intro, math="docs/math.md §8")
