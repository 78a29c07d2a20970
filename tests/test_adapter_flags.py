"""Configuration flags outside the exactness matrix: each one reproduces exactly or is refused.

Every case here once gave wrong numbers without a word (issue 13): the adapter either ignored a
flag that changes how attention scores, or trusted a hook that fires before a transformation.
Each test builds a tiny random model with the flag set and checks the adapter against the host's
own activations and, on the bridge, against the Hugging Face model itself; or checks that the
adapter refuses with a ``TLDynamicsError`` naming the flag.
"""

import re
import warnings

import pytest
import torch

from helpers import requires_hooked
from tl_dynamics import testing
from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.errors import HostDiffersWarning, TLDynamicsError

EXACT_TOL = 1e-5  # as in test_adapter_exactness: fp32 sums reordered


def _host_errors(adapter, side="left"):
    return testing.reconstruction_errors(adapter, testing.PROMPTS, side)


def _assert_exact(errors):
    for key in ("pattern", "z", "out"):
        assert errors[key] <= EXACT_TOL, (key, errors)
    assert not errors["scores"] > EXACT_TOL, errors  # NaN where the scores hook holds the pattern


# ----------------------------------------------------------------- bridge flags
@pytest.mark.parametrize(
    "variant", ["bert-decoder", "bert-relative", "gpt2-inverse-layer", "stablelm-qk-layernorm"]
)
def test_flag_variant_is_exact_against_host_and_hugging_face(variant):
    model = testing.cached_model(variant)
    adapter = ModelAdapter(model)
    for side in ("right", "left"):
        _assert_exact(_host_errors(adapter, side))
        truth = testing.hf_truth_errors(adapter, testing.hf_twin(model), testing.PROMPTS, side)
        assert truth["pattern"] <= EXACT_TOL and truth["out"] <= EXACT_TOL, truth


def test_bert_as_a_decoder_is_causal():
    """BertLMHeadModel (is_decoder=True) masks the future; BertForMaskedLM does not."""
    decoder = ModelAdapter(testing.cached_model("bert-decoder"))
    assert all(spec.causal for spec in decoder.specs) and not decoder.is_encoder
    assert ModelAdapter(testing.cached_model("bert")).is_encoder


def test_clip_qkv_is_exact_and_its_query_map_refused():
    """OLMo's clip_qkv clamps q, k and v after the hooks fire: the adapter clamps them too
    (exact against the host and Hugging Face), and query_norm, the query map the contextual
    MLP inverts, refuses the layer by name (tests/test_architectures.py covers OLMoE and MPT)."""
    model = testing.cached_model("olmo-clip-qkv")
    adapter = ModelAdapter(model)
    for side in ("right", "left"):
        _assert_exact(_host_errors(adapter, side))
        truth = testing.hf_truth_errors(adapter, testing.hf_twin(model), testing.PROMPTS, side)
        assert truth["pattern"] <= EXACT_TOL and truth["out"] <= EXACT_TOL, truth
    with pytest.raises(
        TLDynamicsError,
        match=re.escape(
            f"layer 0 of {model.cfg.architecture} clamps q, k and v to [-0.1, 0.1] after their "
            "projections (clip_qkv)"
        ),
    ):
        adapter.query_norm(0)


def test_gpt2_scale_is_the_one_the_bridge_uses():
    """The bridge scores GPT-2 with d_head**-0.5 even when scale_attn_weights=False (the
    Hugging Face module then uses 1.0): the adapter follows the host it reads hooks from."""
    with pytest.warns(
        HostDiffersWarning,
        match=re.escape(
            "GPT2LMHeadModel sets scale_attn_weights=False (Hugging Face does not scale q.k), but "
            "TransformerLens scores with d_head**-0.5 anyway"
        ),
    ):
        adapter = ModelAdapter(testing.cached_model("gpt2-unscaled"))
    assert adapter.specs[0].scale == pytest.approx(testing.D_HEAD**-0.5)
    _assert_exact(_host_errors(adapter))
    inverse = ModelAdapter(testing.cached_model("gpt2-inverse-layer"))
    assert inverse.specs[1].scale == pytest.approx(testing.D_HEAD**-0.5 / 2)


def test_gemma3_softcap_follows_the_host():
    """TransformerLens soft-caps Gemma 3 scores when attn_logit_softcapping is set; Hugging Face
    Gemma 3 ignores it. The adapter follows the host whose hooks it reads."""
    with pytest.warns(
        HostDiffersWarning,
        match=re.escape(
            f"Gemma3ForCausalLM sets attn_logit_softcapping={testing.SOFTCAP}: TransformerLens "
            "soft-caps the attention scores (cap * tanh(s / cap)) but Hugging Face Gemma 3 ignores"
        ),
    ):
        adapter = ModelAdapter(testing.cached_model("gemma3-softcap"))
    assert adapter.specs[0].softcap == testing.SOFTCAP
    _assert_exact(_host_errors(adapter))


def test_stablelm_qk_layernorm_is_detected_and_read():
    """StableLM's per-head LayerNorm on q: spec.qk_norm is set and query_norm reproduces the
    Hugging Face module on arbitrary projected queries."""
    model = testing.tiny_model("stablelm-qk-layernorm")  # its own copy: its norms are changed
    assert all(spec.qk_norm for spec in ModelAdapter(model).specs)
    y = torch.randn(
        3, 5, testing.N_HEADS, testing.D_HEAD, generator=torch.Generator().manual_seed(0)
    )
    hf_norm = model.blocks[0].attn.original_component.q_layernorm
    with torch.no_grad():
        for n in hf_norm.norms:  # non-trivial gains, so a per-head mix-up shows
            n.weight.copy_(
                torch.rand(n.weight.shape, generator=torch.Generator().manual_seed(1)) + 0.5
            )
        norm = ModelAdapter(model).query_norm(0)
        want = hf_norm(y.transpose(1, 2)).transpose(1, 2)
    assert (norm.apply_heads(y) - want).abs().max().item() <= EXACT_TOL
    assert (norm.apply(y[:, 0, 2], head=2) - want[:, 0, 2]).abs().max().item() <= EXACT_TOL


def test_t5_is_refused_with_a_package_error():
    """Encoder-decoders have no blocks[i].attn: a TLDynamicsError, not an AttributeError."""
    import transformers

    config = transformers.T5Config(
        vocab_size=len(testing.tokenizer()),
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=1,
        num_heads=4,
        decoder_start_token_id=0,
    )
    torch.manual_seed(0)
    hf = transformers.T5ForConditionalGeneration(config).eval()
    folder = testing.hf_folder("gpt2").parent / "t5"
    hf.save_pretrained(folder)
    testing.tokenizer().save_pretrained(folder)
    try:
        model = testing.bridge_class().boot_transformers(str(folder), device="cpu")
    except Exception as exc:  # the host itself cannot boot it here: nothing to refuse
        pytest.skip(f"TransformerLens cannot boot T5 here: {type(exc).__name__}")
    with pytest.raises(TLDynamicsError, match="T5"):
        ModelAdapter(model)


def test_adapter_follows_a_later_compatibility_mode():
    """An adapter made before enable_compatibility_mode() sees the processed weights after it."""
    model = testing.tiny_bridge("gpt2")
    adapter = ModelAdapter(model)
    adapter.W_O(0), adapter.b_O(0)  # cached in raw mode
    model.enable_compatibility_mode(disable_warnings=True)
    assert adapter.info.compat
    _assert_exact(_host_errors(adapter))


# ----------------------------------------------------------------- HookedTransformer flags
@requires_hooked
@pytest.mark.parametrize(
    "variant,overrides,flag",
    [
        ("alibi", dict(attn_scores_soft_cap=testing.SOFTCAP), "attn_scores_soft_cap"),
        ("gpt2-like", dict(clip_qkv=0.1), "clip_qkv"),
        ("rotary", dict(clip_qkv=0.1), "clip_qkv"),
        ("gpt2-like", dict(use_qk_norm=True, normalization_type="RMS"), "q/k normalisation"),
        (
            "gpt2-like",
            dict(original_architecture="Olmo2ForCausalLM", normalization_type="RMS"),
            "q/k normalisation",
        ),
    ],
)
def test_hooked_flag_is_refused(variant, overrides, flag):
    model = testing.tiny_hooked(variant, **overrides)
    with pytest.raises(TLDynamicsError, match=flag):
        ModelAdapter(model)


@requires_hooked
def test_hooked_local_window_is_not_applied_when_bidirectional():
    """A bidirectional HookedTransformer applies no mask at all, local layers included."""
    model = testing.tiny_hooked("local", attention_dir="bidirectional")
    adapter = ModelAdapter(model)
    assert all(spec.window is None and not spec.causal for spec in adapter.specs)
    errors = testing.reconstruction_errors(adapter, testing.PROMPTS[1])
    for key in ("scores", "pattern", "z", "out"):
        assert errors[key] <= EXACT_TOL, (key, errors)


@requires_hooked
@pytest.mark.parametrize("variant", ["gpt2-like", "rotary"])
def test_hooked_attention_sinks_are_exact(variant):
    """``use_attention_sinks``: the per-head sink logit joins every softmax denominator."""
    model = testing.tiny_hooked(variant, use_attention_sinks=True)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.sinks.normal_(0.0, 1.0)  # initialised at zero; make every head differ
    adapter = ModelAdapter(model)
    assert all(spec.sinks for spec in adapter.specs)
    for side in ("right", "left"):
        errors = testing.reconstruction_errors(adapter, testing.PROMPTS, side)
        for key in ("scores", "pattern", "z", "out"):
            assert errors[key] <= EXACT_TOL, (key, errors)
    la = adapter.attention(testing.PROMPTS[1], sinks=True)[0]
    assert la.pattern().sum(-1)[0].min() < 0.9  # the sinks take a visible share
    with pytest.raises(TLDynamicsError, match=r"sinks=True"):
        adapter.attention(testing.PROMPTS[1])


@requires_hooked
def test_hooked_alibi_and_softcap_each_alone_stay_exact():
    """The refusal is for the combination only: either one alone reproduces exactly."""
    for variant in ("alibi", "softcap"):
        errors = testing.reconstruction_errors(ModelAdapter(testing.cached_model(variant)))
        assert errors["pattern"] <= EXACT_TOL, (variant, errors)


# ----------------------------------------------------------------- arguments and devices
@pytest.mark.parametrize(
    "layers,expected",
    [
        (1.0, "of type float"),
        ("1", "of type str"),
        ([], "selects nothing"),
        ((), "selects nothing"),
        ([0, "1"], "of type str"),
        (5, "out of range"),
        ([True], "of type bool"),
    ],
)
def test_wrong_layers_say_what_is_expected(layers, expected):
    adapter = ModelAdapter(testing.cached_model("gpt2"))
    with pytest.raises(TLDynamicsError, match=expected):
        adapter.check_layers(layers)


@pytest.mark.parametrize(
    "heads,expected",
    [
        ([(1, 0)], "layers=l, heads=h"),
        (0.5, "of type float"),
        ([0.0], "integer index"),
        ([], "selects nothing"),
        (4, "out of range"),
    ],
)
def test_wrong_heads_say_what_is_expected(heads, expected):
    adapter = ModelAdapter(testing.cached_model("gpt2"))
    with pytest.raises(TLDynamicsError, match=expected):
        adapter.check_heads(heads)


def test_index_like_arguments_are_accepted():
    import numpy as np

    adapter = ModelAdapter(testing.cached_model("gpt2"))
    assert adapter.check_layers(np.int64(1)) == [1]
    assert adapter.check_heads(torch.tensor([3, 0])) == [3, 0]
    assert adapter.check_heads((1, 0)) == [1, 0]  # a tuple of heads is a sequence of heads
    assert adapter.check_layers(range(2)) == [0, 1]


@pytest.mark.parametrize("prompt", [None, 3, {"text": "a"}])
def test_prompt_of_the_wrong_type_is_refused(prompt):
    adapter = ModelAdapter(testing.cached_model("gpt2"))
    with pytest.raises(TLDynamicsError, match="prompt must be"):
        adapter.tokenize(prompt)


def test_analysis_entry_points_refuse_wrong_layers_before_any_work():
    """An analysis gets the adapter's error, not a KeyError or TypeError from deep inside."""
    from tl_dynamics import odds_ratio

    model = testing.cached_model("gpt2")
    for layers in ([], 1.0, "0"):
        with pytest.raises(TLDynamicsError, match="layer"):
            odds_ratio.compute(model, testing.PROMPTS[0], layers=layers)


def test_meta_device_model_is_refused_at_construction():
    model = testing.tiny_bridge("gpt2").to("meta")
    with pytest.raises(TLDynamicsError, match="meta"):
        ModelAdapter(model)


def test_docstring_examples_run():
    import doctest

    from tl_dynamics.adapter import _checks, _flags, _qknorm, _sae, _weights

    for module in (_checks, _flags, _qknorm, _sae, _weights):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


def test_adapter_reads_weights_edited_in_place_after_it_was_made():
    """Weights changed in place (an ablation, a fine-tuning step) are re-read, not served stale."""
    model = testing.tiny_bridge("gpt2")
    adapter = ModelAdapter(model)
    before = adapter.W_O(0).clone()
    with torch.no_grad():
        for param in model.blocks[0].attn.o.parameters():
            param.mul_(2.0)
    assert torch.allclose(adapter.W_O(0), 2 * before)
    _assert_exact(_host_errors(adapter))


def test_ministral3_context_stops_where_its_query_scaling_starts():
    """Ministral 3 rescales queries from original_max_position_embeddings on: the adapter's
    context ends there (longer prompts are refused) and is exact below it."""
    from test_architectures import boot_tiny

    rope = {
        "rope_type": "yarn",
        "rope_theta": 1e6,
        "factor": 16.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 12,
        "llama_4_scaling_beta": 0.1,
    }
    model = boot_tiny("Ministral3ForCausalLM", rope_parameters=rope)
    adapter = ModelAdapter(model)
    assert adapter.n_ctx == 12
    errors = testing.reconstruction_errors(adapter, testing.PROMPTS[0])
    assert errors["pattern"] <= EXACT_TOL and errors["out"] <= EXACT_TOL, errors
    with pytest.raises(TLDynamicsError, match="context is 12 tokens"):
        adapter.tokenize(testing.PROMPTS[1])


@pytest.mark.parametrize("arch", ["gpt2", "gemma3", "gpt2-inverse-layer"])
def test_no_host_difference_warning_where_host_and_hugging_face_agree(arch):
    with warnings.catch_warnings():
        warnings.simplefilter("error", HostDiffersWarning)
        ModelAdapter(testing.cached_model(arch))


def test_gemma3_bidirectional_window_is_two_sided_and_exact():
    """Gemma 3 with use_bidirectional_attention: its sliding layer lets query i see keys with
    |i - j| < w (both sides), its full layer every key; host and Hugging Face agree."""
    model = testing.cached_model("gemma3-bidirectional")
    adapter = ModelAdapter(model)
    assert [spec.causal for spec in adapter.specs] == [False, False]
    w = adapter.specs[0].window
    la = adapter.attention(testing.PROMPTS[0])[0]
    i, j = torch.meshgrid(
        torch.arange(la.allowed.shape[1]), torch.arange(la.allowed.shape[1]), indexing="ij"
    )
    assert torch.equal(la.allowed[0], (i - j).abs() < w) and w is not None
    _assert_exact(_host_errors(adapter))
    twin = testing.hf_twin(model)
    for prompt, side in ((testing.PROMPTS[0], "right"), (testing.PROMPTS, "left")):
        errors = testing.hf_truth_errors(adapter, twin, prompt, side)
        assert max(errors.values()) <= EXACT_TOL, errors
