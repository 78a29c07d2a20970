"""Frozen result objects: one destination's neurons, an evaluation, an exactness check."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
from jaxtyping import Float, Int
from torch import Tensor

from tl_dynamics import viz


# The name of the learned-sink neuron in tables and views (GPT-OSS; docs/math.md §3.7).
LEARNED_SINK = "learned sink"


@dataclass(frozen=True)
class Neurons(viz.Result):
    """The contextual MLP of one head at one destination ``position``.

    ``a`` (outgoing) is ``[n_src, d_model]``, ``b`` (incoming) ``[n_src, d_model]`` (``[n_src,
    d_head]`` on qk-norm layers, where it acts on the normalised query), ``c`` (biases) ``[n_src]``;
    ``activations`` are the normalised hidden activations at the real query input (the pattern
    row over ``sources``). On a layer with learned sinks, ``sink_logit`` and ``sink_activation``
    describe one more neuron, the learned sink: pre-activation ``c = sink_logit``, no incoming
    weight, outgoing weight zero, activation the mass it absorbs (docs/math.md §3.7); the
    table lists it last, as source -1.
    """

    layer: int
    head: int
    position: int
    sources: Int[Tensor, " src"]
    source_tokens: tuple[str, ...]
    a: Float[Tensor, "src d_model"]
    b: Float[Tensor, "src d_in"]
    c: Float[Tensor, " src"]
    activations: Float[Tensor, " src"]
    softcap: float | None = None
    sink_logit: float | None = None
    sink_activation: float | None = None

    @property
    def importance(self) -> Float[Tensor, " src"]:
        """``activation_i * |a_i|``."""
        return self.activations * self.a.norm(dim=-1)

    @property
    def winner(self) -> int:
        """Source position of the most active neuron."""
        return int(self.sources[self.activations.argmax()])

    def to_dataframe(self) -> pd.DataFrame:
        df = pd.DataFrame(
            {
                "layer": self.layer,
                "head_index": self.head,
                "position": self.position,
                "source": self.sources.tolist(),
                "token": list(self.source_tokens),
                "activation": self.activations.tolist(),
                "importance": self.importance.tolist(),
                "a_norm": self.a.norm(dim=-1).tolist(),
                "b_norm": self.b.norm(dim=-1).tolist(),
                "c": self.c.tolist(),
            }
        )
        if self.sink_logit is None:
            return df
        sink = {
            "layer": self.layer,
            "head_index": self.head,
            "position": self.position,
            "source": -1,
            "token": LEARNED_SINK,
            "activation": self.sink_activation,
            "importance": 0.0,
            "a_norm": 0.0,
            "b_norm": 0.0,
            "c": self.sink_logit,
        }
        return pd.concat([df, pd.DataFrame([sink])], ignore_index=True)

    def show(self) -> viz.Component:
        """The neurons' table (an escaped HTML table)."""
        return viz.table(
            self.to_dataframe(),
            caption=f"L{self.layer}H{self.head} neurons at destination {self.position}",
        )


@dataclass(frozen=True)
class Evaluation(viz.Result):
    """A head's contextual MLP at ``position`` evaluated on ``n`` query inputs.

    ``activations[n, src]`` over the neurons ``sources``; ``winners[n]`` the source position of
    the most active neuron per input; ``outputs[n, d_model]`` (None unless kept); ``sink[n]``
    the learned-sink neuron's activation on layers with learned sinks (None elsewhere).
    """

    layer: int
    head: int
    position: int
    sources: Int[Tensor, " src"]
    source_tokens: tuple[str, ...]
    activations: Float[Tensor, "n src"]
    outputs: Float[Tensor, "n d_model"] | None
    winners: Int[Tensor, " n"]
    labels: tuple[str, ...]
    sink: Float[Tensor, " n"] | None = None

    def winner_tokens(self) -> list[str]:
        lookup = dict(zip(self.sources.tolist(), self.source_tokens))
        return [lookup[int(w)] for w in self.winners]

    def to_dataframe(self) -> pd.DataFrame:
        df = pd.DataFrame(
            {
                "input": list(self.labels),
                "winner": self.winners.tolist(),
                "winner_token": self.winner_tokens(),
                "winner_activation": self.activations.max(-1).values.tolist(),
            }
        )
        if self.outputs is not None:
            df["output_norm"] = self.outputs.norm(dim=-1).tolist()
        if self.sink is not None:
            df["sink_activation"] = self.sink.tolist()
        df.insert(0, "position", self.position)
        return df

    def show(self, max_k: int = 7) -> viz.Component:
        """Each input's activations over the neurons (source tokens), top-k neurons per input."""
        acts = self.activations.T[None]  # [layers=1, tokens=src, neurons=inputs]
        return viz.topk_tokens(
            [list(self.source_tokens)],
            [acts],
            max_k=max_k,
            first_dimension_name="Head",
            third_dimension_name="Query input",
            caption=f"L{self.layer}H{self.head} at destination "
            f"{self.position}: most active neurons (source tokens) per query",
        )


@dataclass(frozen=True)
class Exactness(viz.Result):
    """Max abs errors per destination of the explicit MLP against the model's own activations."""

    layer: int
    head: int
    architecture: str
    positions: tuple[int, ...]
    output_error: Float[Tensor, " n"]
    pattern_error: Float[Tensor, " n"]

    def __repr__(self) -> str:
        """Short: the head, how many destinations, and the two largest errors (not the tensors)."""
        return (
            f"Exactness({self.architecture}, L{self.layer}H{self.head}, "
            f"destinations={len(self.positions)}, "
            f"output_error {list(self.output_error.shape)} max {self.max_output_error:.3g}, "
            f"pattern_error {list(self.pattern_error.shape)} max {self.max_pattern_error:.3g})"
        )

    @property
    def max_output_error(self) -> float:
        return float(self.output_error.max()) if len(self.positions) else 0.0

    @property
    def max_pattern_error(self) -> float:
        return float(self.pattern_error.max()) if len(self.positions) else 0.0

    def to_dataframe(self) -> pd.DataFrame:
        return pd.DataFrame(
            {
                "architecture": self.architecture,
                "layer": self.layer,
                "head_index": self.head,
                "position": list(self.positions),
                "output_error": self.output_error.tolist(),
                "pattern_error": self.pattern_error.tolist(),
            }
        )
