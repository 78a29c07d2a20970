"""Planted truth for QK attribution (docs/math.md §10.6): at the induction targets of a layer-1
induction head, the key side is led by a layer-0 previous-token head and the query side by the
token embedding, on induction-2l and on a second induction model trained here; on the
weight-shuffled controls neither holds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tl_dynamics import atlas, qk_attribution, zoo
from tl_dynamics.adapter import ModelAdapter, shuffled_weights
from tl_dynamics.collect import torch_threads
from tl_dynamics.compat import has_hooked_transformer
from tl_dynamics.errors import TLDynamicsError

HALF = 20  # each probe: BOS, HALF random tokens, the same tokens again
N_PROMPTS = 8
LEADS = 0.8  # the bar: a previous-token head leads the key side on >= 80% of rows
CONTROL_AT_MOST = 0.5  # on the shuffled control the same leads hold on at most half the rows

# The second induction model: no norms, learned positions, 4 heads of 8 (induction-2l: LayerNorm,
# 4 heads of 16), trained on repeats of varying length so that position alone cannot find them.
TINY = dict(
    d_model=32, d_head=8, n_layers=2, n_ctx=32, n_heads=4, d_mlp=None, d_vocab=64, act_fn=None,
    attn_only=True, normalization_type=None, positional_embedding_type="standard", eps=1e-5,
    model_name="induction-tiny", default_prepend_bos=True,
)  # fmt: skip
TINY_STEPS = 1200


def repeats(vocab: int, half: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    body = torch.randint(1, vocab, (n, half), generator=g)
    return torch.cat([torch.zeros(n, 1, dtype=torch.long), body, body], 1)


def train_tiny() -> ModelAdapter:
    """The second induction model, trained in about 6 s on one CPU thread (deterministic)."""
    from tl_dynamics.zoo._load import _bridge, _hooked, _to_bridge_keys
    from tl_dynamics.zoo._torch_model import TorchTransformer

    with torch_threads(1):
        torch.manual_seed(0)
        net = TorchTransformer(TINY)
        opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.01)
        g = torch.Generator().manual_seed(0)
        for _ in range(TINY_STEPS):
            half = int(torch.randint(4, 15, (1,), generator=g))
            body = torch.randint(1, TINY["d_vocab"], (32, half), generator=g)
            toks = torch.cat([torch.zeros(32, 1, dtype=torch.long), body, body], 1)
            logits = net(toks[:, :-1])[:, half:]
            loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), toks[:, half + 1 :].flatten()
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
    tokenizer = zoo.load("induction-2l").tokenizer  # 64 ids, as TINY's vocabulary
    state = net.state_dict()
    if has_hooked_transformer():
        host = _hooked(TINY, tokenizer)
        host.load_state_dict(state, strict=False)
    else:
        host = _bridge(TINY, tokenizer)
        host.load_state_dict(_to_bridge_keys(state, host.cfg), strict=False)
    return ModelAdapter(host.eval())


def leads(adapter: ModelAdapter, prev: list[str], heads: list[int], half: int, seed: int = 1):
    """Per head: (share of target rows whose key side is led by one of ``prev``, share whose
    query side is led by the token embedding, share of rows attending the target). Target rows:
    second-copy destinations whose most attended key is the token after the earlier copy."""
    toks = repeats(int(adapter.W_E.shape[0]), half, N_PROMPTS, seed)
    res = qk_attribution.compute(adapter, toks, layers=1, heads=heads)
    dests = np.arange(half + 1, 2 * half + 1)
    out = {}
    for h in heads:
        on = res.rows[(1, h)]["chosen"][:, dests] == dests - half + 1
        key = res.leader_names(1, h, "key")[:, dests]
        query = res.leader_names(1, h, "query")[:, dests]
        rows = on if on.sum() >= 10 else np.ones_like(on)  # a control rarely attends the target
        out[h] = (
            float(np.isin(key[rows], prev).mean()),
            float((query[rows] == "token embedding").mean()),
            float(on.mean()),
        )
    return out


@pytest.fixture(scope="module")
def induction():
    return ModelAdapter(zoo.load("induction-2l"))


@pytest.fixture(scope="module")
def tiny():
    return train_tiny()


def marked(adapter: ModelAdapter, seq_len: int):
    marks = atlas.compute(adapter, causal=False, seq_len=seq_len)
    prev = [f"L0H{h} output" for layer, h in marks.heads_with("previous-token") if layer == 0]
    ind = [h for layer, h in marks.heads_with("induction") if layer == 1]
    return prev, ind


def test_induction_2l_keys_come_from_previous_token_heads(induction):
    prev, ind = marked(induction, 20)
    assert prev == ["L0H0 output", "L0H2 output", "L0H3 output"] and ind == [0, 1, 2, 3]
    model = leads(induction, prev, ind, HALF)
    control = leads(shuffled_weights(induction, 0), prev, ind, HALF)
    for h in ind:
        key, query, target = model[h]
        assert target > 0.5, (h, model[h])
        assert query >= LEADS, (h, model[h])
        if h != 0:
            assert key >= LEADS, (h, model[h])
        ckey, cquery, ctarget = control[h]
        assert ctarget < 0.1 and ckey <= CONTROL_AT_MOST and cquery <= CONTROL_AT_MOST, control[h]
    # L1H0, the weakest induction head (detect score 0.37), also reads the positional head L0H1:
    # a previous-token head leads its key side on 69% of its target rows, L0H1 on the rest
    assert 0.6 <= model[0][0] < LEADS
    pairs = qk_attribution.compute(induction, repeats(64, HALF, N_PROMPTS, 1), layers=1, heads=0)
    r, dests = pairs.rows[(1, 0)], np.arange(HALF + 1, 2 * HALF + 1)
    on = r["chosen"][:, dests] == dests - HALF + 1
    top_key = np.array(pairs.key_names(1))[r["top_b"][:, dests, 0]][on]
    assert np.isin(top_key, prev).mean() >= LEADS  # its top pair's key side: 87%


def test_a_second_induction_model_trained_here(tiny):
    prev, ind = marked(tiny, 12)
    assert prev and ind
    model = leads(tiny, prev, ind, 12)
    control = leads(shuffled_weights(tiny, 0), prev, ind, 12)
    keys = np.mean([model[h][0] for h in ind])
    queries = np.mean([model[h][1] for h in ind])
    assert keys >= LEADS, model
    assert queries >= 0.7, model  # the rest: the positional embedding, self-attending L0 heads
    assert np.mean([control[h][0] for h in ind]) <= 0.2, control
    assert np.mean([control[h][1] for h in ind]) <= CONTROL_AT_MOST, control


def test_over_prompts_separates_the_model_from_its_control(induction):
    toks = repeats(64, 10, 6, 2)
    # on the rows where the head attends a key other than BOS: pooled with the rows that rest on
    # BOS, six prompts do not tell the model from its control (test below)
    s = qk_attribution.over_prompts(induction, toks, 1, heads=1, n_boot=200, positions="focused")
    k = s.names["key"].index("L0H0 output")
    st = s.stats["key"]
    assert st["diff_low"][0, k] > 0  # above the control, paired by prompt
    assert st["low"][0, k] <= st["mean"][0, k] <= st["high"][0, k]
    frame = s.to_dataframe()
    assert {"mean_share", "low", "high", "control_mean_share", "diff_mean", "diff_low"} <= set(
        frame.columns
    )


def test_positions_keep_the_rows_that_do_the_work(induction):
    """Pooled over every row, L1H1's key side mixes first-copy rows (which rest on BOS) with
    second-copy rows (which attend the induction target); restricted to the second copy or to the
    'focused' rows, L0H0's share rises well above the pooled one and clears the weight-shuffled
    control by at least 0.4, paired by prompt, and the summary sentence says so."""
    toks = repeats(64, 20, 16, 3)
    second = list(range(21, 41))
    got = {}
    for name, pos in (("all", None), ("second", second), ("focused", "focused")):
        s = qk_attribution.over_prompts(induction, toks, 1, heads=1, positions=pos)
        k = s.names["key"].index("L0H0 output")
        got[name] = (s, k)
    pooled = got["all"][0].stats["key"]["mean"][0, got["all"][1]]
    for name in ("second", "focused"):
        s, k = got[name]
        st = s.stats["key"]
        assert st["mean"][0, k] >= pooled + 0.2, (name, st["mean"][0, k], pooled)
        assert st["diff_low"][0, k] >= 0.4, (name, st["diff_low"][0, k])
        said = s.summary()
        assert "L1H1 key side" in said and "L0H0 output leads" in said, said
        assert "above it by" in said, said
    first = list(range(1, 21))
    s = qk_attribution.over_prompts(induction, toks, 1, heads=1, positions=first)
    k = s.names["key"].index("L0H0 output")
    assert s.stats["key"]["mean"][0, k] < pooled  # the first copy: what pooling dilutes with
    with pytest.raises(TLDynamicsError, match="positions"):
        qk_attribution.over_prompts(induction, toks, 1, heads=1, positions="second-copy")
    with pytest.raises(TLDynamicsError, match="past the last position"):
        qk_attribution.compute(induction, toks[:1], layers=1, heads=1).row_mask(1, 1, [99])
