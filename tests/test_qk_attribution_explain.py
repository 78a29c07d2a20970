"""``qk_attribution.explain`` and ``chains`` (docs/math.md §10.8): every link of an edge's chain is
exact on every architecture QK attribution splits (both hosts, rotary, grouped heads, q/k norms,
random norm gains); the induction chain ("the key at j carries the token of j-1 through a
previous-token head, the query carries the token at i") is named on the target rows of
induction-2l's induction heads and of the model trained in the test, and not on their
weight-shuffled controls."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_qk_attribution import SPLIT, with_random_norms
from test_qk_attribution_planted import marked, train_tiny

from tl_dynamics import qk_attribution, testing, viz, zoo
from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.atlas._probes import repeated_tokens
from tl_dynamics.errors import TLDynamicsError

LINK_TOL = 1e-4  # float32: each link's parts against its total, relative to the largest
INDUCTION = "key: L{} <- the token at src-1 | query: the token at dest"
PROMPT = "a b c d a b c d"


def _check(adapter: ModelAdapter, prompt, layer: int, head: int, dest: int) -> None:
    e = qk_attribution.explain(adapter, prompt, layer, head, dest, depth=3, top=2)
    worst = max(link.error for link in e.links())
    assert worst < LINK_TOL, worst
    la = adapter.attention(prompt, layers=[layer])[layer]
    assert e.numbers["attention"] == pytest.approx(float(la.pattern()[0, head, dest, e.src]))
    q, k = la.q[0, dest, head].double(), la.k[0, :, head].double()
    allowed = la.allowed[0, dest].double()
    lift = la.scale * float(q @ (k[e.src] - (allowed / allowed.sum()) @ k))
    assert e.key.total == pytest.approx(lift, rel=1e-4, abs=1e-5)
    assert e.query.total == pytest.approx(lift, rel=1e-4, abs=1e-5)
    # a head on the chain: its sources' parts add up to the part its output holds in the stream
    for link in e.links():
        for i, child in link.children.items():
            assert child.total == pytest.approx(link.parts[i][1], rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("arch", SPLIT)
def test_every_link_of_an_edge_is_exact(arch):
    adapter = ModelAdapter(testing.cached_model(arch))
    n = int(adapter.tokenize(PROMPT).tokens.shape[1])
    _check(adapter, PROMPT, 1, 0, n - 1)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_links_are_exact_with_random_norm_gains(arch):
    adapter = ModelAdapter(with_random_norms(arch))
    n = int(adapter.tokenize(PROMPT).tokens.shape[1])
    for head in range(adapter.n_heads):
        _check(adapter, PROMPT, 1, head, n - 2)


def _target_rows(
    adapter: ModelAdapter, tokens: torch.Tensor, offset: int, n: int, layer: int, head: int
):
    """``[prompts, pos]``: the second-copy rows whose most attended key is the induction target."""
    la = adapter.attention(tokens, layers=[layer])[layer]
    top = la.pattern()[:, head].argmax(-1)
    q = torch.arange(tokens.shape[1])
    return ((q[None] >= offset + n) & (top == q[None] - n + 1)).numpy()


def _induction_share(summary) -> tuple[float, float]:
    """The share of rows (and on the control) whose chain is the induction chain through any
    previous-token head of layer 0 or later."""
    model, control = 0.0, 0.0
    for i, shape in enumerate(summary.shapes):
        key, query = shape.split(" | ")
        if key.endswith("<- the token at src-1") and query == "query: the token at dest":
            model += summary.stats["mean"][i]
            control += summary.stats["control_mean"][i]
    return model, control


def test_induction_2l_chain_is_the_induction_chain():
    """On induction-2l (16 prompts of 20 random symbols twice), at the second-copy rows where an
    induction head attends the target: L1H1, L1H2, L1H3 on 100% of rows (L0H0 moving the token
    at src-1; the query the token at dest); the weight-shuffled control on 0%. L1H0, the weakest
    induction head, on 30%: its keys are led by the positional head L0H1 on most target rows
    (docs/math.md §10.6 found the same with the per-row leaders)."""
    ad = ModelAdapter(zoo.load("induction-2l"))
    tokens, offset = repeated_tokens(ad, 16, 20, 3)
    for head, at_least in ((1, 0.9), (2, 0.9), (3, 0.9), (0, 0.2)):
        rows = _target_rows(ad, tokens, offset, 20, 1, head)
        s = qk_attribution.chains(ad, tokens, 1, head, positions=rows)
        model, control = _induction_share(s)
        assert model >= at_least, (head, s.summary())
        assert control <= 0.1, (head, s.summary())
        if at_least >= 0.9:
            assert s.shapes[0] == INDUCTION.format("0H0"), s.summary()
            assert "weight-shuffled control" in s.summary()


def test_the_model_trained_here_names_the_induction_chain():
    """The second induction model (trained in tests/test_qk_attribution_planted.py): pooled over
    its induction heads' target rows, the induction chain on at least 90% of rows; the control on
    at most 10%."""
    tiny = train_tiny()
    prev, ind = marked(tiny, 12)
    tokens = torch.cat(
        [
            torch.zeros(12, 1, dtype=torch.long),
            *([torch.randint(1, 64, (12, 10), generator=torch.Generator().manual_seed(5))] * 2),
        ],
        1,
    )
    shares, controls, weights = [], [], []
    for head in ind:
        rows = _target_rows(tiny, tokens, 1, 10, 1, head)
        s = qk_attribution.chains(tiny, tokens, 1, head, positions=rows)
        model, control = _induction_share(s)
        shares.append(model)
        controls.append(control)
        weights.append(s.n_rows)
    assert np.average(shares, weights=weights) >= 0.9, shares
    assert np.average(controls, weights=weights) <= 0.1, controls


def test_the_sentence_and_the_view_come_from_the_links():
    ad = ModelAdapter(zoo.load("induction-2l"))
    e = qk_attribution.explain(ad, "ABCDEFGHABCDEFGH", 1, 1, dest=13)
    i = e.key.ranked()[0]
    assert e.key.parts[i][0] in e.sentence and f"{e.key.share(i):.2f}" in e.sentence
    assert e.shape == INDUCTION.format("0H0")
    html = e.show().components[1].html
    assert viz.html_escape("L0H0 moved 'E' (5) to 6") in html  # the chain's arc, hover naming it
    frame = e.to_dataframe()
    assert {"side", "what", "part", "value", "share", "error"} <= set(frame.columns)
    assert frame["error"].max() < LINK_TOL


def test_one_edge_costs_one_forward():
    """An edge at depth 2 costs at most 3 forwards (the issue's budget): one pass, then maps and
    dot products (counted with a hook on the model, not timed)."""
    ad = ModelAdapter(zoo.load("induction-2l"))
    calls = []
    handle = ad.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        qk_attribution.explain(ad, "ABCDEFGHABCDEFGH", 1, 1, dest=13, depth=2)
    finally:
        handle.remove()
    assert len(calls) <= 3, len(calls)


@pytest.mark.parametrize(
    "kwargs,words",
    [
        (dict(dest=99), "dest must be a position"),
        (dict(dest=3, src=5), "cannot attend from 3 to 5"),
        (dict(dest=3, depth=0), "depth must be an int >= 1"),
        (dict(dest=3, row=2), "row 2 is not a prompt"),
    ],
)
def test_bad_input_is_refused_by_name(kwargs, words):
    with pytest.raises(TLDynamicsError, match=words):
        qk_attribution.explain(zoo.load("induction-2l"), "ABCDEFGH", 1, 1, **kwargs)
