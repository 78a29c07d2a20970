"""``Calls``: the collector behind ``ModelAdapter.capture``, which hands each asked layer's
``LayerAttention`` to a function."""

from __future__ import annotations

from typing import Callable

from tl_dynamics.adapter._hub import LayerState
from tl_dynamics.adapter._layer import LayerAttention
from tl_dynamics.collect import Collector


class Calls(Collector):
    """``capture``'s collector: hands each layer's ``LayerAttention`` to a function (whose ``z``
    and head outputs include a gated layer's output gate)."""

    gates, query_frames = True, False  # hands the layer on: forms no query frame itself

    def __init__(
        self,
        fn: Callable[[LayerAttention], None],
        layers: list[int],
        reference: bool,
        inputs: bool,
        sinks: bool,
    ):
        self.fn, self.layers = fn, tuple(layers)
        self.reference, self.inputs, self.sinks = reference, inputs, sinks

    def on_layer(self, state: LayerState) -> None:
        if state.attention is not None and state.layer in self.layers:
            self.fn(state.attention)
