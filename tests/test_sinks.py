"""Learned attention sinks (GPT-OSS) in every analysis: the odds-ratio split's virtual key
(docs/math.md §2.6), the contextual MLP's sink neuron (§3.7), the atlas and the report. Checked
against the model's own pattern/z/out hooks and against the Hugging Face model itself."""

import re

import numpy as np
import pytest
import torch

from tl_dynamics import odds_ratio, testing
from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.odds_ratio import _collect, _stats
from test_architectures import EXACT_TOL, boot_tiny

REL_TOL = 1e-5  # the split's parts against the raw scores, relative to their size (§7.3)
STATS_TOL = 1e-4  # streamed statistics against a direct float64 computation (as test_odds_ratio)


@pytest.fixture(scope="module")
def gpt_oss():
    return boot_tiny("GptOssForCausalLM")


def masked_max(diff, keep) -> float:
    return float(diff.abs().masked_fill(~keep.expand_as(diff), 0.0).max())


def hf_attentions(adapter, twin, batch) -> list[torch.Tensor]:
    """The Hugging Face twin's own attention weights (eager; positions as the bridge derives them)."""
    mask = batch.key_valid.long()
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        out = twin(
            batch.tokens, attention_mask=mask, position_ids=positions, output_attentions=True
        )
    return [a.float() for a in out.attentions]


def extended(logits: torch.Tensor, allowed: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """Float64 softmax over the allowed keys and the virtual key (last column), by hand."""
    column = sink.double()[None, :, None, None].expand(*logits.shape[:-1], 1)
    x = torch.cat([logits.double().masked_fill(~allowed[:, None], float("-inf")), column], -1)
    return torch.softmax(x, -1)


# ------------------------------------------------------------------ the odds-ratio split
@pytest.mark.parametrize("side", ["right", "left"])
def test_sink_is_a_virtual_key_whose_parts_reproduce_the_model(gpt_oss, side):
    """§2.6: the parts with the virtual key sum to the model's scores, sink included; their
    softmax is the model's hook_pattern and the Hugging Face model's attention; the virtual
    key's mass is what the rows miss; the counterfactuals give it its prior / no likelihood."""
    adapter = ModelAdapter(gpt_oss)
    twin = testing.hf_twin(gpt_oss)
    batch = adapter.tokenize(testing.PROMPTS, side)
    hf = hf_attentions(adapter, twin, batch)
    layers = adapter.attention(batch, reference=True, sinks=True)
    for layer, la in layers.items():
        dec = _collect.decompose_layer(la, range(la.n_heads))
        parts = dec.parts
        # the virtual key's prior is the model's learned sink logit, read from Hugging Face
        hf_sinks = twin.model.layers[layer].self_attn.sinks.detach().float()
        assert parts.sink is not None and torch.equal(parts.sink, hf_sinks)
        total = parts.total_with_sink()
        keep = la.allowed[:, None] & la.query_valid[:, None, :, None]
        magnitude = max(
            1.0, float((parts.query_term[..., :, None] + parts.key_prior[..., None, :]).max())
        )
        assert masked_max(total[..., :-1] - la.raw_scores(), keep) <= REL_TOL * magnitude
        assert torch.equal(total[..., -1], hf_sinks[None, :, None].expand_as(total[..., -1]))
        # the softmax of the parts, virtual key included, is the model's pattern
        p = extended(total[..., :-1], la.allowed, parts.sink)
        rows = la.query_valid[:, None, :, None]
        for truth in (la.reference["pattern"], hf[layer], dec.pattern):
            assert masked_max(p[..., :-1].float() - truth, rows) <= EXACT_TOL
        absorbed = 1.0 - la.reference["pattern"].sum(-1)
        assert masked_max(p[..., -1].float() - absorbed, rows[..., 0]) <= EXACT_TOL
        assert dec.learned_sink is not None
        assert masked_max(dec.learned_sink - p[..., -1].float(), rows[..., 0]) <= EXACT_TOL
        assert float(absorbed[la.query_valid[:, None].expand_as(absorbed)].max()) > 0.05
        # prior-only: key priors and the sink's prior; likelihood-only: Q + L and logit 0
        prior = extended(
            parts.key_prior[..., None, :].expand_as(parts.loglik), la.allowed, parts.sink
        )
        lik = extended(
            parts.query_term[..., :, None] + parts.loglik, la.allowed, torch.zeros_like(parts.sink)
        )
        assert masked_max(prior[..., :-1].float() - dec.prior_pattern, rows) <= EXACT_TOL
        assert masked_max(lik[..., :-1].float() - dec.likelihood_pattern, rows) <= EXACT_TOL
        # Decomposition.kl is over the real keys and the virtual one
        kl = dec.kl()
        for name, q in (("prior", prior), ("loglik", lik)):
            want = (p * (p.clamp(min=1e-300).log() - q.clamp(min=1e-300).log())).sum(-1)
            assert masked_max(kl[name] - want.float(), la.query_valid[:, None]) <= 1e-4


def direct_statistics(dec, la) -> dict[str, np.ndarray]:
    """Per-head sums over the rows that choose (a valid row with one real key chooses between it
    and the sink), in float64 from the parts: entropy and KLs over the extended support (the
    real pattern soft-capped where the layer is; prior-only logits P_j + p_ij), the learned
    sink's mass, and the row-centred Var(r) and Cov(r, P) over the real keys (pre-cap r)."""
    parts = dec.parts
    scores = parts.total().double()  # pre-cap, bias included
    real = scores if la.softcap is None else la.softcap * torch.tanh(scores / la.softcap)
    p = extended(real, la.allowed, parts.sink)
    prior_logits = parts.key_prior.double()[..., None, :].expand_as(scores)
    if parts.bias is not None:
        prior_logits = prior_logits + parts.bias.double()
    prior = extended(prior_logits, la.allowed, parts.sink)
    lik = extended(
        scores - parts.key_prior.double()[..., None, :], la.allowed, torch.zeros_like(parts.sink)
    )
    rows = (la.query_valid & la.allowed.any(-1))[:, None].double()  # [b, 1, i]

    def xlogy(a, b):
        return torch.where(a > 0, a * b.clamp(min=1e-300).log(), torch.zeros((), dtype=a.dtype))

    def per_head(x):
        return (x * rows).sum(dim=(0, 2)).numpy()

    allowed = la.allowed[:, None].double()
    n = allowed.sum(-1).clamp(min=1.0)
    centre = scores - (scores * allowed).sum(-1, keepdim=True) / n[..., None]
    prior_c = (
        parts.key_prior.double()[..., None, :]
        - (parts.key_prior.double()[..., None, :] * allowed).sum(-1, keepdim=True) / n[..., None]
    )
    return {
        "rows": per_head(torch.ones_like(p[..., 0])),
        "entropy": per_head(-xlogy(p, p).sum(-1)),
        "kl_prior": per_head((xlogy(p, p) - xlogy(p, prior)).sum(-1)),
        "kl_loglik": per_head((xlogy(p, p) - xlogy(p, lik)).sum(-1)),
        "learned_sink": per_head(p[..., -1]),
        "var_r": per_head((centre * centre * allowed).sum(-1)),
        "cov_r_prior": per_head((centre * prior_c * allowed).sum(-1)),
    }


def test_streamed_statistics_with_sinks_equal_a_direct_computation(gpt_oss):
    """§2.6: HeadStats' sums over the extended support (entropy, both KLs, the learned sink's
    mass, the rows that choose) and the variance split over the real keys, against float64."""
    res = odds_ratio.compute(gpt_oss, list(testing.PROMPTS), padding_side="left")
    adapter = ModelAdapter(gpt_oss)
    layers = adapter.attention(list(testing.PROMPTS), padding_side="left", sinks=True)
    df = res.to_dataframe()
    for a, layer in enumerate(res.stats.layers):
        want = direct_statistics(res[layer], layers[layer])
        for key, value in want.items():
            got = res.stats.sums[key][a]
            assert np.allclose(got, value, rtol=STATS_TOL, atol=STATS_TOL), (key, got, value)
        mass = df[df.layer == layer]["learned_sink_mass"].to_numpy()
        assert np.allclose(mass, want["learned_sink"] / want["rows"], atol=1e-6)
        assert (mass > 0).all()
    # the per-prompt sink facts: the learned sink's mean mass, and a real sink must dominate it
    la = layers[1]
    facts = odds_ratio.sink_facts(la)
    p = extended(la.scores(), la.allowed, la.sink_logit)
    rows = (la.query_valid & la.allowed.any(-1))[:, None]
    mean = (p[..., -1] * rows).sum(-1) / rows.sum(-1)
    assert torch.allclose(facts["learned_sink_mass"].double(), mean, atol=1e-6)
    choose = (la.query_valid & (la.allowed.sum(-1) >= 2))[:, None, :, None]
    column = (p[..., :-1] * choose).sum(2)  # [b, h, k]
    learned = (p[..., -1] * choose[..., 0]).sum(-1)  # [b, h]
    two = column.topk(2, -1).values
    dominance = two[..., 0] / torch.maximum(two[..., 1], learned)
    assert torch.allclose(facts["sink_dominance"].double(), dominance, rtol=1e-5)


@pytest.mark.skipif(
    not testing.has_hooked_transformer(),
    reason="HookedTransformer (use_attention_sinks) is TransformerLens 3.x only",
)
@pytest.mark.parametrize("variant", ["gpt2-like", "softcap", "alibi", "local"])
def test_hooked_sinks_with_cap_bias_and_window_split_and_build_exactly(variant):
    """The same identities on HookedTransformer's learned sinks, with a soft-cap (the sink joins
    after the cap), an ALiBi bias (a prior-only logit P_j + p_ij) and a window: the parts with
    the virtual key give hook_pattern, the streamed statistics their float64 definitions, and
    every head's contextual MLP its own z W_O and pattern row."""
    from tl_dynamics import contextual_mlp

    model = testing.tiny_hooked(variant, use_attention_sinks=True)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.sinks.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(1))
    adapter = ModelAdapter(model)
    res = odds_ratio.compute(model, list(testing.PROMPTS), padding_side="left")
    layers = adapter.attention(
        list(testing.PROMPTS), reference=True, padding_side="left", sinks=True
    )
    for a, (layer, la) in enumerate(layers.items()):
        dec = res[layer]
        total = dec.parts.total_with_sink()
        real = total[..., :-1] if la.softcap is None else la.capped(total[..., :-1])
        p = extended(real, la.allowed, dec.parts.sink)
        rows = la.query_valid[:, None, :, None]
        assert masked_max(p[..., :-1].float() - la.reference["pattern"], rows) <= EXACT_TOL
        for key, value in direct_statistics(dec, la).items():
            assert np.allclose(res.stats.sums[key][a], value, rtol=STATS_TOL, atol=STATS_TOL), key
    for mlp in contextual_mlp.compute(model, testing.PROMPTS[1]):
        exact = mlp.exactness()
        assert exact.max_output_error <= EXACT_TOL and exact.max_pattern_error <= EXACT_TOL


def test_a_sink_that_is_never_taken_leaves_the_statistics_as_without_one():
    """A sink logit far below every score absorbs nothing: every sum equals the no-sink
    computation but the row count (which now admits rows with a single real key, whose whole
    mass is on it: top_real and top_prior grow by one a row) and the likelihood-only sums
    kl_loglik and top_loglik (in the likelihood-only pattern every prior is dropped, the sink's
    too: its logit is 0)."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 7, 3, 4), torch.randn(2, 7, 3, 4)
    allowed = torch.ones(7, 7, dtype=torch.bool).tril()[None].expand(2, -1, -1).clone()
    allowed[1, :, :2] = False  # left padding in the second prompt
    valid = allowed.any(-1)
    plain, plain_sinks = _stats.layer_sums(q, k, 0.5, None, allowed, valid, fast=False)
    far, far_sinks = _stats.layer_sums(
        q, k, 0.5, None, allowed, valid, fast=False, sink=torch.full((3,), -1e4)
    )
    # the likelihood-only pattern's sums (kl_loglik, top_loglik) keep the sink at logit 0; the
    # rows admitted with a single real key put all their mass on it, in the real and the
    # prior-only pattern alike (top_real, top_prior: +1 a row)
    changed = ("rows", "kl_loglik", "top_loglik", "top_real", "top_prior")
    for key in _stats.SUM_KEYS:
        if key not in changed:
            assert torch.allclose(far[key], plain[key], atol=1e-9), key
    assert (far["rows"] - plain["rows"]).tolist() == [2.0, 2.0, 2.0]  # each prompt's first row
    for key in ("top_real", "top_prior"):
        assert torch.allclose(far[key] - plain[key], far["rows"] - plain["rows"], atol=1e-9), key
    assert float(far["learned_sink"].abs().max()) == 0.0
    for key in _stats.SINK_KEYS:
        assert torch.allclose(far_sinks[key].double(), plain_sinks[key].double()), key


def test_layers_without_sinks_have_no_learned_sink_column():
    res = odds_ratio.compute(testing.tiny_model("gpt2"), testing.PROMPTS[0])
    assert float(np.abs(res.stats.sums["learned_sink"]).max()) == 0.0
    assert (res.to_dataframe()["learned_sink_mass"] == 0.0).all()
    assert res[0].parts.sink is None and res[0].learned_sink is None
    assert "learned_sink_mass" not in res.stats.show().section_html()


# ------------------------------------------------------------------ the contextual MLP
def hf_head_sums(twin, batch) -> dict[int, torch.Tensor]:
    """Each layer's attention output (o_proj's result) in the Hugging Face twin itself."""
    mask = batch.key_valid.long()
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    outs: dict[int, torch.Tensor] = {}
    handles = [
        layer.self_attn.o_proj.register_forward_hook(
            lambda _m, _i, out, i=i: outs.__setitem__(i, out.detach().float())
        )
        for i, layer in enumerate(twin.model.layers)
    ]
    try:
        with torch.no_grad():
            twin(batch.tokens, attention_mask=mask, position_ids=positions)
    finally:
        for handle in handles:
            handle.remove()
    return outs


@pytest.mark.parametrize("side", ["right", "left"])
def test_the_sink_is_a_neuron_with_zero_outgoing_weight(gpt_oss, side):
    """§3.7: with the learned-sink neuron the MLP gives the model's own head output (hook z W_O,
    and summed over heads the Hugging Face model's attention output) and pattern row; the sink
    neuron's activation is the mass the rows miss, its weights are (0, 0, sink_h)."""
    from tl_dynamics import contextual_mlp

    adapter = ModelAdapter(gpt_oss)
    twin = testing.hf_twin(gpt_oss)
    batch = adapter.tokenize(testing.PROMPTS, side)
    hf = hf_head_sums(twin, batch)
    layers = adapter.attention(batch, reference=True, sinks=True)
    for result in contextual_mlp.compute_rows(gpt_oss, batch):
        row = result.row
        for layer in result.layers:
            la = layers[layer]
            hf_sinks = twin.model.layers[layer].self_attn.sinks.detach().float()
            total = la.b_O.clone().expand(la.q.shape[1], -1).clone()
            for head in result.heads:
                mlp = result[layer, head]
                exact = mlp.exactness()
                assert exact.max_output_error <= EXACT_TOL and exact.max_pattern_error <= EXACT_TOL
                assert mlp.sink_logit == float(hf_sinks[head])
                missing = 1.0 - la.reference["pattern"][row, head].sum(-1)  # [pos]
                sink = mlp.learned_sink()
                valid = la.query_valid[row]
                assert float((sink - missing).abs()[valid].max()) <= EXACT_TOL
                assert float(sink[valid].max()) > 0.05
                for pos in mlp.positions:
                    total[pos] += mlp.output(pos)
                pos = mlp.positions[-1]
                table = mlp.neurons(pos).to_dataframe()
                last = table.iloc[-1]
                assert (last.source, last.token, last.a_norm, last.b_norm) == (
                    -1,
                    "learned sink",
                    0.0,
                    0.0,
                )
                assert last.c == pytest.approx(float(hf_sinks[head]))
                assert last.activation == pytest.approx(mlp.sink_activation(pos), abs=1e-6)
                # counterfactual inputs: the sink neuron takes its share and writes nothing
                x = torch.randn(5, mlp.d_model, generator=torch.Generator().manual_seed(head))
                ev = mlp.evaluate(x, pos)
                assert ev.sink is not None and ev.outputs is not None
                sums = ev.activations.double().sum(-1) + ev.sink.double()
                assert torch.allclose(sums, torch.ones_like(sums), atol=1e-6)
                want = ev.activations @ mlp.outgoing[mlp.sources(pos)]
                assert torch.allclose(ev.outputs, want, atol=1e-5)
            valid = la.query_valid[row]
            assert float((total - hf[layer][row]).abs()[valid].max()) <= EXACT_TOL


# ------------------------------------------------------------------ atlas and report
def test_the_atlas_names_learned_sinks_with_their_mass(gpt_oss):
    """Each head's learned_sink score is the mass its sink absorbs on the natural probe (the
    model's own pattern: 1 - row sum, mean over the rows that choose); it is named "learned
    sink" at the floor, and every head of such a layer says its mass in the evidence. A model
    without sinks has none (NaN, never named)."""
    from tl_dynamics import atlas
    from tl_dynamics.atlas import _roles

    res = atlas.compute(gpt_oss, testing.PROMPTS[0], causal=False)
    adapter = ModelAdapter(gpt_oss)
    for layer, la in adapter.attention(testing.PROMPTS[0], reference=True, sinks=True).items():
        rows = la.query_valid & la.allowed.any(-1)  # [b, i]
        absorbed = 1.0 - la.reference["pattern"].sum(-1)  # [b, h, i]
        want = ((absorbed * rows[:, None]).sum(-1) / rows.sum(-1)[:, None]).mean(0)
        assert np.allclose(res.scores["learned_sink"][layer], want.numpy(), atol=1e-5)
    named = res.heads_with("learned sink")
    assert named == sorted(
        (a, b)
        for a in range(res.n_layers)
        for b in range(res.n_heads)
        if res.scores["learned_sink"][a, b] >= _roles.LEARNED_SINK_FLOOR
    )
    assert named and len(named) < res.n_layers * res.n_heads  # the floor separates heads here
    frame = res.to_dataframe()
    assert frame.evidence.str.contains("learned sink: absorbs").all()
    assert "lsink" in res.show().components[0].html
    plain = atlas.compute(testing.tiny_model("gpt2"), testing.PROMPTS[0], causal=False)
    assert np.isnan(plain.scores["learned_sink"]).all() and not plain.heads_with("learned sink")
    assert "learned sink" not in plain.show().components[0].html


def test_gpt_oss_report_shows_every_section_and_names_its_learned_sinks(gpt_oss):
    from tl_dynamics import report

    page = report.build_report(gpt_oss, testing.PROMPTS[0])
    html = page.to_html()
    assert page.failed_sections == []
    # every section shows, the in-context regression view too: it reads each learned sink as
    # one more visible key with a zero value (docs/math.md §8.1)
    notes = re.findall(r"Not shown for this model: ([^<]*)", html)
    assert notes == [] and "Attention as in-context regression" in html, notes
    attention = html.rsplit("Attention patterns", 1)[1].split("<section", 1)[0]  # not the TOC
    assert "learned sink" in attention and "each row of the pattern sums to 1 minus" in attention
    assert "learned_sink_mass" in html  # the odds-ratio table's column
    assert re.search(r"learned sink per head: one more neuron", html)  # the contextual MLP
    assert "lsink" in html  # the atlas grid


def test_barycentric_rows_gain_the_origin_and_markov_chains_refuse_by_name(gpt_oss):
    """§2.5 with a learned sink: the head's output is a convex combination of the o_j and the
    virtual key's output 0, so the simplex gains that vertex; a pattern whose rows lose mass to
    the sink is no Markov chain on positions, and markov/composed say so."""
    from tl_dynamics.errors import TLDynamicsError

    view = odds_ratio.barycentric(gpt_oss, testing.PROMPTS[0], 1, 2)
    adapter = ModelAdapter(gpt_oss)
    la = adapter.attention(testing.PROMPTS[0], layers=[1], reference=True, sinks=True)[1]
    assert view.S_sink is not None and view.A_sink is not None
    rows = list(view.rows)
    missing = 1.0 - la.reference["pattern"][0, 2, rows].sum(-1).double()
    assert torch.allclose(view.S_sink, missing, atol=1e-5)
    assert torch.allclose(
        view.A.sum(-1) + view.A_sink, torch.ones(len(rows), dtype=torch.float64), atol=1e-9
    )
    assert float(view.kkt.max()) <= 1e-6 and bool((view.fit_error <= view.head_error + 1e-9).all())
    O = la.source_outputs([2])[0, :, 0].double()
    gap = ((view.S.double() - view.A.double()) @ O).pow(2).sum(-1)
    assert torch.allclose(view.gap.double(), gap, rtol=1e-5, atol=1e-9)
    for call, name in (
        (lambda: odds_ratio.markov(gpt_oss, testing.PROMPTS[0], 0, 0), "markov"),
        (lambda: odds_ratio.composed(gpt_oss, testing.PROMPTS[0]), "composed"),
    ):
        with pytest.raises(
            TLDynamicsError,
            match=re.escape(
                f"odds_ratio.{name} (a Markov chain on positions needs rows that sum to 1): "
                "layer 0 has learned attention sinks"
            ),
        ):
            call()


def test_the_corpus_page_maps_the_learned_sinks_mass(gpt_oss):
    """The statistics page (``tl-dynamics report --stats``) adds a learned-sink map where heads
    have learned sinks, with the mass the corpus run measured, and none elsewhere."""
    from tl_dynamics import scale

    prompts = ["a b a b", "x = 1", "def f(x): return x", "c d c d"]
    stats = scale.run_stats(
        gpt_oss,
        prompts,
        analyses=["odds_ratio"],
        batch_size=2,
        progress=False,
        model_name="tiny-gpt-oss",
    )
    mass = stats.odds_ratio.means()["learned_sink_mass"]
    assert (mass > 0).all() and (mass < 1).all()
    caption = "attention that the head&#x27;s learned sink logit takes"
    assert caption in scale.stats_page(stats).to_html()
    plain = scale.run_stats(
        testing.tiny_model("gpt2"),
        prompts,
        analyses=["odds_ratio"],
        batch_size=2,
        progress=False,
        model_name="tiny-gpt2",
    )
    assert caption not in scale.stats_page(plain).to_html()
