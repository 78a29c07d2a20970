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

What is read is a ``LayerSpec`` per layer and one ``HostInfo`` (``_spec``); a bridge's layers are
read by ``_bridgespec``, a HookedTransformer's here.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tl_dynamics.adapter._bridgespec import bridge_spec
from tl_dynamics.adapter._flags import (
    REFUSED_ATTENTION,
    check_bridge_flags,
    check_hooked_flags,
    check_host_version,
)
from tl_dynamics.adapter._kinds import ATTENTION, layer_kind
from tl_dynamics.adapter._nonstandard import structure_refusal
from tl_dynamics.adapter._readers import required
from tl_dynamics.adapter._spec import HostInfo, LayerSpec
from tl_dynamics.adapter._unhooked import unhooked_family, unhooked_spec
from tl_dynamics.compat import detect_host, tl_major_version, tl_version
from tl_dynamics.errors import TLDynamicsError

# Hugging Face attention modules whose bridge recomputation is tested exact (test_adapter_exactness).
VERIFIED_HF_ATTENTION = {
    "GPT2Attention": "gpt2",
    "GPTNeoSelfAttention": "gptneo",
    "GPTJAttention": "gptj",
    "GPTNeoXAttention": "gptneox",
    "LlamaAttention": "llama",
    "MistralAttention": "mistral",
    "Qwen2Attention": "qwen2",
    "Gemma2Attention": "gemma2",
    "Gemma3Attention": "gemma3",
    "OPTAttention": "opt",
    "BloomAttention": "bloom",
    "PhiAttention": "phi",
    "Phi3Attention": "phi3",
    "OlmoAttention": "olmo",
    "Olmo2Attention": "olmo2",
    "StableLmAttention": "stablelm",
    "BertAttention": "bert",
    "NativeAttention": "native",  # TransformerBridge.boot_native (TransformerLensNative)
    # Exact in the generated architecture matrix (tests/test_architectures.py), host and HF:
    "Qwen3Attention": "qwen3",
    "Qwen3MoeAttention": "qwen3_moe",
    "Qwen2MoeAttention": "qwen2_moe",
    "MixtralAttention": "mixtral",
    "GemmaAttention": "gemma",
    "Starcoder2Attention": "starcoder2",
    "GraniteAttention": "granite",
    "GraniteMoeAttention": "granitemoe",
    "GPTBigCodeAttention": "gpt_bigcode",
    "Olmo3Attention": "olmo3",
    "OlmoeAttention": "olmoe",
    "FlexOlmoAttention": "flex_olmo",
    "ApertusAttention": "apertus",
    "SmolLM3Attention": "smollm3",
    "RobertaAttention": "roberta",
    "XGLMAttention": "xglm",
    "ArceeAttention": "arcee",
    "SeedOssAttention": "seed_oss",
    "Glm4MoeAttention": "glm4_moe",
    "NemotronAttention": "nemotron",
    "Jais2Attention": "jais2",
    "VaultGemmaAttention": "vaultgemma",
    "MiniMaxM2Attention": "minimax_m2",
    "Exaone4Attention": "exaone4",
    "FalconAttention": "falcon",
    "CodeGenAttention": "codegen",
    "Ministral3Attention": "ministral3",  # context limited to its original one (_flags)
    "CohereAttention": "cohere",
    "Cohere2Attention": "cohere2",
    "GlmAttention": "glm",
    "Glm4Attention": "glm4",
    "Ernie4_5Attention": "ernie4_5",
    "Ernie4_5_MoeAttention": "ernie4_5_moe",
    "MptAttention": "mpt",
    "GptOssAttention": "gpt_oss",  # GPT-OSS: learned sinks (LayerSpec)
    # issue 23: hybrids (attention on some layers only: LayerSpec.kind) and new dense models
    "JambaAttention": "jamba",
    "BambaAttention": "bamba",
    "Lfm2Attention": "lfm2",
    "FalconH1Attention": "falcon_h1",
    "OpenAIGPTAttention": "openai_gpt",
    # multi-head latent attention (_mla): q/k/v read from MLAAttentionBridge's hooks
    "DeepseekV2Attention": "deepseek_v2",
    "DeepseekV3Attention": "deepseek_v3",
    "Glm4MoeLiteAttention": "glm4_moe_lite",
    "YoutuAttention": "youtu",
    # Llama 4 text: its bridge delegates, q/k hooks hold the projections (LayerSpec.prenorm)
    "Llama4TextAttention": "llama4",
    # a delegating bridge without rotary hooks: rotary from the module's own tables (_modrope)
    "ModernBertDecoderAttention": "modernbert_decoder",
    "OlmoHybridAttention": "olmo_hybrid",  # pre-norm hooks (OLMo 2 norms over all heads)
    "NanoChatAttention": "nanochat",  # pre-norm hooks; weightless norm after a reversed rotary
    # gated attention (_gate): z multiplied by sigmoid of q_proj's second half (hook_q_gate)
    "Qwen3NextAttention": "qwen3_next",
    "Qwen3_5Attention": "qwen3_5",
    "Qwen3_5MoeAttention": "qwen3_5_moe",
    "HunYuanDenseV1Attention": "hunyuan_v1_dense",  # q/k normalised after rotary (_postrope)
    # delegating bridges, pre-norm q/k hooks, gates from their own projections (_gate)
    "AfmoeAttention": "afmoe",
    "LagunaAttention": "laguna",
    "BitNetAttention": "bitnet",  # attn_sub_norm over all heads of z, as a multiplier (_gate)
    "JetMoeAttention": "jetmoe",  # router-chosen query and output experts (_jetmoe)
    "Gemma4TextAttention": "gemma4",  # q, k, v normalised; widths per layer (_gemma4)
}


def host_info(model: Any) -> HostInfo:
    host = detect_host(model)
    if host == "hooked":
        cfg = model.cfg
        return HostInfo(
            host,
            tl_version(),
            False,
            str(cfg.original_architecture or _own_name(cfg) or "HookedTransformer"),
            "hooked",
        )
    architecture = str(
        getattr(model.cfg, "architecture", None) or type(model.original_model).__name__
    )
    refusal = structure_refusal(model, architecture)  # DeepSeek V4 (mHC), HRM-Text (recurrent)
    if refusal is not None:
        raise refusal
    if architecture == "TransformerLensNative":  # TransformerLens's marker: say the checkpoint's
        architecture = _own_name(model.cfg) or architecture
    blocks = getattr(model, "blocks", None)
    if not blocks:  # e.g. T5 and other encoder-decoders: no decoder-style blocks
        raise TLDynamicsError(
            f"unsupported architecture {architecture!r}: this TransformerBridge has no "
            "blocks[i] (encoder-decoder models are not supported)"
        )
    # hybrids: the first softmax-attention layer names the family (all of them share it)
    hooked = [block.attn for i, block in enumerate(blocks) if layer_kind(model, i) == ATTENTION]
    if not hooked:  # Mamba, RWKV, or a hybrid whose attention TransformerLens does not hook
        family = unhooked_family(model) or "none"  # read by torch hooks (_unhooked)
    else:
        orig = hooked[0].original_component
        family = VERIFIED_HF_ATTENTION.get(_attention_name(orig))
        if type(orig).__name__ in REFUSED_ATTENTION:
            raise TLDynamicsError(
                f"unsupported architecture {architecture!r}: its attention module "
                f"{type(orig).__name__}: {REFUSED_ATTENTION[type(orig).__name__]}, which the "
                "recipe does not model; the adapter refuses rather than return attention that "
                "ignores it"
            )
        if family is None:
            raise TLDynamicsError(
                f"unsupported architecture {architecture!r}: its attention module "
                f"{type(orig).__name__} (bridged by {type(hooked[0]).__name__}) has not been "
                f"verified to reproduce exactly; supported attention modules: "
                f"{sorted(VERIFIED_HF_ATTENTION)}, or a HookedTransformer"
            )
    compat = bool(getattr(model, "compatibility_mode", False))
    return HostInfo(host, tl_version(), compat, architecture, family)


def _own_name(cfg: Any) -> str | None:
    """A TransformerLens checkpoint's own name (``code-2l``), where its config gives one: what
    the user loaded, not the host's class."""
    name = getattr(cfg, "model_name", None)
    return str(name) if name and name != "custom" else None


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
        if kind == "unhooked_attention" and info.family != "none":
            specs.append(unhooked_spec(model, layer, info.architecture))
            continue
        specs.append(
            bridge_spec(model, info, layer)
            if kind == ATTENTION
            else LayerSpec(
                layer=layer,
                scale=1.0,
                softcap=None,
                window=None,
                causal=True,
                rotary="none",
                rotary_dim=None,
                rotary_base=None,
                alibi="none",
                scores_hook="logits",
                qk_norm=False,
                kind=kind,
            )
        )
    return specs


def _hooked_spec(model: Any, layer: int) -> LayerSpec:
    cfg = model.cfg
    attn = model.blocks[layer].attn
    for flag, what in (("use_logn_attn", "log-n attention scaling"),):
        if getattr(cfg, flag, False):
            raise TLDynamicsError(
                f"unsupported HookedTransformer config: {flag}=True ({what}) "
                "is not part of the exact score recipe"
            )
    pos_type = cfg.positional_embedding_type
    if pos_type not in ("standard", "rotary", "alibi", "shortformer"):
        raise TLDynamicsError(
            f"unsupported positional_embedding_type {pos_type!r}; "
            "supported: standard, shortformer, rotary, alibi"
        )
    # cfg.attn_types alone is not used; the window lives in the causal mask, which a
    # bidirectional HookedTransformer does not apply at all
    attn_type = required(attn, "attn_type", "global or local")
    local = attn_type == "local" and cfg.attention_dir == "causal"
    cap = required(cfg, "attn_scores_soft_cap", "soft-cap; <= 0: none")
    return LayerSpec(
        layer=layer,
        scale=1.0 / float(required(attn, "attn_scale", "divisor of q.k")),
        softcap=float(cap) if cap and cap > 0 else None,
        window=int(required(cfg, "window_size", "local window")) if local else None,
        causal=cfg.attention_dir == "causal",
        rotary="hooked" if pos_type == "rotary" else "none",
        rotary_dim=cfg.rotary_dim if pos_type == "rotary" else None,
        rotary_base=float(cfg.rotary_base) if pos_type == "rotary" else None,
        alibi="relative" if pos_type == "alibi" else "none",
        scores_hook="logits",
        qk_norm=getattr(attn, "q_norm", None) is not None,
        sinks=bool(required(cfg, "use_attention_sinks", "learned attention sinks")),
    )


def hooked_post_norm(model: Any) -> str | None:
    """HookedTransformer blocks that normalise the attention output before ``hook_attn_out``:
    ``"both"`` (``use_normalization_before_and_after``, e.g. Gemma 2) or ``"post"`` (OLMo 2
    post-norm, whose attention reads the unnormalised stream); None elsewhere."""
    cfg = model.cfg
    if required(cfg, "use_normalization_before_and_after", "attention output normalised"):
        return "both"
    try:
        from transformer_lens.utilities.architectures import POST_NORM_ARCHITECTURES
    except ImportError:  # older 3.x: no post-norm blocks
        return None
    return (
        "post" if getattr(cfg, "original_architecture", None) in POST_NORM_ARCHITECTURES else None
    )


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
