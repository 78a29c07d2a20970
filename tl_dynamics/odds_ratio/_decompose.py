"""``decompose_layer``: the exact split of one captured layer into its score parts and
counterfactual patterns, kept per prompt (docs/math.md §2.1)."""

from __future__ import annotations

from typing import Sequence

import torch

from tl_dynamics.adapter import LayerAttention
from tl_dynamics.odds_ratio._result import Decomposition
from tl_dynamics.odds_ratio._split import counterfactual_patterns, split_scores


def decompose_layer(
    la: LayerAttention,
    heads: Sequence[int],
    model: str = "",
    tokens: torch.Tensor | None = None,
    str_tokens: Sequence[Sequence[str]] = (),
    dtype: torch.dtype = torch.float32,
) -> Decomposition:
    """The exact split of one captured layer (from ``ModelAdapter.capture``/``attention``).

    Example:
        >>> from tl_dynamics import testing
        >>> from tl_dynamics.adapter import ModelAdapter
        >>> la = ModelAdapter(testing.tiny_model("gpt2")).attention("a b")[0]
        >>> dec = decompose_layer(la, heads=[0, 1])
        >>> dec.parts.total().shape
        torch.Size([1, 2, 3, 3])
    """
    heads = list(heads)
    parts = split_scores(
        la.q[:, :, heads],
        la.k[:, :, heads],
        la.scale,
        la.bias(heads),
        dtype,
        sink=None if la.sink_logit is None else la.sink_logit[heads],
    )
    prior_p, lik_p = counterfactual_patterns(parts, la.allowed)
    if tokens is None:
        tokens = torch.zeros(la.q.shape[:2], dtype=torch.long, device=la.q.device)
    return Decomposition(
        model=model,
        layer=la.layer,
        heads=tuple(heads),
        tokens=tokens,
        str_tokens=tuple(tuple(t) for t in str_tokens),
        parts=parts,
        pattern=la.pattern(heads),
        prior_pattern=prior_p,
        likelihood_pattern=lik_p,
        allowed=la.allowed,
        query_valid=la.query_valid,
        softcap=la.softcap,
    )
