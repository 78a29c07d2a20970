"""Softmax attention that TransformerLens wraps without query, key or pattern hooks
(RecurrentGemma's local attention, NemotronH's attention; adapter/_unhooked.py): read with torch
hooks on the Hugging Face module, checked against the module's own attention weights, against the
Hugging Face model itself and against the module's weights; the torch hooks are removed on exit,
also when an exception is raised inside the forward pass."""

import re

import pytest
import torch

from test_architectures import EXACT_TOL, boot_tiny
from tl_dynamics import contextual_mlp, odds_ratio, testing
from tl_dynamics.adapter import ModelAdapter, masked_softmax
from tl_dynamics.adapter import _unhooked
from tl_dynamics.errors import TLDynamicsError

KINDS = {
    "RecurrentGemmaForCausalLM": ["recurrent", "attention"],
    "NemotronHForCausalLM": ["state_space", "attention"],
}


@pytest.fixture(scope="module")
def models():
    return {name: boot_tiny(name) for name in KINDS}


def _torch_hooks(model) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.original_model.modules()
    )


def _host_hooks(model) -> int:
    return sum(len(point.fwd_hooks) for point in model.hook_dict.values())


@pytest.mark.parametrize("name", sorted(KINDS))
def test_scores_and_pattern_are_exact_against_the_module_and_hugging_face(models, name):
    model = models[name]
    adapter = ModelAdapter(model)
    assert [spec.kind for spec in adapter.specs] == KINDS[name]
    assert adapter.attention_layers == [1] and adapter.specs[1].unhooked
    assert adapter.specs[1].scores_hook == "pattern"  # the module returns weights, not logits
    twin = testing.hf_twin(model)
    for prompt, side in (
        (testing.PROMPTS[0], "right"),
        (testing.PROMPTS, "right"),
        (testing.PROMPTS, "left"),
    ):
        host = testing.reconstruction_errors(adapter, prompt, side)
        assert max(host["pattern"], host["z"], host["out"]) <= EXACT_TOL, (side, host)
        hf = testing.hf_truth_errors(adapter, twin, prompt, side)
        assert max(hf.values()) <= EXACT_TOL, (side, hf)
    assert _torch_hooks(model) == 0 and _host_hooks(model) == 0


@pytest.mark.parametrize("name", sorted(KINDS))
def test_scored_q_k_v_follow_from_the_module_weights_and_rotation(models, name):
    """q, k and v as scored equal x W + b (rotated on RecurrentGemma: the first half of each
    head, rotate-half layout, positions from the padding mask), W read from the module's own
    projections; the head outputs sum to the module's o_proj output."""
    model = models[name]
    adapter = ModelAdapter(model)
    module = _unhooked.hf_attention(model, 1)
    batch = adapter.tokenize(testing.PROMPTS, "left")
    la = adapter.attention(batch, reference=True, inputs=True)[1]
    x, rows = la.reference["x"], la.query_valid[..., None, None]
    assert torch.equal(adapter.W_Q(1)[2], module.q_proj.weight[32:48].T.float())
    k_rows = module.k_proj.weight[16:32].T.float()  # kv head 1 serves query heads 2 and 3
    assert torch.equal(adapter.W_K(1)[2], k_rows) and torch.equal(adapter.W_K(1)[3], k_rows)
    rotation = adapter.rotation(1)
    positions = adapter.positions(batch)

    def project(name: str) -> torch.Tensor:
        w, b = getattr(adapter, f"W_{name}")(1), getattr(adapter, f"b_{name}")(1)
        y = torch.einsum("bpm,hmd->bphd", x, w) + b
        return y if rotation is None or name == "V" else rotation.rotate(y, positions)

    for got, want in ((la.q, project("Q")), (la.k, project("K")), (la.v, project("V"))):
        assert ((got - want).abs() * rows).max() <= EXACT_TOL
    out = la.head_outputs().sum(2) + la.b_O
    assert ((out - la.reference["out"]).abs() * la.query_valid[..., None]).max() <= EXACT_TOL
    if name == "RecurrentGemmaForCausalLM":
        assert (rotation.layout, rotation.rotary_dim) == ("half", 8)  # partial_rotary_factor 0.5
        assert torch.allclose(rotation.inv_freq.float(), 10000.0 ** -(torch.arange(0, 8, 2) / 8))
    else:
        assert rotation is None  # NemotronH's attention has no position embedding


def test_recurrent_gemma_local_window_is_the_modules_and_nemotron_h_has_none(models):
    """RecurrentGemma masks keys more than attention_window_size - 1 back (read from the
    module); the pattern without that window is not the model's. NemotronH's config carries a
    sliding_window its causal mask ignores: no window."""
    gemma = ModelAdapter(models["RecurrentGemmaForCausalLM"])
    config = models["RecurrentGemmaForCausalLM"].original_model.config
    assert gemma.specs[1].window == config.attention_window_size == 4
    la = gemma.attention(testing.PROMPTS[1], reference=True)[1]
    i, j = torch.meshgrid(torch.arange(la.q.shape[1]), torch.arange(la.q.shape[1]), indexing="ij")
    far = (j <= i - 4)[None, None]
    assert la.reference["pattern"].masked_select(far).abs().max() == 0
    causal = (j <= i)[None].expand_as(la.allowed)
    unwindowed = masked_softmax(la.scores(), causal)
    assert (unwindowed - la.reference["pattern"]).abs().max() > 1e-2
    nemotron = ModelAdapter(models["NemotronHForCausalLM"])
    assert nemotron.specs[1].window is None
    assert models["NemotronHForCausalLM"].original_model.config.sliding_window == 4
    pattern = nemotron.attention(testing.PROMPTS[1], reference=True)[1].reference["pattern"]
    n = pattern.shape[-1]
    i, j = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    assert pattern.masked_select((j <= i - 4)[None, None]).max() > 1e-3


@pytest.mark.parametrize("name", sorted(KINDS))
def test_no_hook_is_left_after_an_exception_inside_the_forward_pass(models, name):
    model = models[name]
    adapter = ModelAdapter(model)
    before = _torch_hooks(model), _host_hooks(model)

    def fail(_la):
        raise RuntimeError("collector bug")

    with pytest.raises(RuntimeError, match="collector bug"):
        with adapter.capture(fail, reference=True, inputs=True):
            adapter.forward(adapter.tokenize(testing.PROMPTS[0]))
    assert (_torch_hooks(model), _host_hooks(model)) == before == (0, 0)

    def bad_patch(_z):
        raise ValueError("patch bug")

    with pytest.raises(TLDynamicsError, match="patch bug"):
        with adapter.patch([("z", 1, bad_patch), ("pattern", 1, lambda p: p)]):
            adapter.forward(adapter.tokenize(testing.PROMPTS[0]))
    assert (_torch_hooks(model), _host_hooks(model)) == before


def test_patched_pattern_and_z_change_the_output_as_on_hooked_hosts(models):
    """A pattern patch recomputes the module's output as o_proj(pattern @ v): the identity patch
    keeps the logits, attending to the first key only gives v_0 W_O + b_O; zeroing z leaves
    b_O; only z and pattern can be patched."""
    model = models["RecurrentGemmaForCausalLM"]
    adapter = ModelAdapter(model)
    batch = adapter.tokenize(testing.PROMPTS[0])
    clean = adapter.forward(batch)
    la = adapter.attention(batch)[1]
    with adapter.patch([("pattern", 1, lambda p: p.clone()), ("z", 1, lambda z: z.clone())]):
        assert (adapter.forward(batch) - clean).abs().max() <= EXACT_TOL
    seen = []

    def first_key(p):
        return torch.zeros_like(p).index_fill_(-1, torch.tensor([0]), 1.0)

    with adapter.patch([("pattern", 1, first_key)]), adapter.hooks([("out", 1, seen.append)]):
        patched = adapter.forward(batch)
    want = torch.einsum("hd,hdm->m", la.v[0, 0], la.W_O) + la.b_O
    assert (seen[-1][0] - want).abs().max() <= EXACT_TOL and (patched - clean).abs().max() > 1e-3
    seen.clear()
    with adapter.patch([("z", 1, torch.zeros_like)]), adapter.hooks([("out", 1, seen.append)]):
        adapter.forward(batch)
    assert torch.equal(seen[-1][0], la.b_O.expand_as(seen[-1][0]))
    with pytest.raises(
        TLDynamicsError, match=re.escape("only its 'z' and 'pattern' can be patched")
    ):
        with adapter.patch([("q", 1, lambda q: q)]):
            adapter.forward(batch)
    assert _torch_hooks(model) == 0


@pytest.mark.parametrize("name", sorted(KINDS))
def test_attention_analyses_run_exactly_on_the_unhooked_layers(models, name):
    model = models[name]
    prompt = testing.PROMPTS[0]
    frame = odds_ratio.compute(model, prompt).to_dataframe()
    assert set(frame["layer"]) == {1}
    mlps = contextual_mlp.compute(model, prompt)
    assert [m.layer for m in mlps] and all(
        m.exactness().max_output_error <= EXACT_TOL for m in mlps
    )


def test_nemotron_h_mlp_and_moe_layers_are_named_and_attention_stays_exact():
    model = boot_tiny("NemotronHForCausalLM", hybrid_override_pattern="M-*E", num_hidden_layers=4)
    adapter = ModelAdapter(model)
    assert [spec.kind for spec in adapter.specs] == ["state_space", "mlp", "attention", "mlp"]
    hf = testing.hf_truth_errors(adapter, testing.hf_twin(model), testing.PROMPTS, "left")
    assert max(hf.values()) <= EXACT_TOL, hf
    message = "layer 1 of NemotronHForCausalLM is not an attention layer: it is a 'mlp' layer"
    with pytest.raises(TLDynamicsError, match=re.escape(message)):
        adapter.attention(testing.PROMPTS[0], layers=1)


def test_an_unverified_unhooked_module_is_not_read(models, monkeypatch):
    monkeypatch.delitem(_unhooked.UNHOOKED_ATTENTION, "NemotronHAttention")
    adapter = ModelAdapter(models["NemotronHForCausalLM"])
    assert [spec.kind for spec in adapter.specs] == ["state_space", "unhooked_attention"]
    with pytest.raises(TLDynamicsError, match="not verified to be read exactly"):
        adapter.attention(testing.PROMPTS[0])


def test_under_sdpa_the_recomputation_stays_exact_and_pattern_patches_are_refused():
    """SDPA returns no attention weights: q/k/v still come from the projections, so the
    recomputed pattern equals the eager Hugging Face twin's; a pattern patch says what to do."""
    model = boot_tiny("NemotronHForCausalLM")
    model.original_model.set_attn_implementation("sdpa")
    adapter = ModelAdapter(model)
    hf = testing.hf_truth_errors(adapter, testing.hf_twin(model), testing.PROMPTS, "left")
    assert max(hf.values()) <= EXACT_TOL, hf
    assert "pattern" not in adapter.attention(testing.PROMPTS[0], reference=True)[1].reference
    message = "load the model with attn_implementation='eager' to patch it"
    with pytest.raises(TLDynamicsError, match=re.escape(message)):
        with adapter.patch([("pattern", 1, lambda p: p)]):
            adapter.forward(adapter.tokenize(testing.PROMPTS[0]))
    assert _torch_hooks(model) == 0


def test_attached_analyses_read_the_unhooked_layer_in_the_users_own_pass(models):
    """odds_ratio.attach and contextual_mlp.attach on one padded call of the model itself: the
    same statistics as compute, and each head's contextual MLP reproduces its output."""
    model = models["RecurrentGemmaForCausalLM"]
    adapter = ModelAdapter(model)
    batch = adapter.tokenize(testing.PROMPTS, "left")
    with (
        odds_ratio.attach(model) as ratios,
        contextual_mlp.attach(model, layers=1, heads=[0, 3], reference=True) as mlps,
    ):
        model(batch.tokens, attention_mask=batch.key_valid.long())
    attached = ratios.result().to_dataframe()
    computed = odds_ratio.compute(model, batch).to_dataframe()
    assert attached.index.tolist() == ["L1H0", "L1H1", "L1H2", "L1H3"]
    numbers = attached.select_dtypes("number").columns
    assert (attached[numbers] - computed[numbers]).abs().max().max() <= 1e-5
    found = mlps.result()
    assert found.keys() == [(1, 0), (1, 3)]
    assert all(found[key].exactness().max_output_error <= EXACT_TOL for key in found.keys())
    assert _torch_hooks(model) == 0
