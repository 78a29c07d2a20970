"""What a TransformerLens model is, and how each of its attention layers really scores.

This module reads TransformerLens (and the wrapped Hugging Face modules) once per model and
records, per layer, the facts the recomputation needs: score scale, soft-cap, sliding window,
causality, rotary style, ALiBi. Every value is read from the module that really computes the
scores, never from a config default: on the bridge several cfg fields do not describe the
wrapped model (``attn_scale`` is -1, there is no window, no ``query_pre_attn_scalar``), so they
are never used. Each rule here is checked by the exactness tests
(``tests/test_adapter_exactness.py``), which compare the recomputed scores, pattern, ``z`` and
head outputs with the host's own activations on every architecture listed below, and
``tests/test_hf_truth.py`` / ``tests/test_architectures.py`` against the Hugging Face model itself.
Where the host and Hugging Face disagree the adapter follows the host whose hooks it reads: the
bridge scores GPT-2 and GPT-BigCode with ``d_head**-0.5`` even when ``scale_attn_weights=False``,
and soft-caps Gemma 3 scores when ``attn_logit_softcapping`` is set (Hugging Face Gemma 3 ignores
it). Attention flags the recipe does not model are refused by name (``_flags``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from tl_dynamics.adapter._flags import (REFUSED_ATTENTION, check_bridge_flags, check_hooked_flags,
                                        check_host_version)
from tl_dynamics.adapter._gate import output_gate
from tl_dynamics.adapter._kinds import ATTENTION, layer_kind
from tl_dynamics.adapter._mla import LATENT_BRIDGES
from tl_dynamics.compat import Host, detect_host, tl_major_version, tl_version
from tl_dynamics.errors import TLDynamicsError

RotaryStyle = Literal["none", "hooked", "half", "interleaved"]

# Hugging Face attention modules whose bridge recomputation is tested exact (test_adapter_exactness).
VERIFIED_HF_ATTENTION = {
    "GPT2Attention": "gpt2", "GPTNeoSelfAttention": "gptneo", "GPTJAttention": "gptj",
    "GPTNeoXAttention": "gptneox", "LlamaAttention": "llama", "MistralAttention": "mistral",
    "Qwen2Attention": "qwen2", "Gemma2Attention": "gemma2", "Gemma3Attention": "gemma3",
    "OPTAttention": "opt", "BloomAttention": "bloom", "PhiAttention": "phi",
    "Phi3Attention": "phi3", "OlmoAttention": "olmo", "Olmo2Attention": "olmo2",
    "StableLmAttention": "stablelm", "BertAttention": "bert",
    "NativeAttention": "native",  # TransformerBridge.boot_native (TransformerLensNative)
    # Exact in the generated architecture matrix (tests/test_architectures.py), host and HF:
    "Qwen3Attention": "qwen3", "Qwen3MoeAttention": "qwen3_moe", "Qwen2MoeAttention": "qwen2_moe",
    "MixtralAttention": "mixtral", "GemmaAttention": "gemma", "Starcoder2Attention": "starcoder2",
    "GraniteAttention": "granite", "GraniteMoeAttention": "granitemoe",
    "GPTBigCodeAttention": "gpt_bigcode", "Olmo3Attention": "olmo3", "OlmoeAttention": "olmoe",
    "FlexOlmoAttention": "flex_olmo", "ApertusAttention": "apertus", "SmolLM3Attention": "smollm3",
    "RobertaAttention": "roberta", "XGLMAttention": "xglm", "ArceeAttention": "arcee",
    "SeedOssAttention": "seed_oss", "Glm4MoeAttention": "glm4_moe", "NemotronAttention": "nemotron",
    "Jais2Attention": "jais2", "VaultGemmaAttention": "vaultgemma",
    "MiniMaxM2Attention": "minimax_m2", "Exaone4Attention": "exaone4",
    "FalconAttention": "falcon", "CodeGenAttention": "codegen",
    "Ministral3Attention": "ministral3",  # context limited to its original one (_flags)
    "CohereAttention": "cohere", "Cohere2Attention": "cohere2", "GlmAttention": "glm",
    "Glm4Attention": "glm4", "Ernie4_5Attention": "ernie4_5", "Ernie4_5_MoeAttention": "ernie4_5_moe",
    "MptAttention": "mpt", "GptOssAttention": "gpt_oss",  # GPT-OSS: learned sinks (LayerSpec)
    # issue 23: hybrids (attention on some layers only: LayerSpec.kind) and new dense models
    "JambaAttention": "jamba", "BambaAttention": "bamba", "Lfm2Attention": "lfm2",
    "FalconH1Attention": "falcon_h1", "OpenAIGPTAttention": "openai_gpt",
    # multi-head latent attention (_mla): q/k/v read from MLAAttentionBridge's hooks
    "DeepseekV2Attention": "deepseek_v2", "DeepseekV3Attention": "deepseek_v3",
    "Glm4MoeLiteAttention": "glm4_moe_lite", "YoutuAttention": "youtu",
    # Llama 4 text: its bridge delegates, q/k hooks hold the projections (LayerSpec.prenorm)
    "Llama4TextAttention": "llama4",
    # a delegating bridge without rotary hooks: rotary from the module's own tables (_modrope)
    "ModernBertDecoderAttention": "modernbert_decoder",
    "OlmoHybridAttention": "olmo_hybrid",  # pre-norm hooks (OLMo 2 norms over all heads)
    "NanoChatAttention": "nanochat",  # pre-norm hooks; weightless norm after a reversed rotary
    # gated attention (_gate): z multiplied by sigmoid of q_proj's second half (hook_q_gate)
    "Qwen3NextAttention": "qwen3_next", "Qwen3_5Attention": "qwen3_5",
    "Qwen3_5MoeAttention": "qwen3_5_moe",
    "HunYuanDenseV1Attention": "hunyuan_v1_dense",  # q/k normalised after rotary (_postrope)
    # delegating bridges, pre-norm q/k hooks, gates from their own projections (_gate)
    "AfmoeAttention": "afmoe", "LagunaAttention": "laguna",
    "BitNetAttention": "bitnet",  # attn_sub_norm over all heads of z, as a multiplier (_gate)
}
# Bridge attention classes that recompute attention, so hook_attn_scores holds logits.
RECONSTRUCTING_BRIDGES = {
    "PositionEmbeddingsAttentionBridge", "JointQKVAttentionBridge",
    "JointQKVPositionEmbeddingsAttentionBridge", "BloomAttentionBridge",
    "_SmolLM3AttentionBridge", "_Exaone4AttentionBridge",  # subclasses, tested exact
    "CodeGenAttentionBridge", "_Cohere2AttentionBridge",
    "ALiBiJointQKVAttentionBridge", "MPTALiBiAttentionBridge",  # Falcon ALiBi, MPT
    "_OpenAIGPTJointQKVAttentionBridge", "MLAAttentionBridge", "_BitNetAttentionBridge",
}
# Bridge attention class that runs the HF module and fires hook_attn_scores on its weights.
DELEGATING_BRIDGES = {"AttentionBridge"}


@dataclass(frozen=True)
class LayerSpec:
    """How one attention layer scores, as read from the model (not from cfg defaults).

    Attributes:
        scale: ``c`` in ``s = c <q, k> + bias``.
        softcap: ``cap`` in ``cap * tanh(s / cap)``, or None.
        window: sliding/local window ``w`` (key ``j`` allowed iff ``j > i - w``, and also
            ``j < i + w`` on bidirectional layers: Gemma 3 with use_bidirectional_attention), or None.
        causal: whether key ``j`` must satisfy ``j <= i``.
        rotary: how q and k are rotated: ``"none"``; ``"hooked"`` (the model fires rotated
            q/k hooks); ``"half"`` (rotate_half with the model's cos/sin on the first
            ``rotary_dim`` dims); ``"interleaved"`` (GPT-J style, base ``rotary_base``).
        alibi: ``"none"``, ``"key"`` (Bloom: ``slope_h * key_position``), ``"relative"``
            (HookedTransformer: ``slope_h * (j - i)``), ``"falcon"`` (Falcon with
            ``alibi=True``: Hugging Face adds its bf16 ``a_j = slope_h * key_position`` twice,
            inside the module as ``(q.k + a_j) * scale`` and again through the attention mask
            as ``a_j / sqrt(d_head)``; TransformerLens runs the same two terms) or ``"mpt"``
            (MPT: ``slope_h * (j - (n - 1))`` with MPT's own slopes, not padding-aware).
        scores_hook: what the model's ``hook_attn_scores`` holds: ``"logits"`` (pre-softmax,
            post-mask) or ``"pattern"`` (post-softmax weights, on delegating bridges).
        qk_norm: whether q/k are normalised after their projections (q is then not linear
            in the layer input).
        sinks: whether the layer has learned per-head attention sinks (GPT-OSS): a logit
            ``sink_h`` joins every softmax row as an extra column that is then dropped, so
            ``p_ij = exp(s_ij) / (sum_j exp(s_ij) + exp(sink_h))`` and rows sum to less than 1.
        kind: what the layer mixes tokens with (``_kinds``): ``"attention"`` (softmax attention
            the host hooks: every other field describes it), else e.g. ``"state_space"``,
            ``"linear_attention"``, ``"conv"`` on hybrid and attention-free models, whose other
            fields are placeholders that no recipe reads.
        latent: multi-head latent attention (DeepSeek-V2/V3; ``_mla``): the q/k hooks hold the
            rotated, concatenated non-rotary and rotary parts, so ``rotary`` is ``"none"`` (no
            rotation left to apply; ``ModelAdapter.rotation`` gives the one the model applied, to
            the last coordinates) and the q/k width differs from the value width.
        prenorm: the q/k hooks hold the projections before the layer's q/k norm (Llama 4, whose
            bridge delegates to Hugging Face): the adapter applies the norm (``query_norm``) to
            both before rotary. Llama 4 normalises after rotary; a weightless RMS norm commutes
            with a rotation (it preserves the sum of squares), so the order does not matter.
        gate: the output gate multiplying ``z`` (``_gate.GATE_WHAT``: ``"sigmoid"`` on Qwen3-Next
            and Qwen3.5, ``"gate_proj"`` on AFMoE, ``"g_proj"`` on Laguna, ``"sub_norm"`` on
            BitNet), or None.
        postrope: q and k are normalised after rotary (HunYuan; ``_postrope``): the scored q/k
            are read from the norm's hooks, and ``query_norm`` refuses the layer.
        clip: ``clip_qkv`` (OLMo, OLMoE, MPT): q, k and v clamped to ``[-clip, clip]`` after
            their projections (after the hooks fire), or None.
    """

    layer: int
    scale: float
    softcap: float | None
    window: int | None
    causal: bool
    rotary: RotaryStyle
    rotary_dim: int | None
    rotary_base: float | None
    alibi: Literal["none", "key", "relative", "falcon", "mpt"]
    scores_hook: Literal["logits", "pattern"]
    qk_norm: bool
    sinks: bool = False
    kind: str = ATTENTION
    latent: bool = False
    prenorm: bool = False
    gate: str | None = None
    postrope: bool = False
    clip: float | None = None

    @property
    def is_attention(self) -> bool:
        return self.kind == ATTENTION


@dataclass(frozen=True)
class HostInfo:
    host: Host
    tl_version: str
    compat: bool
    architecture: str
    family: str


def host_info(model: Any) -> HostInfo:
    host = detect_host(model)
    if host == "hooked":
        cfg = model.cfg
        return HostInfo(host, tl_version(), False, str(cfg.original_architecture or "HookedTransformer"),
                        "hooked")
    architecture = str(getattr(model.cfg, "architecture", None) or type(model.original_model).__name__)
    blocks = getattr(model, "blocks", None)
    if not blocks:  # e.g. T5 and other encoder-decoders: no decoder-style blocks
        raise TLDynamicsError(
            f"unsupported architecture {architecture!r}: this TransformerBridge has no "
            "blocks[i] (encoder-decoder models are not supported)")
    # hybrids: the first softmax-attention layer names the family (all of them share it)
    hooked = [block.attn for i, block in enumerate(blocks) if layer_kind(model, i) == ATTENTION]
    if not hooked:  # Mamba, RWKV, or a hybrid whose attention TransformerLens does not hook
        family = "none"
    else:
        orig = hooked[0].original_component
        family = VERIFIED_HF_ATTENTION.get(_attention_name(orig))
        if type(orig).__name__ in REFUSED_ATTENTION:
            raise TLDynamicsError(
                f"unsupported architecture {architecture!r}: its attention module "
                f"{type(orig).__name__}: {REFUSED_ATTENTION[type(orig).__name__]}, which the "
                "recipe does not model; the adapter refuses rather than return attention that "
                "ignores it")
        if family is None:
            raise TLDynamicsError(
                f"unsupported architecture {architecture!r}: its attention module "
                f"{type(orig).__name__} (bridged by {type(hooked[0]).__name__}) has not been "
                f"verified to reproduce exactly; supported attention modules: "
                f"{sorted(VERIFIED_HF_ATTENTION)}, or a HookedTransformer")
    compat = bool(getattr(model, "compatibility_mode", False))
    return HostInfo(host, tl_version(), compat, architecture, family)


def _attention_name(orig: Any) -> str:
    """The attention module's class name; the first GPT's is plain ``Attention``, so it is
    told apart by its module (``OpenAIGPTAttention``)."""
    name = type(orig).__name__
    if name == "Attention" and type(orig).__module__.endswith("modeling_openai"):
        return "OpenAIGPTAttention"
    return name


def layer_specs(model: Any, info: HostInfo) -> list[LayerSpec]:
    if info.host == "hooked":
        check_hooked_flags(model)
        return [_hooked_spec(model, layer) for layer in range(model.cfg.n_layers)]
    check_bridge_flags(model, info.architecture)
    check_host_version(info.family, info.architecture, tl_major_version())
    specs = []
    for layer in range(len(model.blocks)):
        kind = layer_kind(model, layer)
        specs.append(_bridge_spec(model, info, layer) if kind == ATTENTION else LayerSpec(
            layer=layer, scale=1.0, softcap=None, window=None, causal=True, rotary="none",
            rotary_dim=None, rotary_base=None, alibi="none", scores_hook="logits", qk_norm=False,
            kind=kind))
    return specs


def _hooked_spec(model: Any, layer: int) -> LayerSpec:
    cfg = model.cfg
    attn = model.blocks[layer].attn
    for flag, what in (("use_logn_attn", "log-n attention scaling"),):
        if getattr(cfg, flag, False):
            raise TLDynamicsError(f"unsupported HookedTransformer config: {flag}=True ({what}) "
                                  "is not part of the exact score recipe")
    pos_type = cfg.positional_embedding_type
    if pos_type not in ("standard", "rotary", "alibi", "shortformer"):
        raise TLDynamicsError(f"unsupported positional_embedding_type {pos_type!r}; "
                              "supported: standard, shortformer, rotary, alibi")
    # cfg.attn_types alone is not used; the window lives in the causal mask, which a
    # bidirectional HookedTransformer does not apply at all
    local = getattr(attn, "attn_type", "global") == "local" and cfg.attention_dir == "causal"
    cap = getattr(cfg, "attn_scores_soft_cap", -1.0)
    return LayerSpec(
        layer=layer, scale=1.0 / float(attn.attn_scale),
        softcap=float(cap) if cap and cap > 0 else None,
        window=int(cfg.window_size) if local else None,
        causal=cfg.attention_dir == "causal",
        rotary="hooked" if pos_type == "rotary" else "none",
        rotary_dim=cfg.rotary_dim if pos_type == "rotary" else None,
        rotary_base=float(cfg.rotary_base) if pos_type == "rotary" else None,
        alibi="relative" if pos_type == "alibi" else "none",
        scores_hook="logits", qk_norm=getattr(attn, "q_norm", None) is not None,
        sinks=bool(getattr(cfg, "use_attention_sinks", False)))


def hooked_post_norm(model: Any) -> str | None:
    """HookedTransformer blocks that normalise the attention output before ``hook_attn_out``:
    ``"both"`` (``use_normalization_before_and_after``, e.g. Gemma 2) or ``"post"`` (OLMo 2
    post-norm, whose attention reads the unnormalised stream); None elsewhere."""
    cfg = model.cfg
    if getattr(cfg, "use_normalization_before_and_after", False):
        return "both"
    try:
        from transformer_lens.utilities.architectures import POST_NORM_ARCHITECTURES
    except ImportError:  # older 3.x: no post-norm blocks
        return None
    return "post" if getattr(cfg, "original_architecture", None) in POST_NORM_ARCHITECTURES else None


def _bridge_spec(model: Any, info: HostInfo, layer: int) -> LayerSpec:
    attn = model.blocks[layer].attn
    orig = attn.original_component
    hf_cfg = getattr(model.original_model, "config", None)
    kind = type(attn).__name__
    if kind not in RECONSTRUCTING_BRIDGES | DELEGATING_BRIDGES:
        raise TLDynamicsError(f"unsupported attention bridge {kind} in layer {layer} of "
                              f"{info.architecture}; supported: "
                              f"{sorted(RECONSTRUCTING_BRIDGES | DELEGATING_BRIDGES)}")
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
        scale = model.cfg.d_head ** -0.5 if bool(orig.scale) else 1.0
    elif kind == "JointQKVAttentionBridge":  # GPT-2: the bridge ignores scale_attn_weights
        scale = model.cfg.d_head ** -0.5 / (
            layer + 1 if getattr(hf_cfg, "scale_attn_by_inverse_layer_idx", False) else 1)
    else:
        scale = float(getattr(orig, "scaling", None) or orig.self.scaling)

    cap = getattr(orig, "attn_logit_softcapping", None)
    if hasattr(orig, "sliding_window"):
        window = orig.sliding_window
    elif hasattr(orig, "attention_type"):
        window = None
        if orig.attention_type == "local":  # GPT-Neo: the window is in the model's config
            if hf_cfg is None:
                raise TLDynamicsError(f"layer {layer} of {info.architecture} uses local attention "
                                      "but the model has no config giving its window")
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
    causal = bool(getattr(orig, "is_causal", getattr(getattr(orig, "self", None), "is_causal", True)))
    if family == "bert":
        causal = bool(getattr(hf_cfg, "is_decoder", False))
    return LayerSpec(
        layer=layer, scale=scale, softcap=float(cap) if cap else None,
        window=int(window) if window else None, causal=causal,
        rotary=rotary, rotary_dim=rotary_dim, rotary_base=base,
        alibi=alibi,
        scores_hook="logits" if kind in RECONSTRUCTING_BRIDGES else "pattern",
        qk_norm=any(getattr(orig, name, None) is not None
                    for name in ("q_norm", "q_layernorm", "qk_norm", "query_layernorm")),
        sinks=getattr(orig, "sinks", None) is not None, latent=latent,
        prenorm=(family == "llama4" and getattr(orig, "qk_norm", None) is not None)
        or family in ("olmo_hybrid", "nanochat", "afmoe", "laguna"), gate=output_gate(model, orig),
        postrope=bool(getattr(model.cfg, "qk_norm_after_rope", False)),
        clip=float(clip) if (clip := getattr(hf_cfg, "clip_qkv", None) or getattr(
            getattr(hf_cfg, "attn_config", None), "clip_qkv", None)) else None)


def _native_spec(model: Any, layer: int, orig: Any) -> LayerSpec:
    """``NativeAttention`` (TransformerLens 4.x ``boot_native``): scores ``q k^T / scale``,
    soft-cap, causal mask from cfg, adjacent-pair RoPE from its own cos/sin tables."""
    rotary = getattr(orig, "rotary", None)
    if rotary is not None and float(getattr(rotary, "position_scale", 1.0)) != 1.0:
        raise TLDynamicsError(f"layer {layer}: native rotary with rope_scaling (position_scale "
                              f"{rotary.position_scale}) is not supported")
    cap = float(getattr(orig, "attn_scores_soft_cap", -1.0))
    return LayerSpec(
        layer=layer, scale=1.0 / float(orig.scale), softcap=cap if cap > 0 else None, window=None,
        causal=bool(orig.causal), rotary="interleaved" if rotary is not None else "none",
        rotary_dim=int(rotary.rotary_dim) if rotary is not None else None,
        rotary_base=float(rotary.effective_base) if rotary is not None else None,
        alibi="none", scores_hook="pattern", qk_norm=False)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi head slopes as Bloom/HF build them (also HookedTransformer's multipliers)."""
    closest = 2 ** math.floor(math.log2(n_heads))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != n_heads:
        extra_base = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        n_extra = min(closest, n_heads - closest)
        slopes += [extra_base ** (2 * i + 1) for i in range(n_extra)]
    return torch.tensor(slopes, dtype=torch.float32)


def mpt_alibi_slopes(n_heads: int, alibi_bias_max: int = 8) -> torch.Tensor:
    """ALiBi head slopes as Hugging Face MPT builds them (``build_mpt_alibi_tensor``).

    Example:
        >>> mpt_alibi_slopes(4)
        tensor([0.2500, 0.0625, 0.0156, 0.0039])
    """
    power = 2 ** math.ceil(math.log2(n_heads))
    base = torch.arange(1, power + 1, dtype=torch.int64).float() * (alibi_bias_max / power)
    slopes = 1.0 / torch.pow(2, base)
    if power != n_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:n_heads]
    return slopes
