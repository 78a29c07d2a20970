"""JetMoE: a mixture of attention heads (docs/math.md §1.10, adapter/_jetmoe.py).

A router picks each token's top-k query/output experts; keys and values are shared. The bridge
hooks the module's input, the router's logits and the shared k/v projection, not the query, so
the adapter forms each query from its token's expert. Checked here against the Hugging Face
module's own ``experts.map`` and rotary function (independent of the adapter's arithmetic), the
head outputs against the module's own ``experts.reduce``, and the refusals of everything that
reads W_Q or W_O as one fixed matrix.
"""

import re
import sys

import pytest
import torch

from test_architectures import EXACT_TOL, boot_tiny
from tl_dynamics import circuits, contextual_mlp, odds_ratio, particles, report, testing
from tl_dynamics import trajectories
from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.errors import TLDynamicsError

NAME = "JetMoeForCausalLM"
ROUTED = f"of {NAME} has router-chosen attention experts"


@pytest.fixture(scope="module")
def jetmoe():
    model = boot_tiny(NAME)
    return model, ModelAdapter(model)


def _hf_queries(model, layer, x, positions):
    """The module's own rotated queries ``[batch, pos, head, d_head]`` (experts.map, then its
    modeling file's apply_rotary_pos_emb with the model's own rotary tables)."""
    orig = model.blocks[layer].attn.original_component
    hf_model = model.original_model
    rotate = sys.modules[type(orig).__module__].apply_rotary_pos_emb
    with torch.no_grad():
        q, _, topo = orig.experts.map(x)  # [batch, pos, top_k, n_kv * d_head]
        q = q.reshape(*x.shape[:2], -1, orig.head_dim).transpose(1, 2)
        cos, sin = hf_model.model.rotary_emb(x, positions)
        q, _ = rotate(q, q, cos, sin)
    return q.transpose(1, 2), topo


def test_queries_are_each_tokens_router_chosen_expert_rotated(jetmoe):
    model, adapter = jetmoe
    assert [spec.gate for spec in adapter.specs] == ["router", "router"]
    for side in ("left", "right"):
        las = adapter.attention(testing.PROMPTS, reference=True, inputs=True, padding_side=side)
        for layer, la in las.items():
            positions = adapter.positions(la.allowed.any(1)).masked_fill(~la.query_valid, 1)
            hf_q, _ = _hf_queries(model, layer, la.reference["x"], positions)
            rows = la.query_valid
            assert (la.q - hf_q)[rows].abs().max() <= EXACT_TOL
            # the router matters: each token's slots hold different experts, and not one expert
            # for every token (expert 0 for all queries scores differently)
            chosen = la.routing.experts[rows]
            assert chosen.unique().numel() > 2
            orig = model.blocks[layer].attn.original_component
            weight = orig.experts.input_linear.weight.detach().float()[0]
            one = (la.reference["x"] @ weight.T).reshape(*la.q.shape[:2], -1, la.q.shape[-1])
            one = adapter.rotation(layer).rotate(one.repeat(1, 1, 2, 1), positions)
            assert (one - la.q)[rows].abs().max() > 1e-2


def test_keys_and_values_are_shared_and_tiled_over_the_slots(jetmoe):
    _, adapter = jetmoe
    la = adapter.attention(testing.PROMPTS[0], inputs=True)[1]
    n_kv = adapter.n_kv_heads
    assert adapter.n_heads == 2 * n_kv  # two slots (top_k = 2) of n_kv heads
    # head h reads key/value head h mod n_kv: the slots repeat, not interleave, the kv heads
    assert torch.equal(la.k[:, :, :n_kv], la.k[:, :, n_kv:])
    assert torch.equal(la.v[:, :, :n_kv], la.v[:, :, n_kv:])
    assert not torch.equal(la.k[:, :, 0], la.k[:, :, 1])
    x = la.reference["x"]
    # W_K is the shared projection, tiled (W_V is refused with the value path, below)
    keys = torch.einsum("bpm,hmd->bphd", x, adapter.W_K(1))
    rotated = adapter.rotation(1).rotate(keys, adapter.positions(la.allowed.any(1)))
    assert (rotated - la.k).abs().max() <= EXACT_TOL


def test_head_outputs_go_through_each_querys_output_expert(jetmoe):
    """sum_h of the head outputs + b equals the module's own experts.reduce of the ungated z,
    and the router weight is each slot's gate on z."""
    model, adapter = jetmoe
    la = adapter.attention(testing.PROMPTS, reference=True, inputs=True, padding_side="left")[0]
    orig = model.blocks[0].attn.original_component
    x, rows = la.reference["x"], la.query_valid
    positions = adapter.positions(la.allowed.any(1)).masked_fill(~rows, 1)
    _, topo = _hf_queries(model, 0, x, positions)
    ungated = torch.einsum("bhij,bjhd->bihd", la.pattern(), la.v)
    with torch.no_grad():
        expected = orig.experts.reduce(ungated.reshape(*ungated.shape[:2], 2, -1), topo)
    out = la.head_outputs().sum(2) + la.b_O
    assert (out - expected)[rows].abs().max() <= EXACT_TOL
    assert (out - la.reference["out"])[rows].abs().max() <= EXACT_TOL
    assert (la.z() - ungated)[rows].abs().max() > 1e-3  # the router weight gates z
    # a query's two slots' weights sum to 1 (softmax over its top-k logits)
    weights = la.gate[..., 0][rows]
    assert torch.allclose(weights[:, 0] + weights[:, 2], torch.ones(weights.shape[0]))
    with pytest.raises(
        TLDynamicsError,
        match=re.escape(f"cannot patch z of layer 0 of {NAME}: it has router-chosen"),
    ):
        with adapter.patch([("z", 0, lambda z: z)]):
            pass
    with pytest.raises(TLDynamicsError, match=re.escape("fires hook_pattern after the module")):
        with adapter.patch([("pattern", 0, lambda p: p)]):
            pass


def test_fixed_matrix_readers_refuse_by_name_and_the_rest_runs(jetmoe):
    model, adapter = jetmoe
    prompt = testing.PROMPTS[0]
    la = adapter.attention(prompt)[0]
    refused = [  # (what the message starts with, the call)
        ("W_Q", lambda: adapter.W_Q(0)),
        ("W_O", lambda: adapter.W_O(1)),
        ("W_V", lambda: adapter.W_V(0)),
        ("ModelAdapter.query_norm", lambda: adapter.query_norm(0)),
        ("ContextualMLPCollector", lambda: contextual_mlp.compute(model, prompt)),
        ("W_Q", lambda: circuits.qk_circuit(model, 0, 1)),
        ("W_V", lambda: circuits.ov_circuit(model, 1, 0)),
        ("W_Q", lambda: particles.from_head(model, 0, 0)),
    ]
    for what, call in refused:
        with pytest.raises(TLDynamicsError, match=re.escape(ROUTED)) as info:
            call()
        assert str(info.value).startswith(what), str(info.value)
    with pytest.raises(TLDynamicsError, match="of this model has router-chosen attention experts"):
        la.source_outputs()  # a LayerAttention does not know the model's name
    assert adapter.b_O(0).shape == (adapter.d_model,)
    split = odds_ratio.compute(model, prompt).to_dataframe()
    assert len(split) == adapter.n_layers * adapter.n_heads
    labels = list(trajectories.compute(adapter, testing.PROMPTS).labels)
    assert labels[-1] == f"resid_post{adapter.n_layers - 1}"


def test_report_shows_the_patterns_and_names_router_chosen_experts(jetmoe):
    model, _ = jetmoe
    page = report.build_report(model, "a b c a b c")
    html = page.to_html()
    assert page.failed_sections == []
    notes = re.findall(r"Not shown for this model: ([^<]*)", html)
    assert notes and all("router-chosen attention experts" in note for note in notes), notes
    atlas = html.rsplit("What each head does", 1)[1].split("</section>", 1)[0]
    assert "causal evidence not run: cannot patch z" in atlas
    assert "The causal columns are left out: cannot patch z of layer 0" in html
    patterns = html.rsplit("Attention patterns", 1)[1].split("</section>", 1)[0]
    assert "Not shown for this model" not in patterns


def test_delegated_pattern_patches_are_refused_and_the_atlas_says_so():
    """Where the bridge runs the Hugging Face module whole (Llama 4 here, JetMoE above), its
    hook_pattern fires after the module used the pattern: a patched pattern would change nothing
    (measured: the logits are unchanged), so ModelAdapter.patch refuses it and the atlas notes
    that its causal evidence was not run, leaving the loss columns empty."""
    from tl_dynamics import atlas

    adapter = ModelAdapter(boot_tiny("Llama4ForCausalLM", no_rope_layers=[1, 0]))
    message = (
        "cannot patch the pattern of layer 0 of Llama4ForCausalLM: TransformerLens runs its "
        "Hugging Face attention module whole and fires hook_pattern after the module"
    )
    with pytest.raises(TLDynamicsError, match=re.escape(message)):
        with adapter.patch([("pattern", 0, lambda p: torch.zeros_like(p))]):
            pass
    result = atlas.compute(adapter, testing.PROMPTS[0])
    assert any(note.startswith("causal evidence not run: " + message) for note in result.notes)
    assert all(torch.tensor(d).isnan().all() for d in result.delta_loss.values())
