"""The contextual MLP as pure tensor functions (no model, no hooks; docs/math.md §3.1).

At destination ``T`` a head is ``g(x) = sum_i a_i act(b_i . x + c_i) / Z(x)`` with hidden
neurons = allowed source positions ``i``:

- ``a_i = v_i W_O`` (outgoing, ``[d_model]``),
- ``b_i = c W_Q k_i'`` (incoming, ``[d_model]``) with ``k_i' = R_T^T k_i`` the scored key in the
  query's (unrotated) frame,
- ``c_i = c <b_Q, k_i'> + p_iT`` (bias; ``p`` the ALiBi position bias),
- ``act(u) = exp(cap tanh(u / cap))`` (``exp(u)`` without soft-cap), normalised over the neurons,
- with a learned sink (GPT-OSS), one more neuron: pre-activation ``sink_h``, no incoming
  weight, outgoing weight zero; its activation is the mass the sink absorbs (``with_sink``).

``b_i . x + c_i = c <x W_Q + b_Q, k_i'> + p_iT``, so the pre-activations of many query inputs are
computed through the ``d_head``-dimensional query without ever forming ``b`` (``[n_src, d_model]``);
``incoming_weights`` forms it when asked.
"""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor


def incoming_weights(
    W_Q: Float[Tensor, "d_model d_head"],
    b_Q: Float[Tensor, " d_head"],
    keys: Float[Tensor, "src d_head"],
    scale: float,
    bias: Float[Tensor, " src"] | None = None,
) -> tuple[Float[Tensor, "src d_model"], Float[Tensor, " src"]]:
    """Incoming weights ``b_i = c W_Q k_i'`` and biases ``c_i = c <b_Q, k_i'> + p_i``.

    ``keys`` are already in the query's frame. Example:
        >>> W_Q, keys = torch.eye(3, 2), torch.tensor([[1.0, 0.0], [0.0, 2.0]])
        >>> b, c = incoming_weights(W_Q, torch.zeros(2), keys, scale=0.5)
        >>> b.tolist(), c.tolist()
        ([[0.5, 0.0, 0.0], [0.0, 1.0, 0.0]], [0.0, 0.0])
    """
    b = scale * keys @ W_Q.T
    c = scale * keys @ b_Q
    return b, c if bias is None else c + bias


def preactivations(
    queries: Float[Tensor, "n d_head"],
    keys: Float[Tensor, "src d_head"],
    scale: float,
    bias: Float[Tensor, " src"] | None = None,
) -> Float[Tensor, "n src"]:
    """``b_i . x + c_i`` for queries ``x W_Q + b_Q`` (unrotated) and keys in the query's frame."""
    pre = scale * queries @ keys.T
    return pre if bias is None else pre + bias


def activate(pre: Float[Tensor, "n src"], softcap: float | None) -> Float[Tensor, "n src"]:
    """The log of the activation: ``cap tanh(u / cap)`` (soft-capped) or ``u``."""
    return pre if softcap is None else softcap * torch.tanh(pre / softcap)


def hidden(
    pre: Float[Tensor, "n src"], softcap: float | None, sink: float | None = None
) -> Float[Tensor, "n src"]:
    """Normalised hidden activations ``act(u_i) / sum_j act(u_j)`` (a softmax of the capped u).
    With a learned ``sink`` logit the sink neuron joins the normalisation (``with_sink``)."""
    if sink is None:
        return torch.softmax(activate(pre, softcap), dim=-1)
    return with_sink(pre, softcap, sink)[..., :-1]


def with_sink(
    pre: Float[Tensor, "n src"], softcap: float | None, sink: float
) -> Float[Tensor, "n src_plus_1"]:
    """The activations of the source neurons and, last, of the learned-sink neuron: its
    pre-activation is the sink logit itself (no incoming weight, not soft-capped, as the model
    adds it after the cap) and its outgoing weight is zero (docs/math.md §3.7).

    Example:
        >>> with_sink(torch.zeros(1, 3), None, 0.0).tolist()
        [[0.25, 0.25, 0.25, 0.25]]
    """
    act = activate(pre, softcap)
    column = torch.full((*act.shape[:-1], 1), float(sink), dtype=act.dtype, device=act.device)
    return torch.softmax(torch.cat([act, column], dim=-1), dim=-1)


def output(
    activations: Float[Tensor, "n src"], outgoing: Float[Tensor, "src d_model"]
) -> Float[Tensor, "n d_model"]:
    """``g(x) = sum_i a_i h_i(x)``."""
    return activations @ outgoing


def importance(
    activations: Float[Tensor, "... src"], outgoing: Float[Tensor, "src d_model"]
) -> Float[Tensor, "... src"]:
    """Neuron importance ``h_i |a_i|``: how much of the output's length neuron ``i`` can carry."""
    return activations * outgoing.norm(dim=-1)


def naive_mlp(
    x: Float[Tensor, " d_model"],
    a: Float[Tensor, "src d_model"],
    b: Float[Tensor, "src d_model"],
    c: Float[Tensor, " src"],
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Reference evaluation, one neuron at a time (for tests and teaching; slow).

    Returns ``(g(x) [d_model], activations [src])``.
    """
    acts = []
    for i in range(a.shape[0]):
        u = float(b[i] @ x + c[i])
        if softcap is not None:
            u = softcap * float(torch.tanh(torch.tensor(u / softcap)))
        acts.append(torch.exp(torch.tensor(u, dtype=torch.float64)))
    total = sum(acts)
    h = torch.stack([act / total for act in acts]).float()
    out = torch.zeros(a.shape[1])
    for i in range(a.shape[0]):
        out = out + h[i] * a[i]
    return out, h
