"""Configuration flags that change how attention scores and that the exact recipe does not model.

Every flag below is read from the model's own configuration (the wrapped Hugging Face config and
attention module on the bridge, ``cfg`` on a HookedTransformer). When one is set the adapter
refuses with a ``TLDynamicsError`` naming the architecture, the flag and what it does, instead of
returning numbers that silently ignore it. Flags the recipe does model (scale switches, windows,
soft-caps, q/k norms read through the hooks) are read in ``_host`` and ``_bridgespec`` instead.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

from tl_dynamics.adapter._readers import required
from tl_dynamics.compat import tl_major_version
from tl_dynamics.errors import HostDiffersWarning, TLDynamicsError

__all__ = [
    "REFUSED_ATTENTION",
    "check_bridge_flags",
    "check_hooked_flags",
    "check_host_version",
    "host_differences",
    "query_scaling_context",
    "warn_host_differences",
]

_Rule = tuple[str, Callable[[Any], bool], str]

# Hugging Face attention modules TransformerLens runs whose attention the recipe does not model,
# with what they do (a refusal says so instead of "not verified").
REFUSED_ATTENTION: dict[str, str] = {}  # none left (Gemma 4 and JetMoE are modelled now)

# Hugging Face config flags (read from the wrapped model's config).
_HF_CONFIG_RULES: list[_Rule] = [
    ("use_logn_attn", bool, "log-n scaling of the query by position"),
    ("attention_sink_size", lambda v: bool(v), "attention sinks"),
]
# Attributes of the wrapped Hugging Face attention module.
# (learned sinks, ``sinks``, are modelled: LayerSpec.sinks, LayerAttention.sink_logit)
_HF_MODULE_RULES: list[_Rule] = []
# TransformerLens bridge cfg switches that change the attention computation after the hooks.
_BRIDGE_CFG_RULES: list[_Rule] = []
# HookedTransformer cfg flags.
_HOOKED_RULES: list[_Rule] = [
    ("use_logn_attn", bool, "log-n attention scaling"),
    (
        "clip_qkv",
        lambda v: v is not None,
        "q, k and v are clamped after hook_q/hook_k/hook_v fire, so the hooks do not hold what "
        "is scored",
    ),
]


def _check(source: Any, rules: list[_Rule], where: str, architecture: str) -> None:
    for flag, is_set, why in rules:
        value = getattr(source, flag, None)
        if value is not None and is_set(value):
            raise TLDynamicsError(
                f"unsupported {architecture}: {where} {flag}={value!r} ({why}); the adapter "
                "refuses rather than return attention that ignores it"
            )


def check_bridge_flags(model: Any, architecture: str) -> None:
    """Refuse a TransformerBridge model whose configuration sets an unmodelled attention flag.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> block = NS(attn=NS(original_component=NS()))
        >>> model = NS(original_model=NS(config=NS(use_logn_attn=True)), cfg=NS(), blocks=[block])
        >>> check_bridge_flags(model, "QWenLMHeadModel")
        Traceback (most recent call last):
        ...
        tl_dynamics.errors.TLDynamicsError: unsupported QWenLMHeadModel: Hugging Face config use_logn_attn=True (log-n scaling of the query by position); the adapter refuses rather than return attention that ignores it
    """
    hf_cfg = getattr(getattr(model, "original_model", None), "config", None)
    # MPT keeps its attention flags in a sub-config
    for cfg in (hf_cfg, getattr(hf_cfg, "text_config", None), getattr(hf_cfg, "attn_config", None)):
        if cfg is not None:
            _check(cfg, _HF_CONFIG_RULES, "Hugging Face config", architecture)
    _check(model.cfg, _BRIDGE_CFG_RULES, "TransformerLens cfg", architecture)
    for block in model.blocks:
        orig = getattr(getattr(block, "attn", None), "original_component", None)
        if orig is not None:
            _check(orig, _HF_MODULE_RULES, "attention module", architecture)


def query_scaling_context(model: Any) -> int | None:
    """The context below which a Llama-4-style query scaling is exactly 1, or None.

    Ministral 3 multiplies the rotated query by ``1 + beta * log(1 + floor(p / original_max))``
    (``rope_parameters["llama_4_scaling_beta"]``): at positions ``p < original_max`` the factor
    is exactly 1, so the adapter limits its context to ``original_max`` tokens and is exact there.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> rope = {"llama_4_scaling_beta": 0.1, "original_max_position_embeddings": 16384}
        >>> query_scaling_context(NS(original_model=NS(config=NS(rope_parameters=rope))))
        16384
    """
    hf_cfg = getattr(getattr(model, "original_model", None), "config", None)
    for cfg in (hf_cfg, getattr(hf_cfg, "text_config", None)):
        rope = getattr(cfg, "rope_parameters", None)
        if isinstance(rope, dict) and rope.get("llama_4_scaling_beta") is not None:
            return int(rope["original_max_position_embeddings"])
        # Llama 4: attention is chunked (keys of the query's own chunk only) from
        # attention_chunk_size tokens on, and NoPE layers scale queries by
        # 1 + attn_scale * log(1 + floor((p + 1) / floor_scale)), exactly 1 below floor_scale
        # (a Llama 4 text config always carries the three switches: a renamed one is refused,
        # never read as "no limit", which a probe of 8 tokens could not see)
        if type(cfg).__name__ != "Llama4TextConfig":
            continue
        chunk = required(cfg, "attention_chunk_size", "chunked attention from this many tokens")
        limits = [chunk]
        if required(cfg, "attn_temperature_tuning", "NoPE layers scale their queries by position"):
            limits.append(required(cfg, "floor_scale", "query scaling is 1 below this position"))
        if any(limits):
            return int(min(v for v in limits if v))
    return None


def check_hooked_flags(model: Any) -> None:
    """Refuse a HookedTransformer whose cfg sets a flag the recipe does not reproduce, or a
    combination whose hooks do not hold what is scored (see ``_hooked_combinations``)."""
    cfg = model.cfg
    name = str(getattr(cfg, "original_architecture", None) or "HookedTransformer")
    _check(cfg, _HOOKED_RULES, "HookedTransformer config", name)
    pos_type = cfg.positional_embedding_type
    cap = required(cfg, "attn_scores_soft_cap", "soft-cap; <= 0: none")
    if pos_type == "alibi" and cap and cap > 0:
        raise TLDynamicsError(
            f"unsupported {name}: HookedTransformer config attn_scores_soft_cap={cap} with ALiBi "
            "(it soft-caps q.k and adds ALiBi after the cap, while the recipe caps the sum); "
            "the adapter refuses rather than return attention that ignores it"
        )
    normed = bool(required(cfg, "use_qk_norm", "q/k normalised")) or any(
        getattr(block.attn, "q_norm", None) is not None for block in model.blocks
    )
    if normed and pos_type != "rotary":
        raise TLDynamicsError(
            f"unsupported {name}: HookedTransformer q/k normalisation with "
            f"positional_embedding_type={pos_type!r} (hook_q/hook_k fire before the norm and no "
            "rotated hook fires after it, so no hook holds the scored q and k); the adapter "
            "refuses rather than return attention that ignores it"
        )


def host_differences(model: Any, family: str, architecture: str) -> list[str]:
    """What a TransformerBridge computes differently from its Hugging Face model, per flag this
    model sets (the adapter follows the bridge; ``AdapterBase`` warns with each message).

    Example:
        >>> from types import SimpleNamespace as NS
        >>> model = NS(original_model=NS(config=NS(scale_attn_weights=False)))
        >>> host_differences(model, "gpt2", "GPT2LMHeadModel")[0][:60]
        'GPT2LMHeadModel sets scale_attn_weights=False (Hugging Face '
    """
    hf_cfg = getattr(getattr(model, "original_model", None), "config", None)
    found = []
    scaled = family not in ("gpt2", "gpt_bigcode") or required(
        hf_cfg, "scale_attn_weights", "whether q.k is scaled"
    )
    if not scaled:
        found.append(
            f"{architecture} sets scale_attn_weights=False (Hugging Face does not scale "
            "q.k), but TransformerLens scores with d_head**-0.5 anyway, so its patterns "
            "differ from the Hugging Face model's; the adapter reproduces TransformerLens"
        )
    cap = getattr(hf_cfg, "attn_logit_softcapping", None)
    if family == "gemma3" and cap:
        found.append(
            f"{architecture} sets attn_logit_softcapping={cap}: TransformerLens soft-caps "
            "the attention scores (cap * tanh(s / cap)) but Hugging Face Gemma 3 ignores "
            "the flag, so its patterns differ from the Hugging Face model's; the adapter "
            "reproduces TransformerLens"
        )
    if family == "hunyuan_v1_dense" and tl_major_version() < 4 and _gains_split_pairs(model):
        found.append(
            f"{architecture} normalises q and k after rotary (Hugging Face), but TransformerLens "
            "3.x normalises them before rotary; this model's q/k norm gains differ within rotated "
            "pairs, so the two orders score differently and its patterns differ from the Hugging "
            "Face model's (TransformerLens 4.x follows Hugging Face); the adapter reproduces "
            "TransformerLens"
        )
    return found


def _gains_split_pairs(model: Any) -> bool:
    """Whether a HunYuan q/k norm's gain differs between the two dimensions of a rotated pair
    ``(k, k + d_head / 2)``: only then do "normalise, rotate" and "rotate, normalise" differ
    (an RMS norm's own scale is rotation invariant)."""
    for block in model.blocks:
        orig = getattr(getattr(block, "attn", None), "original_component", None)
        for name in ("query_layernorm", "key_layernorm"):
            weight = getattr(getattr(orig, name, None), "weight", None)
            if weight is not None:
                first, second = weight.detach().reshape(-1, 2, weight.shape[-1] // 2).unbind(1)
                if not torch.equal(first, second):
                    return True
    return False


def check_host_version(family: str, architecture: str, major: int) -> None:
    """Refuse a family whose bridge in this TransformerLens major version does not compute what
    the Hugging Face model computes (so no hook holds the real attention to reproduce).

    Example:
        >>> check_host_version("cohere", "CohereForCausalLM", 3)
        Traceback (most recent call last):
        ...
        tl_dynamics.errors.TLDynamicsError: unsupported CohereForCausalLM on TransformerLens 3.x: its bridge rotates Cohere's queries and keys with neither layout of its own cos/sin tables, and its attention pattern differs from the Hugging Face model's (by 0.97 on a tiny random model); TransformerLens 4.x computes it exactly and the adapter reproduces it there
    """
    if family in ("cohere", "cohere2") and major < 4:
        raise TLDynamicsError(
            f"unsupported {architecture} on TransformerLens 3.x: its bridge rotates Cohere's "
            "queries and keys with neither layout of its own cos/sin tables, and its attention "
            "pattern differs from the Hugging Face model's (by 0.97 on a tiny random model); "
            "TransformerLens 4.x computes it exactly and the adapter reproduces it there"
        )


def warn_host_differences(model: Any, host: str, family: str, architecture: str) -> None:
    """Warn once (``HostDiffersWarning``) per ``host_differences`` message of a bridge model."""
    if host == "bridge":
        for message in host_differences(model, family, architecture):
            warnings.warn(message, HostDiffersWarning, stacklevel=4)
