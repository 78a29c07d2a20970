"""Attention as in-context regression (docs/math.md §8): every predictor against a naive float64
loop, the softmax row against the model's z, planted structure found (a near-linear head beside
previous-token heads) and absent in the shuffled control, errors for bad settings."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from tl_dynamics import regression, testing, zoo
from tl_dynamics.adapter import ModelAdapter, shuffled_weights
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.regression._collect import layer_predictions
from tl_dynamics.regression._measure import MARGIN
from tl_dynamics.regression._predict import GD_STEPS, RIDGE_PATH, chunks, predictor_names

NAIVE_RTOL = 1e-10  # float64 spectral filters vs direct solves and explicit GD iterations
EXACT_TOL = 1e-5  # the float64 softmax row vs the model's float32 z (docs/math.md §7.1)
GCV_TIE = 1e-6  # GCV values this close (relative) are a tie two float routes may break apart


def _naive(q, k, v, allowed, kv_of, b, t, h):
    """Every predictor at one destination and head, by direct float64 loops and solves."""
    q, k, v, al = q.numpy(), k.numpy(), v.numpy(), allowed.numpy()
    seen = [i for i in range(al.shape[-1]) if al[b, t, i]]
    K, V, x = k[b, seen, kv_of[h]], v[b, seen, kv_of[h]], q[b, t, h]
    n, d = len(seen), K.shape[1]
    kb, vb = K.mean(0), V.mean(0)
    Kc, Vc = K - kb, V - vb
    G, B = Kc.T @ Kc, Kc.T @ Vc
    out = {
        "linear": sum((x @ K[j]) * V[j] for j in range(n)),
        "linear_norm": vb + sum((x @ Kc[j]) * Vc[j] for j in range(n)) / n,
    }
    tr, gcv, preds = np.trace(G), [], []
    for rho in RIDGE_PATH:
        lam = rho * tr / d
        inv = np.zeros_like(G) if tr == 0 else np.linalg.inv(G + lam * np.eye(d))
        W = inv @ B
        preds.append(vb + W.T @ x)
        out[f"ridge@{rho:g}"] = preds[-1]
        rss, df = ((Vc - Kc @ W) ** 2).sum(), np.trace(Kc @ inv @ Kc.T)
        gcv.append(rss / n / (1 - (df + 1) / n) ** 2 if df + 1 < n else np.inf)
    gcv = np.array(gcv)
    out["ridge_gcv"] = preds[len(gcv) - 1 if np.isinf(gcv).all() else int(np.argmin(gcv))]
    finite = np.sort(gcv[np.isfinite(gcv)])
    tie = len(finite) > 1 and finite[1] - finite[0] <= GCV_TIE * abs(finite[0])
    smax = np.linalg.eigvalsh(G).max()
    eta, W = (1 / smax if smax > 0 else 0.0), np.zeros_like(B)
    for step in range(1, max(GD_STEPS) + 1):
        W = W - eta * (G @ W - B)
        if step in GD_STEPS:
            out[f"gd{step}"] = vb + W.T @ x
    out.update(
        mean=vb,
        first=v[b, seen[0], kv_of[h]],
        self=v[b, t, kv_of[h]],
        previous=v[b, max(t - 1, seen[0]), kv_of[h]],
    )
    return out, tie


def test_every_predictor_matches_a_naive_float64_loop():
    """Causal, sliding window 9, left padding on row 1, two query heads per KV head, d < n and
    d > n prefixes; a small memory budget forces many chunks."""
    gen = torch.Generator().manual_seed(0)
    B, T, H, d, e = 2, 14, 4, 3, 2
    q = torch.randn(B, T, H, d, generator=gen, dtype=torch.float64)
    k = torch.randn(B, T, 2, d, generator=gen, dtype=torch.float64) + 0.5
    v = torch.randn(B, T, 2, e, generator=gen, dtype=torch.float64)
    kv_of = [0, 0, 1, 1]
    i = torch.arange(T)
    allowed = (i[:, None] >= i[None, :]) & (i[None, :] > i[:, None] - 9)
    allowed = allowed.expand(B, T, T).clone()
    allowed[1, :, :2], allowed[1, :2, :] = False, False
    db, dt = allowed.any(-1).nonzero(as_tuple=True)
    names, checked = predictor_names(), 0
    for sl, heads, P in chunks(q, k, v, allowed, kv_of, db, dt, budget=20_000):
        for row, (b, t) in enumerate(zip(db[sl].tolist(), dt[sl].tolist())):
            for j, h in enumerate(heads):
                ref, tie = _naive(q, k, v, allowed, kv_of, b, t, h)
                for p, name in enumerate(names):
                    if name == "ridge_gcv" and tie:
                        continue
                    want = ref[name]
                    err = np.abs(P[row, j, p].numpy() - want).max() / np.abs(want).max()
                    assert err < NAIVE_RTOL, (name, b, t, h, err)
                    checked += 1
    assert checked > 0.95 * len(db) * H * len(names)


def test_a_mask_that_is_not_an_interval_is_refused():
    allowed = torch.ones(1, 4, 4, dtype=torch.bool)
    allowed[0, 3, 1] = False
    x = torch.zeros(1, 4, 1, 2, dtype=torch.float64)
    with pytest.raises(TLDynamicsError, match="not an interval"):
        next(chunks(x, x, x, allowed, [0], torch.tensor([0]), torch.tensor([3])))


def test_the_softmax_row_reproduces_z_and_gqa_heads_share_sums():
    """gpt2 and llama (rotary, two query heads per KV head): the float64 softmax row of the
    adapter's scores reproduces the model's z; the GQA grouping gives the numbers of each head
    taken alone."""
    prompts = ["def f(x):\n    return x * 2 + 1\n" * 3, "a = [i for i in range(10)]\n" * 3] * 2
    for arch in ("gpt2", "llama"):
        ad = ModelAdapter(testing.cached_model(arch))
        res = regression.compute(ad, prompts, n_boot=20)
        assert max(res.z_error) < EXACT_TOL, (arch, res.z_error)
        assert np.isfinite(res.r2[:, :-1]).any()
    la = ad.attention(prompts, layers=[0])[0]
    db, dt = la.query_valid.nonzero(as_tuple=True)
    shared = torch.cat([P for _, _, P in layer_predictions(la, [0, 1, 2, 3], 2, db, dt)], 1)
    alone = torch.cat([P for h in range(4) for _, _, P in layer_predictions(la, [h], 4, db, dt)], 1)
    torch.testing.assert_close(shared, alone, rtol=1e-12, atol=1e-12)


def _induction(query_gain: float | None = None, key_gain: float | None = None, heads=slice(0, 1)):
    """``induction-2l`` (a bridge on TransformerLens 4.x, a ``HookedTransformer`` on 3.x), with
    the queries of layer 0's ``heads`` scaled by ``query_gain`` (L0H0 alone by 0.1: the
    near-linear regime of softmax) and their keys by ``key_gain``."""
    model = copy.deepcopy(zoo.load("induction-2l"))
    rows = slice(16 * heads.start, 16 * heads.stop)  # d_head = 16
    with torch.no_grad():
        for gain, name in ((query_gain, "q"), (key_gain, "k")):
            if gain is None:
                continue
            if hasattr(model, "blocks"):  # HookedTransformer
                attn = model.blocks[0].attn
                getattr(attn, f"W_{name.upper()}")[heads] *= gain
                getattr(attn, f"b_{name.upper()}")[heads] *= gain
            else:
                attn = model.layers[0]._original_component.attn._original_component
                proj = getattr(attn, name)._original_component
                proj.weight[rows] *= gain
                proj.bias[rows] *= gain
    return ModelAdapter(model)


PROMPTS = torch.randint(0, 64, (8, 128), generator=torch.Generator().manual_seed(0))


@pytest.mark.slow
def test_planted_near_linear_head_is_separated_from_previous_token_heads():
    """(a) induction-2l with L0H0's query scaled by 0.1: linear attention plus the mean explains
    its z (held-out R² 0.93 against the mean's 0.58); the sharp previous-token head L0H2 is read
    as ``previous`` (R² 0.97), where linear attention explains little (0.19)."""
    res = regression.compute(_induction(0.1), PROMPTS, layers=0)
    reading, table = res.reading(), res.claims().set_index("head_index")
    assert reading[0, 0] == "linear" and table.r2_linear[0] > 0.9
    assert table.r2_linear[0] > table.r2_control[0] + 0.3
    assert reading[0, 2] == "previous" and table.r2_control[2] > 0.9
    assert table.r2_linear[2] < 0.5
    assert not res.regression_like.any()


def test_readings_do_not_depend_on_how_the_scores_are_factored():
    """Queries times ``c`` and keys divided by ``c`` leave every score, the model and its ``z``
    unchanged, so no reading may change: every predictor is ``vbar + (linear in q_t)`` with a
    fitted gain (§8.2). Evaluating ridge and GD at ``q_t - kbar_t`` instead (the first version)
    fails this: claim-band R² moved by up to 0.25 here."""
    tokens = PROMPTS[:4, :64]
    model = _induction()
    base = regression.compute(model, tokens, layers=0)
    with torch.no_grad():
        logits = model.model(tokens)
    for c in (3.0, 1 / 3):
        moved = _induction(c, 1 / c, heads=slice(0, 4))
        with torch.no_grad():
            torch.testing.assert_close(moved.model(tokens), logits, rtol=1e-4, atol=1e-4)
        res = regression.compute(moved, tokens, layers=0)
        # the claim band, every predictor; below it GCV's pick may flip on float32 near-ties
        np.testing.assert_allclose(res.r2[:, -1], base.r2[:, -1], atol=1e-5, equal_nan=True)
        pick = [n != "ridge_gcv" for n in res.names]
        np.testing.assert_allclose(res.r2[..., pick], base.r2[..., pick], atol=1e-5)
        assert (res.reading() == base.reading()).all()


@pytest.mark.slow
def test_shuffled_control_claims_no_regression():
    """(c) induction-2l with its weights shuffled: no head reads as regression beyond its best
    linear or control predictor (measured: every difference at most +0.008, within a sixth of
    the margin)."""
    res = regression.compute(shuffled_weights(_induction(), seed=1), PROMPTS)
    assert not res.regression_like.any()
    assert (res.delta_regression[..., 0] < MARGIN / 5).all()


def test_result_faces_and_bad_settings():
    ad = ModelAdapter(testing.cached_model("gpt2"))
    prompt = "def f(x):\n    return x * 2 + 1\n" * 3
    res = regression.compute(ad, prompt, layers=1, heads=[0, 2], n_boot=10)
    assert res.units.startswith("blocks") and res.heads == (0, 2)
    frame = res.to_dataframe()
    assert len(frame) == len(res.bands) * 2 * len(res.names)
    assert set(res.claims().reading) <= {"regression", "linear", "unexplained", *res.names}
    assert "2 d_head = 32 keys" in res.notice
    assert res.show().components
    n_pos = ad.tokenize(prompt).tokens.shape[1]
    for stride in (1, 3):  # every destination once per head (the claim band counts twice)
        sub = (
            res if stride == 1 else regression.compute(ad, prompt, layers=1, heads=[0, 2], stride=3)
        )
        counted = sub.n_fit[:, :-1].sum() + sub.n_held[:, :-1].sum()
        assert counted == 2 * len(range(0, n_pos, stride))
    for kwargs, match in (
        (dict(stride=0), "stride"),
        (dict(fit_fraction=1.0), "fit_fraction"),
        (dict(ridge_path=(0.0,)), "ridge_path"),
        (dict(gd_steps=(1.5,)), "gd_steps"),
        (dict(n_boot=0), "n_boot"),
    ):
        with pytest.raises(TLDynamicsError, match=match):
            regression.compute(ad, prompt, **kwargs)
    with pytest.raises(TLDynamicsError, match="fewer than two units"):
        regression.compute(ad, torch.tensor([[5]]))


def test_a_prompt_shorter_than_the_claim_band_draws_no_empty_map_and_says_why(recwarn):
    """A prompt whose destinations never see 2 d_head keys has no claim: the view says so, with
    the count, instead of drawing an all-empty map (the report's default prompt on code-2l)."""
    ad = ModelAdapter(testing.cached_model("gpt2"))  # d_head 16: the claim band starts at 32
    short = regression.compute(ad, ["def f(x):\n    return x\n", "a = 1 + 2 + 3"], n_boot=10)
    assert not np.isfinite(short.delta_regression).any()
    kinds = [type(c).__name__ for c in short.show().components]
    texts = " ".join(c.fragment("n") for c in short.show().components)
    assert "Heatmap" not in " ".join(kinds) and "no map is drawn" in texts
    assert "at least 32 keys: 0" in texts
    long = regression.compute(ad, "def f(x):\n    return x * 2 + 1\n" * 3, layers=1, n_boot=10)
    assert np.isfinite(long.delta_regression).any()
    assert "no map is drawn" not in " ".join(c.fragment("n") for c in long.show().components)
    assert not [w for w in recwarn if "All-NaN" in str(w.message)]


@pytest.mark.slow
def test_sink_epsilon_matches_a_hand_computation():
    """Sink^eps (Gu et al. 2025) on GPT-Neo, whose local layers' queries past the window do not
    see the first key: alpha averages over the queries that do; the report's sentence gives the
    fraction of heads above epsilon and says whether the first key is a BOS token."""
    from tl_dynamics import viz
    from tl_dynamics._attention_section import attention_section
    from tl_dynamics._heads import head_statistics, sink_epsilon

    ad = ModelAdapter(testing.cached_model("gptneo"))
    batch = ad.tokenize("def f(x):\n    return x * 2 + 1\n")
    layers = ad.attention(batch)
    alpha = []
    for _, la in sorted(layers.items()):
        p, allowed = la.pattern()[0], la.allowed[0]
        row = []
        for h in range(ad.n_heads):  # by hand: sum over the queries that see key 0, divided
            seen = [i for i in range(p.shape[1]) if allowed[i, 0]]
            row.append(sum(float(p[h, i, 0]) for i in seen) / len(seen))
        got = head_statistics(p, allowed, batch.tokens[0])["sink_alpha"]
        np.testing.assert_allclose(got, row, rtol=1e-6)
        alpha.append(row)
    assert not bool(layers[1].allowed[0, -1, 0])  # the local layer: the last query cannot see it
    alpha = np.array(alpha)
    for eps in (0.3, 0.05, float(np.median(alpha))):
        assert sink_epsilon(alpha, eps) == sum(a > eps for a in alpha.ravel()) / alpha.size
    page = viz.Page("attention")
    attention_section(page, ad, batch)
    html = page.to_html()
    assert f"Sink^eps of the first key (Gu et al. 2025): {sink_epsilon(alpha):.2f}" in html
    assert "is not a BOS token" in html or "is the BOS token" in html
