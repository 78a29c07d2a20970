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
from tl_dynamics.contextual_mlp._from_layer import from_layer
from tl_dynamics.odds_ratio._collect import decompose_layer

EXACT_TOL = 1e-5  # fp32 sums reordered (as in test_adapter_exactness and test_hf_truth)
# Measured host-vs-HF gaps above EXACT_TOL (see test_hf_truth.HF_GAP for the reasons).
HF_GAP = {
    "GPTNeoForCausalLM": 5e-5,
    "BloomForCausalLM": 2e-5,
    "MptForCausalLM": 2e-5,
}  # MPT: summed head outputs 1.13e-5 off HF (host exact)
TEXT_HEADS = ("ForCausalLM", "LMHeadModel", "ForMaskedLM")
# Rows measured exact on both hosts (TransformerLens 3.9 and 4.3 bridges): a refusal there is a
# regression, not a safe answer.
MUST_BE_EXACT = {
    "ApertusForCausalLM",
    "ArceeForCausalLM",
    "BertForMaskedLM",
    "BertLMHeadModel",
    "BloomForCausalLM",
    "CodeGenForCausalLM",
    "Exaone4ForCausalLM",
    "FalconForCausalLM",
    "FlexOlmoForCausalLM",
    "GPT2LMHeadModel",
    "GPTBigCodeForCausalLM",
    "GPTJForCausalLM",
    "GPTNeoForCausalLM",
    "GPTNeoXForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "GemmaForCausalLM",
    "Glm4MoeForCausalLM",
    "GraniteForCausalLM",
    "GraniteMoeForCausalLM",
    "Jais2ForCausalLM",
    "LlamaForCausalLM",
    "MiniMaxM2ForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "NemotronForCausalLM",
    "OPTForCausalLM",
    "Olmo2ForCausalLM",
    "Olmo3ForCausalLM",
    "OlmoForCausalLM",
    "OlmoeForCausalLM",
    "Phi3ForCausalLM",
    "PhiForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "RobertaForMaskedLM",
    "SeedOssForCausalLM",
    "SmolLM3ForCausalLM",
    "StableLmForCausalLM",
    "Starcoder2ForCausalLM",
    "VaultGemmaForCausalLM",
    "XGLMForCausalLM",
    "falcon-rotary",
    "phi3-sliding",
    "qwen3-sliding",
    "granite-attention-multiplier",
    "gpt_bigcode-unscaled",
    "Ministral3ForCausalLM",
    "GlmForCausalLM",
    "Glm4ForCausalLM",
    "Ernie4_5ForCausalLM",
    "Ernie4_5_MoeForCausalLM",
    "falcon-alibi",
    "MptForCausalLM",
    "GptOssForCausalLM",
}
# Issue 23, measured exact on both TransformerLens versions: latent attention (MLAAttentionBridge),
# Llama 4, NoPE layers, and the attention layers of hybrids (the other layers carry
# LayerSpec.kind and are not attention layers).
MUST_BE_EXACT |= {
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "Glm4MoeLiteForCausalLM",
    "YoutuForCausalLM",
    "JambaForCausalLM",
    "BambaForCausalLM",
    "Lfm2ForCausalLM",
    "FalconH1ForCausalLM",
    "smollm3-nope-layer",
    "Llama4ForCausalLM",
    "llama4-nope-layer",
    "ModernBertDecoderForCausalLM",
    "OlmoHybridForCausalLM",
    "NanoChatForCausalLM",
    # gated attention (adapter/_gate.py): z times sigmoid of q_proj's second half
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    # output gates from their own projections (adapter/_gate.py)
    "AfmoeForCausalLM",
    "LagunaForCausalLM",
    "laguna-gate-per-entry",
    "BitNetForCausalLM",  # attn_sub_norm as a multiplier on z (adapter/_gate.py)
    "olmoe-clip-qkv",
    "mpt-clip-qkv",  # q, k, v clamped after the hooks fire
    # wrapped without attention hooks: read with torch hooks on the module (adapter/_unhooked.py)
    "RecurrentGemmaForCausalLM",
    "NemotronHForCausalLM",
    "JetMoeForCausalLM",  # router-chosen query and output experts (adapter/_jetmoe.py)
    # q/k normalised after rotary (_postrope) on 4.x; before it on 3.x, the same scores while the
    # gains are equal within rotated pairs, as here (tests/test_hunyuan.py: the warning otherwise)
    "HunYuanDenseV1ForCausalLM",
    # q, k, v normalised, widths per layer, keys shared across layers (_gemma4)
    "Gemma4ForCausalLM",
    "gemma4-k-eq-v",
    "gemma4-shared-kv",
    "gemma4-bidirectional",
}
# Exact on the TransformerLens 4.x bridge; the 3.9 bridge's rotated queries are not reproduced
# by its own cos/sin tables there, so the adapter refuses them (by name) on 3.9.
if compat.tl_major_version() >= 4:
    MUST_BE_EXACT |= {
        "CohereForCausalLM",
        "Cohere2ForCausalLM",
        "cohere-qk-norm",
    }

# One tiny config for every family: each key is passed only where the config class takes it.
_TINY = dict(
    num_hidden_layers=2,
    n_layer=2,
    num_layers=2,
    n_layers=2,
    hidden_size=64,
    n_embd=64,
    d_model=64,
    num_attention_heads=4,
    n_head=4,
    num_heads=4,
    n_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    kv_channels=16,
    rotary_dim=8,
    intermediate_size=256,
    ffn_dim=256,
    n_inner=256,
    d_ff=256,
    max_position_embeddings=64,
    n_positions=64,
    n_ctx=64,
    max_seq_len=64,
    initializer_range=0.2,
    init_std=0.2,
    num_local_experts=4,
    num_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
    sliding_window=4,
    window_size=4,
    use_cache=False,
    tie_word_embeddings=False,
)
# Multi-head latent attention at a tiny size: q/k head width 16 + 8 (non-rotary + rotary) differs
# from the value width 12, and one key per head (Hugging Face's eager DeepSeek path has no GQA).
MLA = dict(
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=12,
    num_key_value_heads=4,
)
# Families whose config validates a per-layer list against the layer count, or that need a
# layout to be exercised: hybrids get one layer of each type (attention last).
_EXTRA = {
    "GPTNeoForCausalLM": dict(attention_types=[[["global", "local"], 1]]),
    "DeepseekV2ForCausalLM": MLA,
    "DeepseekV3ForCausalLM": MLA,
    "Glm4MoeLiteForCausalLM": MLA,
    "YoutuForCausalLM": MLA,
    "JambaForCausalLM": dict(attn_layer_period=2, attn_layer_offset=1),
    "BambaForCausalLM": dict(attn_layer_indices=[1]),
    "Lfm2ForCausalLM": dict(layer_types=["conv", "full_attention"]),
    "Qwen3NextForCausalLM": dict(layer_types=["linear_attention", "full_attention"]),
    "Qwen3_5ForCausalLM": dict(layer_types=["linear_attention", "full_attention"]),
    "Qwen3_5MoeForCausalLM": dict(layer_types=["linear_attention", "full_attention"]),
    "NemotronHForCausalLM": dict(hybrid_override_pattern="M*", num_hidden_layers=2),
    "RecurrentGemmaForCausalLM": dict(block_types=["recurrent", "attention"]),
    "ModernBertDecoderForCausalLM": dict(local_attention=8),  # layer 1: sliding window 4
    # gates from their own projections; one sliding (rotary) and one full layer (NoPE on AFMoE)
    "AfmoeForCausalLM": dict(layer_types=["sliding_attention", "full_attention"]),
    "Gemma4ForCausalLM": dict(global_head_dim=32),  # full layers twice the sliding width
    "LagunaForCausalLM": dict(layer_types=["sliding_attention", "full_attention"]),
}


def supported_architectures() -> list[str]:
    """TransformerLens's own list of the architectures its bridge supports."""
    from transformer_lens.factories import architecture_adapter_factory

    return list(architecture_adapter_factory.SUPPORTED_ARCHITECTURES)


def tiny_config(name: str, config_class, **overrides):
    accepted = set(inspect.signature(config_class.__init__).parameters)
    accepted |= set(getattr(config_class, "__dataclass_fields__", {}) or {})
    accepted |= set(getattr(config_class, "attribute_map", {}) or {})
    kwargs = {k: v for k, v in _TINY.items() if k in accepted}
    vocab = len(testing.tokenizer())
    if "vocab_size_per_layer_input" in accepted:  # Gemma 3n/4: per-layer embeddings of the
        kwargs["vocab_size_per_layer_input"] = vocab  # tiny vocabulary, not 262,144 rows (800 MB)
    kwargs.update(_EXTRA.get(name, {}), **overrides)
    config = config_class(vocab_size=vocab, **kwargs)
    config.architectures = [name]
    return config


def boot_tiny(name: str, ran_or_refused: bool = False, **overrides):
    """A tiny random bridge of ``name``, or ``pytest.skip`` with the reason it cannot be had.
    ``ran_or_refused``: a row of ``REFUSED_WHEN_IT_CANNOT_RUN`` that boots but cannot run is
    returned (its refusal is checked) rather than skipped."""
    import transformers

    if not name.endswith(TEXT_HEADS):
        pytest.skip(f"{name}: not a text language model (not built by this matrix)")
    model_class = getattr(transformers, name, None)
    if model_class is None or getattr(model_class, "config_class", None) is None:
        pytest.skip(
            f"{name}: this transformers {transformers.__version__} has no such class "
            "(remote code only)"
        )
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
    except Exception as exc:
        pytest.skip(
            f"{name}: TransformerLens itself cannot boot or run it "
            f"({type(exc).__name__}: {str(exc)[:80]})"
        )
    failure = host_failure(model)
    if failure is not None and not (ran_or_refused and name in REFUSED_WHEN_IT_CANNOT_RUN):
        pytest.skip(
            f"{name}: TransformerLens itself cannot boot or run it "
            f"({type(failure).__name__}: {str(failure)[:80]})"
        )
    return model


def host_failure(model) -> Exception | None:
    """The exception the booted model's own forward pass raises, or None where it runs."""
    try:
        with torch.no_grad():
            model(model.to_tokens(testing.PROMPTS[0]))
    except Exception as exc:
        return exc
    return None


# Rows that TransformerLens boots but cannot run with some transformers release (TransformerLens
# 4.3's CodeGen bridge reads embed_positions, which transformers 5.24 removed): there the adapter
# must refuse by name before any analysis, the host's own exception chained (issue 31).
REFUSED_WHEN_IT_CANNOT_RUN = {"CodeGenForCausalLM"}


def check_host_failure_refused(name, model, failure):
    def hooks() -> tuple[int, int]:
        lens = sum(len(point.fwd_hooks) for point in model.hook_dict.values())
        return lens, sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())

    before = hooks()
    with pytest.raises(TLDynamicsError, match="the model's own forward pass fails") as caught:
        ModelAdapter(model)
    assert hooks() == before, "the probe pass left hooks on the model"
    message = str(caught.value)
    assert name in message and type(failure).__name__ in message, message
    assert "Installed: transformers" in message and "the tests ran on" in message, message
    assert type(caught.value.__cause__) is type(failure), caught.value.__cause__


@pytest.mark.parametrize("name", supported_architectures())
def test_architecture_is_exact_or_refused_by_name(name):
    model = boot_tiny(name, ran_or_refused=True)
    failure = host_failure(model) if name in REFUSED_WHEN_IT_CANNOT_RUN else None
    if failure is not None:  # booted, but its own forward fails: refused by name, not skipped
        check_host_failure_refused(name, model, failure)
        return
    check_exact_or_refused(name, model)


def check_exact_or_refused(name, model, row=None):
    row = row or name
    try:
        adapter = ModelAdapter(model)
        host = [
            testing.reconstruction_errors(adapter, testing.PROMPTS, side)
            for side in ("right", "left")
        ]
        hf = (
            []
            if row in HOST_NOT_HF
            else [testing.hf_truth_errors(adapter, testing.hf_twin(model), testing.PROMPTS, "left")]
        )
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
    "falcon-new-decoder": (
        "FalconForCausalLM",
        dict(new_decoder_architecture=True, num_kv_heads=2),
    ),
    "phi3-sliding": ("Phi3ForCausalLM", dict(sliding_window=4)),
    "qwen3-sliding": (
        "Qwen3ForCausalLM",
        dict(
            use_sliding_window=True,
            max_window_layers=1,
            layer_types=["full_attention", "sliding_attention"],
        ),
    ),
    "granite-attention-multiplier": ("GraniteForCausalLM", dict(attention_multiplier=0.3)),
    "smollm3-nope-layer": ("SmolLM3ForCausalLM", dict(no_rope_layers=[1, 0])),
    # a hybrid: its global (full) layer has the window set and does not rotate (global NoPE)
    "exaone4-global-nope": (
        "Exaone4ForCausalLM",
        dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
    ),
    "olmoe-clip-qkv": ("OlmoeForCausalLM", dict(clip_qkv=0.5)),
    "phi-qk-layernorm": ("PhiForCausalLM", dict(qk_layernorm=True)),
    "gpt_bigcode-unscaled": ("GPTBigCodeForCausalLM", dict(scale_attn_weights=False)),
    "cohere-qk-norm": ("CohereForCausalLM", dict(use_qk_norm=True)),
    "mpt-clip-qkv": ("MptForCausalLM", dict(attn_config=dict(clip_qkv=0.5))),
    "llama4-nope-layer": ("Llama4ForCausalLM", dict(no_rope_layers=[1, 0])),
    "laguna-gate-per-entry": ("LagunaForCausalLM", dict(gating=False)),
    # Gemma 4: keys shared with values on full layers; the last layer reuses layer 1's keys
    "gemma4-k-eq-v": (
        "Gemma4ForCausalLM",
        dict(attention_k_eq_v=True, num_global_key_value_heads=1),
    ),
    # every token attends both ways; Hugging Face's window is inclusive there (|i - j| <= w)
    "gemma4-bidirectional": ("Gemma4ForCausalLM", dict(use_bidirectional_attention="all")),
    "gemma4-shared-kv": (
        "Gemma4ForCausalLM",
        dict(
            num_hidden_layers=3,
            num_kv_shared_layers=1,
            layer_types=["sliding_attention", "full_attention", "full_attention"],
        ),
    ),
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


def test_an_unmodelled_attention_module_is_refused_by_name(monkeypatch):
    """An attention module listed in ``REFUSED_ATTENTION`` is refused with what it does (none is
    listed now that Gemma 4 and JetMoE are modelled; the check stays for the next one)."""
    from tl_dynamics.adapter import _flags

    model = boot_tiny("LlamaForCausalLM")
    module = type(model.blocks[0].attn.original_component).__name__
    monkeypatch.setitem(_flags.REFUSED_ATTENTION, module, "something the recipe does not model")
    with pytest.raises(TLDynamicsError, match=re.escape(f"{module}: something the recipe")):
        ModelAdapter(model)
    monkeypatch.delitem(_flags.REFUSED_ATTENTION, module)
    ModelAdapter(model)


def test_gpt_oss_sinks_join_the_softmax_and_every_analysis_models_them():
    """The sink is in the pattern (capture refuses it only where a caller did not ask); the
    odds-ratio split and the contextual MLP model it (tests/test_sinks.py checks them exactly)."""
    from tl_dynamics import contextual_mlp, odds_ratio
    from tl_dynamics.adapter import masked_softmax
    from tl_dynamics.contextual_mlp._frame import build_frames

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
    with pytest.raises(TLDynamicsError, match=re.escape("ModelAdapter.attention(..., sinks=True)")):
        adapter.attention(prompt)  # a raw capture that did not say it handles sinks
    assert torch.equal(decompose_layer(la, [2, 0]).parts.sink, la.sink_logit[[2, 0]])
    assert odds_ratio.compute(model, prompt).to_dataframe()["learned_sink_mass"].min() > 0
    mlps = contextual_mlp.compute(model, prompt)
    assert all(m.exactness().max_output_error <= EXACT_TOL for m in mlps)
    captured = adapter.attention(prompt, reference=True, inputs=True, sinks=True)[0]
    mlp = from_layer(
        adapter, captured, 1, frame=build_frames(adapter, captured, captured.allowed.any(1))[0]
    )
    assert mlp.sink_logit == float(captured.sink_logit[1])
    assert mlp.exactness().max_pattern_error <= EXACT_TOL


def test_latent_attention_scores_split_into_a_per_head_part_and_a_shared_rotary_key():
    """DeepSeek-V3's score is <q_nope, k_nope> + <q_rope, k_rope>, the rotary key the same vector
    for every head, q/k wider than v (docs/math.md §1.7); W_Q is the low-rank product of the
    factors (tests/test_latent_attention.py checks it against the Hugging Face modules)."""
    model = boot_tiny("DeepseekV3ForCausalLM")
    adapter = ModelAdapter(model)
    la = adapter.attention(testing.PROMPTS, reference=True, padding_side="left")[1]
    assert la.spec.latent and la.q.shape[-1] == 24 and la.v.shape[-1] == 12
    rope = la.k[..., 16:]
    assert torch.equal(rope, rope[:, :, :1].expand_as(rope))  # one rotary key per position
    assert not torch.equal(la.k[:, :, 0, :16], la.k[:, :, 1, :16])  # per-head non-rotary keys
    split = (
        sum(
            torch.einsum("bihd,bjhd->bhij", la.q[..., part], la.k[..., part])
            for part in (slice(0, 16), slice(16, 24))
        )
        * la.scale
    )
    keep = la.allowed[:, None] & la.query_valid[:, None, :, None]
    assert ((split - la.reference["scores"]).abs() * keep).max() <= EXACT_TOL
    assert adapter.W_Q(0).shape == adapter.W_K(0).shape == (4, 64, 24)
    assert adapter.W_V(0).shape == (4, 64, 12) and adapter.W_O(0).shape == (4, 12, 64)


def test_hybrid_attention_layers_and_refusal_of_the_others():
    model = boot_tiny("JambaForCausalLM")
    adapter = ModelAdapter(model)
    assert [spec.kind for spec in adapter.specs] == ["state_space", "attention"]
    assert adapter.attention_layers == [1]
    assert list(adapter.attention(testing.PROMPTS[0])) == [1]  # default: the attention layers
    message = (
        "layer 0 of JambaForCausalLM is not an attention layer: it is a 'state_space' "
        "layer (a state-space (Mamba) mixer, no attention pattern); attention layers: [1]"
    )
    with pytest.raises(TLDynamicsError, match=re.escape(message)):
        adapter.attention(testing.PROMPTS[0], layers=0)
    with pytest.raises(TLDynamicsError, match=re.escape(message)):
        adapter.W_Q(0)


@pytest.mark.parametrize(
    "name, kind",
    [
        ("MambaForCausalLM", "state_space"),
        ("FalconMambaForCausalLM", "state_space"),
        ("RwkvForCausalLM", "rwkv"),
    ],
)
def test_models_without_hooked_attention_load_and_say_so(name, kind):
    from tl_dynamics import trajectories

    adapter = ModelAdapter(boot_tiny(name))
    assert adapter.attention_layers == [] and kind in {spec.kind for spec in adapter.specs}
    with pytest.raises(TLDynamicsError, match=re.escape(f"{name} has no attention layers")):
        adapter.attention(testing.PROMPTS[0])
    # the residual stream runs through every layer: its trajectories apply
    labels = list(trajectories.compute(adapter, testing.PROMPTS).labels)
    assert labels[0] == "resid_pre0" and labels[-1] == f"resid_post{adapter.n_layers - 1}"


def test_openai_gpt_is_exact_on_single_prompts_and_refuses_padded_batches():
    model = boot_tiny("OpenAIGPTLMHeadModel")
    adapter = ModelAdapter(model)
    host = testing.reconstruction_errors(adapter, testing.PROMPTS[0])
    hf = testing.hf_truth_errors(adapter, testing.hf_twin(model), testing.PROMPTS[0])
    assert max(host["pattern"], host["z"], host["out"], host["scores"]) <= EXACT_TOL, host
    assert max(hf.values()) <= EXACT_TOL, hf
    with pytest.raises(TLDynamicsError, match="replaces the causal mask by the padding mask"):
        adapter.attention(testing.PROMPTS)


@pytest.mark.parametrize(
    "name, kind",
    [
        ("JambaForCausalLM", "&#x27;state_space&#x27;"),
        ("MambaForCausalLM", "&#x27;state_space&#x27;"),
        ("DeepseekV3ForCausalLM", None),
        ("Llama4ForCausalLM", None),
        ("NanoChatForCausalLM", None),
        # the in-context regression view declines learned sinks, naming them (docs/math.md §8)
        ("GptOssForCausalLM", "learned attention sinks"),
        ("RecurrentGemmaForCausalLM", None),
        ("NemotronHForCausalLM", None),
    ],
)
def test_report_on_new_architectures_shows_or_names_the_layer_type(name, kind):
    """Every section shows, or says why not naming the layer type (kind None: every section
    shows); trajectories always show."""
    from tl_dynamics import report

    page = report.build_report(boot_tiny(name), testing.PROMPTS[0])
    html = page.to_html()
    assert page.failed_sections == []
    notes = re.findall(r"Not shown for this model: ([^<]*)", html)
    assert all(kind is not None and kind in note for note in notes), notes
    trajectories = html.rsplit("Depth-wise trajectories", 1)[1].split("<section", 1)[
        0
    ]  # not the TOC
    assert "<svg" in trajectories and "Not shown for this model" not in trajectories


def test_llama4_rotary_layers_normalise_q_and_k_and_nope_layers_do_not_rotate():
    """Llama 4: rotary layers apply a weightless RMS norm to q and k (read from the module,
    applied by the adapter to the pre-norm hooks); NoPE layers score unrotated projections; the
    context stops where chunked attention and the NoPE query temperature would start."""
    adapter = ModelAdapter(boot_tiny("Llama4ForCausalLM", no_rope_layers=[1, 0]))
    assert [(s.rotary, s.prenorm) for s in adapter.specs] == [
        ("interleaved", True),
        ("none", False),
    ]
    la = adapter.attention(testing.PROMPTS[0])[0]
    rms = la.q[:, 1:].pow(2).mean(-1)  # unit mean square after the norm (BOS: a zero embedding)
    assert (rms - 1).abs().max() <= 1e-4
    assert adapter.rotation(1) is None and adapter.n_ctx == 64  # min(n_ctx, chunk 8192)


@pytest.mark.skipif(
    compat.tl_major_version() >= 4, reason="TransformerLens 4.x runs Cohere exactly"
)
@pytest.mark.parametrize("name", ["CohereForCausalLM", "Cohere2ForCausalLM"])
def test_cohere_on_transformer_lens_3_is_refused_saying_what_the_host_does(name):
    with pytest.raises(
        TLDynamicsError,
        match=re.escape(
            f"unsupported {name} on TransformerLens 3.x: its bridge rotates Cohere's queries"
        ),
    ):
        ModelAdapter(boot_tiny(name))


def test_delegated_rotary_is_read_from_the_module_and_verified_with_its_direction():
    """Bridges that hook only the projections: each layer's Rotation comes from the tables its
    Hugging Face module receives and is checked against the module's own rotary function, which
    NanoChat runs the other way (a negated frequency) and ModernBERT the usual way, with a
    different base on its sliding layer."""
    nanochat = ModelAdapter(boot_tiny("NanoChatForCausalLM")).rotation(0)
    modern = ModelAdapter(boot_tiny("ModernBertDecoderForCausalLM"))
    assert (nanochat.inv_freq < 0).all() and nanochat.layout == "half"
    full, sliding = modern.rotation(0), modern.rotation(1)
    assert (full.inv_freq > 0).all() and not torch.equal(full.inv_freq, sliding.inv_freq)


GATED = {
    "Qwen3NextForCausalLM": "a sigmoid output gate computed from the query projection",
    "Qwen3_5ForCausalLM": "a sigmoid output gate computed from the query projection",
    "AfmoeForCausalLM": "a sigmoid output gate from its own projection (gate_proj)",
    "LagunaForCausalLM": "a softplus output gate from its own projection (g_proj)",
    "BitNetForCausalLM": "an RMSNorm over all heads (attn_sub_norm) divides z",
}


@pytest.mark.parametrize("name", sorted(GATED))
def test_gated_attention_z_includes_the_gate_and_value_path_analyses_refuse_it(name):
    """Gated attention: z = (pattern @ v) * gate, the gate sigmoid(g) with g from q_proj's second
    half per head (Qwen3-Next / Qwen3.5), sigmoid(x W_gate) (AFMoE), softplus(x W_g) per head
    (Laguna), or BitNet's sub-norm w / rms(z_i) over all heads (docs/math.md §1.9); the pattern is the plain softmax. The gate is checked against
    the module's own projection weights; what reads the value path as a fixed matrix (W_V,
    per-source outputs, the contextual MLP) refuses by name; the odds-ratio split (scores only)
    runs."""
    import torch.nn.functional as F

    from tl_dynamics import contextual_mlp, odds_ratio

    model = boot_tiny(name)
    adapter = ModelAdapter(model)
    layer = adapter.attention_layers[-1]
    la = adapter.attention(testing.PROMPTS, reference=True, inputs=True, padding_side="left")[layer]
    assert la.spec.gate is not None and la.gate is not None
    rows = la.query_valid
    assert (la.z() - la.reference["z"])[rows].abs().max() <= EXACT_TOL
    ungated = torch.einsum("bhij,bjhd->bihd", la.pattern(), la.v)
    assert (ungated - la.reference["z"])[rows].abs().max() > 1e-2  # the gate matters
    orig, x, d = model.blocks[layer].attn.original_component, la.reference["x"], adapter.d_head
    if name.startswith("Qwen3"):  # per head, rows [h * 2d + d, (h + 1) * 2d) of q_proj
        weight = orig.q_proj.weight.detach().float()
        both = (x @ weight.T).reshape(*la.q.shape[:2], adapter.n_heads, 2 * d)
        expected = torch.sigmoid(both[..., d:])
        assert torch.allclose(
            adapter.W_Q(layer), weight.reshape(adapter.n_heads, 2 * d, -1)[:, :d].transpose(1, 2)
        )  # W_Q is the query half
    elif name.startswith("Afmoe"):
        expected = torch.sigmoid(x @ orig.gate_proj.weight.detach().float().T).reshape(la.v.shape)
    elif name.startswith("Laguna"):  # one softplus gate per head
        expected = F.softplus(x @ orig.g_proj.weight.detach().float().T)[..., None]
    else:  # BitNet: the sub-norm's w / rms over every head's entries of the query's z
        norm = orig.attn_sub_norm
        mean_square = ungated.pow(2).mean((2, 3), keepdim=True)
        expected = norm.weight.detach().float().reshape(la.v.shape[2:]) * torch.rsqrt(
            mean_square + norm.variance_epsilon
        )
    assert (expected - la.gate)[rows].abs().max() <= EXACT_TOL
    message = f"layer {layer} of {name} has gated attention ({GATED[name]}"
    for call in (
        lambda: adapter.W_V(layer),
        lambda: contextual_mlp.compute(model, testing.PROMPTS[0], layers=layer),
    ):
        with pytest.raises(TLDynamicsError, match=re.escape(message)):
            call()
    with pytest.raises(
        TLDynamicsError, match=re.escape(f"LayerAttention.source_outputs: layer {layer}")
    ):
        la.source_outputs()
    with pytest.raises(
        TLDynamicsError, match=re.escape(f"contextual_mlp.from_layer: layer {layer}")
    ):
        from_layer(adapter, la, 0)
    result = odds_ratio.compute(model, testing.PROMPTS[0])
    assert result is not None


@pytest.mark.skipif(
    compat.tl_major_version() < 4, reason="TransformerLens 3.x normalises before rotary"
)
def test_hunyuan_scores_q_and_k_normalised_after_rotary_and_query_frames_refuse():
    """HunYuan rotates q and k, then RMS-normalises each head with a per-dimension gain: the
    scored q/k come from the norm's hooks (not the rotated projections, which differ), and the
    query frame that assumes 'normalise, then rotate' refuses by name (docs/math.md §1.6)."""
    from tl_dynamics import contextual_mlp

    model = boot_tiny("HunYuanDenseV1ForCausalLM")
    adapter = ModelAdapter(model)
    assert [spec.postrope for spec in adapter.specs] == [True, True]
    la = adapter.attention(testing.PROMPTS, reference=True, inputs=True, padding_side="left")[0]
    keep = la.allowed[:, None] & la.query_valid[:, None, :, None]
    assert ((la.scores() - la.reference["scores"]).abs() * keep).max() <= EXACT_TOL
    rotated = adapter.rotation(0).rotate(
        adapter.unrotated_queries(0, la.reference["x"]), adapter.positions(la.allowed.any(1))
    )
    assert (rotated - la.q).abs().max() > 1e-2  # the norm after rotary matters
    norm = model.blocks[0].attn.original_component.query_layernorm
    rms = rotated.pow(2).mean(-1, keepdim=True).add(norm.variance_epsilon).rsqrt()
    weight = norm.weight.detach().float()  # N(R q) = (R q) / rms(q) * w
    assert ((rotated * rms * weight - la.q)[la.query_valid]).abs().max() <= EXACT_TOL
    message = (
        "layer 0 of HunYuanDenseV1ForCausalLM normalises q and k after rotary with a "
        "per-dimension gain (qk_norm_after_rope)"
    )
    for call in (
        lambda: adapter.query_norm(0),
        lambda: contextual_mlp.compute(model, testing.PROMPTS[0]),
    ):
        with pytest.raises(TLDynamicsError, match=re.escape(message)):
            call()


@pytest.mark.parametrize("variant", ["olmoe-clip-qkv", "mpt-clip-qkv"])
def test_clip_qkv_is_applied_after_the_hooks_and_query_frames_refuse_it(variant):
    """clip_qkv: q, k and v are clamped to [-c, c] after their projections, after hook_q/k/v
    fire; the adapter clamps what the hooks hold (rotated q/k hooks, where they fire, are
    already clamped), and refuses the query frame, which reads q as a linear map of x."""
    from tl_dynamics import contextual_mlp

    name, overrides = VARIANTS[variant]
    model = boot_tiny(name, **overrides)
    adapter = ModelAdapter(model)
    assert [spec.clip for spec in adapter.specs] == [0.5, 0.5]
    captured = {}
    with adapter.hooks([("v", 0, lambda t: captured.setdefault("v", t.detach().clone()))]):
        la = adapter.attention(testing.PROMPTS[0], reference=True)[0]
    assert captured["v"].abs().max() > 0.5 and la.v.abs().max() <= 0.5  # the clamp is active
    assert (la.z() - la.reference["z"]).abs().max() <= EXACT_TOL
    message = f"layer 0 of {name} clamps q, k and v to [-0.5, 0.5] after their projections"
    with pytest.raises(TLDynamicsError, match=re.escape(message)):
        contextual_mlp.compute(model, testing.PROMPTS[0])
