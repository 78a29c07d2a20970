"""How each attention layer of a ``TransformerBridge`` scores, read from the module that
really computes its scores (the wrapped Hugging Face module, or TransformerLens's native one),
never from a config default: the bridge's cfg fields do not describe the wrapped model (see
``_host``)."""

from __future__ import annotations

from typing import Any, Literal

from tl_dynamics.adapter._gate import output_gate
from tl_dynamics.adapter._gemma4 import gemma4_window, kv_source
from tl_dynamics.adapter._mla import LATENT_BRIDGES
from tl_dynamics.adapter._spec import HostInfo, LayerSpec, RotaryStyle
from tl_dynamics.errors import TLDynamicsError

# Bridge attention classes that recompute attention, so hook_attn_scores holds logits.
RECONSTRUCTING_BRIDGES = {
    "PositionEmbeddingsAttentionBridge",
    "JointQKVAttentionBridge",
    "JointQKVPositionEmbeddingsAttentionBridge",
    "BloomAttentionBridge",
    "_SmolLM3AttentionBridge",
    "_Exaone4AttentionBridge",  # subclasses, tested exact
    "CodeGenAttentionBridge",
    "_Cohere2AttentionBridge",
    "ALiBiJointQKVAttentionBridge",
    "MPTALiBiAttentionBridge",  # Falcon ALiBi, MPT
    "_OpenAIGPTJointQKVAttentionBridge",
    "MLAAttentionBridge",
    "_BitNetAttentionBridge",
}
# Bridge attention class that runs the HF module and fires hook_attn_scores on its weights.
DELEGATING_BRIDGES = {"AttentionBridge", "_JetMoeAttentionBridge"}  # JetMoE: _jetmoe


def bridge_spec(model: Any, info: HostInfo, layer: int) -> LayerSpec:
    attn = model.blocks[layer].attn
    orig = attn.original_component
    hf_cfg = getattr(model.original_model, "config", None)
    kind = type(attn).__name__
    if kind not in RECONSTRUCTING_BRIDGES | DELEGATING_BRIDGES:
        raise TLDynamicsError(
            f"unsupported attention bridge {kind} in layer {layer} of "
            f"{info.architecture}; supported: "
            f"{sorted(RECONSTRUCTING_BRIDGES | DELEGATING_BRIDGES)}"
        )
    family = info.family
    if family == "native":
        return _native_spec(model, layer, orig)
    if family == "gptneo":
        scale = 1.0  # GPT-Neo does not scale its scores
    elif family in ("gptj", "codegen"):
        scale = 1.0 / float(orig.scale_attn)
    elif family in ("bloom", "falcon"):
        scale = float(orig.inv_norm_factor)
    elif family == "mpt":
        scale = float(orig.softmax_scale)
    elif family == "openai_gpt":  # the first GPT: scores divided by sqrt(d_head) iff scale=True
        scale = model.cfg.d_head**-0.5 if bool(orig.scale) else 1.0
    elif kind == "JointQKVAttentionBridge":  # GPT-2: the bridge ignores scale_attn_weights
        scale = model.cfg.d_head**-0.5 / (
            layer + 1 if getattr(hf_cfg, "scale_attn_by_inverse_layer_idx", False) else 1
        )
    else:
        scale = float(getattr(orig, "scaling", None) or orig.self.scaling)

    cap = getattr(orig, "attn_logit_softcapping", None)
    if hasattr(orig, "sliding_window"):
        window = gemma4_window(orig, orig.sliding_window)  # Gemma 4 bidirectional: inclusive
    elif hasattr(orig, "attention_type"):
        window = None
        if orig.attention_type == "local":  # GPT-Neo: the window is in the model's config
            if hf_cfg is None:
                raise TLDynamicsError(
                    f"layer {layer} of {info.architecture} uses local attention "
                    "but the model has no config giving its window"
                )
            window = hf_cfg.window_size
    else:
        window = getattr(hf_cfg, "sliding_window", None)

    rotary: RotaryStyle = "none"
    rotary_dim, base = None, None
    latent = kind in LATENT_BRIDGES
    if latent:
        pass  # q/k hooks fire after rotary (_mla)
    elif family == "llama4":  # complex rotary on adjacent pairs with the model's own frequencies
        if orig.use_rope:
            rotary, rotary_dim = "interleaved", int(orig.head_dim)
    elif family in ("gptj", "codegen"):
        rotary, rotary_dim, base = "interleaved", int(orig.rotary_dim or model.cfg.d_head), 10000.0
    elif family == "afmoe" and not orig.is_local_attention:
        pass  # AFMoE rotates its sliding layers only; the full layers are NoPE
    elif model.cfg.positional_embedding_type == "rotary" and getattr(orig, "use_rope", True):
        rotary = "half"  # rot hooks are used when they fire; cos/sin otherwise
    # (SmolLM3 / Llama 4 NoPE layers set use_rope=False: their q and k are scored unrotated)

    alibi: Literal["none", "key", "falcon", "mpt"] = "none"
    if family == "bloom" or family == "mpt":
        alibi = "key" if family == "bloom" else "mpt"
    elif family == "falcon" and bool(getattr(hf_cfg, "alibi", False)):
        alibi = "falcon"  # the bias reaches the scores twice, in HF and in TransformerLens
    # BERT: BertLMHeadModel (is_decoder=True) is causal, BertForMaskedLM is not.
    causal = bool(
        getattr(orig, "is_causal", getattr(getattr(orig, "self", None), "is_causal", True))
    )
    if family == "bert":
        causal = bool(getattr(hf_cfg, "is_decoder", False))
    return LayerSpec(
        layer=layer,
        scale=scale,
        softcap=float(cap) if cap else None,
        window=int(window) if window else None,
        causal=causal,
        rotary=rotary,
        rotary_dim=rotary_dim,
        rotary_base=base,
        alibi=alibi,
        scores_hook="logits" if kind in RECONSTRUCTING_BRIDGES else "pattern",
        qk_norm=any(
            getattr(orig, name, None) is not None
            for name in ("q_norm", "q_layernorm", "qk_norm", "query_layernorm")
        ),
        sinks=getattr(orig, "sinks", None) is not None,
        latent=latent,
        prenorm=(family == "llama4" and getattr(orig, "qk_norm", None) is not None)
        or family in ("olmo_hybrid", "nanochat", "afmoe", "laguna"),
        gate=output_gate(model, orig),
        postrope=bool(getattr(model.cfg, "qk_norm_after_rope", False)),
        clip=float(clip)
        if (
            clip := getattr(hf_cfg, "clip_qkv", None)
            or getattr(getattr(hf_cfg, "attn_config", None), "clip_qkv", None)
        )
        else None,
        vnorm=family == "gemma4",  # q, k, v read from their norms (_gemma4)
        kv_from=kv_source(model, orig, layer),
    )


def _native_spec(model: Any, layer: int, orig: Any) -> LayerSpec:
    """``NativeAttention`` (TransformerLens 4.x ``boot_native``): scores ``q k^T / scale``,
    soft-cap, causal mask from cfg, adjacent-pair RoPE from its own cos/sin tables."""
    rotary = getattr(orig, "rotary", None)
    if rotary is not None and float(getattr(rotary, "position_scale", 1.0)) != 1.0:
        raise TLDynamicsError(
            f"layer {layer}: native rotary with rope_scaling (position_scale "
            f"{rotary.position_scale}) is not supported"
        )
    cap = float(getattr(orig, "attn_scores_soft_cap", -1.0))
    return LayerSpec(
        layer=layer,
        scale=1.0 / float(orig.scale),
        softcap=cap if cap > 0 else None,
        window=None,
        causal=bool(orig.causal),
        rotary="interleaved" if rotary is not None else "none",
        rotary_dim=int(rotary.rotary_dim) if rotary is not None else None,
        rotary_base=float(rotary.effective_base) if rotary is not None else None,
        alibi="none",
        scores_hook="pattern",
        qk_norm=False,
    )
