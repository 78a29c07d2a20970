"""The tiny models' shapes and configurations, re-exported by ``tl_dynamics.testing``.

``HF_ARCHS`` (the exactness matrix, as Hugging Face config and model classes),
``HF_FLAG_VARIANTS`` (flags outside the matrix: reproduced exactly or refused by name),
``HOOKED_VARIANTS`` (``HookedTransformerConfig``, TransformerLens 3.x) and ``NATIVE_VARIANTS``
(``TransformerBridge.boot_native``, TransformerLens 4.x); ``tl_dynamics.testing`` builds them.

Example:
    >>> HF_ARCHS["llama"][:2], HOOKED_VARIANTS["alibi"]["positional_embedding_type"]
    (('LlamaConfig', 'LlamaForCausalLM'), 'alibi')
"""

from __future__ import annotations

from typing import Any

D_MODEL, N_HEADS, D_HEAD, N_LAYERS, N_CTX = 64, 4, 16, 2, 64
INIT_STD = 0.2
WINDOW = 4
SOFTCAP = 2.0
QUERY_PRE_ATTN_SCALAR = 32  # != D_HEAD, so a scale read from cfg.d_head would be wrong

_COMMON = dict(
    num_hidden_layers=N_LAYERS,
    hidden_size=D_MODEL,
    num_attention_heads=N_HEADS,
    intermediate_size=4 * D_MODEL,
    max_position_embeddings=N_CTX,
    initializer_range=INIT_STD,
)
_GQA = dict(num_key_value_heads=2)

# arch name -> (transformers config class, model class, config kwargs)
HF_ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(
            n_layer=N_LAYERS,
            n_embd=D_MODEL,
            n_head=N_HEADS,
            n_positions=N_CTX,
            initializer_range=INIT_STD,
        ),
    ),
    "gptneo": (
        "GPTNeoConfig",
        "GPTNeoForCausalLM",
        dict(
            num_layers=N_LAYERS,
            hidden_size=D_MODEL,
            num_heads=N_HEADS,
            attention_types=[[["global", "local"], 1]],
            window_size=WINDOW,
            max_position_embeddings=N_CTX,
            initializer_range=INIT_STD,
        ),
    ),
    "gptj": (
        "GPTJConfig",
        "GPTJForCausalLM",
        dict(
            n_layer=N_LAYERS,
            n_embd=D_MODEL,
            n_head=N_HEADS,
            rotary_dim=8,
            n_positions=N_CTX,
            initializer_range=INIT_STD,
        ),
    ),
    "gptneox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(_COMMON, rotary_pct=0.25)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_COMMON, **_GQA)),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(_COMMON, **_GQA, sliding_window=WINDOW),
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_COMMON, **_GQA)),
    "qwen2-sliding": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            _COMMON,
            **_GQA,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,
            layer_types=["full_attention", "sliding_attention"],
        ),
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            _COMMON,
            **_GQA,
            head_dim=D_HEAD,
            query_pre_attn_scalar=QUERY_PRE_ATTN_SCALAR,
            attn_logit_softcapping=SOFTCAP,
            final_logit_softcapping=None,
            sliding_window=WINDOW,
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            _COMMON,
            **_GQA,
            head_dim=D_HEAD,
            query_pre_attn_scalar=QUERY_PRE_ATTN_SCALAR,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        dict(
            num_hidden_layers=N_LAYERS,
            hidden_size=D_MODEL,
            num_attention_heads=N_HEADS,
            ffn_dim=4 * D_MODEL,
            word_embed_proj_dim=D_MODEL,
            max_position_embeddings=N_CTX,
            init_std=INIT_STD,
        ),
    ),
    "bloom": (
        "BloomConfig",
        "BloomForCausalLM",
        dict(n_layer=N_LAYERS, hidden_size=D_MODEL, n_head=N_HEADS, initializer_range=INIT_STD),
    ),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(_COMMON, partial_rotary_factor=0.5)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_COMMON, pad_token_id=0)),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", dict(_COMMON)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(_COMMON)),
    "stablelm": (
        "StableLmConfig",
        "StableLmForCausalLM",
        dict(_COMMON, num_key_value_heads=N_HEADS, partial_rotary_factor=0.25),
    ),
    "bert": (
        "BertConfig",
        "BertForMaskedLM",
        dict(
            num_hidden_layers=N_LAYERS,
            hidden_size=D_MODEL,
            num_attention_heads=N_HEADS,
            intermediate_size=4 * D_MODEL,
            max_position_embeddings=N_CTX,
            initializer_range=INIT_STD,
        ),
    ),
}

# Configuration flags outside the exactness matrix (issue 13): each one either reproduces
# exactly or is refused by the adapter with a TLDynamicsError naming the flag. Same format.
HF_FLAG_VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "bert-decoder": ("BertConfig", "BertLMHeadModel", dict(HF_ARCHS["bert"][2], is_decoder=True)),
    "bert-relative": (
        "BertConfig",
        "BertForMaskedLM",
        dict(HF_ARCHS["bert"][2], position_embedding_type="relative_key"),
    ),
    "gemma3-bidirectional": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(HF_ARCHS["gemma3"][2], use_bidirectional_attention=True),
    ),
    "gemma3-softcap": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(HF_ARCHS["gemma3"][2], attn_logit_softcapping=SOFTCAP),
    ),
    "olmo-clip-qkv": ("OlmoConfig", "OlmoForCausalLM", dict(_COMMON, clip_qkv=0.1)),
    "gpt2-unscaled": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(HF_ARCHS["gpt2"][2], scale_attn_weights=False),
    ),
    "gpt2-inverse-layer": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(HF_ARCHS["gpt2"][2], scale_attn_by_inverse_layer_idx=True),
    ),
    "stablelm-qk-layernorm": (
        "StableLmConfig",
        "StableLmForCausalLM",
        dict(HF_ARCHS["stablelm"][2], qk_layernorm=True),
    ),
}

# HookedTransformerConfig variants (TransformerLens 3.x)
_HT_BASE = dict(
    n_layers=N_LAYERS,
    d_model=D_MODEL,
    n_heads=N_HEADS,
    d_head=D_HEAD,
    n_ctx=N_CTX,
    d_mlp=4 * D_MODEL,
    act_fn="gelu",
    initializer_range=INIT_STD,
    seed=0,
    normalization_type="LN",
)
HOOKED_VARIANTS: dict[str, dict[str, Any]] = {
    "gpt2-like": dict(_HT_BASE),
    "rotary": dict(_HT_BASE, positional_embedding_type="rotary", rotary_dim=8),
    "gqa-rms": dict(
        _HT_BASE,
        positional_embedding_type="rotary",
        rotary_dim=D_HEAD,
        n_key_value_heads=2,
        normalization_type="RMS",
        act_fn="silu",
        gated_mlp=True,
    ),
    "attn-only": dict(_HT_BASE, attn_only=True, d_mlp=None),
    "no-norm": dict(_HT_BASE, normalization_type=None),
    "ln-pre": dict(_HT_BASE, normalization_type="LNPre"),
    "softcap": dict(_HT_BASE, attn_scores_soft_cap=SOFTCAP),
    "alibi": dict(_HT_BASE, positional_embedding_type="alibi"),
    "local": dict(
        _HT_BASE, attn_types=["global", "local"], window_size=WINDOW, use_local_attn=True
    ),
    "attn-scale-2": dict(_HT_BASE, attn_scale=2.0),
    "bidirectional": dict(_HT_BASE, attention_dir="bidirectional"),
    "qk-norm": dict(
        _HT_BASE,
        positional_embedding_type="rotary",
        rotary_dim=D_HEAD,
        normalization_type="RMS",
        use_qk_norm=True,
    ),
    # OLMo 2 layout: q/k norm over all heads, post-norm blocks (attention reads the raw stream)
    "olmo2-post-norm": dict(
        _HT_BASE,
        positional_embedding_type="rotary",
        rotary_dim=D_HEAD,
        normalization_type="RMS",
        original_architecture="Olmo2ForCausalLM",
    ),
    # Gemma 2 layout: a norm before and after attention and MLP
    "norm-before-after": dict(
        _HT_BASE, normalization_type="RMS", use_normalization_before_and_after=True
    ),
}

# TransformerBridge.boot_native (TransformerLensNative; TransformerLens 4.x): the zoo's format.
_NATIVE_BASE = dict(
    d_model=D_MODEL,
    n_layers=N_LAYERS,
    n_heads=N_HEADS,
    d_head=D_HEAD,
    n_ctx=N_CTX,
    d_mlp=4 * D_MODEL,
    act_fn="gelu",
)
NATIVE_VARIANTS: dict[str, dict[str, Any]] = {
    "native": dict(_NATIVE_BASE),
    "native-rotary-gqa": dict(
        _NATIVE_BASE,
        positional_embedding_type="rotary",
        rotary_dim=8,
        n_key_value_heads=2,
        normalization_type="RMS",
        act_fn="silu",
    ),
    "native-softcap-bidirectional": dict(
        _NATIVE_BASE, attn_scores_soft_cap=SOFTCAP, attention_dir="bidirectional"
    ),
}
