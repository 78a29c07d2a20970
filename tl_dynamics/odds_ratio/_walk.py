"""Model-facing Markov-chain views: one head's chain, and patterns composed through depth."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from tl_dynamics.adapter import Batch, ModelAdapter, Prompt
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.odds_ratio._markov import DAMPING, ChainSummary, chain_summary, compose

# Why a layer with learned sinks has no chain on its positions (docs/math.md §2.4): the mass its
# sink absorbs leaves the positions, so the pattern is not row-stochastic.
NOT_A_CHAIN = "{} (a Markov chain on positions needs rows that sum to 1)"


def _batch_row(adapter: Any, prompt: Prompt | Batch, row: int) -> tuple[Batch, list[int]]:
    batch = adapter.tokenize(prompt)
    if not 0 <= row < batch.tokens.shape[0]:
        raise TLDynamicsError(
            f"row {row!r} is out of range: the batch has {batch.tokens.shape[0]} "
            f"prompts (valid: 0..{batch.tokens.shape[0] - 1})"
        )
    return batch, torch.nonzero(batch.key_valid[row]).flatten().tolist()


def markov(
    model: Any, prompt: Prompt | Batch, layer: int, head: int, row: int = 0, alpha: float = DAMPING
) -> ChainSummary:
    """One head's pattern on one prompt as a Markov chain on its real positions.

    Causal heads absorb at the first position (``absorption_steps``: expected steps to reach it);
    bidirectional heads have a stationary distribution. Eigenvalues, singular values, effective
    rank and row entropy describe the walk either way.

    Args:
        model: a TransformerLens model or a ``ModelAdapter``.
        prompt: text, a list of texts, ``[batch, pos]`` token ids or a ``Batch``.
        layer: the head's layer.
        head: the head's index.
        row: which prompt of the batch.
        alpha: damping of the damped stationary distribution (PageRank style).

    Returns:
        ``ChainSummary``: ``stationary`` and ``damped_stationary`` ``[pos]``,
        ``absorption_steps`` ``[pos]`` (causal only, else None), ``eigenvalues``,
        ``singular_values`` and the tokens.

    Example:
        >>> from tl_dynamics import odds_ratio, testing
        >>> chain = odds_ratio.markov(testing.tiny_model("bert"), "a b c", 0, 1)
        >>> round(float(chain.stationary.sum()), 6), chain.causal
        (1.0, False)
        >>> causal = odds_ratio.markov(testing.tiny_model("gpt2"), "a b c", 0, 1)
        >>> causal.stationary.tolist(), float(causal.absorption_steps[0])
        ([1.0, 0.0, 0.0, 0.0], 0.0)
    """

    adapter = ModelAdapter.of(model)
    adapter.check_layer(layer)
    adapter.check_head(head, layer)
    batch, real = _batch_row(adapter, prompt, row)
    la = adapter.attention(batch, layers=[layer], sinks=True)[layer]
    la.require_no_sinks(NOT_A_CHAIN.format("odds_ratio.markov"))
    S = la.pattern([head])[row, 0][real][:, real]
    tokens = adapter.str_tokens(batch, row)
    return chain_summary(S, layer, head, [tokens[i] for i in real], alpha)


def composed(
    model: Any,
    prompt: Prompt | Batch,
    layers: Sequence[int] | None = None,
    heads: Mapping[int, int] | None = None,
    residual: float | None = None,
    row: int = 0,
) -> Float[Tensor, "pos pos"]:
    """Patterns composed through ``layers`` (first first) on the real positions of one prompt.

    Each layer contributes one head (``heads[layer]``) or, by default, the mean over its heads
    (as attention rollout does). ``residual=0.5`` gives attention rollout (Abnar & Zuidema
    2020); ``None`` the plain product.

    Args:
        model: a TransformerLens model or a ``ModelAdapter``.
        prompt: text, a list of texts, ``[batch, pos]`` token ids or a ``Batch``.
        layers: the attention layers to compose (None: all).
        heads: ``{layer: head}`` for layers that contribute one head (others: the head mean).
        residual: weight of the identity mixed into each layer's pattern, in ``[0, 1]``, or None.
        row: which prompt of the batch.

    Returns:
        The composed row-stochastic pattern ``[pos, pos]`` over the prompt's real positions.

    Example:
        >>> from tl_dynamics import odds_ratio, testing
        >>> rollout = odds_ratio.composed(testing.tiny_model("gpt2"), "a b c", residual=0.5)
        >>> rollout.shape, [round(x, 6) for x in rollout.sum(-1).tolist()]
        (torch.Size([4, 4]), [1.0, 1.0, 1.0, 1.0])
    """

    adapter = ModelAdapter.of(model)
    layers = adapter.check_attention_layers(layers)
    heads = dict(heads or {})
    for layer, head in heads.items():
        adapter.check_layer(layer)
        adapter.check_head(head, layer)
    batch, real = _batch_row(adapter, prompt, row)
    patterns: dict[int, Tensor] = {}

    def keep(la: Any) -> None:
        la.require_no_sinks(NOT_A_CHAIN.format("odds_ratio.composed"))
        full = la.pattern([heads[la.layer]] if la.layer in heads else None)[row]
        patterns[la.layer] = full.mean(0)[real][:, real]

    with adapter.capture(keep, layers, batch=batch, sinks=True):
        adapter.forward(batch)
    return compose([patterns[layer] for layer in sorted(layers)], residual)
