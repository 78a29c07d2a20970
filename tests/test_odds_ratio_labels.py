"""Labels say what the evidence shows (issue 30): a one-part label ("prior-driven",
"likelihood-driven") needs its counterfactual pattern to reproduce the head, and a head that
neither part alone reproduces is labelled "needs both" (docs/math.md §2.2). Planted heads, hand-built
and trained, each against a shuffled control."""

from __future__ import annotations

import pytest
import torch

from tl_dynamics import odds_ratio, zoo
from tl_dynamics.adapter import ModelAdapter, shuffled_weights
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.odds_ratio import _labels, _stats


def planted(kind: str, n: int = 12, d: int = 16, seed: int = 0):
    """Queries and keys ``[1, n, 1, d]`` of one hand-built head.

    ``loud``: one key far louder than the rest, queries leaning towards it (the prior alone
    picks it). ``close``: keys of equal norm, each query next to one key (the distances alone
    pick it). ``both``: queries along ``u``; a loud key orthogonal to ``u`` (the prior alone
    picks it), the rest small and close to the queries (the distances alone pick one of them),
    and a long key along ``u``, which the inner product, and so the head, picks."""
    g = torch.Generator().manual_seed(seed)
    u = torch.nn.functional.normalize(torch.randn(d, generator=g), dim=0)
    if kind == "loud":
        q = 0.3 * torch.randn(n, d, generator=g) + 1.0 * u
        k = 0.3 * torch.randn(n, d, generator=g)
        k[3] = 6.0 * u
    elif kind == "close":
        k = 2.0 * torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=1)
        q = k[torch.randperm(n, generator=g)] + 0.05 * torch.randn(n, d, generator=g)
    else:
        v = torch.randn(d, generator=g)
        v = torch.nn.functional.normalize(v - (v @ u) * u, dim=0)
        q = 1.5 * u + 0.1 * torch.randn(n, d, generator=g)
        k = 1.5 * u + 0.1 * torch.randn(n, d, generator=g)
        k[3], k[7] = 6.0 * v, 5.0 * u
    return q.reshape(1, n, 1, d), k.reshape(1, n, 1, d)


def head_label(q: torch.Tensor, k: torch.Tensor) -> tuple[str, float, float]:
    """The label of one hand-built head (all keys allowed, c = 1/2) and its two agreements."""
    n = q.shape[1]
    allowed = torch.ones(1, n, n, dtype=torch.bool)
    sums, _ = _stats.layer_sums(q, k, 0.5, None, allowed, torch.ones(1, n, dtype=torch.bool))
    attr_prior = float(sums["cov_r_prior"] / sums["var_r"])
    agree_prior = float(sums["top_prior"] / sums["top_real"])
    agree_loglik = float(sums["top_loglik"] / sums["top_real"])
    return (
        _labels.label(attr_prior, 1.0 - attr_prior, agree_prior, agree_loglik),
        agree_prior,
        agree_loglik,
    )


def ablated(kind: str, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The control of a hand-built head: the same head with its planted part taken out (the loud
    key brought to a typical norm; the long key replaced by a copy of a small one). With keys of
    equal norm (``close``) the likelihood-only pattern is the real one whatever the queries: its
    control is the trained previous-token head against shuffled weights (below)."""
    q, k = q.clone(), k.clone()
    if kind == "loud":
        k[0, 3] = k[0, 3] / k[0, 3].norm() * k[0, 0].norm()
    else:
        k[0, 7] = k[0, 0]
    return q, k


@pytest.mark.parametrize(
    "kind,expected",
    [("loud", "prior-driven"), ("close", "likelihood-driven"), ("both", "needs both")],
)
def test_hand_built_heads_get_the_label_their_counterfactuals_show(kind, expected):
    q, k = planted(kind)
    got, agree_prior, agree_loglik = head_label(q, k)
    assert got == expected, (kind, got, agree_prior, agree_loglik)
    if kind == "both":  # the inner product picks the long key; each part alone misses it
        assert max(agree_prior, agree_loglik) < 0.2
    if kind != "close":
        control = head_label(*ablated(kind, q, k))
        assert control[0] != expected, control


def test_a_one_part_label_needs_its_counterfactual_to_reproduce_the_head():
    assert _labels.label(-0.15, 1.15, 0.07, 0.005) == "needs both"  # induction-2l's L1H3
    assert _labels.label(-0.15, 1.15, 0.07, 0.9) == "likelihood-driven"
    assert _labels.label(0.9, 0.1, 0.3, 0.7) == "mixed"  # the prior's share, not its pattern
    assert _labels.label(float("nan"), float("nan"), float("nan"), float("nan")) == "mixed"


@pytest.fixture(scope="module")
def induction():
    return ModelAdapter(zoo.load("induction-2l"))


def repeated(adapter: ModelAdapter) -> torch.Tensor:
    """The issue's probe: BOS, 20 random tokens (seed 1), the same 20 again."""
    first = torch.randint(
        1, int(adapter.W_E.shape[0]), (1, 20), generator=torch.Generator().manual_seed(1)
    )
    return torch.cat([torch.zeros(1, 1, dtype=torch.long), first, first], 1)


def test_no_induction_2l_head_carries_a_one_part_label_its_counterfactual_misses(induction):
    """Target of issue 30. Checked against the kept per-prompt patterns, computed apart from the
    streamed agreement: a one-part label's counterfactual keeps at least half the real pattern's
    mass on each row's top key (pooled); L1H1 and L1H3, whose likelihood-only patterns put
    nothing on the induction target, are not "likelihood-driven"."""
    res = odds_ratio.compute(induction, repeated(induction), keep_tensors=True)
    frame = res.to_dataframe()
    assert frame.loc["L1H1", "label"] == "needs both" and frame.loc["L1H3", "label"] == "needs both"
    which = {"prior-driven": "prior_pattern", "likelihood-driven": "likelihood_pattern"}
    checked = 0
    for layer in res.stats.layers:
        dec = res[layer]
        rows = dec.allowed[0].sum(-1) >= 2
        for b, head in enumerate(dec.heads):
            name = f"L{layer}H{head}"
            real = dec.pattern[0, b][rows]
            top = real.argmax(-1, keepdim=True)
            agree = {
                key: float(
                    getattr(dec, key)[0, b][rows].gather(-1, top).sum() / real.gather(-1, top).sum()
                )
                for key in which.values()
            }
            assert agree["likelihood_pattern"] == pytest.approx(
                frame.loc[name, "agree_loglik"], abs=1e-4
            )
            assert agree["prior_pattern"] == pytest.approx(frame.loc[name, "agree_prior"], abs=1e-4)
            lab = frame.loc[name, "label"]
            if lab in which:
                assert agree[which[lab]] >= _labels.AGREE_THRESHOLD, (name, lab, agree)
                checked += 1
    assert checked >= 4  # the previous-token heads of layer 0


def test_trained_heads_against_a_shuffled_control(induction):
    """induction-2l's L0H0 (previous token) is a sharp pattern its likelihood alone reproduces;
    its induction heads L1H1 and L1H3 are sharp patterns neither part alone comes near. The
    same weights shuffled have neither: no head is that sharp, and every head's better part keeps
    over a quarter of the real top-key mass."""
    tokens = repeated(induction)
    trained = odds_ratio.compute(induction, tokens, keep_tensors=False).to_dataframe()
    best = trained[["agree_prior", "agree_loglik"]].max(axis=1)
    assert trained.loc["L0H0", "label"] == "likelihood-driven"
    assert trained.loc["L0H0", "top_real"] > 0.9 and trained.loc["L0H0", "agree_loglik"] > 0.9
    for name in ("L1H1", "L1H3"):
        assert trained.loc[name, "top_real"] > 0.9 and best[name] < 0.15
    control = odds_ratio.compute(shuffled_weights(induction, seed=0), tokens, keep_tensors=False)
    frame = control.to_dataframe()
    assert (frame["top_real"] < 0.9).all()
    assert (frame[["agree_prior", "agree_loglik"]].max(axis=1) > 0.25).all()


def test_the_view_and_the_table_show_the_agreement_next_to_the_shares(induction):
    res = odds_ratio.compute(induction, repeated(induction), keep_tensors=False)
    frame = res.to_dataframe()
    assert {"top_real", "agree_prior", "agree_loglik"} <= set(frame.columns)
    html = res.stats.show()._repr_html_()
    assert "needs both" in html
    # the agreement columns sit right after the attribution shares
    assert html.index("attr_loglik") < html.index("agree_prior") < html.index("agree_loglik")
    assert html.index("agree_loglik") < html.index("var_prior")


def test_the_notebooks_label_claims(induction):
    """notebooks/odds_ratio.ipynb: on the README's prompt L1H1-L1H3 need both (their likelihood
    shares 1.0 to 1.2), L1H0 is mixed, the layer-0 heads likelihood-driven; on its four sentences
    all-MiniLM-L6-v2 has exactly four prior-driven heads, L0H8, L0H11, L5H4, L5H7."""
    frame = odds_ratio.compute(induction, "KQZ7XMBW2RKQZ7XMBW2R", keep_tensors=False).to_dataframe()
    assert list(frame["label"]) == ["likelihood-driven"] * 4 + ["mixed"] + ["needs both"] * 3
    assert frame.loc[["L1H1", "L1H2", "L1H3"], "attr_loglik"].between(0.95, 1.25).all()
    try:
        minilm = ModelAdapter(zoo.load("minilm"))
    except TLDynamicsError as exc:  # the optional package is missing
        pytest.skip(f"real encoder unavailable: {exc}")
    sentences = [
        "The cat sat on the mat because it was warm.",
        "Paris is the capital of France, and Berlin is the capital of Germany.",
        "She poured the coffee into a mug and added some milk.",
        "The quick brown fox jumps over the lazy dog.",
    ]
    labels = odds_ratio.compute(minilm, sentences, keep_tensors=False).to_dataframe()["label"]
    assert sorted(labels[labels == "prior-driven"].index) == ["L0H11", "L0H8", "L5H4", "L5H7"]
