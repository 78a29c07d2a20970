"""The head atlas: what every head does, from mechanistic and causal evidence, in one call.

``compute(model, prompts=None, *, layers=None, heads=None)`` returns a ``HeadAtlas``: per head,
ranked roles (previous-token, duplicate-token, induction, copying, copy-suppression,
negative copying, sink, positional/local, unclassified, undecided), each from the mechanism
read on the model's own pass rather than one pattern (an induction head's attended key is led
by a previous-token head's output and its query by the current token; copying raises the
attended token's logit; a sink must dominate the next-largest key), every score beside its value
on a weight-shuffled copy of the model (a role needs a margin over it, decided on a 95% interval
over the probes), and the change in next-token loss when the head is mean-ablated (estimated for
every head by attribution patching, exact for the strongest and the named ones), or its pattern
replaced by the prior-only or the likelihood-only counterfactual of the odds-ratio split.
``tl-dynamics heads --model M`` prints it; ``report_section`` adds it to the report page.

Probes are built from token ids (repeated random sequences), so models without a tokenizer
work. The atlas cannot stream (it runs its own probes and interventions), so there is no
``attach``. See docs/atlas.md for the rules, the controls and the comparison with
TransformerLens's ``detect_head``.
"""

from tl_dynamics.atlas._api import compute
from tl_dynamics.atlas._report import report_section
from tl_dynamics.atlas._result import HeadAtlas

__all__ = ["HeadAtlas", "compute", "report_section"]
