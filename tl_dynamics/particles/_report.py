"""The report page's particles section."""

from __future__ import annotations

from tl_dynamics import viz
from tl_dynamics.adapter import Batch, ModelAdapter
from tl_dynamics.particles._beside import compute

REPORT_MAX_PARTICLES = 64  # the section simulates at most this many tokens: the prompt's first ones
# The integrator's local error per step on the page (the API's default is 1e-6): a head with sharp
# attention makes the flow stiff (SmolLM2-135M's L0H0: 2,889 steps, 22 s at 1e-6), and a picture
# of cluster counts needs no more than this.
REPORT_TOL = 1e-4
INTRO = (
    "Geshkovski et al.'s self-attention dynamics on the sphere, with Q, K, V and beta"
    " from one head (head 0 of the first attention layer) and the prompt's own tokens as the initial "
    "particles, beside the number of token clusters the real model forms through its layers. "
    "A cluster is a group of tokens linked by cosine above 1 - eps; a count equal to the "
    "number of tokens means no two are that close. The idealised flow drops biases, "
    "LayerNorm, MLPs and the other heads. The flow is integrated to a local error of "
    f"{REPORT_TOL:g} per step."
)


def report_section(page: viz.Page, adapter: ModelAdapter, batch: Batch) -> None:
    """Add the particles section to ``page``: the flow from one head beside the model's clustering.

    The flow seeded from head 0 of the first attention layer (layer 0 except on hybrids) beside
    the model's clustering (``compute(adapter, batch, layers=first, heads=0, t_max=10)``) on the
    first prompt's first ``REPORT_MAX_PARTICLES`` real tokens (on a causal model their states are
    exactly those of the whole prompt).

    Args:
        page: the ``viz.Page`` to add the section to.
        adapter: the model's ``ModelAdapter``.
        batch: the report's tokenized prompts (``Batch``, ``[batch, pos]``); row 0 is used.

    Example:
        >>> from tl_dynamics import particles, testing, viz
        >>> from tl_dynamics.adapter import ModelAdapter
        >>> ad, page = ModelAdapter(testing.tiny_model("gpt2")), viz.Page("report")
        >>> particles.report_section(page, ad, ad.tokenize("a b c d"))
        >>> page.sections[0].title
        'Idealised particle dynamics'
    """
    real = batch.real_tokens()
    shown = real[:REPORT_MAX_PARTICLES]  # causal models: these states are the full prompt's
    first = adapter.check_attention_layers(None)[0]  # no attention layers: refused by name
    result = compute(
        adapter, adapter.tokenize(shown[None]), layers=first, heads=0, t_max=10.0, tol=REPORT_TOL
    )
    note = (
        ""
        if len(shown) == len(real)
        else f" The particles are the prompt's first {len(shown)} of its {len(real)} tokens (the "
        "simulation's cost grows with the square of their number)"
        + (
            ": this encoder reads them as a prompt of their own."
            if adapter.is_encoder
            else ", with exactly the states they have in the whole prompt."
        )
    )
    page.add_section(
        "Idealised particle dynamics", [result.show()], intro=INTRO + note, math="docs/math.md §6"
    )
