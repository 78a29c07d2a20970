"""DeepSeek V4 and HRM-Text: TransformerLens boots and runs both, and the adapter refuses each as a
whole, before any work, saying what the host does (docs/math.md §1.8). The messages are checked
literally, and each thing they claim is checked on the Hugging Face model the bridge wraps:
DeepSeek V4's blocks read several residual streams and its compressed layers score more keys
than tokens; HRM-Text's layers run several times per forward."""

import re

import pytest
import torch

from test_architectures import boot_tiny
from tl_dynamics import testing
from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.errors import TLDynamicsError

transformers = pytest.importorskip("transformers")

# one layer of each type; compression rates small enough that a test prompt fills blocks
DSV4 = dict(
    num_hidden_layers=3,
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
)


def _refusal(model) -> str:
    with pytest.raises(TLDynamicsError) as info:
        ModelAdapter(model)
    return str(info.value)


@pytest.mark.skipif(not hasattr(transformers, "DeepseekV4ForCausalLM"), reason="no DeepSeek V4")
def test_deepseek_v4_is_refused_by_layer_type_and_the_message_holds_on_the_model():
    model = boot_tiny("DeepseekV4ForCausalLM", **DSV4)
    assert _refusal(model) == (
        "unsupported architecture 'DeepseekV4ForCausalLM': hc_mult=4 residual streams (mHC) and "
        "keys pooled over blocks of tokens (layers 1, 2); DeepSeek V4 keeps hc_mult=4 residual "
        "streams per token, which hyper-connections (mHC) collapse into each block's input and "
        "mix after it with weights computed from the streams themselves, so there is no single "
        "residual stream for the analyses to read (TransformerLens's bridge gives its blocks no "
        "hook_resid_pre or hook_resid_post either); beside the sliding window of 4 tokens, attention also "
        "scores, on layer 1 (compressed_sparse_attention), entries a learned compressor pools "
        "over each block of 4 tokens, of which a learned indexer keeps the top 512 per query, "
        "and on layer 2 (heavily_compressed_attention), entries a learned compressor pools over "
        "each block of 8 tokens, so these keys are not tokens; attention on layer 0 "
        "(sliding_attention) scores tokens, but reads its input from those streams and writes "
        "through values that are its rotated keys rotated back at the query's position, which "
        "the analyses do not model; the adapter refuses rather than return attention that "
        "ignores it"
    )
    hf = model.original_model
    tokens = model.to_tokens(testing.PROMPTS[0])
    n = tokens.shape[1]
    assert n >= 8
    streams, keys = [], []
    hooks = [hf.model.layers[0].register_forward_pre_hook(lambda _, a: streams.append(a[0].shape))]
    hooks += [  # the Hugging Face attention modules' own eager weights: [batch, head, query, key]
        block.attn.original_component.register_forward_hook(
            lambda *a: keys.append(a[2][1].shape[-1])
        )
        for block in model.blocks
    ]
    try:
        with torch.no_grad():
            hf(tokens)
    finally:
        for hook in hooks:
            hook.remove()
    assert [tuple(s) for s in streams] == [(1, n, 4, hf.config.hidden_size)]  # four streams
    assert keys == [n, n + n // 4, n + n // 8]  # the tokens, then the tokens and pooled entries


@pytest.mark.skipif(not hasattr(transformers, "DeepseekV4ForCausalLM"), reason="no DeepSeek V4")
def test_deepseek_v4_with_only_sliding_layers_is_refused_for_its_streams_and_values():
    model = boot_tiny("DeepseekV4ForCausalLM", layer_types=["sliding_attention"] * 2)
    message = _refusal(model)
    assert "hc_mult=4 residual streams" in message
    assert "compress" not in message and "pooled" not in message
    assert re.search(
        r"; attention on layers 0, 1 \(sliding_attention\) scores tokens, but", message
    )


@pytest.mark.skipif(not hasattr(transformers, "HrmTextForCausalLM"), reason="no HRM-Text")
def test_hrm_text_is_refused_as_recurrent_and_its_layers_run_several_times_per_forward():
    model = boot_tiny("HrmTextForCausalLM")
    assert _refusal(model) == (
        "unsupported architecture 'HrmTextForCausalLM': HRM-Text is recurrent: each forward "
        "runs its L stack H_cycles*L_cycles = 6 times and its H stack H_cycles = 2 times "
        "(TransformerBridge's L_blocks and H_blocks of 2 layers each, no blocks[i]), each run's "
        "input adding the other stack's state, so every layer's hooks fire once per run with no "
        "run index and no pass of layers over one residual stream exists for the analyses to "
        "read; the adapter refuses rather than return attention from one of those runs"
    )
    assert not hasattr(model, "blocks")
    inner = model.original_model.model
    calls = {"L": 0, "H": 0}
    hooks = [
        inner.L_module.layers[0].self_attn.register_forward_hook(
            lambda *_: calls.__setitem__("L", calls["L"] + 1)
        ),
        inner.H_module.layers[0].self_attn.register_forward_hook(
            lambda *_: calls.__setitem__("H", calls["H"] + 1)
        ),
    ]
    try:
        with torch.no_grad():
            model(model.to_tokens(testing.PROMPTS[0]))
    finally:
        for hook in hooks:
            hook.remove()
    assert calls == {"L": 6, "H": 2}
