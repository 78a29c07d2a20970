"""How each attention layer of a ``TransformerBridge`` scores, read from the module that
really computes its scores (the wrapped Hugging Face module, or TransformerLens's native one),
never from a config default: the bridge's cfg fields do not describe the wrapped model (see
``_host``)."""

from __future__ import annotations

from typing import Any, Literal

from tl_dynamics.adapter import _readers, _switches
from tl_dynamics.adapter._gate import output_gate
from tl_dynamics.adapter._gemma4 import gemma4_window, kv_source
from tl_dynamics.adapter._mla import LATENT_BRIDGES
from tl_dynamics.adapter._readers import optional, required
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
    d_head = int(model.cfg.d_head)
    if family == "gptneo":
        scale = 1.0  # GPT-Neo does not scale its scores
    elif kind == "JointQKVAttentionBridge" and family not in _readers.FIXED_SCALE | {
        "mpt",
        "openai_gpt",
    }:  # GPT-2: the bridge ignores scale_attn_weights
        inverse = family == "gpt2" and required(
            hf_cfg, "scale_attn_by_inverse_layer_idx", "divide scores by l + 1"
        )  # GPT-BigCode has no such option
        scale = d_head**-0.5 / (layer + 1 if inverse else 1)
    else:  # by meaning: a multiplier or a divisor, per family (_readers.SCALES)
        scale = _readers.scale(orig, family, d_head)
    text = _readers.text_config(model)
    cap = _readers.softcap(orig, text)
    if family == "gptneo":  # "local" layers take the config's window
        window = None
        if required(orig, "attention_type", "global or local") == "local":
            window = required(hf_cfg, "window_size", "the local attention's window")
    else:  # per layer, layer types honoured (_readers.window)
        window = gemma4_window(orig, _readers.window(orig, layer, text))  # Gemma 4: inclusive

    rotary: RotaryStyle = "none"
    rotary_dim, base = None, None
    latent = kind in LATENT_BRIDGES
    if latent:
        pass  # q/k hooks fire after rotary (_mla)
    elif family == "llama4":  # complex rotary on adjacent pairs with the model's own frequencies
        if _switches.rotates(orig, family):
            rotary, rotary_dim = "interleaved", int(orig.head_dim)
    elif family in ("gptj", "codegen"):  # base 10000 is in their code, not an attribute
        width = required(orig, "rotary_dim", "rotated width; None: the whole head")
        rotary, rotary_dim, base = "interleaved", int(width or d_head), _readers.rotary_base(family)
    elif family == "afmoe" and not orig.is_local_attention:
        pass  # AFMoE rotates its sliding layers only; the full layers are NoPE
    elif model.cfg.positional_embedding_type == "rotary" and _switches.rotates(orig, family):
        rotary = "half"  # rot hooks are used when they fire; cos/sin otherwise
    # (NoPE layers, _switches.rotates: SmolLM3's use_rope=0, Exaone 4's global layers)

    alibi: Literal["none", "key", "falcon", "mpt"] = "none"
    if family == "bloom" or family == "mpt":
        alibi = "key" if family == "bloom" else "mpt"
    elif family == "falcon" and bool(required(hf_cfg, "alibi", "ALiBi instead of rotary")):
        alibi = "falcon"  # the bias reaches the scores twice, in HF and in TransformerLens
    # BERT: BertLMHeadModel (is_decoder=True) is causal, BertForMaskedLM is not.
    causal = _readers.causal(orig, family, hf_cfg)
    return LayerSpec(
        layer=layer,
        scale=scale,
        softcap=cap,
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
        or family in ("olmo_hybrid", "nanochat", "afmoe", "laguna")
        or (family == "exaone4" and rotary == "none"),  # NoPE: q, k read before their norms
        gate=output_gate(model, orig),
        postrope=_switches.qk_norm_after_rope(model),
        clip=_readers.clip(hf_cfg),
        vnorm=family == "gemma4",  # q, k, v read from their norms (_gemma4)
        kv_from=kv_source(model, orig, layer, family),
    )


def _native_spec(model: Any, layer: int, orig: Any) -> LayerSpec:
    """``NativeAttention`` (TransformerLens 4.x ``boot_native``): scores ``q k^T / scale``,
    soft-cap, causal mask from cfg, adjacent-pair RoPE from its own cos/sin tables."""
    rotary = optional(orig, "rotary")  # None: no rotary
    if rotary is not None and float(required(rotary, "position_scale", "RoPE scaling")) != 1.0:
        raise TLDynamicsError(
            f"layer {layer}: native rotary with rope_scaling (position_scale "
            f"{rotary.position_scale}) is not supported"
        )
    cap = float(required(orig, "attn_scores_soft_cap", "soft-cap; <= 0: none"))
    return LayerSpec(
        layer=layer,
        scale=1.0 / float(required(orig, "scale", "divisor of q.k")),
        softcap=cap if cap > 0 else None,
        window=None,
        causal=bool(required(orig, "causal", "causal mask")),
        rotary="interleaved" if rotary is not None else "none",
        rotary_dim=int(required(rotary, "rotary_dim", "rotated width")) if rotary else None,
        rotary_base=float(required(rotary, "effective_base", "base")) if rotary else None,
        alibi="none",
        scores_hook="pattern",
        qk_norm=False,
    )
