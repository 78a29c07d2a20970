"""Views of contextual MLPs (neurons = source tokens), built from plain data (token strings,
tensors, tables) with ``tl_dynamics.viz`` components only. Results compute what is shown and
call these; nothing here imports a result, so there is no import circle."""

from __future__ import annotations

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from tl_dynamics import viz
from tl_dynamics.contextual_mlp._results import LEARNED_SINK


def mlp_view(
    name: str,
    tokens: list[str],
    pattern: Float[Tensor, "dest src"],
    sink: Float[Tensor, " dest"] | None = None,
) -> viz.Group:
    """Every destination's hidden activations (``text_neuron_activations``) and the destinations
    where each neuron fires most (``topk_tokens``) of one head ``name`` on one prompt; ``sink``,
    where the layer has learned sinks, is the learned-sink neuron's activation (one more
    neuron, last)."""
    labels = [f"{i}: {tok}" for i, tok in enumerate(tokens)]
    if sink is not None:
        pattern = torch.cat([pattern, sink[:, None].to(pattern)], dim=-1)
        labels.append(LEARNED_SINK)
    per_token = viz.text_neuron_activations(
        tokens,
        pattern[:, None, :],
        first_dimension_name="Head",
        second_dimension_name="Neuron (source token)",
        first_dimension_labels=[name],
        second_dimension_labels=labels,
        caption=f"{name} as a contextual MLP: hover a destination token to see its hidden "
        "activations; pick a neuron (a source token) to see where it fires",
    )
    per_neuron = viz.topk_tokens(
        [tokens],
        [pattern[None]],
        first_dimension_name="Head",
        third_dimension_name="Neuron (source token)",
        caption=f"{name}: destinations where each neuron is most active",
    )
    return viz.group(per_token, per_neuron)


def destination_view(
    name: str,
    tokens: list[str],
    position: int,
    importance: Float[Tensor, " pos"],
    neurons: pd.DataFrame,
) -> viz.Group:
    """One destination's neurons: importance per source token, and the neurons' table."""
    return viz.group(
        viz.colored_tokens(
            tokens,
            importance,
            caption=f"{name} at destination {position}: neuron importance "
            "activation x |a_i| per source token",
        ),
        viz.table(
            neurons.sort_values("importance", ascending=False),
            caption=f"{name} at destination {position}: its neurons",
        ),
    )


def heads_view(
    focus: list[viz.Group], exactness: pd.DataFrame | None, layers: list[int], architecture: str
) -> viz.Group:
    """The focus head's views, then (where references were kept) the table of every head's
    largest error against the model's own head output and pattern."""
    items = [c for group in focus for c in group.components]
    if exactness is not None:
        where = ", ".join(str(layer) for layer in layers)
        items.append(
            viz.table(
                exactness,
                caption=f"layer {where}: the explicit MLP at the real "
                "query input against the model's own head "
                "output and pattern (max abs error over "
                "destinations)",
            )
        )
    return viz.group(*items, caption=f"Contextual MLPs of {architecture}")
