"""Attention as a contextual MLP: per prompt, each head is an MLP whose neurons are source tokens.

``compute(model, prompt, layers=..., heads=..., row=0)`` returns a ``ContextualMLPs`` (one
``ContextualMLP`` per selected head: ``result[layer, head]``); ``compute_rows`` does every row of
a batch in one forward pass; ``attach`` builds them during your own forward passes.
"""

from tl_dynamics.contextual_mlp._collect import (ContextualMLPCollector, attach, compute,
                                               compute_rows, from_layer)
from tl_dynamics.contextual_mlp._core import naive_mlp
from tl_dynamics.contextual_mlp._frame import RotaryFrame, build_frames
from tl_dynamics.contextual_mlp._growth import Growth, generate_growth, growth
from tl_dynamics.contextual_mlp._mlp import ContextualMLP
from tl_dynamics.contextual_mlp._mlps import ContextualMLPs
from tl_dynamics.contextual_mlp._readout import (Readout, direction_logits, evaluate_tokens,
                                                 evaluate_vocab, read_tokens, token_inputs,
                                                 written_tokens)
from tl_dynamics.contextual_mlp._report import ContextualMLPAnalysis, report_section
from tl_dynamics.contextual_mlp._results import Evaluation, Exactness, Neurons

__all__ = ["ContextualMLP", "ContextualMLPAnalysis", "ContextualMLPCollector", "ContextualMLPs",
           "Evaluation", "Exactness", "Growth", "Neurons", "Readout", "RotaryFrame", "attach",
           "build_frames", "compute", "compute_rows", "direction_logits", "evaluate_tokens",
           "evaluate_vocab", "from_layer", "generate_growth", "growth", "naive_mlp",
           "read_tokens", "report_section", "token_inputs", "written_tokens"]
