"""The one module that knows TransformerLens: hooks, weights, scale, rotary, GQA, masks.

Analyzers ask it for "the query of head h in layer l as scored" and never spell hook names.
"""

from tl_dynamics.adapter._batch import Batch, Prompt
from tl_dynamics.adapter._host import HostInfo, LayerSpec, VERIFIED_HF_ATTENTION
from tl_dynamics.adapter._hub import LayerState
from tl_dynamics.adapter._layer import LayerAttention
from tl_dynamics.adapter._model import ModelAdapter
from tl_dynamics.adapter._qknorm import QueryNorm
from tl_dynamics.adapter._rotary import Rotation
from tl_dynamics.adapter._shuffle import shuffled_weights
from tl_dynamics.adapter._softmax import masked_log_softmax, masked_softmax
from tl_dynamics.adapter._weights import HeadWeights

__all__ = ["Batch", "HeadWeights", "HostInfo", "LayerAttention", "LayerSpec", "LayerState", "ModelAdapter",
           "Prompt", "QueryNorm", "Rotation", "VERIFIED_HF_ATTENTION", "masked_log_softmax",
           "masked_softmax", "shuffled_weights"]
