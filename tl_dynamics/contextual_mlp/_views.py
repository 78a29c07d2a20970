"""Views (neurons = source tokens) and the report page section."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pandas as pd
import torch

from tl_dynamics import viz
from tl_dynamics.errors import TLDynamicsError

if TYPE_CHECKING:
    from tl_dynamics.adapter import Batch, ModelAdapter
    from tl_dynamics.contextual_mlp._mlp import ContextualMLP

REPORT_MAX_POSITIONS = 64  # the report section reads at most this many leading positions


def _neuron_labels(mlp: "ContextualMLP") -> list[str]:
    return [f"{i}: {tok}" for i, tok in enumerate(mlp.str_tokens)]


def show_mlp(mlp: "ContextualMLP", position: int | None = None):
    name = f"L{mlp.layer}H{mlp.head}"
    if position is None:
        pattern = mlp.pattern()  # [dest, src]: hidden activations at the real inputs
        per_token = viz.text_neuron_activations(
            list(mlp.str_tokens), pattern[:, None, :], first_dimension_name="Head",
            second_dimension_name="Neuron (source token)", first_dimension_labels=[name],
            second_dimension_labels=_neuron_labels(mlp),
            caption=f"{name} as a contextual MLP: hover a destination token to see its hidden "
                    "activations; pick a neuron (a source token) to see where it fires")
        per_neuron = viz.topk_tokens(
            [list(mlp.str_tokens)], [pattern[None]], first_dimension_name="Head",
            third_dimension_name="Neuron (source token)",
            caption=f"{name}: destinations where each neuron is most active")
        return viz.group(per_token, per_neuron)
    pos = mlp.check_position(position)
    neurons = mlp.neurons(pos)
    importance = torch.zeros(mlp.n_pos)
    importance[neurons.sources] = neurons.importance
    return viz.group(
        viz.colored_tokens(list(mlp.str_tokens), importance,
                           caption=f"{name} at destination {pos}: neuron importance "
                                   "activation x |a_i| per source token"),
        viz.table(neurons.to_dataframe().sort_values("importance", ascending=False),
                  caption=f"{name} at destination {pos}: its neurons"))


def _decisive(mlps: list["ContextualMLP"]) -> "ContextualMLP":
    """The head whose neurons win most clearly: highest mean top activation over destinations."""
    def score(m: "ContextualMLP") -> float:
        return float(m.pattern().max(dim=-1).values[m.query_valid].mean())
    return max(mlps, key=score)


def report_section(page: "viz.Page", adapter: "ModelAdapter", batch: "Batch") -> None:
    """Add the contextual-MLP section: the most decisive head of the last supported layer.

    Where the MLP cannot be built exactly (the weights would be wrong), the section says why
    instead of failing the whole report.
    """
    try:
        _report_section(page, adapter, batch)
    except TLDynamicsError as err:
        page.add_section("Attention as a contextual MLP", [viz.text(f"Not available: {err}")])


def _report_section(page: "viz.Page", adapter: "ModelAdapter", batch: "Batch") -> None:
    from tl_dynamics.contextual_mlp._build import compute_layer
    from tl_dynamics.contextual_mlp._readout import written_tokens

    title = "Attention as a contextual MLP"
    layer = adapter.n_layers - 1
    real = batch.tokens[0][batch.key_valid[0]][:REPORT_MAX_POSITIONS]  # row 0, unpadded
    row = adapter.tokenize(real[None])
    mlps = compute_layer(adapter, row, layer)
    mlp = _decisive(mlps)
    last = mlp.positions[-1]
    exact = pd.DataFrame([dict(head=m.head, output_error=m.exactness().max_output_error,
                               pattern_error=m.exactness().max_pattern_error) for m in mlps])
    items = [mlp.show(), mlp.show(last),
             viz.table(exact, caption=f"layer {layer}: the explicit MLP at the real query input "
                                      "against the model's own head output and pattern "
                                      "(max abs error over destinations)")]
    try:
        items.append(written_tokens(mlp, adapter, position=last, k=5).show())
    except TLDynamicsError as err:
        items.append(viz.text(f"What neurons write: not shown ({err})."))
    incoming = ("incoming weights b_i = c W_Q k_i" if mlp.input_space == "residual" else
                "incoming weights b_i = c k_i acting on the model's normalised query N(x W_Q + b_Q) "
                "(this architecture normalises q after its projection)")
    intro = (f"At each destination a head is a one-hidden-layer MLP whose neurons are the source "
             f"tokens: outgoing weights a_i = v_i W_O, {incoming}, biases "
             f"c_i, softmax activation. Shown: layer {layer}, head {mlp.head} (the head whose "
             f"neurons win most clearly), first row of the batch.")
    page.add_section(title, items, intro=intro)
