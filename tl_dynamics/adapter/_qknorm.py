"""The query normalisation of qk-norm architectures (Gemma 3, OLMo 2), as plain tensors.

These models normalise the query after its projection, before rotary: per head over
``d_head`` (Gemma 3, gain ``1 + w``) or over all heads together (OLMo 2, gain ``w`` over
``n_heads * d_head``). The query is then not a linear function of the layer input, so analyses
that read it as one need this map. ``ModelAdapter.query_norm(layer)`` reads it from the model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch
from jaxtyping import Float
from torch import Tensor

from tl_dynamics.errors import TLDynamicsError

Scope = Literal["head", "all", "latent"]


@dataclass(frozen=True)
class QueryNorm:
    """RMS normalisation of the projected query: ``y / sqrt(mean(y^2) + eps) * (offset + weight)``.

    ``scope == "head"``: the mean runs over each head's ``d_head`` entries and ``weight`` is
    ``[d_head]``. ``scope == "all"``: it runs over all heads' ``n_heads * d_head`` entries
    (``weight`` is ``[n_heads * d_head]``), so a head's normalised query depends on every head's
    projection: ``W_Q``/``b_Q`` (``[n_heads, d_model, d_head]``/``[n_heads, d_head]``) are kept.
    ``scope == "latent"`` (multi-head latent attention): ``y / sqrt(mean(u^2) + eps)`` with
    ``u = x down + down_bias`` the query latent of the layer input ``x`` (its gain is folded into
    ``W_Q``), so the query is ``(x W_Q + b_Q) / rho_q(x)`` and ``weight`` is unused.

    Args:
        scope: ``"head"``, ``"all"`` or ``"latent"``.
        weight: The gain, ``[d_head]`` (``[head, d_head]`` for one norm per head) or
            ``[n_heads * d_head]``.
        eps: The epsilon inside the square root.
        offset: Added to ``weight`` (1 for Gemma's ``1 + w`` gains).
        W_Q: All heads' query weights, ``[head, d_model, d_head]`` (scope ``"all"``).
        b_Q: All heads' query biases, ``[head, d_head]`` (scope ``"all"``).
        center: Subtract the mean first (a LayerNorm rather than an RMSNorm).
        bias: The LayerNorm's shift, shaped like ``weight``.
        down: The query down-projection ``[d_model, r]`` (scope ``"latent"``).
        down_bias: Its bias, ``[r]``.

    Example:
        >>> norm = QueryNorm("head", torch.zeros(2), eps=0.0, offset=1.0)
        >>> [round(v, 4) for v in norm.apply(torch.tensor([[3.0, 4.0]]), head=0)[0].tolist()]  # y / rms(y)
        [0.8485, 1.1314]
    """

    scope: Scope
    weight: Float[Tensor, " n"]
    eps: float
    offset: float = 0.0
    W_Q: Float[Tensor, "head d_model d_head"] | None = None
    b_Q: Float[Tensor, "head d_head"] | None = None
    center: bool = False  # a LayerNorm (mean subtracted first) rather than an RMSNorm
    bias: Float[Tensor, "..."] | None = None  # the LayerNorm's shift, shaped like ``weight``
    down: Float[Tensor, "d_model r"] | None = None  # scope "latent": the query down-projection
    down_bias: Float[Tensor, " r"] | None = None

    def apply_heads(
        self, y: Float[Tensor, "... head d_head"], x: Float[Tensor, "... d_model"] | None = None
    ) -> Float[Tensor, "... head d_head"]:
        """Normalise every head's projected query at once (``y = x W_Q + b_Q`` for all heads).

        The layer inputs ``x`` are needed with ``scope == "latent"``.

        Args:
            y: Projected queries, ``[..., head, d_head]``.
            x: The layer inputs, ``[..., d_model]`` (scope ``"latent"`` only).

        Returns:
            The normalised queries, ``[..., head, d_head]``.

        Example:
            >>> norm = QueryNorm("head", torch.zeros(2), eps=0.0, offset=1.0)
            >>> norm.apply_heads(torch.tensor([[[3.0, 4.0], [1.0, 1.0]]]))
            tensor([[[0.8485, 1.1314],
                     [1.0000, 1.0000]]])
        """
        if self.scope == "latent":
            return y / self._latent_rms(x, y)[..., None, None]
        dims = (-1,) if self.scope == "head" else (-2, -1)
        if self.center:
            y = y - y.mean(dims, keepdim=True)
        ms = y.pow(2).mean(dims, keepdim=True)
        gain = self.offset + (
            self.weight if self.scope == "head" else self.weight.reshape(y.shape[-2:])
        )
        out = y * torch.rsqrt(ms + self.eps) * gain.to(y.dtype)
        if self.bias is not None:
            out = out + (self.bias if self.scope == "head" else self.bias.reshape(y.shape[-2:])).to(
                y.dtype
            )
        return out

    def apply(
        self, y: Float[Tensor, "n d_head"], head: int, x: Float[Tensor, "n d_model"] | None = None
    ) -> Float[Tensor, "n d_head"]:
        """Normalise head ``head``'s projected queries ``y = x W_Q[head] + b_Q[head]``.

        Computed in ``y``'s dtype.

        Args:
            y: The head's projected queries, ``[n, d_head]``.
            head: The head.
            x: The layer inputs, ``[n, d_model]``; needed with ``scope == "all"`` (the other heads'
                projections enter the mean).

        Returns:
            The normalised queries, ``[n, d_head]``.

        Example:
            >>> norm = QueryNorm("head", torch.ones(2), eps=0.0)
            >>> norm.apply(torch.tensor([[2.0, 2.0]]), head=0)
            tensor([[1., 1.]])
        """
        if self.scope == "head" and self.weight.ndim == 2:  # one norm per head (StableLM)
            own = dataclasses.replace(
                self, weight=self.weight[head], bias=None if self.bias is None else self.bias[head]
            )
            return own.apply_heads(y[:, None])[:, 0]
        if self.scope == "head":
            return self.apply_heads(y[:, None])[:, 0]
        if self.scope == "latent":
            return y / self._latent_rms(x, y)[..., None]
        if x is None:
            raise TLDynamicsError(
                "QueryNorm(scope='all') needs the layer inputs x: the other "
                "heads' projections enter the mean"
            )
        if self.W_Q is None or self.b_Q is None:
            raise TLDynamicsError(
                "QueryNorm(scope='all') was built without the layer's W_Q and b_Q"
            )
        ys = torch.einsum("nm,hmd->nhd", x.to(y.dtype), self.W_Q.to(y.dtype)) + self.b_Q.to(y.dtype)
        return self.apply_heads(ys)[:, head]

    def _latent_rms(self, x: Tensor | None, y: Tensor) -> Tensor:
        if x is None or self.down is None or self.down_bias is None:
            raise TLDynamicsError(
                "QueryNorm(scope='latent') needs the layer inputs x and its "
                "down-projection: the query's scale is the RMS of x's latent"
            )
        u = x.to(y.dtype) @ self.down.to(y) + self.down_bias.to(y)
        return torch.sqrt(u.pow(2).mean(-1) + self.eps)


def read_query_norm(
    attn: Any,
    where: str,
    gemma_gain: bool,
    n_heads: int,
    d_head: int,
    W_Q: Tensor | None,
    b_Q: Tensor | None,
) -> QueryNorm:
    """The ``QueryNorm`` of one attention module (a HookedTransformer ``attn`` or a bridge's
    ``attn``, whose Hugging Face module and norm wrapper are looked through). ``gemma_gain``:
    the norm multiplies by ``1 + w`` (Gemma's Hugging Face RMSNorm). ``where`` names the layer
    in errors; ``W_Q``/``b_Q`` (all heads) are kept for an all-heads norm."""
    hf_attn = getattr(attn, "original_component", attn)
    per_head = getattr(hf_attn, "q_layernorm", None)  # StableLM qk_layernorm: a LayerNorm per head
    if per_head is not None and hasattr(per_head, "norms"):
        norms = list(per_head.norms)
        weight = torch.stack([n.weight.detach().float() for n in norms])
        biases = [n.bias for n in norms]
        bias = None if biases[0] is None else torch.stack([b.detach().float() for b in biases])
        return QueryNorm("head", weight, float(norms[0].eps), 0.0, center=True, bias=bias)
    module = per_head if per_head is not None else getattr(hf_attn, "q_norm", None)
    if module is None:  # HunYuan's query_layernorm (normalised before rotary on TL 3.x)
        module = getattr(hf_attn, "query_layernorm", None)
    # weightless RMS norms: Llama 4's one qk_norm for q and k, NanoChat's q_norm
    shared = module if module is not None else getattr(hf_attn, "qk_norm", None)
    shared = getattr(shared, "original_component", None) or shared  # a bridge wrapper: its module
    weightless = getattr(shared, "weight", getattr(shared, "w", None)) is None
    if shared is not None and weightless and hasattr(shared, "eps"):
        return _matching(
            [QueryNorm("head", torch.ones(d_head), float(shared.eps), 0.0)],
            shared,
            torch.float32,
            n_heads,
            d_head,
            where,
        )
    if module is None:
        raise TLDynamicsError(
            f"{where}: its attention module {type(hf_attn).__name__} has no "
            "q_norm/q_layernorm to read"
        )
    inner = getattr(module, "original_component", None) or module  # bridge wrapper
    weight = getattr(inner, "weight", getattr(inner, "w", None))
    eps = getattr(inner, "eps", getattr(inner, "variance_epsilon", None))
    if weight is None or eps is None:
        raise TLDynamicsError(
            f"{where}: cannot read its query norm ({type(inner).__name__}: no weight/eps)"
        )
    dtype, weight = weight.dtype, weight.detach().float().clone()
    if weight.numel() == n_heads * d_head and weight.ndim == 2:  # one norm per head (Cohere)
        weight = weight.reshape(n_heads, d_head)
        scope: Scope = "head"
    elif weight.numel() in (d_head, n_heads * d_head):
        scope = "head" if weight.numel() == d_head else "all"
    else:
        raise TLDynamicsError(
            f"{where}: query norm of size {weight.numel()} is neither d_head="
            f"{d_head} nor n_heads*d_head={n_heads * d_head}"
        )
    raw_bias = getattr(inner, "bias", None)
    bias = raw_bias.detach().float().reshape(weight.shape) if isinstance(raw_bias, Tensor) else None
    extra = (W_Q, b_Q) if scope == "all" else (None, None)
    offsets = (1.0, 0.0) if gemma_gain else (0.0, 1.0)
    candidates = [
        QueryNorm(scope, weight, float(eps), offset, *extra, center=center, bias=bias)
        for offset in offsets
        for center in (False, True)
    ]
    return _matching(candidates, inner, dtype, n_heads, d_head, where)


# Relative error within which a candidate reproduces the model's own norm module (float32
# reorders a few sums: ~1e-7; half precision rounds at ~1e-3).
_PROBE_RTOL = {torch.float32: 1e-4, torch.float64: 1e-4}


def _matching(
    candidates: list[QueryNorm],
    module: Any,
    dtype: torch.dtype,
    n_heads: int,
    d_head: int,
    where: str,
) -> QueryNorm:
    """The candidate (gain ``w`` or ``1 + w``; RMS or mean-centred) that reproduces ``module``
    on random projected queries, so a norm's convention is read from what it computes."""
    y = torch.randn(2, 3, n_heads, d_head, generator=torch.Generator().manual_seed(0))
    flat = candidates[0].scope == "all"
    try:
        with torch.no_grad():
            arg = (y.reshape(2, 3, n_heads * d_head) if flat else y).to(dtype)
            want = module(arg).float().reshape(y.shape)
    except Exception as exc:  # a norm module with another calling convention
        raise TLDynamicsError(
            f"{where}: cannot probe its query norm {type(module).__name__} "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    errors = []
    for candidate in candidates:
        err = float(
            (candidate.apply_heads(y) - want).abs().max() / want.abs().max().clamp_min(1e-30)
        )
        if err <= _PROBE_RTOL.get(dtype, 2e-2):
            return candidate
        errors.append(round(err, 4))
    raise TLDynamicsError(
        f"{where}: its query norm {type(module).__name__} is neither an RMS nor "
        f"a LayerNorm with gain w or 1 + w (relative errors {errors})"
    )
