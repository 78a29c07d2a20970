"""The head atlas: planted structure (induction-2l's card), an untrained control, the real
encoder's [CLS] sinks, and the activation patching it rests on."""

import copy
import math

import numpy as np
import pytest
import torch

from tl_dynamics import atlas, circuits, viz, zoo
from tl_dynamics.adapter import ModelAdapter, shuffled_weights
from tl_dynamics.atlas import _causal
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.atlas import _probes
from tl_dynamics.atlas import _roles
from tl_dynamics.odds_ratio import _stats

# induction-2l's MODEL_CARD.md, "Head structure": previous-token heads (detect_head > 0.3)
# L0H0, L0H2, L0H3; induction heads L1H0..L1H3.
CARD_PREVIOUS = [(0, 0), (0, 2), (0, 3)]
CARD_INDUCTION = [(1, 0), (1, 1), (1, 2), (1, 3)]
# Losses are means of float32 log-softmaxes over a few hundred positions.
LOSS_TOL = 1e-4
# An induction head's mean ablation must cost at least this much on the repeated half, and
# this much more than on the unrepeated half (where it has nothing to copy).
INDUCTION_COST = 0.2


@pytest.fixture(scope="module")
def induction():
    return ModelAdapter(zoo.load("induction-2l"))


@pytest.fixture(scope="module")
def induction_atlas(induction):
    return atlas.compute(induction)


@pytest.fixture(scope="module")
def untrained(induction):
    """induction-2l's shape with fresh random weights (matrices N(0, 0.02), gains 1, biases 0)."""
    model = copy.deepcopy(induction.model)
    generator = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim >= 2:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
            else:
                param.fill_(1.0 if name.split(".")[-1] in ("w", "weight") else 0.0)
    return ModelAdapter(model.eval())


# ------------------------------------------------------------------ patching
def _hook_counts(adapter):
    return {name: len(point.fwd_hooks) for name, point in adapter.model.hook_dict.items()}


def test_patch_own_pattern_back_leaves_logits_and_removes_hooks(induction):
    batch = induction.tokenize(_probes.repeated_tokens(induction, 2, 6)[0])
    clean = induction.forward(batch)
    layers = induction.attention(batch)
    before = _hook_counts(induction)
    patches = [
        ("pattern", layer, lambda p, la=la: la.pattern().to(p.dtype))
        for layer, la in layers.items()
    ]
    with induction.patch(patches):
        assert _hook_counts(induction) != before
        patched = induction.forward(batch)
    assert _hook_counts(induction) == before
    assert (patched - clean).abs().max() <= 1e-4
    uniform = [("pattern", 1, lambda p: la_uniform(p))]
    with induction.patch(uniform):
        changed = induction.forward(batch)
    assert (changed - clean).abs().max() > 0.1  # the replacement is really used


def la_uniform(p):
    causal = torch.tril(torch.ones(p.shape[-2:], dtype=p.dtype))
    return (causal / causal.sum(-1, keepdim=True)).expand_as(p)


def test_patch_errors_and_removal_on_error(induction):
    batch = induction.tokenize(_probes.repeated_tokens(induction, 1, 4)[0])
    before = _hook_counts(induction)
    with pytest.raises(TLDynamicsError, match="returned shape"):
        with induction.patch([("z", 0, lambda z: z[:, :1])]):
            induction.forward(batch)
    with pytest.raises(TLDynamicsError, match="error inside tl_dynamics patch"):
        with induction.patch([("z", 0, lambda z: 1 / 0)]):
            induction.forward(batch)
    assert _hook_counts(induction) == before
    with pytest.raises(TLDynamicsError, match="unknown hook role"):
        with induction.patch([("nope", 0, lambda x: x)]):
            pass
    with pytest.raises(TLDynamicsError, match="needs a ModelAdapter"):
        shuffled_weights(induction.model)


def test_shuffled_weights_keep_values_and_leave_the_original(induction):
    before = induction.W_Q(0).clone()
    control = shuffled_weights(induction, seed=3)
    assert torch.equal(induction.W_Q(0), before)
    assert torch.equal(control.W_Q(0).flatten().sort().values, before.flatten().sort().values)
    assert not torch.equal(control.W_Q(0), before)


def test_a_shuffled_copy_of_a_model_that_has_run_outlives_it_and_runs_on_its_own():
    """A bridge wires capture hooks at its first forward (closures over weak proxies of its own
    modules); the copy must not keep the original's, nor write into the original."""
    import gc

    original = ModelAdapter(zoo.load("induction-2l"))  # the self-check has run a forward
    tokens = torch.tensor([[1, 2, 3, 4, 1, 2, 3, 4]])
    original.model(tokens)
    owned = {id(m) for m in original.model.modules()}
    control = shuffled_weights(original, seed=1)
    for module in control.model.modules():
        for hook in [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]:
            cells = [c.cell_contents for c in getattr(hook, "__closure__", None) or ()]
            assert not any(id(v) in owned for v in cells), (type(module).__name__, hook)
    expected = copy.deepcopy(control.model)(tokens)
    del original
    gc.collect()
    assert torch.equal(control.model(tokens), expected)
    layers = control.attention(tokens, reference=True)
    assert (layers[1].pattern() - layers[1].reference["pattern"]).abs().max() <= 1e-5


def test_layer_prefix_sharing_gives_the_same_losses(induction):
    """Repeating resid_pre inside the forward pass equals repeating the input."""
    probes = _probes.build_probes(induction, n_seq=2, seq_len=8)
    captures = induction.attention(probes.natural)
    targets = {"all": None}
    runner = _causal.CausalRunner(induction, probes.natural, captures, targets)
    repl = runner._replacements(captures[1], [0, 2])
    variants = [(0, 0, "mean"), (2, 1, "prior"), (0, 0, "likelihood")]
    shared = runner._forward(1, variants, repl, expand=True)
    repeated = runner._forward(1, variants, repl, expand=False)
    assert (shared - repeated).abs().max() <= LOSS_TOL


# ------------------------------------------------------------------ ground truth
def test_induction_2l_roles_match_the_card(induction_atlas):
    assert induction_atlas.heads_with("previous-token") == CARD_PREVIOUS
    assert induction_atlas.heads_with("induction") == CARD_INDUCTION
    frame = induction_atlas.to_dataframe().set_index(["layer", "head_index"])
    for pair in CARD_INDUCTION:
        assert frame.loc[pair, "role"] == "induction"
        assert frame.loc[pair, "score"] >= frame.loc[pair, "baseline"] + _roles.MARGIN
        assert "L0H0, L0H2, L0H3" in frame.loc[pair, "evidence"]  # composes through them


def test_induction_heads_cost_loss_on_repeats(induction_atlas):
    """Mean-ablating an induction head costs loss on the repeated half and not on the first
    half. (The previous-token head L0H0 and L0H1, which feed every induction head, cost more:
    the 'clearly above all others' of the issue holds within the induction layer only.)"""
    frame = induction_atlas.to_dataframe().set_index(["layer", "head_index"])
    for pair in CARD_INDUCTION:
        cost, control = frame.loc[pair, "delta_loss"], frame.loc[pair, "delta_loss_unrepeated"]
        assert cost >= INDUCTION_COST and cost >= control + INDUCTION_COST
        assert math.isfinite(frame.loc[pair, "delta_loss_prior"])
        assert math.isfinite(frame.loc[pair, "delta_loss_likelihood"])


def test_untrained_model_has_no_induction_or_previous_token_heads(untrained, induction_atlas):
    res = atlas.compute(untrained)
    assert res.heads_with("induction") == [] and res.heads_with("previous-token") == []
    trained = induction_atlas.to_dataframe()
    worst = res.to_dataframe()["delta_loss"].abs().max()
    assert (
        trained.set_index(["layer", "head_index"]).loc[CARD_INDUCTION, "delta_loss"].min()
        > 2 * worst
    )


def test_atlas_frame_view_and_selection(induction):
    res = atlas.compute(induction, layers=1, heads=[0, 3], causal=False)
    frame = res.to_dataframe()
    assert list(frame.columns[:7]) == [
        "layer",
        "head_index",
        "role",
        "score",
        "baseline",
        "evidence",
        "delta_loss",
    ]
    assert list(zip(frame["layer"], frame["head_index"])) == [(1, 0), (1, 3)]
    assert frame.delta_loss.isna().all()
    assert res.roles_of(1, 0)[0] == "induction"  # earlier previous-token heads read anyway
    shown = res.show()
    assert isinstance(shown, viz.Group) and "L1H3" in shown.components[0].html
    with pytest.raises(TLDynamicsError, match="not in this atlas"):
        res.roles_of(0, 0)
    with pytest.raises(TLDynamicsError, match="unknown role"):
        res.heads_with("mover")


def test_errors_name_what_is_valid(induction):
    with pytest.raises(TLDynamicsError, match=r"valid: 0\.\.1"):
        atlas.compute(induction, layers=5)
    with pytest.raises(TLDynamicsError, match=r"seq_len 100 does not fit.*valid: 2\.\.63"):
        atlas.compute(induction, seq_len=100)
    with pytest.raises(TLDynamicsError, match="n_seq must be a positive"):
        _probes.build_probes(induction, n_seq=0)


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_sink_scores_equal_the_odds_ratio_split(arch):
    """The atlas's sink scores (``odds_ratio.sink_facts``) against a direct reading of the
    pattern and of ``odds_ratio.split_scores``: the column with the most attention over rows
    with two or more keys, its mass and place, and its attention-weighted key-prior and
    log-likelihood advantages over the row mean (padded prompts of two lengths, causal and
    bidirectional)."""
    from tl_dynamics import odds_ratio, testing
    from tl_dynamics.atlas import _measure

    ad = ModelAdapter(testing.tiny_model(arch))
    las = ad.attention(ad.tokenize(["a b c a b c d", "x y"]))
    for la in las.values() if isinstance(las, dict) else las:
        got = _measure.natural_scores(la)
        pattern = la.pattern().double()
        rows = (la.query_valid & (la.allowed.sum(-1) >= 2)).double()  # [b, q]
        column = (pattern * rows[:, None, :, None]).sum(2)
        top = column.argmax(-1)  # [b, h]
        mass = column.gather(-1, top[..., None]).squeeze(-1) / rows.sum(-1)[:, None]
        two = column.topk(2, dim=-1).values
        dominant = two[..., 0] >= _stats.SINK_DOMINANCE * two[..., 1]  # [b, h]
        first = ((top == la.allowed.any(1).double().argmax(-1)[:, None]) & dominant).double()
        parts = odds_ratio.split_scores(la.q, la.k, la.scale, dtype=torch.float64)
        allowed = la.allowed[:, None].expand_as(parts.loglik)
        n_keys = la.allowed.double().sum(-1).clamp(min=1.0)[:, None, :]
        idx = top[:, :, None, None].expand(-1, -1, parts.loglik.shape[2], 1)
        prior = parts.key_prior[:, :, None, :].expand_as(parts.loglik)
        prior_adv = (
            prior.gather(-1, idx).squeeze(-1) - prior.masked_fill(~allowed, 0).sum(-1) / n_keys
        )
        lik_adv = (
            parts.loglik.gather(-1, idx).squeeze(-1)
            - parts.loglik.masked_fill(~allowed, 0).sum(-1) / n_keys
        )
        weight = pattern.gather(-1, idx).squeeze(-1) * rows[:, None]
        weight = weight / weight.sum(-1, keepdim=True)
        want = {
            "sink_mass": mass,
            "sink_first": first,
            "sink_dominant": dominant.double(),
            "sink_prior_adv": (weight * prior_adv).sum(-1),
            "sink_loglik_adv": (weight * lik_adv).sum(-1),
        }
        for name, value in want.items():
            torch.testing.assert_close(got[name].double(), value, rtol=1e-4, atol=1e-5, msg=name)


# ------------------------------------------------------------------ copy suppression, sinks
def _scores(**given):
    """One head's scores: nothing clears its control unless ``given``."""
    base = dict(
        prev_pattern=0.0,
        prev_circuit=0.0,
        dup_pattern=0.0,
        dup_mech=0.0,
        qk_positivity=0.0,
        ind_pattern=0.0,
        ind_mech=0.0,
        ind_kcomp=float("nan"),
        ov_copying=0.0,
        neg_ov_copying=0.0,
        copy_pass=0.0,
        neg_copy_pass=0.0,
        suppression_qk=float("nan"),
        sink_mass=0.0,
        sink_first=0.0,
        sink_dominant=0.0,
        sink_prior_adv=0.0,
        sink_loglik_adv=0.0,
        local_mass=0.0,
    )
    return {**base, **given}


def test_copy_suppression_needs_the_qk_side_and_a_sink_needs_dominance():
    c = {k: 0.1 for k in _scores()}
    both = _roles.classify(_scores(copy_pass=-0.5, neg_copy_pass=0.5, suppression_qk=0.6), c)
    assert both.roles == ("copy-suppression",)  # negative copying is part of it, not listed
    assert "ranks that token's key first for 60% (control 10%)" in both.evidence
    ov_only = _roles.classify(_scores(copy_pass=-0.5, neg_copy_pass=0.5, suppression_qk=0.15), c)
    assert ov_only.roles == ("negative copying",)
    assert "not copy-suppression" in ov_only.evidence and "15% (control 10%)" in ov_only.evidence
    unmeasured = _roles.classify(_scores(copy_pass=-0.5, neg_copy_pass=0.5), c)
    assert unmeasured.roles == ("negative copying",) and "not measured" in unmeasured.evidence
    # a large column that does not dominate the next-largest in most prompts is not a sink
    tie = _roles.classify(_scores(sink_mass=0.4, sink_dominant=0.25, sink_first=0.25), c)
    assert tie.roles == ("unclassified",) and "dominates the next-largest column" in tie.evidence
    sink = _roles.classify(_scores(sink_mass=0.4, sink_dominant=0.75, sink_first=0.75), c)
    assert sink.roles == ("sink",) and sink.sink_position == "first-token"
    elsewhere = _roles.classify(_scores(sink_mass=0.4, sink_dominant=0.75, sink_first=0.25), c)
    assert elsewhere.sink_position == "other"


def test_suppression_qk_equals_its_definition(induction):
    """The QK side of copy suppression against the dense ``W_U^T W_Q W_K^T W_E^T`` (query:
    the predicted token's unembedding; key: the token's embedding; biases left out)."""
    from tl_dynamics.atlas import _measure

    rows = torch.tensor([0, 5, 17, 33, 63])
    for layer, head in [(0, 1), (1, 2)]:
        q = induction.W_U.T[rows] @ induction.W_Q(layer)[head] * induction.specs[layer].scale
        k = induction.W_E @ induction.W_K(layer)[head]
        want = float(((q @ k.T).argmax(-1) == rows).float().mean())
        assert _measure.suppression_qk(induction, layer, head, rows) == pytest.approx(want)


def test_code_2l_layer_1_writes_against_nothing_on_the_pass():
    """code-2l's layer-1 heads read as negative copying from the weights alone (``W_E W_V W_O
    W_U``: -0.32 to -0.56), but that is inside the weights' own chance level (random heads
    reading code-2l's embeddings, the circuits section's number), and on the pass, through the
    norm and the layer-0 MLP, what they write from a token does not lower that token's logit
    (``copy_pass`` within the control's margin): no negative copying, no copy suppression. The
    weights-only copying score and the atlas share one null."""
    model = zoo.load("code-2l")
    res = atlas.compute(model, causal=False)
    layer_1 = [(1, h) for h in range(4)]
    chance = circuits.copying_scores(model).chance
    assert res.controls["ov_copying"] == pytest.approx(chance)  # one null per score
    assert res.heads_with("copy-suppression") == [] and res.heads_with("negative copying") == []
    for pair in layer_1:
        assert res.scores["ov_copying"][pair] < 0  # the weights alone say "negative"
        assert abs(res.scores["ov_copying"][pair]) < chance  # ... inside their chance level
        assert res.scores["neg_copy_pass"][pair] < res.controls["neg_copy_pass"] + _roles.MARGIN
        assert "negative copying" not in res.roles[pair].undecided


def test_planted_copy_suppression_head():
    """A HookedTransformer (TransformerLens 3.x), attention-only, with planted heads: token
    embeddings are unit vectors in the first d_head coordinates, the unembedding is their
    transpose, and layer 0 writes nothing (positions and its W_O zeroed), so layer 1 reads the
    tokens themselves. L1H0 reads the predicted token with W_Q = W_K = identity there and writes
    minus it (W_V W_O = -I): copy-suppression. L1H1 writes minus the token too but its QK circuit
    is random: negative copying only. Both read as such on the pass (``copy_pass`` near -1), and
    the weights-only QK side applies (attention-only)."""
    from tl_dynamics import testing

    try:
        model = testing.tiny_hooked(attn_only=True)
    except TLDynamicsError as exc:
        pytest.skip(f"HookedTransformer unavailable: {exc}")
    gen = torch.Generator().manual_seed(0)
    d_head, vocab = model.cfg.d_head, model.cfg.d_vocab
    embed = torch.zeros(vocab, model.cfg.d_model)
    embed[:, :d_head] = torch.nn.functional.normalize(
        torch.randn(vocab, d_head, generator=gen), dim=-1
    )
    eye = torch.zeros(model.cfg.d_model, d_head)
    eye[:d_head] = torch.eye(d_head)
    with torch.no_grad():
        model.W_E.copy_(embed)
        model.W_U.copy_(embed.T)
        model.W_pos.zero_()
        model.blocks[0].attn.W_O.zero_()
        attn = model.blocks[1].attn
        attn.W_Q[0], attn.W_K[0] = eye, eye
        for head in (0, 1):
            attn.W_V[head], attn.W_O[head] = eye, -eye.T
    res = atlas.compute(model, causal=False)
    assert res.roles_of(1, 0)[0] == "copy-suppression"
    assert res.scores["suppression_qk"][1, 0] == 1.0
    assert "negative copying" in res.roles_of(1, 1) and "copy-suppression" not in res.roles_of(1, 1)
    assert (res.scores["copy_pass"][1, :2] < -0.9).all()


# ------------------------------------------------------------------ the real encoder
MINILM_PROMPTS = [  # eight: a role's interval needs at least evidence.MIN_UNITS prompts
    "The cat sat on the mat because it was warm.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "She poured the coffee into a mug and added some milk.",
    "The quick brown fox jumps over the lazy dog.",
    "Rain is expected tomorrow, so take an umbrella with you.",
    "He read the letter twice before he put it back in the drawer.",
    "The museum opens at nine and closes at five on weekdays.",
    "Our train was late because of snow on the tracks.",
]


def test_minilm_cls_heads_are_likelihood_driven_sinks():
    try:
        model = ModelAdapter(zoo.load("minilm"))
    except TLDynamicsError as exc:  # the optional package is missing
        pytest.skip(f"real encoder unavailable: {exc}")
    res = atlas.compute(model, MINILM_PROMPTS)
    frame = res.to_dataframe()
    # the heads that put most of their attention on [CLS] in every prompt
    on_cls = frame[(frame.sink_first == 1.0) & (frame.sink_mass > 0.5)]
    assert len(on_cls) >= 20
    sink = on_cls.roles.str.contains("sink")  # decided; the rest undecided, never "no"
    assert (sink | on_cls.undecided.str.contains("sink")).all() and sink.mean() > 0.9
    assert (on_cls.sink_cause == "likelihood-driven").mean() > 0.9
    assert frame.delta_loss.isna().all() and any("encoder" in n for n in res.notes)
    assert np.isfinite(frame.sink_loglik_adv).all()


# ------------------------------------------------------------------ command line
def test_cli_heads_prints_the_table_and_writes_the_page(tmp_path, capsys):
    from tl_dynamics import cli

    out = tmp_path / "heads.html"
    assert cli.main(["heads", "--model", "induction-2l", "--no-causal", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "induction" in printed and "previous-token" in printed and out.stat().st_size > 0
    assert "L1H2" in out.read_text(encoding="utf-8")
    assert cli.main(["heads", "--model", "induction-2l", "--prompt", " "]) == 2
    assert "--prompt is empty" in capsys.readouterr().err


def test_report_section_adds_the_atlas(induction):
    page = viz.Page("atlas")
    atlas.report_section(page, induction, induction.tokenize("ABCDEFGHABCDEFGH"))
    html = page.to_html()
    assert "What each head does" in html and "induction" in html and "L0H0" in html


def test_hugging_face_bridge_falls_back_to_repeating_the_input():
    """A Hugging Face bridge passes a batch-shaped mask to every block, so a hook cannot grow
    the batch there; the atlas then repeats the input and still measures every head."""
    from helpers import adapter_for

    adapter = adapter_for("gpt2")
    res = atlas.compute(adapter, n_seq=2, seq_len=6)
    frame = res.to_dataframe()
    assert (
        np.isfinite(frame[["delta_loss", "delta_loss_prior", "delta_loss_likelihood"]]).all().all()
    )
    assert any("re-runs the whole model" in note for note in res.notes)
