"""Only what the model read is counted (issue 40): a padded batch inside ``attach()`` gives each
prompt the statistics it has alone (``PAD_TOL``), or is refused by name where the padding cannot
be known or the model read it.

TransformerLens 4.3's bridge and 3.x's ``HookedTransformer`` right-pad a list of texts with the
pad id and pass no attention mask: the adapter keeps the texts the model tokenized and leaves the
pads out, as queries and as keys. Left padding comes with the host's own mask on the 4.x bridge
(exact) and without one on a ``HookedTransformer`` whose tokenizer pads on the right (the model
reads the pads: refused). A token tensor that looks padded and comes without a mask is refused,
saying how to pass one."""

from __future__ import annotations

import functools

import numpy as np
import pandas as pd
import pytest
import torch

from tl_dynamics import scale
from tl_dynamics.errors import TLDynamicsError
from test_attach_entry_points import ANALYSES, HOSTS, model_of

PAD_TOL = 1e-5  # float32 sums over a padded row reordered against the row alone
# mixed lengths: the longest in the middle, two shorter ones of different lengths
TEXTS = ["x = 1", "def f(a, b, c): return a", "yy = 22"]


def results(name: str, collector) -> list[pd.DataFrame]:
    """What an analysis reports, per prompt where it reports per prompt."""
    if name == "contextual_mlp":
        passes = collector._passes
        rows = [(p, r) for p, layers in enumerate(passes) for r in range(len(layers[0][0].q))]
        return [collector.result(r, p).to_dataframe() for p, r in rows]
    res = collector.result()
    frames = [res.to_dataframe()]
    if name == "trajectories":
        frames.append(res.stats.to_dataframe())
    return frames


POSITIONS = ("pos", "position", "winner")  # indices into the (padded) row, not statistics


def from_first(frame: pd.DataFrame) -> pd.DataFrame:
    """Positions counted from each prompt's first real token (left padding shifts them)."""
    frame = frame.copy()
    col = "pos" if "pos" in frame else "position"
    if col not in frame:  # per-head statistics: no positions
        return frame
    by = frame.groupby("prompt")[col] if "prompt" in frame else frame.groupby(lambda _: 0)[col]
    first = by.transform("min")
    for col in POSITIONS:
        if col in frame:
            frame[col] = frame[col] - first
    return frame


def assert_close(
    got: list[pd.DataFrame], want: list[pd.DataFrame], where: str, shifted: bool = False
) -> None:
    assert len(got) == len(want), where
    for g, w in zip(got, want):
        g, w = g.reset_index(drop=True), w.reset_index(drop=True)
        g, w = (from_first(g), from_first(w)) if shifted else (g, w)
        assert list(g.columns) == list(w.columns) and g.shape == w.shape, (where, g.shape, w.shape)
        for col in w.columns:
            if pd.api.types.is_numeric_dtype(w[col]):
                np.testing.assert_allclose(
                    g[col].to_numpy(float),
                    w[col].to_numpy(float),
                    rtol=PAD_TOL,
                    atol=PAD_TOL,
                    equal_nan=True,
                    err_msg=f"{where}: {col}",
                )
            else:
                assert g[col].tolist() == w[col].tolist(), f"{where}: {col}"


@pytest.fixture(autouse=True)
def tokenizers_pad_on_the_right():
    """The hosts' tokenizers pad on the right, as built (what these tests are about); a
    ``padding_side`` another test's host call left on a shared model is undone for these."""
    sides = {host: model_of(host).tokenizer.padding_side for host in HOSTS}
    for host in HOSTS:
        model_of(host).tokenizer.padding_side = "right"
    yield
    for host, side in sides.items():
        model_of(host).tokenizer.padding_side = side


@functools.lru_cache(maxsize=None)
def alone(host: str, name: str) -> list[pd.DataFrame]:
    """Each text run on its own, one pass each."""
    model = model_of(host)
    with torch.no_grad(), ANALYSES[name](model) as collector:
        for text in TEXTS:
            model(text)
    return results(name, collector)


ENTRIES = {
    "call": lambda m, texts: m(texts),
    "run_with_cache": lambda m, texts: m.run_with_cache(texts),
    "to_tokens_inside": lambda m, texts: m(m.to_tokens(texts)),
}


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("name", ANALYSES)
@pytest.mark.parametrize("host", HOSTS)
def test_right_padded_texts_count_what_each_text_counts_alone(host, name, entry):
    model = model_of(host)
    with torch.no_grad(), ANALYSES[name](model) as collector:
        ENTRIES[entry](model, TEXTS)
    assert_close(results(name, collector), alone(host, name), f"{host}/{name}/{entry}")


@pytest.mark.parametrize("name", ANALYSES)
@pytest.mark.parametrize("host", HOSTS)
def test_left_padded_texts_are_exact_with_the_host_mask_or_refused(host, name):
    """A 4.x bridge passes its own mask for left padding: exact. A host that runs left padding
    without a mask (3.x ``HookedTransformer`` with a right-padding tokenizer) made its real
    tokens read the pads: refused by name, nothing collected."""
    model = model_of(host)
    with torch.no_grad(), ANALYSES[name](model) as collector:
        try:
            model(TEXTS, padding_side="left")
        except TLDynamicsError as refusal:
            assert "padded on the left" in str(refusal) and "attention mask" in str(refusal)
            with pytest.raises(TLDynamicsError, match="no forward pass has run"):
                collector.result()
            return
    assert_close(results(name, collector), alone(host, name), f"{host}/{name}/left", shifted=True)


@pytest.mark.parametrize("host", HOSTS)
def test_a_padded_token_tensor_without_a_mask_is_refused_saying_how(host):
    """Token ids made before attach (the texts unknown to it) with pads and no mask: refused,
    naming the runs of pads and how to pass the mask; with the mask, exact."""
    model = model_of(host)
    tokens = model.to_tokens(TEXTS)
    with torch.no_grad(), ANALYSES["odds_ratio"](model) as collector:
        with pytest.raises(TLDynamicsError, match=r"runs of the pad token .* attention_mask"):
            model(tokens)
    mask = torch.ones_like(tokens)
    for row, text in enumerate(TEXTS):
        mask[row, model.to_tokens(text).shape[1] :] = 0
    with torch.no_grad(), ANALYSES["odds_ratio"](model) as collector:
        model(tokens, attention_mask=mask)
    assert_close(results("odds_ratio", collector), alone(host, "odds_ratio"), f"{host}/mask")


def test_one_row_and_unpadded_batches_are_never_refused():
    model = model_of("hf")
    same = model.to_tokens(["ab cd", "ef gh"])
    assert same.shape[0] == 2
    with torch.no_grad(), ANALYSES["trajectories"](model) as collector:
        model(model.to_tokens(TEXTS[1]))
        model(same[:, :3])
    assert collector.result().stats.n_prompts == 3


@pytest.mark.parametrize("host", HOSTS)
def test_stats_of_a_padded_batch_equal_its_prompts_one_at_a_time(host):
    model = model_of(host)
    whole = scale.run_stats(model, TEXTS, batch_size=3, progress=False, model_name="m")
    single = scale.run_stats(model, TEXTS, batch_size=1, progress=False, model_name="m")
    assert whole.odds_ratio is not None and single.odds_ratio is not None
    assert whole.trajectories is not None and single.trajectories is not None
    assert_close(
        [whole.odds_ratio.to_dataframe(), whole.trajectories.to_dataframe()],
        [single.odds_ratio.to_dataframe(), single.trajectories.to_dataframe()],
        f"{host}/stats",
    )


def test_padding_the_model_read_is_refused_by_name():
    """Texts padded on the left without a mask, or any padding in a bidirectional model without
    one: the real tokens attended to the pads, so the pass is refused (``_texts``)."""
    from tl_dynamics.adapter._texts import TextLog, unmasked_batch

    alone = {"ab": torch.tensor([[0, 5, 6]]), "abcd": torch.tensor([[0, 5, 6, 7, 8]])}
    log = TextLog()
    left = torch.tensor([[0, 0, 0, 5, 6], [0, 5, 6, 7, 8]])
    log.record(left, ["ab", "abcd"], lambda text: alone[text])
    with pytest.raises(TLDynamicsError, match=r"padded on the left \(rows \[0\]\)"):
        unmasked_batch(left, log, causal=True, pad_id=0)
    right = torch.tensor([[0, 5, 6, 0, 0], [0, 5, 6, 7, 8]])
    log.record(right, ["ab", "abcd"], lambda text: alone[text])
    with pytest.raises(TLDynamicsError, match="padded, in a bidirectional model"):
        unmasked_batch(right, log, causal=False, pad_id=0)
    batch = unmasked_batch(right, log, causal=True, pad_id=0)
    assert batch.key_valid.tolist() == [[True] * 3 + [False] * 2, [True] * 5]


def test_the_bos_policy_is_recorded_beside_the_first_token():
    """Each prompt records whether it begins with the tokenizer's BOS (prepended to texts by
    the host's policy, or not, for token ids without it), in the result and its table."""
    from tl_dynamics import trajectories
    from tl_dynamics.adapter import ModelAdapter

    model = model_of("hf")
    ad = ModelAdapter(model)
    batch = ad.tokenize(TEXTS)
    assert batch.bos_prepended is True and batch.begins_with_bos(0) == (True,) * 3
    ids = batch.tokens[:2, 1:4]  # no BOS: ids of the texts alone
    with torch.no_grad(), trajectories.attach(model) as collector:
        model(TEXTS[0])
        model(ids)
    traj = collector.result()
    assert traj.bos == (True, False, False)
    frame = traj.to_dataframe()
    assert frame.groupby("prompt")["bos"].first().tolist() == [True, False, False]
