"""What the residual split (``ResidualSplit``, ``_components.py``) refuses, by name: families not
verified in the tests, post-attention norms, post-LayerNorm encoders, shortformer positions,
hybrids, and layers whose query or key is not linear in their input once the input and q/k norms
are frozen (docs/math.md §10.1)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tl_dynamics.errors import TLDynamicsError

if TYPE_CHECKING:
    from tl_dynamics.adapter._model import ModelAdapter

# Families whose residual split is exact in tests/test_qk_attribution.py and
# tests/test_qk_attribution_qknorm.py (both hosts where the host runs them),
# and the reason for the families that are refused.
VERIFIED_SPLIT = (
    "bloom", "gpt2", "gptj", "gptneo", "gptneox", "hooked", "llama", "mistral", "native", "olmo",
    "olmoe", "opt", "phi", "phi3", "qwen2", "qwen3", "qwen3_moe", "stablelm", "cohere",
)  # fmt: skip
_POST_NORM = (
    "a norm on each attention output before it joins the residual stream (post-attention norm), "
    "so head outputs do not add up to the stream"
)
REFUSED_SPLIT = {
    "gemma2": _POST_NORM,
    "gemma3": _POST_NORM,
    "olmo2": _POST_NORM,
    "bert": "post-LayerNorm blocks (the stream is renormalised after every block)",
    "roberta": "post-LayerNorm blocks (the stream is renormalised after every block)",
}
_LAYER_FLAGS = {
    "latent": "multi-head latent attention",
    "gate": "an output gate on z",
    "postrope": "q/k normalised after rotary",
    "clip": "clip_qkv (q, k, v clamped: not linear)",
    "unhooked": "attention the host wraps without hooks",
    "vnorm": "q, k and v normalised per head",
    "kv_from": "keys and values shared from another layer",
    "prenorm": "a q/k norm the bridge leaves to the adapter",
    "sinks": "learned attention sinks",
}


def refuse_split(adapter: "ModelAdapter", layer: int, arch: str, family: str) -> None:
    """Refuse (``TLDynamicsError``) a layer whose input cannot be split exactly, by name."""
    if family in REFUSED_SPLIT:
        raise TLDynamicsError(
            f"qk attribution: the residual stream of {arch} cannot be split exactly into "
            f"its components: {REFUSED_SPLIT[family]}"
        )
    if family not in VERIFIED_SPLIT:
        raise TLDynamicsError(
            f"qk attribution: the residual split of {arch} (attention family {family!r}) has "
            f"not been verified to be exact; verified families: {list(VERIFIED_SPLIT)}"
        )
    if adapter.post_norm is not None:
        raise TLDynamicsError(
            f"qk attribution: the residual stream of {arch} cannot be split exactly into its "
            f"components: {_POST_NORM} (post_norm={adapter.post_norm!r})"
        )
    if getattr(adapter.model.cfg, "positional_embedding_type", None) == "shortformer":
        raise TLDynamicsError(
            f"qk attribution: {arch} adds its positional embedding to queries and keys only "
            "(shortformer), not to the residual stream; not modelled"
        )
    for l in range(layer + 1):
        spec = adapter.specs[l]
        if not spec.is_attention:
            raise TLDynamicsError(
                f"qk attribution: layer {l} of {arch} is a {spec.kind!r} layer; the residual "
                "split models attention and MLP blocks only (hybrids are refused)"
            )
        for flag, what in _LAYER_FLAGS.items():
            if getattr(spec, flag) not in (None, False):
                raise TLDynamicsError(
                    f"qk attribution: layer {l} of {arch} has {what} ({flag}); the exact "
                    "split of its scores is not modelled"
                )
