"""The generated architecture matrix: every architecture the installed TransformerBridge supports.

The rows come from TransformerLens's own registry of supported architectures, read at test time,
so a new TransformerLens version adds rows by itself. For each text language model whose class
``transformers`` ships, a tiny random model is built from its config class and booted through
the bridge; the adapter must then either reproduce attention exactly (against the host's own
hooks and against the Hugging Face model itself) or refuse with a ``TLDynamicsError`` that names
the architecture. Never a silent number, never a raw exception. Rows that cannot be built here
(no class in this ``transformers``, not a text model, or TransformerLens itself cannot boot or
run the tiny model) are skipped with that reason, so the skip list is the rest of the matrix.
"""

import inspect
import math
import re
import tempfile

import pytest
import torch

from tl_dynamics import compat, testing
from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.contextual_mlp._collect import from_layer
from tl_dynamics.odds_ratio._collect import decompose_layer

EXACT_TOL = 1e-5  # fp32 sums reordered (as in test_adapter_exactness and test_hf_truth)
# Measured host-vs-HF gaps above EXACT_TOL (see test_hf_truth.HF_GAP for the reasons).
HF_GAP = {"GPTNeoForCausalLM": 5e-5, "BloomForCausalLM": 2e-5}
TEXT_HEADS = ("ForCausalLM", "LMHeadModel", "ForMaskedLM")
# Rows measured exact on both hosts (TransformerLens 3.9 and 4.3 bridges): a refusal there is a
# regression, not a safe answer.
MUST_BE_EXACT = {
    "ApertusForCausalLM", "ArceeForCausalLM", "BertForMaskedLM", "BertLMHeadModel",
    "BloomForCausalLM", "CodeGenForCausalLM", "Exaone4ForCausalLM", "FalconForCausalLM",
    "FlexOlmoForCausalLM", "GPT2LMHeadModel", "GPTBigCodeForCausalLM", "GPTJForCausalLM",
    "GPTNeoForCausalLM", "GPTNeoXForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
    "GemmaForCausalLM", "Glm4MoeForCausalLM", "GraniteForCausalLM", "GraniteMoeForCausalLM",
    "Jais2ForCausalLM", "LlamaForCausalLM", "MiniMaxM2ForCausalLM", "MistralForCausalLM",
    "MixtralForCausalLM", "NemotronForCausalLM", "OPTForCausalLM", "Olmo2ForCausalLM",
    "Olmo3ForCausalLM", "OlmoForCausalLM", "OlmoeForCausalLM", "Phi3ForCausalLM",
    "PhiForCausalLM", "Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM", "RobertaForMaskedLM", "SeedOssForCausalLM", "SmolLM3ForCausalLM",
    "StableLmForCausalLM", "Starcoder2ForCausalLM", "VaultGemmaForCausalLM", "XGLMForCausalLM",
    "falcon-rotary", "phi3-sliding", "qwen3-sliding", "granite-attention-multiplier",
    "gpt_bigcode-unscaled", "Ministral3ForCausalLM", "GlmForCausalLM", "Glm4ForCausalLM", "Ernie4_5ForCausalLM",
    "Ernie4_5_MoeForCausalLM", "falcon-alibi", "MptForCausalLM", "GptOssForCausalLM",
}
# Exact on the TransformerLens 4.x bridge; the 3.9 bridge's rotated queries are not reproduced
# by its own cos/sin tables there, so the adapter refuses them (by name) on 3.9.
if compat.tl_major_version() >= 4:
    MUST_BE_EXACT |= {"CohereForCausalLM", "Cohere2ForCausalLM", "cohere-qk-norm"}

# One tiny config for every family: each key is passed only where the config class takes it.
_TINY = dict(
    num_hidden_layers=2, n_layer=2, num_layers=2, n_layers=2,
    hidden_size=64, n_embd=64, d_model=64,
    num_attention_heads=4, n_head=4, num_heads=4, n_heads=4, num_key_value_heads=2,
    head_dim=16, kv_channels=16, rotary_dim=8,
    intermediate_size=256, ffn_dim=256, n_inner=256, d_ff=256,
    max_position_embeddings=64, n_positions=64, n_ctx=64, max_seq_len=64,
    initializer_range=0.2, init_std=0.2,
    num_local_experts=4, num_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=32,
    bos_token_id=0, eos_token_id=0, pad_token_id=0, sliding_window=4, window_size=4,
    use_cache=False, tie_word_embeddings=False,
)
# Families whose config validates a per-layer list against the layer count.
_EXTRA = {"GPTNeoForCausalLM": dict(attention_types=[[["global", "local"], 1]])}


def supported_architectures() -> list[str]:
    """TransformerLens's own list of the architectures its bridge supports."""
    from transformer_lens.factories import architecture_adapter_factory

    return list(architecture_adapter_factory.SUPPORTED_ARCHITECTURES)


def tiny_config(name: str, config_class, **overrides):
    accepted = set(inspect.signature(config_class.__init__).parameters)
    accepted |= set(getattr(config_class, "__dataclass_fields__", {}) or {})
    accepted |= set(getattr(config_class, "attribute_map", {}) or {})
    kwargs = {k: v for k, v in _TINY.items() if k in accepted}
    kwargs.update(_EXTRA.get(name, {}), **overrides)
    config = config_class(vocab_size=len(testing.tokenizer()), **kwargs)
    config.architectures = [name]
    return config


def boot_tiny(name: str, **overrides):
    """A tiny random bridge of ``name``, or ``pytest.skip`` with the reason it cannot be had."""
    import transformers

    if not name.endswith(TEXT_HEADS):
        pytest.skip(f"{name}: not a text language model (not built by this matrix)")
    model_class = getattr(transformers, name, None)
    if model_class is None or getattr(model_class, "config_class", None) is None:
        pytest.skip(f"{name}: this transformers {transformers.__version__} has no such class "
                    "(remote code only)")
    try:
        config = tiny_config(name, model_class.config_class, **overrides)
        torch.manual_seed(0)
        hf = model_class(config).eval()
        hf.set_attn_implementation("eager")  # as boot_transformers loads a folder
    except Exception as exc:  # the config class rejects a tiny generic config
        pytest.skip(f"{name}: no tiny config here ({type(exc).__name__}: {str(exc)[:80]})")
    folder = tempfile.mkdtemp(prefix="tl_dynamics_arch_")
    config.save_pretrained(folder)
    testing.tokenizer().save_pretrained(folder)
    try:
        model = testing.bridge_class().boot_transformers(folder, device="cpu", hf_model=hf)
        model.eval()
        with torch.no_grad():
            model(model.to_tokens(testing.PROMPTS[0]))
    except Exception as exc:
        pytest.skip(f"{name}: TransformerLens itself cannot boot or run it "
                    f"({type(exc).__name__}: {str(exc)[:80]})")
    return model


@pytest.mark.parametrize("name", supported_architectures())
def test_architecture_is_exact_or_refused_by_name(name):
    check_exact_or_refused(name, boot_tiny(name))


def check_exact_or_refused(name, model, row=None):
    row = row or name
    try:
        adapter = ModelAdapter(model)
        host = [testing.reconstruction_errors(adapter, testing.PROMPTS, side) for side in ("right", "left")]
        hf = [] if row in HOST_NOT_HF else [
            testing.hf_truth_errors(adapter, testing.hf_twin(model), testing.PROMPTS, "left")]
    except TLDynamicsError as exc:
        assert row not in MUST_BE_EXACT, f"{row} was exact and is now refused: {exc}"
        assert name in str(exc) or model.cfg.architecture in str(exc), str(exc)
        return
    for errors in host:
        for key in ("pattern", "z", "out", "scores"):
            assert math.isnan(errors[key]) or errors[key] <= EXACT_TOL, (key, errors)
        assert errors["pattern"] <= EXACT_TOL
    tol = HF_GAP.get(name, EXACT_TOL)
    for errors in hf:
        assert errors["pattern"] <= tol and errors["out"] <= tol, errors


def test_the_registry_is_read_not_copied():
    names = supported_architectures()
    assert "GPT2LMHeadModel" in names and "LlamaForCausalLM" in names and len(names) > 20


# Variants of one registry row whose attention differs (Falcon: rotary or ALiBi; parallel or
# new decoder blocks), each built from the same config class with these overrides.
VARIANTS = {
    "falcon-rotary": ("FalconForCausalLM", dict(alibi=False)),
    "falcon-alibi": ("FalconForCausalLM", dict(alibi=True)),
    "falcon-new-decoder": ("FalconForCausalLM", dict(new_decoder_architecture=True, num_kv_heads=2)),
    "phi3-sliding": ("Phi3ForCausalLM", dict(sliding_window=4)),
    "qwen3-sliding": ("Qwen3ForCausalLM", dict(use_sliding_window=True, max_window_layers=1,
                                               layer_types=["full_attention", "sliding_attention"])),
    "granite-attention-multiplier": ("GraniteForCausalLM", dict(attention_multiplier=0.3)),
    "smollm3-nope-layer": ("SmolLM3ForCausalLM", dict(no_rope_layers=[1, 0])),
    "olmoe-clip-qkv": ("OlmoeForCausalLM", dict(clip_qkv=0.5)),
    "phi-qk-layernorm": ("PhiForCausalLM", dict(qk_layernorm=True)),
    "gpt_bigcode-unscaled": ("GPTBigCodeForCausalLM", dict(scale_attn_weights=False)),
    "cohere-qk-norm": ("CohereForCausalLM", dict(use_qk_norm=True)),
    "mpt-clip-qkv": ("MptForCausalLM", dict(attn_config=dict(clip_qkv=0.5))),
}
# Rows where the adapter follows the host it reads, and the host itself is not the Hugging Face
# model: checked against the host only, with the reason.
HOST_NOT_HF = {
    "gpt_bigcode-unscaled": "TransformerLens scores with d_head**-0.5 although scale_attn_weights=False",
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_is_exact_or_refused_by_name(variant):
    name, overrides = VARIANTS[variant]
    check_exact_or_refused(name, boot_tiny(name, **overrides), row=variant)


@pytest.mark.parametrize("variant, reason", [
    ("mpt-clip-qkv", "clip_qkv=0.5 (q, k and v are clamped after their projections"),
])
def test_refused_variant_says_why(variant, reason):
    name, overrides = VARIANTS[variant]
    model = boot_tiny(name, **overrides)
    with pytest.raises(TLDynamicsError, match=re.escape(reason)) as info:
        ModelAdapter(model)
    assert name in str(info.value)


def test_gpt_oss_sinks_join_the_softmax_and_analyses_refuse_them():
    from tl_dynamics import contextual_mlp, odds_ratio
    from tl_dynamics.adapter import masked_softmax

    model = boot_tiny("GptOssForCausalLM")
    adapter = ModelAdapter(model)
    la = adapter.attention(testing.PROMPTS[0], reference=True, sinks=True)[0]
    assert la.spec.sinks and la.sink_logit is not None and la.sink_logit.shape == (la.n_heads,)
    pattern = la.pattern()
    assert (pattern - la.reference["pattern"]).abs().max() <= EXACT_TOL
    row_sums = pattern.sum(-1).transpose(1, 2)[la.query_valid]  # [rows, head]
    assert row_sums.max() <= 1 + 1e-6 and row_sums.min() < 0.6  # the sinks take their share
    plain = masked_softmax(la.scores(), la.allowed)  # what ignoring the sinks would give
    assert (plain - la.reference["pattern"]).abs().max() > 1e-2
    assert torch.equal(la.pattern([2, 0]), pattern[:, [2, 0]])  # a head subset keeps its sinks
    prompt = testing.PROMPTS[0]
    refusals = [
        (lambda: adapter.attention(prompt), "ModelAdapter.attention(..., sinks=True)"),
        (lambda: odds_ratio.compute(model, prompt), "have learned attention sinks"),
        (lambda: contextual_mlp.compute(model, prompt), "have learned attention sinks"),
        (lambda: decompose_layer(la, [0]), "odds_ratio.decompose_layer: layer 0 has "
                                                      "learned attention sinks"),
        (lambda: from_layer(adapter, la, 0), "contextual_mlp.from_layer: layer 0"),
    ]
    for call, message in refusals:
        with pytest.raises(TLDynamicsError, match=re.escape(message)):
            call()
