"""Host internals read by meaning, continued from ``_readers``: the switches and flags that pick
a layer's recipe (BOS prepending, a post-rotary norm, an output gate, keys shared across
layers, whether a layer rotates, the latent rotary layout and magnitude). Each is one reader: the attribute, what it
means, and a check where one exists; a missing or renamed attribute is a ``TLDynamicsError``
from ``_readers.refusal``. Where an attribute's absence means something (a host without the
feature it switches), the reader says so by host or by the feature, never a bare default.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

# read through the module (not imported names), so that tests renaming a lookup see these too
from tl_dynamics.adapter import _readers


def prepend_bos(model: Any) -> bool:
    """``cfg.default_prepend_bos``: whether the host prepends BOS (so the padding mask it builds
    keeps a left-padded row's BOS); a field of every TransformerLens config."""
    return bool(_readers.required(model.cfg, "default_prepend_bos", "whether BOS is prepended"))


def qk_norm_after_rope(model: Any) -> bool:
    """``cfg.qk_norm_after_rope`` (HunYuan): q and k normalised after rotary. Required where the
    host's config class takes the switch; a TransformerLens whose config has no such switch
    (3.x) always normalises before rotary, so its absence there means False."""
    if "qk_norm_after_rope" not in inspect.signature(type(model.cfg).__init__).parameters:
        return False  # this host has no post-rotary norm: it cannot apply one
    return bool(_readers.required(model.cfg, "qk_norm_after_rope", "q/k normalised after rotary"))


def gated_q_proj(model: Any, orig: Any) -> bool:
    """``cfg.gated_q_proj`` (Qwen3-Next, Qwen3.5): the second half of ``q_proj`` gates ``z``.
    TransformerLens sets it only on the architectures whose ``q_proj`` carries the gate (and reads
    it as False where unset), so its absence means no gate; checked against the width of the
    module's own ``q_proj`` (twice its heads times ``head_dim`` exactly where it carries a gate)."""
    flag = _readers.lookup(model.cfg, "gated_q_proj")
    flag = False if flag is _readers.ABSENT else bool(flag)
    width = _readers.lookup(orig, "q_proj.out_features")
    heads = _readers.lookup(orig, "config.num_attention_heads")
    d_head = _readers.lookup(orig, "head_dim")
    if (
        all(isinstance(n, int) for n in (width, heads, d_head))
        and (width == 2 * heads * d_head) != flag
    ):
        raise _readers.refusal(
            model.cfg,
            "gated_q_proj",
            f"{flag}, but {type(orig).__name__}.q_proj has {width} outputs for {heads} heads "
            f"of width {d_head} ({'twice' if flag is False else 'not twice'} the queries)",
        )
    return flag


KV_SHARING = {"gemma4"}  # the families whose code reuses an earlier layer's keys and values


def kv_shared(orig: Any, family: str) -> bool:
    """``is_kv_shared_layer`` of a Gemma 4 attention module: it reuses an earlier layer's keys
    and values. Required on ``KV_SHARING``; a module of another family that has it set is
    refused (its sharing would be missed), and elsewhere no family's code shares them."""
    if family in KV_SHARING:
        return bool(
            _readers.required(orig, "is_kv_shared_layer", "keys and values of an earlier layer")
        )
    if _readers.optional(orig, "is_kv_shared_layer"):
        raise _readers.refusal(
            orig,
            "is_kv_shared_layer",
            f"set on a {family} layer, which the adapter reads as having its own keys and values",
        )
    return False


# latent-attention families whose code has no rope_interleave switch: DeepSeek-V2 rotates
# adjacent pairs as complex numbers (its Rotation is found as the interleaved layout)
ROPE_INTERLEAVE_BY_CODE = {"deepseek_v2": False}


def rope_interleave(hf: Any) -> bool:
    """``config.rope_interleave`` of a latent-attention module (DeepSeek-V3, GLM-4-MoE-Lite,
    Youtu): the rotary part's pairs ``(2k, 2k+1)`` are permuted to halves before rotation."""
    config = _readers.required(hf, "config", "the module's configuration")
    by_code = ROPE_INTERLEAVE_BY_CODE.get(str(_readers.optional(config, "model_type")))
    if by_code is not None:
        return by_code
    return bool(_readers.required(config, "rope_interleave", "rotary pairs (2k, 2k+1) permuted"))


def rotary_magnitude(module: Any) -> float:
    """``attention_scaling`` of a Hugging Face rotary embedding module: the factor on its cos
    and sin tables (1 but for YaRN-like scalings), a positive number."""
    value = _readers.required(module, "attention_scaling", "factor on the cos/sin tables")
    value = float(value) if isinstance(value, (int, float)) else float("nan")
    if not math.isfinite(value) or value <= 0:
        raise _readers.refusal(module, "attention_scaling", f"{value} is not a positive factor")
    return value


# families whose attention module says whether it rotates in ``use_rope`` (their NoPE layers
# hold 0 or False): required there
USE_ROPE = {"smollm3", "llama4"}
# families whose module rotates unless it has a window and does not slide (a hybrid model's
# global layers are NoPE: ``sliding_window is None or is_sliding``): both attributes required
NOPE_UNLESS_SLIDING = {"exaone4"}


def rotates(module: Any, family: str) -> bool:
    """Whether a rotary model's attention layer rotates q and k, read by the family's rule:
    ``use_rope`` on ``USE_ROPE``, ``sliding_window`` and ``is_sliding`` on
    ``NOPE_UNLESS_SLIDING``; every other family's code rotates every layer, and a ``use_rope``
    set on one of its modules is refused (its NoPE layers would be read as rotating).

    Example:
        >>> from types import SimpleNamespace as NS
        >>> rotates(NS(use_rope=0), "smollm3"), rotates(NS(), "llama")
        (False, True)
        >>> rotates(NS(sliding_window=4, is_sliding=False), "exaone4")
        False
    """
    if family in USE_ROPE:
        return bool(_readers.required(module, "use_rope", "whether this layer rotates q and k"))
    if family in NOPE_UNLESS_SLIDING:
        window = _readers.required(
            module, "sliding_window", "the model's window, set on its global (NoPE) layers too"
        )
        sliding = _readers.required(module, "is_sliding", "whether this layer slides")
        return window is None or bool(sliding)
    if _readers.optional(module, "use_rope") is not None:
        raise _readers.refusal(
            module,
            "use_rope",
            f"set on a {family} layer, whose code the adapter reads as rotating every layer",
        )
    return True
