"""Attention as a contextual MLP: per prompt, each head is an MLP whose neurons are source tokens.

``compute(model, prompt, layers=..., heads=..., row=0)`` returns a ``ContextualMLPs`` (one
``ContextualMLP`` per selected head: ``result[layer, head]``); ``compute_rows`` does every row of
a batch in one forward pass; ``attach`` builds them during your own forward passes.
"""

from tl_dynamics.contextual_mlp._collect import attach, compute, compute_rows
from tl_dynamics.contextual_mlp._growth import generate_growth
from tl_dynamics.contextual_mlp._mlp import ContextualMLP
from tl_dynamics.contextual_mlp._mlps import ContextualMLPs
from tl_dynamics.contextual_mlp._report import report_section

__all__ = [
    "ContextualMLP",
    "ContextualMLPs",
    "attach",
    "compute",
    "compute_rows",
    "generate_growth",
    "report_section",
]
