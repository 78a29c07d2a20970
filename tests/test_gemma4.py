"""Gemma 4 (docs/math.md §1.6): q, k and v each RMS-normalised per head, head widths and rotary
per layer type, keys shared with values (``attention_k_eq_v``) and keys and values reused from
an earlier layer (``num_kv_shared_layers``). Checked against the Hugging Face modules
themselves: the adapter's q, k and v against the module's own projections and norms, the
pattern and output against the host's hooks and the Hugging Face model
(``test_architectures.check_exact_or_refused``), and the refusals' messages literally."""

import re

import pytest
import torch

from test_architectures import EXACT_TOL, VARIANTS, boot_tiny, check_exact_or_refused
from tl_dynamics import circuits, contextual_mlp, testing
from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.errors import TLDynamicsError

pytestmark = pytest.mark.skipif(
    not hasattr(__import__("transformers"), "Gemma4ForCausalLM"), reason="no Gemma 4 here"
)


def _tiny(variant=None):
    name, overrides = VARIANTS[variant] if variant else ("Gemma4ForCausalLM", {})
    return boot_tiny(name, **overrides)


def _hf_qkv(orig, x):
    """The module's own normalised q (before rotary), k (before rotary) and v, per head."""
    shape = (*x.shape[:-1], -1, orig.head_dim)
    with torch.no_grad():
        q = orig.q_norm(orig.q_proj(x).view(shape))
        k_raw = orig.k_proj(x).view(shape)
        v_raw = k_raw if orig.v_proj is None else orig.v_proj(x).view(shape)
        return q, orig.k_norm(k_raw), orig.v_norm(v_raw), v_raw


@pytest.fixture(scope="module")
def gemma4():
    model = _tiny()
    return model, ModelAdapter(model)


def test_q_k_v_are_the_normalised_projections_and_widths_differ_by_layer(gemma4):
    model, adapter = gemma4
    layers = adapter.attention(testing.PROMPTS, reference=True, inputs=True, padding_side="left")
    assert [la.q.shape[-1] for la in layers.values()] == [16, 32]  # sliding, full
    assert [adapter.head_width(layer) for layer in layers] == [16, 32]
    assert [la.spec.window for la in layers.values()] == [4, None]
    assert all(la.scale == 1.0 for la in layers.values())  # the module's scaling
    for layer, la in layers.items():
        orig = model.blocks[layer].attn.original_component
        q, k, v, v_raw = _hf_qkv(orig, la.reference["x"])
        assert (adapter.expand_kv(v) - la.v).abs().max() <= 1e-6
        # v_norm has no gain: every head's value has unit mean square; the projection has not
        real = la.reference["x"].abs().amax(-1) > 0  # pads and BOS (id 0: padding_idx) are 0
        assert torch.allclose(la.v[real].pow(2).mean(-1), torch.ones(()), atol=1e-4)
        assert (v_raw[real].pow(2).mean(-1) - 1).abs().max() > 0.1
        # the scored query: the rotation of the normalised projection (ModelAdapter.query_norm)
        positions = adapter.positions(la.query_valid | la.allowed.any(-1))
        rotation = adapter.rotation(layer)
        unrotated = adapter.unrotated_queries(layer, la.reference["x"])
        assert (unrotated - q).abs().max() <= 1e-5
        assert (rotation.rotate(unrotated, positions) - la.q).abs().max() <= 1e-5
        assert (rotation.rotate(adapter.expand_kv(k), positions) - la.k).abs().max() <= 1e-5
        rows = la.query_valid  # the host's pad rows are not attention
        pattern_err = (la.pattern() - la.reference["pattern"]).transpose(1, 2)[rows]
        assert pattern_err.abs().max() <= EXACT_TOL
        out_err = (la.head_outputs().sum(2) - la.reference["out"])[rows]
        assert out_err.abs().max() <= EXACT_TOL


def test_full_layers_rotate_a_quarter_of_their_frequencies(gemma4):
    """Proportional rope on full layers: partial_rotary_factor 0.25 of 32 dims, the rest zero."""
    _, adapter = gemma4
    sliding, full = adapter.rotation(0), adapter.rotation(1)
    assert sliding.rotary_dim == 16 and bool((sliding.inv_freq > 0).all())
    assert full.rotary_dim == 32 and int((full.inv_freq > 0).sum()) == 4


def test_value_weights_refuse_by_name_and_per_source_outputs_stay_exact(gemma4):
    model, adapter = gemma4
    message = (
        "W_V: layer 1 of Gemma4ForCausalLM RMS-normalises each head's value (v_j = x_j W_V / "
        "rms(x_j W_V), v_norm), so no fixed matrix W_V W_O maps the residual stream to what a "
        "head writes; it does not model the value norm (the pattern, z, head outputs and "
        "per-source outputs v_j W_O are exact: ModelAdapter.attention)"
    )
    with pytest.raises(TLDynamicsError, match=re.escape(message)):
        adapter.W_V(1)
    with pytest.raises(TLDynamicsError, match=re.escape("RMS-normalises each head's value")):
        circuits.ov_circuit(model, 1, 0)
    # W_Q and W_K are the module's own projections, one width per layer
    orig = model.blocks[1].attn.original_component
    assert adapter.W_Q(1).shape == (4, 64, 32) and adapter.W_O(1).shape == (4, 32, 64)
    assert torch.equal(adapter.W_K(1)[1], orig.k_proj.weight.detach()[:32].T)
    # the contextual MLP reads v_j W_O from the hooks, so it is exact on every layer
    mlps = contextual_mlp.compute(model, testing.PROMPTS[0])
    assert len(mlps) == 2 * adapter.n_heads
    assert all(m.exactness().max_output_error <= EXACT_TOL for m in mlps)


def test_keys_shared_with_values_are_exact():
    """attention_k_eq_v: full layers have no v_proj; the value is v_norm(k_proj(x))."""
    model = _tiny("gemma4-k-eq-v")
    check_exact_or_refused("Gemma4ForCausalLM", model, row="gemma4-k-eq-v")
    adapter = ModelAdapter(model)
    la = adapter.attention(testing.PROMPTS[0], layers=[1], inputs=True)[1]
    orig = model.blocks[1].attn.original_component
    assert orig.v_proj is None and la.k.shape[2] == adapter.n_heads
    _, _, v, _ = _hf_qkv(orig, la.reference["x"])
    assert (adapter.expand_kv(v) - la.v).abs().max() <= 1e-6


def test_a_layer_reusing_an_earlier_layers_keys_scores_them_exactly():
    """num_kv_shared_layers=1: layer 2 scores layer 1's keys and values (same type, same
    rotation), fires no key or value hook (the adapter reads layer 1's, also when layer 2 is
    asked alone), and its key/value weights refuse by name."""
    model = _tiny("gemma4-shared-kv")
    check_exact_or_refused("Gemma4ForCausalLM", model, row="gemma4-shared-kv")
    adapter = ModelAdapter(model)
    assert [spec.kv_from for spec in adapter.specs] == [None, None, 1]
    layers = adapter.attention(testing.PROMPTS, reference=True, padding_side="right")
    assert torch.equal(layers[2].k, layers[1].k) and torch.equal(layers[2].v, layers[1].v)
    assert not torch.equal(layers[2].q, layers[1].q)
    for la in layers.values():
        valid = la.query_valid[:, None, :, None]
        err = ((la.pattern() - la.reference["pattern"]) * valid).abs().max()
        assert err <= EXACT_TOL
    with pytest.raises(
        TLDynamicsError,
        match=re.escape(
            "W_K: layer 2 of Gemma4ForCausalLM reuses layer 1's keys and values "
            "(num_kv_shared_layers), computed from layer 1's input, so no W_K of layer 2 maps "
            "its own input to them; layer 1's weights give them"
        ),
    ):
        adapter.W_K(2)
    # asked alone, layer 2 still gets layer 1's keys (its hooks are added to the pass)
    alone = adapter.attention(testing.PROMPTS, layers=[2], reference=True)
    assert list(alone) == [2] and torch.equal(alone[2].k, layers[1].k)
    assert torch.equal(alone[2].pattern(), layers[2].pattern())
    mlps = contextual_mlp.compute(model, testing.PROMPTS[0], layers=2)  # the report's layer
    assert all(m.exactness().max_output_error <= EXACT_TOL for m in mlps)
    assert adapter.W_Q(2).shape == (4, 64, 32)  # its own query projection


def test_a_bidirectional_sliding_layer_sees_keys_up_to_its_window_inclusive():
    """use_bidirectional_attention="all": Hugging Face halves the window (w // 2 + 1) and allows
    |i - j| <= w there; the adapter's mask is that set, and it is the host's pattern support."""
    model = _tiny("gemma4-bidirectional")
    adapter = ModelAdapter(model)
    window = model.blocks[0].attn.original_component.sliding_window
    assert window == 3 and not adapter.specs[0].causal and adapter.is_encoder
    la = adapter.attention(testing.PROMPTS[0], layers=[0], reference=True)[0]
    i = torch.arange(la.allowed.shape[-1])
    assert torch.equal(la.allowed[0], (i[:, None] - i[None]).abs() <= window)
    assert torch.equal(la.reference["pattern"][0] > 0, la.allowed.expand_as(la.pattern())[0])
    assert (la.pattern() - la.reference["pattern"]).abs().max() <= EXACT_TOL


def _lens_error(model):
    """The logit lens on the last resid_post against the model's own logits, and without the
    soft-cap (what the lens gave before it read ``final_softcap``)."""
    adapter = ModelAdapter(model)
    batch, last = adapter.tokenize(testing.PROMPTS[0]), []
    with adapter.hooks([("resid_post", adapter.n_layers - 1, last.append)]):
        logits = adapter.forward(batch).float()
    uncapped = adapter.final_norm(last[0]) @ adapter.W_U + adapter.b_U
    lens = adapter.logit_lens(last[0])
    return adapter.final_softcap, (lens - logits).abs().max(), (uncapped - logits).abs().max()


@pytest.mark.parametrize("name", ["Gemma4ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"])
def test_the_logit_lens_soft_caps_logits_as_the_model_does(name):
    """final_logit_softcapping (Gemma 2, 3 and 4): logits = cap * tanh(l / cap); the lens (and the
    trajectories' lens, through ModelAdapter.unembed) equals the model's logits only with it."""
    cap, err, uncapped_err = _lens_error(boot_tiny(name, final_logit_softcapping=3.0))
    assert cap == 3.0 and err <= EXACT_TOL and uncapped_err > 0.1


def test_a_hooked_transformers_output_soft_cap_is_read_too():
    from tl_dynamics.compat import has_hooked_transformer

    if not has_hooked_transformer():
        pytest.skip("HookedTransformer was removed in TransformerLens 4.0")
    cap, err, uncapped_err = _lens_error(
        testing.tiny_hooked("gpt2-like", output_logits_soft_cap=2.0)
    )
    assert cap == 2.0 and err <= EXACT_TOL and uncapped_err > 0.1
