"""Attention as a contextual MLP: per prompt, each head is an MLP whose neurons are source tokens."""

from tl_dynamics.contextual_mlp._build import as_adapter, attach, compute, compute_layer, from_layer
from tl_dynamics.contextual_mlp._frame import RotaryFrame, build_frames
from tl_dynamics.contextual_mlp._mlp import ContextualMLP
from tl_dynamics.contextual_mlp._results import Evaluation, Exactness, Neurons

__all__ = ["ContextualMLP", "Evaluation", "Exactness", "Neurons", "RotaryFrame", "as_adapter",
           "attach", "build_frames", "compute", "compute_layer", "from_layer"]
