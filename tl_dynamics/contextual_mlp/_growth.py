"""How a head's contextual MLP grows during generation: one neuron per new token (docs/math.md §3.6).

In a causal model the MLP at destination ``T`` of the full generated sequence is exactly the MLP
the model used at generation step ``T``, so one forward pass over the generated text gives every
step. At each step: how many neurons there are, how many come from generated tokens, the share of
attention they take, and the share of the output they carry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from tl_dynamics import viz
from tl_dynamics.adapter import ModelAdapter, Prompt
from tl_dynamics.contextual_mlp._collect import compute
from tl_dynamics.contextual_mlp._mlp import ContextualMLP
from tl_dynamics.errors import TLDynamicsError

PROGRESS_MIN = 32  # show a progress bar from this many generated tokens on


@dataclass(frozen=True)
class Growth(viz.Result):
    """Per generation step (destination ``positions[s]``), the neurons gained since the prompt.

    ``new_output_share`` is ``<g_new, g> / |g|^2`` with ``g = g_old + g_new`` the head output split
    by neuron age (the old and new shares sum to 1); ``new_importance_share`` is the new neurons'
    share of ``sum_i activation_i |a_i|``; ``new_attention`` their total activation.
    """

    layer: int
    head: int
    prompt_length: int
    str_tokens: tuple[str, ...]
    positions: tuple[int, ...]
    n_neurons: Int[Tensor, " step"]
    n_new: Int[Tensor, " step"]
    new_attention: Float[Tensor, " step"]
    new_importance_share: Float[Tensor, " step"]
    new_output_share: Float[Tensor, " step"]
    winners: Int[Tensor, " step"]

    def to_dataframe(self) -> pd.DataFrame:
        return pd.DataFrame(
            {
                "position": list(self.positions),
                "token": [self.str_tokens[p] for p in self.positions],
                "n_neurons": self.n_neurons.tolist(),
                "n_new": self.n_new.tolist(),
                "new_attention": self.new_attention.tolist(),
                "new_importance_share": self.new_importance_share.tolist(),
                "new_output_share": self.new_output_share.tolist(),
                "winner": self.winners.tolist(),
                "winner_token": [self.str_tokens[w] for w in self.winners.tolist()],
            }
        )

    def show(self) -> viz.Component:
        """The text, each destination (generation step) coloured by the new neurons' shares and
        the neuron count (``colored_tokens_multi``: pick the value to colour by)."""
        values = torch.zeros(len(self.str_tokens), 4)
        rows = torch.tensor(self.positions)
        values[rows] = torch.stack(
            [
                self.new_attention,
                self.new_importance_share,
                self.new_output_share,
                self.n_neurons.float(),
            ],
            dim=-1,
        )
        return viz.colored_tokens_multi(
            list(self.str_tokens),
            values,
            labels=[
                "attention on new neurons",
                "importance share (new)",
                "output share (new)",
                "neurons",
            ],
            caption=f"L{self.layer}H{self.head}: the contextual MLP grows by one neuron per "
            f"generated token (prompt: the first {self.prompt_length} tokens)",
        )


def growth(mlp: ContextualMLP, prompt_length: int) -> Growth:
    """Growth statistics of ``mlp`` for destinations ``prompt_length - 1`` onwards, counting
    neurons at positions ``>= prompt_length`` as generated.

    Example:
        >>> from tl_dynamics import contextual_mlp, testing
        >>> mlp = contextual_mlp.compute(testing.tiny_model("gpt2"), "a = b + c", layers=0, heads=0)[0, 0]
        >>> g = growth(mlp, prompt_length=3)
        >>> g.n_new[:3].tolist()
        [0, 1, 2]
    """
    if (
        isinstance(prompt_length, bool)
        or not isinstance(prompt_length, int)
        or not 1 <= prompt_length <= mlp.n_pos
    ):
        raise TLDynamicsError(
            f"prompt_length must be an int in 1..{mlp.n_pos} (the MLP's "
            f"positions), got {prompt_length!r}"
        )
    if not bool(mlp.allowed.tril().eq(mlp.allowed).all()):
        raise TLDynamicsError(
            "generation growth needs a causal head: this one attends to later "
            "positions (an encoder), so its MLP does not grow token by token"
        )
    positions = [p for p in mlp.positions if p >= prompt_length - 1]
    stats: dict[str, list] = {k: [] for k in ("n", "new", "attn", "imp", "out", "win")}
    for pos in positions:
        src = mlp.sources(pos)
        h = mlp.activations(pos)
        a = mlp.outgoing[src]
        new = src >= prompt_length
        g = h @ a
        g_new = h[new] @ a[new]
        imp = h * a.norm(dim=-1)
        stats["n"].append(len(src))
        stats["new"].append(int(new.sum()))
        stats["attn"].append(float(h[new].sum()))
        stats["imp"].append(float(imp[new].sum() / imp.sum().clamp_min(1e-30)))
        stats["out"].append(float(g_new @ g / (g @ g).clamp_min(1e-30)))
        stats["win"].append(int(src[h.argmax()]))
    return Growth(
        layer=mlp.layer,
        head=mlp.head,
        prompt_length=prompt_length,
        str_tokens=mlp.str_tokens,
        positions=tuple(positions),
        n_neurons=torch.tensor(stats["n"]),
        n_new=torch.tensor(stats["new"]),
        new_attention=torch.tensor(stats["attn"]),
        new_importance_share=torch.tensor(stats["imp"]),
        new_output_share=torch.tensor(stats["out"]),
        winners=torch.tensor(stats["win"]),
    )


def generate_growth(
    model: Any, prompt: Prompt, layer: int, head: int, max_new_tokens: int = 16
) -> Growth:
    """Generate greedily from ``prompt`` (one row), then measure the MLP's growth per step.

    Each generated token adds a neuron (a source) to the head's contextual MLP at every later
    destination; the result says how many, and how much attention, importance and output the new
    ones take.

    Args:
        model: a TransformerLens decoder or a ``ModelAdapter``.
        prompt: one prompt (text, ``[1, pos]`` token ids or a one-row ``Batch``).
        layer: the head's layer.
        head: the head's index.
        max_new_tokens: tokens to generate (the context must hold them).

    Returns:
        ``Growth``: per destination from the prompt's last token on, ``n_neurons``, ``n_new``,
        ``new_attention``, ``new_importance_share``, ``new_output_share`` and ``winners``
        (each ``[positions]``).

    Example:
        >>> from tl_dynamics import contextual_mlp, testing
        >>> g = contextual_mlp.generate_growth(testing.tiny_model("gpt2"), "a = b", 1, 0,
        ...                                    max_new_tokens=3)
        >>> g.prompt_length, g.n_new.tolist()  # one new neuron per generated token
        (4, [0, 1, 2, 3])
    """
    adapter = ModelAdapter.of(model)
    adapter.check_layer(layer)
    adapter.check_head(head, layer)
    if adapter.is_encoder:
        raise TLDynamicsError(
            f"generation growth needs a causal decoder; {adapter.info.architecture} is an encoder"
        )
    batch = adapter.tokenize(prompt)
    if batch.tokens.shape[0] != 1:
        raise TLDynamicsError(f"generate_growth takes one prompt, got {batch.tokens.shape[0]} rows")
    tokens = batch.tokens
    prompt_length = tokens.shape[1]
    if (
        isinstance(max_new_tokens, bool)
        or not isinstance(max_new_tokens, int)
        or not 1 <= max_new_tokens <= adapter.n_ctx - prompt_length
    ):
        raise TLDynamicsError(
            f"max_new_tokens must be in 1..{adapter.n_ctx - prompt_length} (the "
            f"context is {adapter.n_ctx} tokens, the prompt {prompt_length}), "
            f"got {max_new_tokens!r}"
        )
    for _ in tqdm(
        range(max_new_tokens), disable=max_new_tokens < PROGRESS_MIN, desc="generating", leave=False
    ):
        logits = adapter.forward(adapter.tokenize(tokens))
        tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True).to(tokens.dtype)], dim=1)
    mlp = compute(adapter, tokens, layers=layer, heads=head)[layer, head]
    return growth(mlp, prompt_length)
