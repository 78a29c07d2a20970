"""What each layer of a TransformerBridge mixes tokens with: softmax attention or something else.

Hybrid models (Qwen3-Next, Qwen3.5, Jamba, Bamba, NemotronH, OLMo-Hybrid, LFM2, RecurrentGemma)
have softmax attention on some layers only; Mamba, FalconMamba and RWKV have none. The bridge
wraps each layer's token mixer under a name that says what it is (``attn``, ``linear_attn``,
``mixer``, ``conv``, ``time_mix``); a layer's kind is read from that name and from the class of
the Hugging Face module it wraps, never from a config default.

Kinds: ``"attention"`` (softmax attention the bridge hooks: ``blocks[i].attn``),
``"linear_attention"`` (gated delta rule), ``"state_space"`` (Mamba mixers), ``"conv"`` (short
convolutions), ``"rwkv"`` (RWKV time mixing), ``"recurrent"`` (RG-LRU), ``"mlp"`` (NemotronH's
MLP and mixture-of-experts layers, which mix no tokens), and ``"unhooked_attention"``: softmax
attention that TransformerLens wraps without query, key or pattern hooks (NemotronH's attention
inside its mixer bridge; RecurrentGemma's local attention). The verified ones
(``_unhooked.UNHOOKED_ATTENTION``) are read with torch hooks on the Hugging Face module and
become attention layers (``LayerSpec.unhooked``); others keep this kind, with nothing read.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ATTENTION", "KIND_WHAT", "layer_kind"]

ATTENTION = "attention"
# kind -> what it is, for messages
KIND_WHAT = {
    "attention": "softmax attention",
    "linear_attention": "linear attention (gated delta rule), no softmax pattern",
    "state_space": "a state-space (Mamba) mixer, no attention pattern",
    "conv": "a short convolution, no attention pattern",
    "rwkv": "RWKV time mixing, no softmax pattern",
    "recurrent": "a recurrent (RG-LRU) block, no attention pattern",
    "mlp": "a feed-forward (MLP or mixture-of-experts) layer, no token mixing",
    "unhooked_attention": "softmax attention that TransformerLens wraps without query, key or "
    "pattern hooks, in a module not verified to be read exactly with torch hooks",
    "unknown": "a token mixer of unknown type",
}
_MIXER_NAMES = {"linear_attn": "linear_attention", "conv": "conv", "time_mix": "rwkv"}


def _hf_layer(model: Any, layer: int) -> Any:
    """The Hugging Face decoder layer ``layer`` (None where it cannot be found)."""
    inner = getattr(getattr(model, "original_model", None), "model", None)
    layers = getattr(inner, "layers", None)
    try:
        return None if layers is None else layers[layer]
    except (IndexError, TypeError):
        return None


def layer_kind(model: Any, layer: int) -> str:
    """The kind of token mixer in ``blocks[layer]`` of a TransformerBridge (see module doc).

    Example:
        >>> from types import SimpleNamespace as NS
        >>> layer_kind(NS(blocks=[NS(linear_attn=object())]), 0)
        'linear_attention'
    """
    block = model.blocks[layer]
    attn = getattr(block, "attn", None)
    if attn is not None and getattr(attn, "original_component", None) is not None:
        return ATTENTION
    for name, kind in _MIXER_NAMES.items():
        if getattr(block, name, None) is not None:
            return kind
    mixer = getattr(block, "mixer", None)
    if mixer is not None:
        wrapped = type(getattr(mixer, "original_component", None)).__name__
        if "Attention" in wrapped:
            return "unhooked_attention"
        return "mlp" if "MLP" in wrapped or "MoE" in wrapped else "state_space"  # NemotronH -, E
    hf = _hf_layer(model, layer)
    temporal = type(getattr(hf, "temporal_block", None)).__name__  # RecurrentGemma
    if "Attention" in temporal:
        return "unhooked_attention"
    if "Rglru" in temporal or "Recurrent" in temporal:
        return "recurrent"
    return "unknown"
