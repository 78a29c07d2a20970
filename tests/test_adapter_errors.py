"""Bad input gets one error type whose message names what was asked and what is valid."""

import re

import pytest
import torch

from tl_dynamics import TLDynamicsError, testing
from tl_dynamics.adapter import ModelAdapter
from helpers import requires_hooked

# Half precision: the adapter upcasts to fp32 and recomputes; the model itself rounds its
# scores and softmax to the half type, so agreement is limited by that type's precision
# (bf16: 8 bits of mantissa; fp16: 11). Measured on the tiny llama/gpt2/gemma2 models:
# bf16 <= 6.7e-3, fp16 <= 9.2e-4; these bounds leave about 3x margin.
HALF_TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3}


@pytest.fixture(scope="module")
def adapter():
    return ModelAdapter(testing.cached_model("gpt2"))


def test_layer_out_of_range(adapter):
    with pytest.raises(
        TLDynamicsError,
        match=re.escape("layer 5 is out of range: this model has 2 layers (valid: 0..1)"),
    ):
        adapter.attention("x", layers=[5])
    with pytest.raises(TLDynamicsError, match="layer -1 is out of range"):
        adapter.check_layer(-1)


def test_head_out_of_range(adapter):
    with pytest.raises(
        TLDynamicsError,
        match=re.escape(
            "head 4 in layer 1 is out of range: this model has 4 heads per layer (valid: 0..3)"
        ),
    ):
        adapter.head_weights(1, 4)


def test_prompt_longer_than_context(adapter):
    with pytest.raises(
        TLDynamicsError,
        match=r"prompt has \d+ tokens but this model's context is "
        r"64 tokens \(valid: 1\.\.64\)",
    ):
        adapter.tokenize("word " * 200)


def test_empty_prompt_and_bad_inputs(adapter):
    with pytest.raises(TLDynamicsError, match="prompt is empty"):
        adapter.tokenize("")
    with pytest.raises(TLDynamicsError, match="non-empty list"):
        adapter.tokenize([])
    with pytest.raises(TLDynamicsError, match="token tensor must be integer"):
        adapter.tokenize(torch.rand(1, 4))
    with pytest.raises(TLDynamicsError, match="padding_side must be 'left' or 'right'"):
        adapter.tokenize(["a", "b"], padding_side="middle")


def test_not_a_transformer_lens_model():
    with pytest.raises(
        TLDynamicsError,
        match="expected a TransformerLens model .* got an object "
        "of type torch.nn.modules.linear.Linear",
    ):
        ModelAdapter(torch.nn.Linear(2, 2))


def test_unsupported_architecture_is_refused_by_name():
    class MysteryAttention(torch.nn.Module):
        pass

    class TransformerBridge(torch.nn.Module):  # stands in for an unverified bridge model
        def __init__(self):
            super().__init__()
            attn = torch.nn.Module()
            attn.original_component = MysteryAttention()
            block = torch.nn.Module()
            block.attn = attn
            self.blocks = torch.nn.ModuleList([block])
            self.cfg = type("cfg", (), {"architecture": "MysteryForCausalLM"})()

    with pytest.raises(
        TLDynamicsError,
        match="unsupported architecture 'MysteryForCausalLM': its "
        "attention module MysteryAttention",
    ):
        ModelAdapter(TransformerBridge())


@requires_hooked
def test_padded_batch_on_bidirectional_hooked_transformer_is_refused():
    adapter = ModelAdapter(testing.cached_model("bidirectional"))
    with pytest.raises(TLDynamicsError, match="padded batch on a bidirectional HookedTransformer"):
        adapter.attention(["a b c d", "e"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_is_upcast_and_matches_within_its_precision(dtype):
    model = testing.tiny_model("llama").to(dtype)
    adapter = ModelAdapter(model)
    assert adapter.dtype == dtype
    for la in adapter.attention(testing.PROMPTS[0], reference=True).values():
        assert la.q.dtype == torch.float32
        err = (la.pattern() - la.reference["pattern"].float()).abs().max().item()
        assert err <= HALF_TOL[dtype], err
