"""The one module that knows TransformerLens: hooks, weights, scale, rotary, GQA, masks.

Analyzers ask it for "the query of head h in layer l as scored" and never spell hook names.
``Prompt`` is what every analysis takes as a prompt: a text, a list of texts, or a token tensor.
"""

from tl_dynamics.adapter._batch import Batch, Prompt
from tl_dynamics.adapter._components import ResidualSplit
from tl_dynamics.adapter._hub import LayerState
from tl_dynamics.adapter._layer import LayerAttention
from tl_dynamics.adapter._model import ModelAdapter
from tl_dynamics.adapter._qknorm import QueryNorm
from tl_dynamics.adapter._rotary import Rotation
from tl_dynamics.adapter._shuffle import shuffled_weights
from tl_dynamics.adapter._softmax import masked_softmax

__all__ = [
    "Batch",
    "LayerAttention",
    "LayerState",
    "ModelAdapter",
    "Prompt",
    "QueryNorm",
    "ResidualSplit",
    "Rotation",
    "masked_softmax",
    "shuffled_weights",
]
