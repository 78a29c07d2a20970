"""The switches and flags read by meaning (``adapter/_switches``, issue 31): each attribute,
hidden as a rename would hide it, is refused by name (class, attribute, installed and tested-on
versions), never read through a default that changes a number; where its absence means
something (a host without the switch), the rule says so and the numbers stay exact."""

import re

import pytest
import torch
from test_architectures import boot_tiny

from tl_dynamics import testing
from tl_dynamics.adapter import ModelAdapter, _readers, _switches
from tl_dynamics.compat import tl_major_version
from tl_dynamics.errors import TLDynamicsError


def _hide(monkeypatch, attribute: str) -> None:
    """Every reader's lookup of ``attribute`` finds nothing, as after a rename upstream."""
    lookup = _readers.lookup
    monkeypatch.setattr(
        _readers,
        "lookup",
        lambda owner, path: _readers.ABSENT if path == attribute else lookup(owner, path),
    )


def _refused(message: str, owner: str, attribute: str) -> None:
    """A reader's refusal: ``owner`` (a regex of the class name), the attribute, the versions."""
    assert re.search(rf"\b{owner}\.{attribute}: ", message), message
    assert "Installed: transformers" in message and "TransformerLens" in message, message
    assert "the tests ran on transformers" in message, message


def test_default_prepend_bos_hidden_is_refused_where_a_padding_mask_is_built(monkeypatch):
    adapter = ModelAdapter(testing.cached_model("gpt2"))
    before = adapter.tokenize(["a b c", "a"], padding_side="left").key_valid
    _hide(monkeypatch, "default_prepend_bos")
    with pytest.raises(TLDynamicsError) as caught:
        adapter.tokenize(["a b c", "a"], padding_side="left")
    _refused(str(caught.value), type(adapter.model.cfg).__name__, "default_prepend_bos")
    monkeypatch.undo()
    assert torch.equal(adapter.tokenize(["a b c", "a"], padding_side="left").key_valid, before)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_qk_norm_after_rope_hidden_is_refused_where_the_host_has_the_switch(monkeypatch, arch):
    model = testing.cached_model(arch)
    truth = ModelAdapter(model).specs
    _hide(monkeypatch, "qk_norm_after_rope")
    if tl_major_version() >= 4:  # TransformerBridgeConfig takes the switch: required
        with pytest.raises(TLDynamicsError) as caught:
            ModelAdapter(model)
        _refused(str(caught.value), type(model.cfg).__name__, "qk_norm_after_rope")
    else:  # no such switch in 3.x: it normalises before rotary, by the rule, not a default
        assert not _switches.qk_norm_after_rope(model)
        assert ModelAdapter(model).specs == truth


def test_gated_q_proj_is_checked_against_the_module_width(monkeypatch):
    model = boot_tiny("Qwen3NextForCausalLM")
    gated = [s.layer for s in ModelAdapter(model).specs if s.gate == "sigmoid"]
    assert gated, "the tiny Qwen3-Next has a gated attention layer"
    _hide(monkeypatch, "gated_q_proj")  # q_proj twice the queries, no flag: refused
    with pytest.raises(TLDynamicsError) as caught:
        ModelAdapter(model)
    _refused(str(caught.value), type(model.cfg).__name__, "gated_q_proj")
    assert "twice the queries" in str(caught.value)


def test_gated_q_proj_set_on_an_ungated_module_is_refused(monkeypatch):
    llama = testing.cached_model("llama")
    if llama.cfg.__class__.__name__ != "TransformerBridgeConfig":
        pytest.skip("the gate is read on bridges only")
    monkeypatch.setattr(llama.cfg, "gated_q_proj", True, raising=False)  # a flag, no gate
    with pytest.raises(TLDynamicsError, match=r"gated_q_proj: True, but .*\(not twice"):
        ModelAdapter(llama)


@pytest.mark.slow
def test_is_kv_shared_layer_hidden_is_refused_on_gemma4(monkeypatch):
    model = boot_tiny(
        "Gemma4ForCausalLM",
        num_hidden_layers=3,
        num_kv_shared_layers=1,
        layer_types=["sliding_attention", "full_attention", "full_attention"],
    )
    assert ModelAdapter(model).specs[2].kv_from == 1
    _hide(monkeypatch, "is_kv_shared_layer")
    with pytest.raises(TLDynamicsError) as caught:
        ModelAdapter(model)
    _refused(str(caught.value), "Gemma4TextAttention", "is_kv_shared_layer")


@pytest.mark.slow
@pytest.mark.parametrize("attribute", ["rope_interleave", "attention_scaling"])
def test_latent_rotary_attributes_hidden_are_refused(monkeypatch, attribute):
    model = boot_tiny("DeepseekV3ForCausalLM")
    ModelAdapter(model)  # exact with the attribute read
    _hide(monkeypatch, attribute)
    with pytest.raises(TLDynamicsError) as caught:
        ModelAdapter(model).rotation(0)
    # the rotary module, or TransformerLens 4.x's bridge around it (it forwards the attribute)
    owner = "DeepseekV3Config" if attribute == "rope_interleave" else r"\w*RotaryEmbedding\w*"
    _refused(str(caught.value), owner, attribute)


def test_kv_sharing_on_another_family_is_refused():
    from types import SimpleNamespace as NS

    assert _switches.kv_shared(NS(), "llama") is False
    with pytest.raises(TLDynamicsError, match=r"is_kv_shared_layer: set on a llama layer"):
        _switches.kv_shared(NS(is_kv_shared_layer=True), "llama")


@pytest.mark.parametrize(
    "attribute", ["attention_chunk_size", "attn_temperature_tuning", "floor_scale"]
)
def test_llama4_long_context_switches_hidden_are_refused_never_read_as_no_limit(
    monkeypatch, attribute
):
    """Llama 4's chunked attention and NoPE query scaling start past 8 tokens, where the
    self-check cannot see them: the context limit they set is read from switches that a Llama 4
    text config always has, alone or inside the multimodal config, and a renamed one is refused."""
    from types import SimpleNamespace as NS

    import transformers

    from tl_dynamics.adapter import _flags

    text = transformers.Llama4TextConfig(attention_chunk_size=96, floor_scale=64)
    for config in (text, transformers.Llama4Config(text_config=text.to_dict())):
        assert _flags.query_scaling_context(NS(original_model=NS(config=config))) == 64
    _hide(monkeypatch, attribute)
    with pytest.raises(TLDynamicsError) as caught:
        _flags.query_scaling_context(NS(original_model=NS(config=text)))
    _refused(str(caught.value), "Llama4TextConfig", attribute)


@pytest.mark.parametrize("arch", ["OlmoHybridForCausalLM", "Llama4ForCausalLM"])
def test_a_hidden_key_norm_is_refused_never_replaced_by_the_query_norm(monkeypatch, arch):
    """Keys normalised before rotary: OLMo-Hybrid's own ``k_norm``, Llama 4's ``qk_norm`` shared
    with the queries. With the attribute the layer uses hidden, the adapter refuses by name
    rather than normalise keys with the query's norm (equal gains at initialisation would let
    that pass the self-check on a fresh model)."""
    model = boot_tiny(arch)
    ModelAdapter(model, verify=False).attention(testing.PROMPTS[0])  # reads as it should
    hidden = "k_norm" if arch.startswith("Olmo") else "qk_norm"
    _hide(monkeypatch, hidden)
    if hidden == "k_norm":
        _hide(monkeypatch, "qk_norm")  # the shared norm it may not fall back to is absent too
    with pytest.raises(TLDynamicsError) as caught:
        ModelAdapter(model, verify=False).attention(testing.PROMPTS[0])
    _refused(str(caught.value), r"\w+", "qk_norm")


# the families whose rotation is a switch of each layer (issue 43), with the layers it skips
NOPE_LAYERS = {
    "SmolLM3ForCausalLM": (dict(no_rope_layers=[1, 0]), ["use_rope"]),
    "Exaone4ForCausalLM": (
        dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
        ["sliding_window", "is_sliding"],
    ),
}


@pytest.mark.parametrize("arch", sorted(NOPE_LAYERS))
def test_deleting_what_says_a_layer_rotates_is_refused_never_read_as_rotating(monkeypatch, arch):
    """SmolLM3's ``use_rope`` and Exaone 4's ``sliding_window`` / ``is_sliding`` decide whether a
    layer rotates q and k. Deleted from the modules (as a rename upstream would), Hugging Face
    fails and TransformerLens's bridge rotates every layer with its own default, so the
    self-check agrees with the bridge's wrong pattern: only reading by meaning can refuse."""
    overrides, attributes = NOPE_LAYERS[arch]
    model = boot_tiny(arch, **overrides)
    specs = ModelAdapter(model).specs
    assert [s.rotary for s in specs] == ["half", "none"]  # layer 1 is NoPE, exactly
    modules = [block.attn.original_component for block in model.blocks]
    for attribute in attributes:
        with monkeypatch.context() as patch:
            for module in modules:
                patch.delattr(module, attribute)
            with pytest.raises(TLDynamicsError) as caught:
                ModelAdapter(model)
            _refused(str(caught.value), type(modules[0]).__name__, attribute)


def test_use_rope_on_a_family_that_always_rotates_is_refused():
    from types import SimpleNamespace as NS

    assert _switches.rotates(NS(), "llama") is True
    with pytest.raises(TLDynamicsError, match=r"SimpleNamespace\.use_rope: set on a llama layer"):
        _switches.rotates(NS(use_rope=False), "llama")
    with pytest.raises(TLDynamicsError, match=r"SimpleNamespace\.sliding_window: missing"):
        _switches.rotates(NS(is_sliding=True), "exaone4")
