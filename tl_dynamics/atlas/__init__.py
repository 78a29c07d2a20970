"""The head atlas: what every head does, from mechanistic and causal evidence, in one call.

``compute(model, prompts=None, *, layers=None, heads=None)`` returns a ``HeadAtlas``: per head,
ranked roles (previous-token, duplicate-token, induction, copying, copy-suppression,
negative copying, sink, positional/local, unclassified), each from the mechanism rather than
one pattern (copy-suppression needs both the negative OV copying and the QK circuit that attends
to the token the residual stream predicts; a sink must dominate the next-largest key), every score
beside its value on a weight-shuffled copy of the model (a role needs a margin over it: the
result's ``margin``), and the change in next-token loss when the head is mean-ablated, or its
pattern replaced by the prior-only or the likelihood-only counterfactual of the odds-ratio split.
``tl-dynamics heads --model M`` prints it; ``report_section`` adds it to the report page.

Probes are built from token ids (repeated random sequences), so models without a tokenizer
work. The atlas cannot stream (it runs its own probes and interventions), so there is no
``attach``. See docs/atlas.md for the rules, the controls and the comparison with
TransformerLens's ``detect_head``.
"""

from tl_dynamics.atlas._api import compute, report_section
from tl_dynamics.atlas._result import HeadAtlas

__all__ = ["HeadAtlas", "compute", "report_section"]
