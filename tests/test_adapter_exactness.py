"""The exactness matrix: the adapter's recomputation against the host's own activations.

For every architecture (TransformerBridge, raw and compatibility mode) and every
HookedTransformer config: scores equal ``hook_attn_scores`` where that hook holds logits, the
softmax over the allowed mask equals ``hook_pattern``, pattern @ v equals ``hook_z``, and the
per-head outputs sum (plus ``b_O``) to the attention output; on a single prompt and on left-
and right-padded batches, padding query rows and key columns excluded.
"""

import math

import pytest
import torch

from tl_dynamics import testing
from tl_dynamics.adapter import ModelAdapter
from helpers import requires_hooked

# fp32 tolerance: recomputation reorders sums of ~16-64 products of O(1) terms (errors seen: 0
# for scores/patterns, <= 3e-6 for summed head outputs).
EXACT_TOL = 1e-5
PADDING = [("single", "right"), ("batch", "right"), ("batch", "left")]
# Delegating bridges fire hook_attn_scores on the Hugging Face post-softmax weights.
DELEGATING = {"gptneo", "gptj", "opt", "bert"}


# HookedTransformer blocks that normalise the attention output before hook_attn_out: no hook
# holds the head-output sum there (checked through the model's own post-norm below).
POST_NORM = {"olmo2-post-norm", "norm-before-after"}


def _check(adapter, kind, side, out=True):
    prompt = testing.PROMPTS[0] if kind == "single" else testing.PROMPTS
    errors = testing.reconstruction_errors(adapter, prompt, padding_side=side)
    for key in ("pattern", "z", "out") if out else ("pattern", "z"):
        assert errors[key] <= EXACT_TOL, (key, errors)
    if not out:
        assert math.isnan(errors["out"]), errors
    return errors


@pytest.mark.parametrize("kind,side", PADDING)
@pytest.mark.parametrize("compat", [False, True], ids=["raw", "compat"])
@pytest.mark.parametrize("arch", list(testing.HF_ARCHS))
def test_bridge_reproduces_its_own_attention(arch, compat, kind, side):
    adapter = ModelAdapter(testing.cached_model(arch, compat))
    errors = _check(adapter, kind, side)
    if arch in DELEGATING:
        assert errors["scores_hook_is_pattern"] == 1.0, (
            "expected hook_attn_scores to hold the pattern"
        )
        assert all(spec.scores_hook == "pattern" for spec in adapter.specs)
    else:
        assert errors["scores"] <= EXACT_TOL, errors


@requires_hooked
@pytest.mark.parametrize("kind,side", PADDING)
@pytest.mark.parametrize("variant", list(testing.HOOKED_VARIANTS))
def test_hooked_transformer_reproduces_its_own_attention(variant, kind, side):
    adapter = ModelAdapter(testing.cached_model(variant))
    if kind == "batch" and adapter.is_encoder:
        pytest.skip(
            "a bidirectional HookedTransformer does not mask padding keys; "
            "the adapter refuses padded batches there (tested in test_adapter_errors)"
        )
    errors = _check(adapter, kind, side, out=variant not in POST_NORM)
    assert errors["scores"] <= EXACT_TOL, errors


@requires_hooked
@pytest.mark.parametrize("variant", sorted(POST_NORM))
def test_post_norm_blocks_give_hook_attn_out_as_the_norm_of_the_head_sum(variant):
    """Gemma 2 layout (norm before and after) and OLMo 2 post-norm: hook_attn_out is the block's
    post-norm of the summed head outputs, so it is no reference for them, and the adapter says so
    (no "out" role); through the model's own post-norm the adapter's sum reproduces it."""
    model = testing.cached_model(variant)
    adapter = ModelAdapter(model)
    assert adapter.hook_name("out", 0) is None
    batch = adapter.tokenize(testing.PROMPTS)
    _, cache = model.run_with_cache(batch.tokens)
    for layer, la in adapter.attention(batch, reference=True).items():
        assert "out" not in la.reference
        block = model.blocks[layer]
        post = block.ln1_post if variant == "norm-before-after" else block.ln1
        with torch.no_grad():
            mine = post(la.head_outputs().sum(2) + la.b_O)
        ref = cache[f"blocks.{layer}.hook_attn_out"]
        assert ((mine - ref).abs() * la.query_valid[..., None]).max() <= EXACT_TOL


def _has_native():
    try:
        return (
            hasattr(testing.bridge_class(), "boot_native")
            and __import__("importlib").util.find_spec("transformer_lens.config") is not None
        )
    except ImportError:
        return False


@pytest.mark.skipif(
    not _has_native(), reason="TransformerBridge.boot_native is TransformerLens 4.x"
)
@pytest.mark.parametrize("kind,side", PADDING)
@pytest.mark.parametrize("variant", list(testing.NATIVE_VARIANTS))
def test_native_bridge_reproduces_its_own_attention(variant, kind, side):
    """The zoo's 4.x format (boot_native): rotary from its own tables, GQA, soft-cap, encoder."""
    adapter = ModelAdapter(testing.cached_model(variant))
    errors = _check(adapter, kind, side)
    assert errors["scores_hook_is_pattern"] == 1.0


@pytest.mark.parametrize(
    "arch",
    ["gpt2", "llama", "bert"]
    + (["gpt2-like", "gqa-rms"] if testing.has_hooked_transformer() else ["native-rotary-gqa"]),
)
def test_attention_input_includes_trained_layernorm_weights(arch):
    """x @ W_Q + b_Q equals q (non-rotary) / v on a model whose norms are not the identity."""
    import torch

    model = testing.tiny_model(arch)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for name, param in model.named_parameters():
            if ("ln" in name or "norm" in name) and param.ndim == 1:
                param.add_(torch.randn(param.shape, generator=gen) * 0.5)
    adapter = ModelAdapter(model)
    for layer, la in adapter.attention(testing.PROMPTS[0], inputs=True).items():
        x = la.reference["x"]
        v = torch.einsum("bpm,hmd->bphd", x, adapter.W_V(layer)) + adapter.b_V(layer)
        assert (v - la.v).abs().max().item() <= EXACT_TOL, (layer, (v - la.v).abs().max())


@requires_hooked
def test_hooked_alibi_matches_after_a_longer_prompt():
    """HookedTransformer caches ALiBi at the longest context seen: still exact afterwards."""
    adapter = ModelAdapter(testing.tiny_model("alibi"))
    adapter.forward(adapter.tokenize("word " * 12))
    errors = testing.reconstruction_errors(adapter, "a b", "right")
    assert errors["scores"] <= EXACT_TOL and errors["pattern"] <= EXACT_TOL, errors


# Known structure each fixture was built with: the adapter must find it in the model.
EXPECTED_WINDOWS = {
    "gptneo": [None, testing.WINDOW],
    "mistral": [testing.WINDOW] * 2,
    "qwen2": [None, None],
    "qwen2-sliding": [None, testing.WINDOW],
    "gemma2": [testing.WINDOW, None],
    "gemma3": [testing.WINDOW, None],
    "gpt2": [None, None],
}


@pytest.mark.parametrize("arch", sorted(EXPECTED_WINDOWS))
def test_sliding_windows_are_found_where_each_architecture_keeps_them(arch):
    adapter = ModelAdapter(testing.cached_model(arch))
    assert [spec.window for spec in adapter.specs] == EXPECTED_WINDOWS[arch]


def test_scale_softcap_and_rotary_read_from_the_model_not_cfg():
    gemma = ModelAdapter(testing.cached_model("gemma2"))
    assert gemma.specs[0].scale == pytest.approx(testing.QUERY_PRE_ATTN_SCALAR**-0.5)
    assert gemma.specs[0].softcap == testing.SOFTCAP
    assert ModelAdapter(testing.cached_model("gptneo")).specs[0].scale == 1.0
    assert ModelAdapter(testing.cached_model("gptj")).specs[0].rotary == "interleaved"
    bert = ModelAdapter(testing.cached_model("bert"))
    assert bert.is_encoder and not any(spec.causal for spec in bert.specs)
    assert ModelAdapter(testing.cached_model("bloom")).specs[0].alibi == "key"


@pytest.mark.parametrize("arch", ["gemma2", "mistral", "bloom", "gptneox", "llama"])
def test_dropping_an_ingredient_breaks_the_match(arch):
    """The fixtures exercise each ingredient: without it the pattern no longer matches."""
    import dataclasses

    import torch

    adapter = ModelAdapter(testing.cached_model(arch))
    la = adapter.attention(testing.PROMPTS[1], reference=True)[0]
    spec = la.spec
    if spec.softcap:
        spec = dataclasses.replace(spec, softcap=None)
    elif spec.window:  # the window lives in the allowed mask: rebuild it causal-only
        n = la.q.shape[1]
        la = dataclasses.replace(la, allowed=torch.ones(n, n, dtype=torch.bool).tril()[None])
    elif spec.alibi != "none":
        la = dataclasses.replace(la, position_bias=None)
    else:  # rotary: score with the unrotated q and k instead
        spec = dataclasses.replace(spec, scale=spec.scale * 1.5)
    broken = dataclasses.replace(la, spec=spec)
    err = (broken.pattern() - la.reference["pattern"]).abs().max().item()
    assert err > 1e-3


@pytest.mark.parametrize("arch", ["gpt2", "llama", "gemma2", "opt", "bert", "gptj"])
def test_grouped_and_expanded_weights_reproduce_q(arch):
    """x @ W_Q + b_Q is the model's q before rotary (weights and attention input agree)."""
    import torch

    adapter = ModelAdapter(testing.cached_model(arch))
    layers = adapter.attention(testing.PROMPTS[0], inputs=True)
    for layer, la in layers.items():
        x = la.reference["x"]
        k = torch.einsum("bpm,hmd->bphd", x, adapter.W_K(layer)) + adapter.b_K(layer)
        v = torch.einsum("bpm,hmd->bphd", x, adapter.W_V(layer)) + adapter.b_V(layer)
        assert (v - la.v).abs().max().item() <= EXACT_TOL
        if la.spec.rotary == "none":
            assert (k - la.k).abs().max().item() <= EXACT_TOL
