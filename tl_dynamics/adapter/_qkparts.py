"""Each residual part carried into a layer's queries or keys: the frozen input norm, ``W_Q``/``W_K``,
the frozen q/k norm where the layer has one (QK-norm), then rotary (docs/math.md §10.2).

A q/k norm before rotary, ``q_h = g_h (P y_h) / t_h + beta_h`` with ``y = x W_Q + b_Q`` the
projection, ``P`` the centring (LayerNorm) and ``t`` the RMS over each head's ``d_head`` entries
(Qwen3, StableLM, Cohere, a HookedTransformer with ``use_qk_norm``) or over all heads together
(OLMoE), is linear in ``y`` once ``t`` is frozen at the pass's own value per position (and head):
every part's projection is centred, scaled by ``g / t``, and the norm's shift joins the bias part.
A norm after rotary, a latent norm, or a centring over all heads is refused by name.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Sequence

import torch
from torch import Tensor

from tl_dynamics.adapter._frozennorm import InputNorm
from tl_dynamics.adapter._qknorm import QueryNorm, read_query_norm
from tl_dynamics.errors import TLDynamicsError

if TYPE_CHECKING:
    from tl_dynamics.adapter._model import ModelAdapter
    from tl_dynamics.adapter._residual import Residual


def side_norms(adapter: "ModelAdapter", layer: int) -> tuple[QueryNorm | None, QueryNorm | None]:
    """The query and key norms of ``layer`` (None, None where it has none), read from the model's
    own modules; refuses a norm that is not linear once its scale is frozen per head.

    Example:
        >>> from tl_dynamics import testing
        >>> from tl_dynamics.adapter import ModelAdapter
        >>> q, k = side_norms(ModelAdapter(testing.cached_model("stablelm-qk-layernorm")), 1)
        >>> q.scope, q.center, tuple(k.weight.shape)  # a LayerNorm per head
        ('head', True, (4, 16))
    """
    if not adapter.specs[layer].qk_norm:
        return None, None
    where = f"layer {layer} of {adapter.info.architecture}"
    q = adapter.query_norm(layer)  # refuses q/k normalised after rotary (_postrope)
    attn = adapter.model.blocks[layer].attn
    hf = getattr(attn, "original_component", attn)
    per_head, k_norm = getattr(hf, "k_layernorm", None), getattr(hf, "k_norm", None)
    if per_head is not None:  # StableLM: one LayerNorm per key head
        module = SimpleNamespace(q_layernorm=per_head)
    elif k_norm is not None:
        module = SimpleNamespace(q_norm=k_norm)
    else:
        raise TLDynamicsError(
            f"qk attribution: {where} normalises its queries but has no k_norm/k_layernorm to "
            "read, so its keys cannot be split exactly"
        )
    k = read_query_norm(
        module,
        f"{where} (key norm)",
        gemma_gain=False,
        n_heads=adapter.n_kv_heads,
        d_head=adapter.head_width(layer),
        W_Q=None,
        b_Q=None,
    )
    for side, norm in (("query", q), ("key", k)):
        if norm is None or norm.scope == "latent" or (norm.scope == "all" and norm.center):
            raise TLDynamicsError(
                f"qk attribution: the {side} norm of {where} is not a per-head or all-heads RMS "
                "or per-head LayerNorm before rotary; the exact split of its scores is not modelled"
            )
    return q, k


def _per_head(value: Tensor, norm: QueryNorm, shape: torch.Size, idx: list[int]) -> Tensor:
    """A norm's gain or shift for the chosen heads: ``[d]`` (shared by every head) or ``[head,
    d]``."""
    if norm.scope == "all" or value.ndim == 2:
        return value.reshape(shape)[idx]
    return value


def _frozen_side(norm: QueryNorm, parts: Tensor, total: Tensor, chosen: Sequence[int]) -> Tensor:
    """``parts`` ``[part + 1, b, pos, head, d]`` (last: the bias part) of the projections of the
    ``chosen`` heads (indices into ``total``'s ``[b, pos, all heads, d]``) through ``norm`` with its
    scale frozen at ``total``'s own value."""
    idx = list(chosen)
    dims = (-1,) if norm.scope == "head" else (-2, -1)
    y = total - total.mean(dims, keepdim=True) if norm.center else total
    t = torch.sqrt(y.pow(2).mean(dims, keepdim=True) + norm.eps)  # [b, pos, head or 1, 1]
    t = t[..., idx, :] if norm.scope == "head" else t
    gain = norm.offset + _per_head(norm.weight.to(parts), norm, total.shape[-2:], idx)
    if norm.center:  # per head (a centring over all heads is refused in side_norms)
        parts = parts - parts.mean(-1, keepdim=True)
    out = parts * (gain / t)
    if norm.bias is not None:
        out[-1] += _per_head(norm.bias.to(parts), norm, total.shape[-2:], idx)
    return out


def frozen_parts(
    adapter: "ModelAdapter",
    res: "Residual",
    norm: InputNorm,
    W: Tensor,
    b: Tensor,
    heads: Sequence[int],
    side: tuple[QueryNorm, Sequence[int], Sequence[int]] | None,
    layer: int,
) -> Tensor:
    """``[part + 1, batch, pos, head, d_head]``: each part of ``res`` through the frozen input
    ``norm``, ``W`` ``[head, d_model, d_head]`` and ``b``, then the frozen q/k norm ``side`` (the
    norm, the rows of ``W`` of every head it spans, the indices of ``heads`` among them), then
    rotary; the last part is the bias (the shifts through ``W``, ``b``)."""
    nh, d = len(heads), W.shape[-1]
    flat = W[list(heads)].permute(1, 0, 2).reshape(W.shape[1], nh * d)
    out = res.project(norm.fold(flat), extra=1)
    out[:-1] /= res.scale[None, ..., None]
    shift = norm.shift
    out[-1] = b[list(heads)].reshape(-1) + (0.0 if shift is None else shift.to(flat) @ flat)
    out = out.reshape(-1, *res.scale.shape, nh, d)
    if side is not None:
        qk_norm, rows, chosen = side
        x = norm.apply(res.stream, res.scale)  # the attention input of this pass
        total = torch.einsum("bpm,hmd->bphd", x, W[list(rows)].float()) + b[list(rows)].float()
        out = _frozen_side(qk_norm, out, total, chosen)
    rotation = adapter.rotation(layer)
    if rotation is None:
        return out
    # one cos/sin table per position, broadcast over the parts (not one per part)
    return rotation.rotate(out, res.positions[None])
