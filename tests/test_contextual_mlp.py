"""Attention as a contextual MLP: exact reconstruction on the exactness matrix, agreement with a
naive per-neuron loop, counterfactual queries, read-outs, growth, views, errors, and the
induction head of the shipped induction model."""

import dataclasses

import pandas as pd
import pytest
import torch

from helpers import adapter_for, requires_hooked
from tl_dynamics import contextual_mlp as cm
from tl_dynamics import testing, viz
from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.contextual_mlp import _core
from tl_dynamics.contextual_mlp import _frame
from tl_dynamics.contextual_mlp import _growth
from tl_dynamics.contextual_mlp import _readout

# fp32: the explicit MLP (b_i . x_T + c_i, softmax, sum of a_i) reorders the model's sums of
# ~16-64 O(1) products; errors seen <= 8e-6 (GPT-Neo, unscaled scores), the bound is 1e-5.
EXACT_TOL = 1e-5
# Two fp32 routes to the same numbers (query route vs explicit b_i, chunked vs not).
ROUTE_TOL = 1e-5
INDUCTION_MIN_WINNERS = 0.9  # the bound
# On trained heads (scores up to ~80) the model's own float32 rounding alone reaches ~1.5e-5
# (float64 attention on its own q, k, v against its z); the MLP's error tracks it within 1.2x.
FLOOR_FACTOR = 2.0
QK_NORM = {"gemma3", "olmo2"}
MATRIX = [(arch, compat) for arch in testing.HF_ARCHS for compat in (False, True)]


def all_mlps(adapter, prompt=testing.PROMPTS, side="right"):
    batch = adapter.tokenize(prompt, padding_side=side)
    return [m for row in cm.compute_rows(adapter, batch) for m in row]


def assert_exact(mlps):
    assert mlps
    for m in mlps:
        e = m.exactness()
        assert len(e.positions) >= 5
        assert e.max_output_error <= EXACT_TOL, (m, e.to_dataframe())
        assert e.max_pattern_error <= EXACT_TOL, (m, e.to_dataframe())


# ------------------------------------------------------------------ exactness matrix
@pytest.mark.parametrize(
    "arch,compat", MATRIX, ids=[f"{a}-{'compat' if c else 'raw'}" for a, c in MATRIX]
)
def test_mlp_reproduces_head_output_and_pattern(arch, compat):
    adapter = adapter_for(arch, compat)
    mlps = all_mlps(adapter)
    assert {m.input_space for m in mlps} == {"query" if arch in QK_NORM else "residual"}
    assert_exact(mlps)


def _random_qk_norm_gains(model, seed=3):
    """Random query/key norm gains: the tiny models start at the identity gain (w = 0 for
    Gemma's 1 + w, w = 1 elsewhere), which would hide a wrong gain convention."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in model.blocks:
            attn = getattr(block.attn, "original_component", block.attn)
            for norm in (attn.q_norm, attn.k_norm):
                inner = getattr(norm, "original_component", None) or norm
                w = inner.weight if hasattr(inner, "weight") else inner.w
                w.add_(0.5 * torch.randn(w.shape, generator=gen))
    return ModelAdapter(model)


QK_NORM_MODELS = [(arch, compat) for arch in sorted(QK_NORM) for compat in (False, True)] + (
    [("qk-norm", False), ("olmo2-post-norm", False)] if testing.has_hooked_transformer() else []
)


@pytest.mark.parametrize("arch,compat", QK_NORM_MODELS)
def test_qk_norm_mlp_acts_on_the_models_normalised_query(arch, compat):
    """Gemma 3 (per head, gain 1 + w), OLMo 2 (over all heads), HookedTransformer use_qk_norm:
    b_i = c k_i act on N(x W_Q + b_Q); exact with random gains, and only with the right norm."""
    adapter = _random_qk_norm_gains(testing.tiny_model(arch, compat))
    mlps = all_mlps(adapter)
    assert_exact(mlps)
    mlp = mlps[-1]
    assert mlp.input_space == "query" and mlp.neurons(3).b.shape == (4, adapter.d_head)
    for pos in (0, 3, mlp.n_pos - 1):
        n = mlp.neurons(pos)
        naive_out, naive_h = _core.naive_mlp(
            mlp.queries(mlp.x[pos][None])[0], n.a, n.b, n.c, mlp.softcap
        )
        assert torch.allclose(mlp.evaluate(mlp.x[pos], pos).outputs[0], naive_out, atol=ROUTE_TOL)
    norm = mlp.query_norm
    for wrong in (
        None,
        dataclasses.replace(norm, offset=1.0 - norm.offset),
        dataclasses.replace(norm, weight=norm.weight.flip(0)),
    ):
        other = dataclasses.replace(mlp, query_norm=wrong)
        errs = [
            (other.evaluate(mlp.x[p], p).outputs[0] - mlp.reference_output[p]).abs().max()
            for p in mlp.positions
        ]
        assert max(errs) > 1e-3, wrong


@pytest.mark.parametrize("arch", ["llama", "gptj", "bloom", "gemma2"])
def test_mlp_exact_on_left_padded_batches(arch):
    assert_exact(all_mlps(adapter_for(arch), side="left"))


@requires_hooked
@pytest.mark.parametrize("variant", list(testing.HOOKED_VARIANTS))
def test_mlp_exact_on_hooked_transformer(variant):
    adapter = adapter_for(variant)
    prompt = testing.PROMPTS[0] if adapter.is_encoder else testing.PROMPTS
    assert_exact(all_mlps(adapter, prompt, side="left" if variant == "rotary" else "right"))


def test_head_output_matches_adapter_recomputation_and_model_z():
    """The reference is the model's own z through W_O; it also equals the adapter's head output."""
    adapter = adapter_for("llama")
    la = adapter.attention(testing.PROMPTS[0], layers=[1], reference=True)[1]
    mlp = cm.compute(adapter, testing.PROMPTS[0], layers=1, heads=3)[1, 3]
    own = la.head_outputs([3])[0, :, 0]
    for pos in mlp.positions:
        assert (mlp.output(pos) - own[pos]).abs().max() <= EXACT_TOL


# ------------------------------------------------------------------ the weights themselves
@pytest.mark.parametrize("arch", ["gpt2", "llama", "gemma2", "bloom", "mistral"])
def test_naive_per_neuron_loop_agrees(arch):
    """Explicit (a_i, b_i, c_i) one neuron at a time == the vectorised evaluation, at the real
    query input and at random ones (soft-cap on gemma2, ALiBi on bloom, window on mistral)."""
    mlp = cm.compute(adapter_for(arch), testing.PROMPTS[1], layers=1, heads=1)[1, 1]
    gen = torch.Generator().manual_seed(0)
    for pos in (0, 3, mlp.n_pos - 1):
        n = mlp.neurons(pos)
        xs = [mlp.x[pos], torch.randn(mlp.d_model, generator=gen) * mlp.x[pos].norm() / 8]
        for x in xs:
            naive_out, naive_h = _core.naive_mlp(x, n.a, n.b, n.c, mlp.softcap)
            fast = mlp.evaluate(x, pos)
            assert torch.allclose(fast.outputs[0], naive_out, atol=ROUTE_TOL)
            assert torch.allclose(fast.activations[0], naive_h, atol=ROUTE_TOL)
        assert torch.equal(n.sources, mlp.sources(pos))


def test_weights_follow_their_definitions():
    adapter = adapter_for("gpt2")
    mlp = cm.compute(adapter, testing.PROMPTS[0], layers=0, heads=2)[0, 2]
    la = adapter.attention(testing.PROMPTS[0], layers=[0])[0]
    pos = 5
    n = mlp.neurons(pos)
    assert n.a.shape == n.b.shape == (pos + 1, adapter.d_model) and n.c.shape == (pos + 1,)
    W_Q, b_Q, c = adapter.W_Q(0)[2], adapter.b_Q(0)[2], la.scale
    k = la.k[0, : pos + 1, 2]
    assert torch.allclose(n.a, torch.einsum("jd,dm->jm", la.v[0, : pos + 1, 2], adapter.W_O(0)[2]))
    assert torch.allclose(n.b, c * k @ W_Q.T)
    assert torch.allclose(n.c, c * k @ b_Q)


def test_rotary_incoming_weights_depend_on_the_destination():
    """b_i for a fixed source changes with the query position on rotary models only."""
    for arch, rotary in (("llama", True), ("gpt2", False)):
        mlp = cm.compute(adapter_for(arch), testing.PROMPTS[0], layers=0, heads=0)[0, 0]
        b4, b8 = mlp.neurons(4).b[2], mlp.neurons(8).b[2]
        assert (not torch.allclose(b4, b8, atol=1e-4)) == rotary, arch


def test_window_limits_the_neurons():
    mlp = cm.compute(adapter_for("mistral"), testing.PROMPTS[1], layers=0, heads=0)[0, 0]
    last = mlp.positions[-1]
    assert mlp.sources(last).tolist() == list(range(last - testing.WINDOW + 1, last + 1))


def test_incoming_all_matches_per_destination_neurons():
    mlp = cm.compute(adapter_for("phi"), testing.PROMPTS[0], layers=1, heads=0)[1, 0]
    b_all, c_all = mlp.incoming_all()
    assert b_all.shape == (mlp.n_pos, mlp.n_pos, mlp.d_model)
    for pos in (0, 4, mlp.n_pos - 1):
        n = mlp.neurons(pos)
        assert torch.equal(b_all[pos, n.sources], n.b) and torch.equal(c_all[pos, n.sources], n.c)
    assert b_all[2, 3:].abs().sum() == 0  # not allowed: zero


def test_a_wrong_rotary_frame_is_refused():
    adapter = adapter_for("llama")
    batch = adapter.tokenize(testing.PROMPTS[0])
    la = adapter.attention(batch, layers=[0], inputs=True)[0]
    assert _frame.build_frames(adapter, la, batch.key_valid)[0].style == "half"
    own = adapter.rotation(0)
    wrong = dataclasses.replace(own, inv_freq=own.inv_freq * 1.05)  # frequencies off by 5%
    with pytest.raises(TLDynamicsError, match="could not reproduce the scored rotary query"):
        _frame.build_frames(adapter, la, batch.key_valid, rotation=wrong)
    gpt2 = adapter_for("gpt2")
    la = gpt2.attention(batch.tokens, layers=[0], inputs=True)[0]
    assert _frame.build_frames(gpt2, la, batch.key_valid)[0].style == "none"
    wrong = dataclasses.replace(la, q=la.q * 1.01)  # x W_Q + b_Q no longer the scored query
    with pytest.raises(
        TLDynamicsError, match=r"could not reproduce the scored query from the layer input"
    ):
        _frame.build_frames(gpt2, wrong, batch.key_valid)


# ------------------------------------------------------------------ counterfactual queries
def test_counterfactual_at_the_real_input_is_the_real_output():
    mlp = cm.compute(adapter_for("qwen2"), testing.PROMPTS[1], layers=1, heads=2)[1, 2]
    for pos in mlp.positions:
        ev = mlp.evaluate(mlp.x[pos], pos)
        assert (ev.outputs[0] - mlp.reference_output[pos]).abs().max() <= EXACT_TOL
        assert ev.winners[0] == int(mlp.reference_pattern[pos].argmax())


def test_batch_and_chunked_evaluation_agree():
    mlp = cm.compute(adapter_for("gptj"), testing.PROMPTS[0], layers=1, heads=1)[1, 1]
    xs = torch.randn(37, mlp.d_model, generator=torch.Generator().manual_seed(1))
    whole, chunked = mlp.evaluate(xs, 6), mlp.evaluate(xs, 6, chunk_size=5)
    assert torch.allclose(whole.outputs, chunked.outputs, atol=ROUTE_TOL)
    assert torch.equal(whole.winners, chunked.winners)
    assert whole.activations.shape == (37, 7)
    assert torch.allclose(whole.activations.sum(-1), torch.ones(37))
    assert mlp.evaluate(xs, 6, keep_outputs=False).outputs is None


def test_token_and_vocabulary_queries():
    adapter = adapter_for("gpt2")
    mlp = cm.compute(adapter, testing.PROMPTS[0], layers=1, heads=0)[1, 0]
    ids = [5, 17, 300]
    ev = mlp.evaluate_tokens(adapter, ids, position=7)
    vocab = mlp.evaluate_vocab(adapter, position=7, chunk_size=100)
    assert vocab.activations.shape == (adapter.W_E.shape[0], 8)
    assert torch.allclose(vocab.activations[ids], ev.activations, atol=ROUTE_TOL)
    assert ev.labels == tuple(adapter.model.tokenizer.decode([i]) for i in ids)
    x = _readout.token_inputs(mlp, adapter, torch.tensor(ids), 7)
    assert torch.allclose(x.norm(dim=-1), mlp.x[7].norm().expand(3))  # normalise="match"
    raw = _readout.token_inputs(mlp, adapter, torch.tensor(ids), 7, normalise="none")
    assert torch.allclose(raw, adapter.W_E[ids] + adapter.W_pos[7])
    assert set(ev.to_dataframe().columns) >= {"input", "winner", "winner_token", "output_norm"}


# ------------------------------------------------------------------ interpretation
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_written_tokens_are_the_logit_lens_of_a_direction(arch):
    """direction_logits(a) + unembed(final_norm(0)) is exactly the model's logit lens of a (the
    bias part dropped), and it depends only on a's direction."""
    adapter = adapter_for(arch)
    mlp = cm.compute(adapter, testing.PROMPTS[0], layers=1, heads=1)[1, 1]
    a = mlp.outgoing[:4]
    lens = adapter.logit_lens(a)
    zero = adapter.unembed(adapter.final_norm(torch.zeros(1, adapter.d_model)))
    assert torch.allclose(_readout.direction_logits(adapter, a) + zero, lens, atol=1e-4)
    assert torch.allclose(
        _readout.direction_logits(adapter, 3 * a), _readout.direction_logits(adapter, a), atol=1e-4
    )
    r = mlp.written_tokens(adapter, k=4)
    assert r.top_ids.shape == (mlp.n_pos, 4)
    assert torch.equal(r.top_ids[2], _readout.direction_logits(adapter, a[2:3])[0].topk(4).indices)
    assert (r.top_values[:, :1] >= r.bottom_values).all()
    assert len(r.top_tokens(2)) == 4


def test_read_tokens_use_incoming_weights_against_embeddings():
    adapter = adapter_for("llama")
    mlp = cm.compute(adapter, testing.PROMPTS[0], layers=1, heads=0)[1, 0]
    pos = 6
    r = mlp.read_tokens(adapter, pos, k=3, normalise="none")
    n = mlp.neurons(pos)
    pre = adapter.W_E @ n.b.T + n.c  # b_i . x(tok) + c_i with x(tok) = W_E[tok] (no W_pos here)
    assert torch.allclose(r.top_values, pre.T.topk(3, dim=-1).values, atol=1e-4)
    assert torch.allclose(r.bottom_values, (-pre.T).topk(3, dim=-1).values.neg(), atol=1e-4)


def test_importance_and_winner():
    mlp = cm.compute(adapter_for("gpt2"), testing.PROMPTS[0], layers=1, heads=3)[1, 3]
    n = mlp.neurons(6)
    assert torch.allclose(mlp.importance(6), n.activations * n.a.norm(dim=-1))
    assert mlp.winner(6) == n.winner == int(mlp.reference_pattern[6].argmax())
    df = mlp.to_dataframe()
    assert len(df) == sum(p + 1 for p in mlp.positions)
    assert set(df.columns) >= {"position", "source", "token", "activation", "importance", "c"}


# ------------------------------------------------------------------ growth
def test_growth_counts_neurons_and_splits_the_output():
    mlp = cm.compute(adapter_for("gpt2"), testing.PROMPTS[1], layers=1, heads=0)[1, 0]
    g = _growth.growth(mlp, prompt_length=5)
    assert g.positions[0] == 4 and g.n_new[0] == 0 and g.new_attention[0] == 0
    assert g.n_neurons.tolist() == [p + 1 for p in g.positions]
    assert g.n_new.tolist() == [p - 4 for p in g.positions]
    pos = g.positions[-1]
    h, a, src = mlp.activations(pos), mlp.outgoing[mlp.sources(pos)], mlp.sources(pos)
    out = h @ a
    old_share = (h[src < 5] @ a[src < 5]) @ out / (out @ out)
    assert abs(float(old_share + g.new_output_share[-1]) - 1) < 1e-4
    assert abs(float(g.new_attention[-1]) - float(h[src >= 5].sum())) < 1e-6
    assert isinstance(g.to_dataframe(), pd.DataFrame)
    view = g.show()
    assert view.name == "ColoredTokensMulti" and view.props["values"].shape == (mlp.n_pos, 4)


def test_generate_growth_adds_one_neuron_per_token():
    adapter = adapter_for("gpt2")
    g = _growth.generate_growth(adapter, "def f", layer=1, head=2, max_new_tokens=3)
    assert g.n_new.tolist() == [0, 1, 2, 3]
    assert len(g.str_tokens) == g.prompt_length + 3


# ------------------------------------------------------------------ attach, views, report
def test_attach_collects_during_own_forward_and_removes_its_hooks():
    adapter = adapter_for("llama")
    batch = adapter.tokenize(list(testing.PROMPTS))
    before = {name: len(point.fwd_hooks) for name, point in adapter.model.hook_dict.items()}
    with cm.attach(adapter, layers=[0, 1], heads=[1], reference=True) as collector:
        adapter.forward(batch)
    after = {name: len(point.fwd_hooks) for name, point in adapter.model.hook_dict.items()}
    assert before == after
    mlps = collector.mlps
    assert [(m.layer, m.row) for m in mlps] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert mlps[1].str_tokens == tuple(adapter.str_tokens(batch, 1))
    assert_exact(mlps)
    second = collector.result(row=1)
    assert isinstance(second, cm.ContextualMLPs) and second.keys() == [(0, 1), (1, 1)]
    direct = cm.compute(adapter, batch, layers=[0, 1], heads=1, row=1)
    assert torch.equal(second[1, 1].pattern(), direct[1, 1].pattern())
    with pytest.raises(
        TLDynamicsError, match=r"row 2 was not collected in forward pass 0; its rows: \[0, 1\]$"
    ):
        collector.result(row=2)


def test_compute_selects_heads_in_every_layer_and_tabulates_each_destination():
    adapter = adapter_for("llama")
    res = cm.compute(adapter, testing.PROMPTS[0], layers=[0, 1], heads=2)
    assert res.keys() == [(0, 2), (1, 2)] and len(res) == 2 and res.mlp(0, 2) is res[0, 2]
    df = res.to_dataframe()
    assert len(df) == sum(len(m.positions) for m in res)
    for m in res:
        part = df[(df.layer == m.layer) & (df["head_index"] == m.head)]
        for pos, winner, imp in zip(part.position, part.winner, part.winner_importance):
            assert winner == m.winner(pos)
            assert imp == pytest.approx(float(m.importance(pos).max()), rel=1e-6)
    assert (df.output_error <= EXACT_TOL).all() and (df.pattern_error <= EXACT_TOL).all()
    with pytest.raises(
        TLDynamicsError, match=r"no contextual MLP for layer 1, head 0.*\[\(0, 2\), \(1, 2\)\]"
    ):
        res[1, 0]
    with pytest.raises(TypeError):
        cm.compute(adapter, "x", 0, 2)
    bare = cm.compute(adapter, testing.PROMPTS[0], layers=0, heads=2, reference=False)
    assert "output_error" not in bare.to_dataframe().columns
    assert torch.equal(bare[0, 2].pattern(), res[0, 2].pattern())
    with pytest.raises(TLDynamicsError, match="build it with reference=True"):
        bare.exactness()


def test_save_and_load_round_trip(tmp_path):
    mlp = cm.compute(adapter_for("phi"), testing.PROMPTS[0], layers=1, heads=2)[1, 2]
    back = cm.ContextualMLP.load(mlp.save(tmp_path / "mlp.safetensors"))
    assert (back.layer, back.head, back.str_tokens, back.frame.style) == (
        mlp.layer,
        mlp.head,
        mlp.str_tokens,
        "half",
    )
    assert torch.equal(back.neurons(5).b, mlp.neurons(5).b)
    for f in dataclasses.fields(mlp):  # every field, tensors bit for bit
        a, b = getattr(mlp, f.name), getattr(back, f.name)
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b or f.name == "frame"
    assert torch.equal(back.frame.positions, mlp.frame.positions)
    assert torch.equal(back.frame.rotation.inv_freq, mlp.frame.rotation.inv_freq)
    assert (
        back.save(tmp_path / "again.safetensors").read_bytes()
        == (tmp_path / "mlp.safetensors").read_bytes()
    )
    torch.save({"something": 1}, tmp_path / "other.pt")
    with pytest.raises(TLDynamicsError, match="is not a saved ContextualMLP.*it is a pickle"):
        cm.ContextualMLP.load(tmp_path / "other.pt")
    (tmp_path / "text.bin").write_bytes(b"hello")
    with pytest.raises(TLDynamicsError, match="is not a saved ContextualMLP"):
        cm.ContextualMLP.load(tmp_path / "text.bin")


def test_a_saved_mlp_whose_header_length_starts_with_the_pickle_byte_loads(tmp_path):
    """A safetensors file begins with its header length (8 bytes, little-endian): when its low
    byte is 0x80, the first byte of a pickle, the file is still ours and loads."""
    from safetensors import safe_open
    from safetensors.torch import save as st_save

    mlp = cm.compute(adapter_for("gpt2"), "a = b", layers=1, heads=0)[1, 0]
    path = mlp.save(tmp_path / "mlp.safetensors")
    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata()
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
    ((key, text),) = meta.items()
    for pad in range(256):  # JSON allows trailing spaces: pad until the low byte is 0x80
        data = st_save(tensors, metadata={key: text + " " * pad})
        if data[0] == 0x80:
            break
    assert data[0] == 0x80
    (tmp_path / "pickle_byte.safetensors").write_bytes(data)
    back = cm.ContextualMLP.load(tmp_path / "pickle_byte.safetensors")
    assert torch.equal(back.x, mlp.x) and back.str_tokens == mlp.str_tokens


def test_qk_norm_mlp_round_trips(tmp_path):
    mlp = cm.compute(adapter_for("gemma3"), testing.PROMPTS[0], layers=1, heads=0)[1, 0]
    assert mlp.query_norm is not None
    back = cm.ContextualMLP.load(mlp.save(tmp_path / "mlp.safetensors"))
    assert torch.equal(back.query_norm.weight, mlp.query_norm.weight)
    assert torch.equal(back.evaluate(mlp.x[3], 3).outputs, mlp.evaluate(mlp.x[3], 3).outputs)


def test_views_are_viz_components():
    adapter = adapter_for("gpt2")
    res = cm.compute(adapter, testing.PROMPTS[0], layers=1)
    mlp = res[1, 0]
    whole, one = mlp.show(), mlp.show(5)
    assert [c.name for c in whole.components] == ["TextNeuronActivations", "TopkTokens"]
    assert whole.components[0].props["activations"].shape == (mlp.n_pos, 1, mlp.n_pos)
    assert one.components[0].name == "ColoredTokens"
    assert mlp.written_tokens(adapter, k=3).show().name == "TopkTokens"
    assert mlp.evaluate_tokens(adapter, [3, 4], 5).show().name == "TopkTokens"
    assert mlp.neurons(5).show().name is None  # an escaped HTML table
    shown = res.show()  # the most decisive head, then every head's exactness
    decisive = res.decisive()
    assert shown.components[0].props["firstDimensionLabels"] == [f"L1H{decisive.head}"]
    assert shown.components[-1].html.count("<tr") == 1 + adapter.n_heads  # header + one per head


def test_report_section_adds_one_section():
    adapter = adapter_for("gpt2")
    page = viz.Page("t")
    cm.report_section(page, adapter, adapter.tokenize(list(testing.PROMPTS)))
    assert [s.title for s in page.sections] == ["Attention as a contextual MLP"]
    assert "contextual" in page.to_html()
    qk = viz.Page("t")
    cm.report_section(qk, adapter_for("olmo2"), adapter_for("olmo2").tokenize("x = 1"))
    assert (
        "acting on the model&#x27;s normalised query" in qk.to_html()
        or "acting on the model's normalised query" in qk.to_html()
    )


# ------------------------------------------------------------------ errors
def test_bad_requests_give_clear_errors():
    adapter = adapter_for("gpt2")
    mlp = cm.compute(adapter, list(testing.PROMPTS), layers=0, heads=0, row=0)[0, 0]
    n = mlp.n_pos
    cases = [
        (
            lambda: cm.compute(adapter, "x", layers=5, heads=0),
            r"layer 5 is out of range.*valid: 0\.\.1",
        ),
        (lambda: cm.compute(adapter, "x", layers=0, heads=9), r"head 9 is out of range.*0\.\.3"),
        (
            lambda: cm.compute(adapter, "x", layers=0, heads=0, row=2),
            r"row 2 is out of range.*valid: 0\.\.0",
        ),
        (lambda: mlp.neurons(n), rf"position {n} is out of range.*valid: 0\.\.{n - 1}"),
        (lambda: mlp.neurons(n - 1), r"position .* is padding.*valid destinations"),
        (lambda: mlp.neurons(1.5), r"position must be an int, got 1\.5"),
        (
            lambda: mlp.evaluate(torch.zeros(3, 5), 2),
            r"\[n, d_model\] with d_model=64, got \(3, 5\)",
        ),
        (lambda: mlp.evaluate(torch.zeros(64), 2, chunk_size=0), r"chunk_size must be >= 1"),
        (lambda: mlp.evaluate_tokens(adapter, [10**6], 2), r"token ids must be .* in 0\.\.\d+"),
        (
            lambda: _readout.token_inputs(mlp, adapter, torch.tensor([1]), 2, normalise="ln"),
            r"normalise must be 'match' or 'none', got 'ln'",
        ),
        (lambda: _growth.growth(mlp, 0), r"prompt_length must be an int in 1\.\.\d+"),
        (
            lambda: _growth.generate_growth(adapter, "x", 0, 0, max_new_tokens=10**4),
            r"max_new_tokens must be in 1\.\.\d+",
        ),
        (lambda: mlp.written_tokens(adapter).top_tokens(10**3), r"source 1000 is not a neuron"),
    ]
    for call, message in cases:
        with pytest.raises(TLDynamicsError, match=message):
            call()
    bert = adapter_for("bert")
    with pytest.raises(TLDynamicsError, match="needs a decoder language model"):
        cm.compute(bert, "x = 1", layers=0, heads=0)[0, 0].written_tokens(bert)
    with pytest.raises(TLDynamicsError, match="needs a causal head"):
        _growth.growth(cm.compute(bert, "x = 1", layers=0, heads=0)[0, 0], 1)


# ------------------------------------------------------------------ ground truth: induction
SYMBOLS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"  # induction-2l's


def _repeated_prompt(adapter, period=20, seed=0):
    """BOS, then ``period`` distinct random symbols, twice (each symbol's earlier copy is unique)."""
    gen = torch.Generator().manual_seed(seed)
    segment = "".join(SYMBOLS[i] for i in torch.randperm(len(SYMBOLS), generator=gen)[:period])
    batch = adapter.tokenize(segment * 2)
    assert batch.tokens.shape[1] == 1 + 2 * period  # BOS + one token per symbol
    return batch, period


def _float64_floor(adapter, batch, layer, head):
    """Max |float64 attention from the model's own q, k, v - the model's z W_O|: the model's own
    float32 rounding, which no reconstruction can beat (trained heads score up to ~80 here)."""
    la = adapter.attention(batch, layers=[layer], reference=True)[layer]
    q, k, v = (t[0, :, head].double() for t in (la.q, la.k, la.v))
    scores = (la.scale * q @ k.T).masked_fill(~la.allowed[0], float("-inf"))
    exact = torch.softmax(scores, -1) @ v @ la.W_O[head].double()
    z = la.reference["z"].reshape(*la.q.shape)[0, :, head].double()
    return float((exact - z @ la.W_O[head].double())[la.query_valid[0]].abs().max())


def test_induction_head_winner_is_the_token_after_the_earlier_copy():
    zoo = pytest.importorskip("tl_dynamics.zoo", reason="the model zoo is not installed")
    try:
        model = zoo.load("induction-2l")
    except TLDynamicsError as err:
        if "missing file" not in str(err):
            raise
        pytest.skip(f"the shipped induction-2l model is missing: {err}")
    adapter = ModelAdapter(model)
    batch, period = _repeated_prompt(adapter)
    second = range(1 + period, 1 + 2 * period)  # positions of the second copy
    mlps = list(cm.compute(adapter, batch, layers=1))

    def induction_score(m):  # attention to the token after the earlier copy
        return float(sum(m.reference_pattern[t, t - period + 1] for t in second)) / period

    head = max(mlps, key=induction_score)
    offsets = [head.winner(t) - (t - period) for t in second]  # winner - earlier copy
    assert sum(o == 1 for o in offsets) / len(offsets) >= INDUCTION_MIN_WINNERS, (
        f"L1H{head.head}: winner minus earlier-copy position per repeated token: {offsets}; "
        f"attention to the token after the earlier copy per head: "
        f"{[round(induction_score(m), 3) for m in mlps]}"
    )
    floor = _float64_floor(adapter, batch, 1, head.head)
    assert head.exactness().max_output_error <= max(EXACT_TOL, FLOOR_FACTOR * floor)


def test_a_lazy_result_shares_each_layers_row_copies_between_its_heads():
    """Heads formed one at a time from ``result()`` share their layer's copy of the row's input
    and masks (at 1,024 tokens a copy per head was 453 MB over 144 heads; issue 15)."""
    adapter = adapter_for("gpt2")
    with cm.attach(adapter) as collector:
        adapter.forward(adapter.tokenize("a = b + c"))
    res = collector.result()
    first, second, other = res[0, 0], res[0, 1], res[1, 0]
    assert first.x is second.x and first.allowed is second.allowed
    assert other.x is not first.x  # another layer: its own input
