"""Attention as a contextual MLP: per prompt, each head is an MLP whose neurons are source tokens."""

from tl_dynamics.contextual_mlp._build import attach, compute, compute_layer, from_layer
from tl_dynamics.contextual_mlp._core import naive_mlp
from tl_dynamics.contextual_mlp._frame import RotaryFrame, build_frames
from tl_dynamics.contextual_mlp._growth import Growth, generate_growth, growth
from tl_dynamics.contextual_mlp._mlp import ContextualMLP
from tl_dynamics.contextual_mlp._readout import (Readout, direction_logits, evaluate_tokens,
                                                 evaluate_vocab, read_tokens, token_inputs,
                                                 written_tokens)
from tl_dynamics.contextual_mlp._results import Evaluation, Exactness, Neurons
from tl_dynamics.contextual_mlp._views import report_section

__all__ = ["ContextualMLP", "Evaluation", "Exactness", "Growth", "Neurons", "Readout",
           "RotaryFrame", "attach", "build_frames", "compute", "compute_layer",
           "direction_logits", "evaluate_tokens", "evaluate_vocab", "from_layer",
           "generate_growth", "growth", "naive_mlp", "read_tokens", "report_section",
           "token_inputs", "written_tokens"]
