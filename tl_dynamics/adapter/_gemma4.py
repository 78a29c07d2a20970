"""Gemma 4: q, k and v each RMS-normalised per head, head widths that differ by layer, and
layers that reuse an earlier layer's keys and values.

Gemma 4's attention (``Gemma4TextAttention``, docs/math.md §1.6) scores

    q_ih = R_i N_q(x_i W_Q^h),   k_jh = R_j N_k(x_j W_K^h),   v_jh = N_v(x_j W_V^h)
    s_ij = <q_ih, k_jh>            (scale 1: the module's ``scaling``)

with ``N_q``/``N_k`` RMS norms over the head's entries with a gain ``w`` (no ``1 + w`` offset)
and ``N_v`` the same norm without a gain. Sliding layers and full layers have their own head
width and rotary (full layers: "proportional" rope, a fraction of the frequencies non-zero);
``N_q`` acts before the rotation, so the query is the rotation of a normalised linear map of the
layer input, as on Gemma 3 (``ModelAdapter.query_norm``).

The bridge delegates to the Hugging Face module and fires ``hook_q``/``hook_k``/``hook_v`` on
the projections, before the norms; its ``q_norm``/``k_norm``/``v_norm`` wrappers fire on the
normalised q, k and v (``[batch, pos, head, d_head]``), which the adapter reads as the layer's
q, k and v (``NORMED_HOOKS``); the rotation comes from the tables the module receives
(``_modrope``), per layer. The bridge's own ``W_Q``/``W_K``/``W_V``/``W_O`` cannot split a
layer whose width differs from the model's ``d_head``, so the weights are read from the module's
projections here (``gemma4_weight``).

The value norm makes what a head writes ``sum_j p_ij N_v(x_j W_V^h) W_O^h``: per source the
output ``v_j W_O`` is exact (read from the hooks), but no fixed matrix ``W_V W_O`` maps the
residual to it, so ``W_V``/``b_V`` and what is built from them (the OV circuits, particles
seeded from a head) refuse such a layer by name (``vnorm_refusal``).

A layer that reuses an earlier layer's keys and values (``num_kv_shared_layers``;
``LayerSpec.kv_from``, ``kv_source``) has no key or value projection, norm or hook: the hub hooks
the source layer's ``k``/``v`` in the same pass (``kv_source_roles``), keeps them (``keep_kv``)
and gives them to the later layer (``shared_kv``), which rotates them with its own tables (the
source has the same layer type, so the same rotation); its ``W_K``/``W_V`` refuse by name
(``kv_shared_refusal``). With ``use_bidirectional_attention="all"`` Hugging Face's sliding window
is inclusive (``gemma4_window``).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from tl_dynamics.adapter import _readers, _switches
from tl_dynamics.errors import TLDynamicsError

__all__ = [
    "NORMED_HOOKS",
    "gemma4_weight",
    "gemma4_window",
    "keep_kv",
    "kv_shared_refusal",
    "kv_source",
    "kv_source_roles",
    "layer_d_head",
    "normed_hook",
    "shared_kv",
    "vnorm_refusal",
]

# role -> bridge hook (after the block prefix) on layers whose q, k and v are normalised
# (``LayerSpec.vnorm``): the normalised, unrotated q, k and v, ``[batch, pos, head, d_head]``
NORMED_HOOKS = {
    "q": "attn.q_norm.hook_out",
    "k": "attn.k_norm.hook_out",
    "v": "attn.v_norm.hook_out",
}
# weight -> the Hugging Face module's projection
_PROJECTIONS = {"Q": "q_proj", "K": "k_proj", "V": "v_proj", "O": "o_proj"}


def normed_hook(spec: Any, role: str) -> str | None:
    """The hook template of ``role`` on a layer with normalised q, k and v (None elsewhere).

    Example:
        >>> from types import SimpleNamespace as NS
        >>> normed_hook(NS(vnorm=True), "v"), normed_hook(NS(vnorm=False), "v")
        ('attn.v_norm.hook_out', None)
    """
    return NORMED_HOOKS.get(role) if getattr(spec, "vnorm", False) else None


def layer_d_head(model: Any, layer: int, default: int) -> int:
    """The head width of ``layer``: the Hugging Face module's own ``head_dim`` on Gemma 4
    (sliding and full layers differ), ``default`` (the model's ``d_head``) elsewhere."""
    orig: Any = getattr(model.blocks[layer].attn, "original_component", None)
    return int(orig.head_dim) if type(orig).__name__ == "Gemma4TextAttention" else default


def gemma4_window(orig: Any, window: int | None) -> int | None:
    """The window ``w`` of the adapter's mask (``|i - j| < w`` on a bidirectional layer) for a
    layer whose module keeps ``window``: on Gemma 4 with ``use_bidirectional_attention="all"``
    Hugging Face allows ``|i - j| <= sliding_window`` (inclusive), so ``w`` is one more there.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> class Gemma4TextAttention(NS): ...
        >>> gemma4_window(Gemma4TextAttention(is_causal=False), 3), gemma4_window(NS(), 3)
        (4, 3)
    """
    bidirectional = type(orig).__name__ == "Gemma4TextAttention" and not orig.is_causal
    return window + 1 if window and bidirectional else window


def gemma4_weight(model: Any, layer: int, name: str, n_heads: int) -> Tensor | None:
    """``W_Q``/``W_K``/``W_V`` (``[head, d_model, d_head]``, key/value heads not yet expanded),
    ``W_O`` (``[head, d_head, d_model]``) or a bias (None where the module has none) of a Gemma 4
    layer, from its Hugging Face projections. Keys and values share ``k_proj`` where the layer
    has no ``v_proj`` (``attention_k_eq_v``)."""
    orig = model.blocks[layer].attn.original_component
    proj = getattr(orig, _PROJECTIONS[name[-1]], None)
    if proj is None and name[-1] == "V":
        proj = getattr(orig, "k_proj", None)
    if proj is None:
        raise TLDynamicsError(
            f"layer {layer} of {type(model.original_model).__name__} has no "
            f"{_PROJECTIONS[name[-1]]} to read {name} from"
        )
    d_head = int(orig.head_dim)
    if name.startswith("b"):
        bias = proj.bias
        if bias is None:
            return None
        b = bias.detach().float()
        return b if name == "b_O" else b.reshape(-1, d_head)
    w = proj.weight.detach().float()  # [out, in]
    if name == "W_O":
        return w.T.reshape(n_heads, d_head, w.shape[0])
    return w.reshape(-1, d_head, w.shape[1]).transpose(1, 2)


def vnorm_refusal(layer: int, architecture: str, what: str) -> TLDynamicsError:
    """The refusal of ``what`` (an analysis or a weight) on a layer whose values are normalised.

    Example:
        >>> str(vnorm_refusal(1, "Gemma4ForCausalLM", "W_V"))[:58]
        'W_V: layer 1 of Gemma4ForCausalLM RMS-normalises each head'
    """
    return TLDynamicsError(
        f"{what}: layer {layer} of {architecture} RMS-normalises each head's value "
        "(v_j = x_j W_V / rms(x_j W_V), v_norm), so no fixed matrix W_V W_O maps the residual "
        "stream to what a head writes; it does not model the value norm (the pattern, z, head "
        "outputs and per-source outputs v_j W_O are exact: ModelAdapter.attention)"
    )


def kv_source(model: Any, orig: Any, layer: int, family: str) -> int | None:
    """The layer whose keys and values Gemma 4's ``layer`` reuses (``num_kv_shared_layers``): the
    last layer of the same type before the shared ones, as Hugging Face's ``kv_sharing_modes``
    picks it (it stores them; ``store_full_length_kv``); None on a layer with its own."""
    if not _switches.kv_shared(orig, family):
        return None
    kind = _readers.required(orig, "layer_type", "sliding or full attention")
    for source in range(layer - 1, -1, -1):
        other = model.blocks[source].attn.original_component
        stores = _readers.required(other, "store_full_length_kv", "keys kept for later layers")
        if _readers.required(other, "layer_type", "sliding or full attention") == kind and stores:
            return source
    raise TLDynamicsError(
        f"layer {layer} of {type(model.original_model).__name__} reuses an earlier layer's keys "
        "and values, but no earlier layer of its type stores them"
    )


def kv_source_roles(specs: Any, layers: set[int]) -> list[tuple[str, int]]:
    """The ``(role, layer)`` hooks to add so that every layer in ``layers`` that reuses another
    layer's keys and values gets them: that layer's ``k`` and ``v`` (its norms' hooks).

    Example:
        >>> from types import SimpleNamespace as NS
        >>> kv_source_roles([NS(kv_from=None), NS(kv_from=None), NS(kv_from=0)], {2})
        [('k', 0), ('v', 0)]
    """
    sources = sorted({specs[layer].kv_from for layer in layers} - {None})
    return [(role, source) for source in sources for role in ("k", "v")]


def keep_kv(specs: Any, layer: int, st: dict[str, Tensor], shared: dict) -> None:
    """Keep the keys and values ``st["k"]``, ``st["v"]`` of a layer that others reuse in the
    pass's memo ``shared`` (the hub calls it as each layer ends, collected or not)."""
    if "k" in st and "v" in st and any(spec.kv_from == layer for spec in specs):
        shared[("gemma4_kv", layer)] = (st["k"], st["v"])


def shared_kv(spec: Any, st: dict[str, Tensor], shared: dict) -> None:
    """Give a layer that reuses another's keys and values (``spec.kv_from``) the normalised,
    unrotated ``k``/``v`` that layer fired (``keep_kv``) as its own; it rotates them with its own
    tables, the same as its source's (Hugging Face shares keys within one layer type)."""
    source = getattr(spec, "kv_from", None)
    if source is not None:
        kv = shared.get(("gemma4_kv", source))
        if kv is None:
            raise TLDynamicsError(
                f"layer {spec.layer} reuses layer {source}'s keys and values, which this forward "
                "pass did not capture"
            )
        st["k"], st["v"] = kv


def kv_shared_refusal(layer: int, source: int, architecture: str, what: str) -> TLDynamicsError:
    """The refusal of a key or value weight (``what``) on a layer that reuses another's keys.

    Example:
        >>> str(kv_shared_refusal(2, 1, "Gemma4ForCausalLM", "W_K"))[:60]
        "W_K: layer 2 of Gemma4ForCausalLM reuses layer 1's keys and "
    """
    return TLDynamicsError(
        f"{what}: layer {layer} of {architecture} reuses layer {source}'s keys and values "
        f"(num_kv_shared_layers), computed from layer {source}'s input, so no {what} of layer "
        f"{layer} maps its own input to them; layer {source}'s weights give them (the pattern, "
        "z and head outputs are exact: ModelAdapter.attention)"
    )
