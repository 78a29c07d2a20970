"""The one masked softmax: softmax over the keys a query may attend to (docs/math.md §1)."""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float
from torch import Tensor


def masked_log_softmax(
    logits: Float[Tensor, "batch head q k"], allowed: Bool[Tensor, "batch q k"]
) -> Float[Tensor, "batch head q k"]:
    """Log-softmax over allowed keys; disallowed entries and rows with no allowed key are ``-inf``.

    Example:
        >>> import torch
        >>> allowed = torch.tensor([[[True, False], [True, True]]])
        >>> masked_log_softmax(torch.zeros(1, 1, 2, 2), allowed).exp()
        tensor([[[[1.0000, 0.0000],
                  [0.5000, 0.5000]]]])
    """
    masked = logits.masked_fill(~allowed[:, None], float("-inf"))
    lse = torch.logsumexp(masked, dim=-1, keepdim=True)
    return masked - lse.masked_fill(torch.isinf(lse), 0.0)


def masked_softmax(
    logits: Float[Tensor, "batch head q k"],
    allowed: Bool[Tensor, "batch q k"],
    sink: Float[Tensor, " head"] | None = None,
) -> Float[Tensor, "batch head q k"]:
    """Softmax over allowed keys; zero elsewhere and on rows with no allowed key (pad queries).

    The same arithmetic as the model's own softmax (``torch.softmax`` over the row with disallowed
    entries at ``-inf``), so recomputed patterns match the host to float rounding. With learned
    per-head ``sink`` logits (GPT-OSS) the sink joins every row's denominator,
    ``p_ij = exp(s_ij) / (sum_j exp(s_ij) + exp(sink_h))``, and is then dropped: rows sum to less
    than 1.

    Args:
        logits: Scores, ``[batch, head, q, k]``.
        allowed: Which keys each query may attend to, ``[batch, q, k]``.
        sink: Learned sink logits, ``[head]``, or None.

    Returns:
        The weights, ``[batch, head, q, k]``.

    Example:
        >>> import torch
        >>> allowed = torch.tensor([[[True, False], [False, False]]])
        >>> masked_softmax(torch.zeros(1, 1, 2, 2), allowed)
        tensor([[[[1., 0.],
                  [0., 0.]]]])
        >>> masked_softmax(torch.zeros(1, 1, 2, 2), allowed, sink=torch.zeros(1))
        tensor([[[[0.5000, 0.0000],
                  [0.0000, 0.0000]]]])
    """
    allowed = allowed[:, None]
    masked = logits.masked_fill(~allowed, float("-inf"))
    empty = ~allowed.any(-1, keepdim=True)
    masked = masked.masked_fill(empty, 0.0)
    if sink is None:
        return torch.softmax(masked, dim=-1).masked_fill(~allowed, 0.0)
    column = sink.to(masked)[None, :, None, None].expand(*masked.shape[:-1], 1)
    weights = torch.softmax(torch.cat([masked, column], dim=-1), dim=-1)[..., :-1]
    return weights.masked_fill(~allowed, 0.0)
