"""Why a head attends where it does: every attention score split exactly over the components
that wrote its query and its key, on this pass (docs/math.md §10).

- ``compute(model, prompt, *, layers=None, heads=None)`` returns a ``QKAttribution``: per head
  and row, each component's share of the attention-weighted score on the query and key sides,
  the top component pairs at the row's most attended key, and the odds-ratio parts.
- ``attach(model, ...)``: the same, collected during the user's own forward passes (a
  ``QKCollector``; the atlas reads the marginals of its heads with one, ``pairs=False``).
- ``pair(model, prompt, layer, head, dest, src)``: one score's full component x component matrix.
- ``explain(model, prompt, layer, head, dest, src=None, depth=2)``: the chain of causes of one
  edge: the score's split, each leading head's output split over its sources and the components
  there, back to the tokens; each link exact (an ``EdgeExplanation``; ``chains`` over rows).
- ``sae=`` (``compute``, ``pair``): a SAELens SAE on the layer's ``hook_resid_pre`` splits the
  query side, the key side or both into its active features, decoder bias and error term.
- ``over_prompts(model, prompts, layer, heads)``: per component, its mean share with an interval
  across prompts, beside the weight-shuffled control.
- ``report_section``: the report page's section (the heads the atlas marks).
"""

from tl_dynamics.qk_attribution._chains import ChainShapes, chains
from tl_dynamics.qk_attribution._collect import QKCollector, attach, compute
from tl_dynamics.qk_attribution._edge import EdgeExplanation
from tl_dynamics.qk_attribution._explain import explain
from tl_dynamics.qk_attribution._pair import pair
from tl_dynamics.qk_attribution._prompts import over_prompts
from tl_dynamics.qk_attribution._report import report_section
from tl_dynamics.qk_attribution._result import QKAttribution

__all__ = [
    "ChainShapes",
    "EdgeExplanation",
    "QKAttribution",
    "QKCollector",
    "attach",
    "chains",
    "compute",
    "explain",
    "over_prompts",
    "pair",
    "report_section",
]
