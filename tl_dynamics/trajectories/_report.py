"""The report page's trajectories section: ``compute`` on the report's batch, shown."""

from __future__ import annotations

from tl_dynamics import viz
from tl_dynamics.adapter import Batch, ModelAdapter
from tl_dynamics.trajectories._collect import compute

INTRO = (
    "Each token's residual state before every block and after the last, as a particle on "
    "the sphere. First: per-token settling point of the next-token "
    "prediction under the logit lens, step sizes, cosine to the final state. Then: "
    "pairwise-cosine histograms (fixed bins, comparable across layers and models), cluster "
    "counts, merge events, effective rank, for the prompts of this batch."
)


def report_section(page: viz.Page, adapter: ModelAdapter, batch: Batch) -> None:
    """Add the trajectories section (per-token views and particle statistics) to ``page``.

    Args:
        page: the ``viz.Page`` to add the section to.
        adapter: the model's ``ModelAdapter``.
        batch: the report's tokenized prompts (``Batch``, ``[batch, pos]``); row 0 is shown.

    Example:
        >>> from tl_dynamics import testing, trajectories, viz
        >>> from tl_dynamics.adapter import ModelAdapter
        >>> ad, page = ModelAdapter(testing.tiny_model("gpt2")), viz.Page("report")
        >>> trajectories.report_section(page, ad, ad.tokenize("x = 1"))
        >>> page.sections[0].title
        'Depth-wise trajectories'
    """
    page.add_section(
        "Depth-wise trajectories",
        [compute(adapter, batch).show(0)],
        intro=INTRO,
        math="docs/math.md §5",
    )
