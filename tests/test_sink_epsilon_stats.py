"""Sink^eps (Gu et al. 2025) over a corpus: the statistics file keeps each prompt's first-key
alpha exactly (a sum and a count over prompts, per head), the dataset page reports it beside the
sink maps and names whether a BOS token was prepended, and a file of format version 1 (written
before it) still loads and says so (docs/math.md §2.3, docs/stats-format.md)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tl_dynamics import cli, odds_ratio, scale, testing
from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.scale import _format

# Lengths from 2 to 13 tokens (BOS included), so the heads' first-key alpha spreads around eps.
PROMPTS = [
    "a",
    "x = 1",
    "def f(x): return x",
    "import os",
    "for i in range(10): print(i * i)",
    "b = a + a",
]
EPS = odds_ratio.HeadStats.SINK_EPSILON


@pytest.fixture(scope="module")
def model():
    return testing.cached_model("gpt2")


def hand_alpha(model, text: str) -> np.ndarray:
    """``[layer, head]`` alpha of the first key of ``text`` run alone, from the model's own
    pattern (its hook, read through the adapter), in float64: a causal head's every query
    sees the first key, so alpha is the mean of the pattern's first column."""
    ad = ModelAdapter.of(model)
    seen: dict[int, np.ndarray] = {}

    def keep(layer):
        return lambda t: seen.__setitem__(layer, t.detach().double().numpy()[0])

    with ad.hooks([("pattern", layer, keep(layer)) for layer in range(ad.n_layers)]):
        ad.forward(ad.tokenize(text))
    out = []
    for layer in range(ad.n_layers):
        p = seen[layer]  # [head, query, key]
        n = p.shape[-1]
        out.append([sum(p[h, i, 0] for i in range(n)) / n for h in range(p.shape[0])])
    return np.array(out)


def run(model, prompts, **kw):
    kw.setdefault("batch_size", 2)
    return scale.run_stats(
        model, prompts, analyses=["odds_ratio"], progress=False, model_name="tiny", **kw
    )


@pytest.fixture(scope="module")
def alphas(model):
    return np.stack([hand_alpha(model, text) for text in PROMPTS])  # [prompt, layer, head]


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_corpus_sink_epsilon_matches_a_hand_computation(model, alphas, padding_side, tmp_path):
    # the prompts are padded two by two: the alphas must be each prompt's own, masks honoured
    assert np.abs(alphas - EPS).min() > 1e-3, "a prompt's alpha sits on eps: ill-posed"
    over = alphas > EPS
    assert 0 < over.mean() < 1  # some heads of some prompts above eps, some below
    gu = over.reshape(len(PROMPTS), -1).mean(1).mean()  # per prompt over heads, then averaged
    path = tmp_path / "s.safetensors"
    stats = run(model, PROMPTS, out=path, padding_side=padding_side)
    for got in (stats, scale.load_stats(path)):
        se = got.odds_ratio.sink_epsilon()
        assert se["epsilon"] == EPS
        np.testing.assert_allclose(se["alpha"], alphas.mean(0), rtol=0, atol=1e-6)
        np.testing.assert_array_equal(se["share"], over.mean(0))
        assert se["sink_epsilon"] == pytest.approx(gu, abs=1e-12)
        assert se["of_mean_alpha"] == pytest.approx((alphas.mean(0) > EPS).mean(), abs=1e-12)
        frame = got.odds_ratio.to_dataframe()
        np.testing.assert_allclose(
            frame["sink_alpha"].to_numpy(), alphas.mean(0).ravel(), rtol=0, atol=1e-6
        )
        np.testing.assert_array_equal(frame["sink_alpha_share"].to_numpy(), over.mean(0).ravel())
    html = scale.stats_page(stats).to_html()
    assert f"Sink^eps of the first key (Gu et al. 2025, eps = 0.3): {gu:.3f}." in html
    assert f"{(alphas.mean(0) > EPS).mean():.3f} of the heads exceed 0.3" in html
    assert '"title": "first-key alpha"' in html and '"title": "alpha > 0.3"' in html


def test_per_prompt_alpha_is_the_report_sections(model, alphas):
    """The per-prompt facts (``sink_table``) and the report's attention section agree with the
    hand computation prompt by prompt, not only on average."""
    from tl_dynamics._heads import head_statistics

    ad = ModelAdapter.of(model)
    res = odds_ratio.compute(ad, PROMPTS, padding_side="left")
    table = res.sink_table()
    for b, text in enumerate(PROMPTS):
        rows = table[table["prompt"] == b].sort_values(["layer", "head_name"])
        np.testing.assert_allclose(rows["sink_alpha"], alphas[b].ravel(), rtol=0, atol=1e-6)
        batch = ad.tokenize(text)
        for layer, la in ad.attention(batch).items():
            got = head_statistics(la.pattern()[0], la.allowed[0], batch.tokens[0])["sink_alpha"]
            np.testing.assert_allclose(got, alphas[b, layer], rtol=0, atol=1e-6)


def test_halves_merge_to_one_run(model, tmp_path):
    whole = run(model, PROMPTS)
    first, second = run(model, PROMPTS[:2]), run(model, PROMPTS[2:])
    merged = scale.merge_stats(second, first)
    assert _format.to_bytes(merged) == _format.to_bytes(whole)
    a, b = merged.odds_ratio.sink_epsilon(), whole.odds_ratio.sink_epsilon()
    assert a["sink_epsilon"] == b["sink_epsilon"] and (a["alpha"] == b["alpha"]).all()
    assert merged.bos_prompts == whole.bos_prompts == len(PROMPTS)


def test_the_page_names_whether_a_bos_token_was_prepended(model):
    bare = testing.tiny_model("gpt2")  # a model of its own: its setting changes below
    tokenizer = ModelAdapter.of(bare).tokenizer
    assert tokenizer.bos_token_id is not None
    with_bos = run(model, PROMPTS[:3])
    assert with_bos.bos_prompts == 3
    assert "prepended by the tokenizer, in all 3 prompts" in scale.stats_page(with_bos).to_html()
    bare.cfg.default_prepend_bos = False
    without = run(bare, PROMPTS[:3])
    assert without.bos_prompts == 0
    ad = ModelAdapter.of(bare)
    assert int(ad.tokenize(PROMPTS[1]).tokens[0, 0]) != tokenizer.bos_token_id
    assert "No BOS token was prepended" in scale.stats_page(without).to_html()


def _as_version_1(stats):
    """The statistics as a file of format version 1 wrote them: no BOS count, the five sink
    sums of then (the first key's alpha dropped from the exact sums)."""
    h = stats.odds_ratio
    old = odds_ratio.HeadStats.from_exact(
        h.model,
        h.layers,
        h.heads,
        h.scale,
        h.softcap,
        h.n_prompts,
        h.exact[:, : len(h.sum_keys) + 5],
        h.sum_keys,
        h.sink_keys[:5],
    )
    return _format.DatasetStats(
        stats.model, stats.settings, stats.n_prompts, stats.prompts_hash, old, None, {}
    )


def test_a_version_1_file_loads_and_the_page_says_sink_epsilon_is_not_in_it(
    model, tmp_path, capsys
):
    new = run(model, PROMPTS)
    path = tmp_path / "old.safetensors"
    data = _format.to_bytes(_as_version_1(new))
    path.write_bytes(data)
    header = json.loads(
        json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"][
            "tl_dynamics_stats"
        ]
    )
    assert header["version"] == 1 and "bos_prompts" not in header
    assert not {"sink_keys", "sink_epsilon"} & set(header["odds_ratio"])
    old = scale.load_stats(path)
    assert old.version == 1 and old.bos_prompts is None
    assert old.odds_ratio.sink_epsilon() is None
    assert old.odds_ratio.to_dataframe()["sink_alpha"].isna().all()
    for key in ("sink_mass", "sink_first"):  # the rest is as it was
        assert (old.odds_ratio.sink_sums[key] == new.odds_ratio.sink_sums[key]).all()
    assert _format.to_bytes(old) == data  # read and written back unchanged
    page = tmp_path / "old.html"
    assert cli.main(["report", "--stats", str(path), "--out", str(page)]) == 0
    html = page.read_text()
    assert "is not available in this file: it is of format version 1" in html
    assert "not recorded (format version 1)" in html
    with pytest.raises(TLDynamicsError, match="format versions 1 and 3: version 1 files predate"):
        scale.merge_stats(path, run(model, ["z = 2"]))


def test_a_header_that_mixes_the_versions_is_refused(model):
    """A version 1 header carrying version 2's fields, or a version 2 one with a bad eps or
    BOS count, is refused by name, not half-read."""
    from tl_dynamics.scale import _validate

    data = _format.to_bytes(run(model, PROMPTS[:2]))
    meta = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]
    fields = json.loads(meta["tl_dynamics_stats"])
    _validate.check_header(fields, "x")  # as written: version 3
    fields["version"] = 1
    with pytest.raises(TLDynamicsError, match=r"unknown \['batches_hash', 'bos_prompts', "):
        _validate.check_header(fields, "x")
    fields["version"] = 3
    fields["odds_ratio"]["sink_epsilon"] = 1.5
    with pytest.raises(TLDynamicsError, match=r"sink_epsilon must lie in \[0, 1\)"):
        _validate.check_header(fields, "x")
    fields["odds_ratio"]["sink_epsilon"] = EPS
    fields["bos_prompts"] = 3  # more than its 2 prompts
    with pytest.raises(TLDynamicsError, match="bos_prompts must be an integer in 0..2"):
        _validate.check_header(fields, "x")


def test_alpha_with_learned_sinks_is_the_weight_left_on_the_first_key():
    """GPT-OSS: a learned sink absorbs part of every row, the single-key rows included; alpha is
    the weight the pattern leaves on the first key, against a float64 softmax over the allowed
    keys and the virtual one (left padding: the first key is each prompt's first real token)."""
    from test_architectures import boot_tiny

    ad = ModelAdapter(boot_tiny("GptOssForCausalLM"))
    prompts = list(testing.PROMPTS)
    facts = odds_ratio.compute(ad, prompts, padding_side="left").sinks[0]
    for layer, la in ad.attention(prompts, padding_side="left", sinks=True).items():
        column = la.sink_logit.double()[None, :, None, None].expand(*la.scores().shape[:-1], 1)
        logits = la.scores().double().masked_fill(~la.allowed[:, None], float("-inf"))
        p = torch.softmax(torch.cat([logits, column], -1), -1)[..., :-1]  # [b, h, q, k]
        for b in range(len(prompts)):
            f = int(la.allowed[b].any(0).nonzero()[0])
            rows = [i for i in range(p.shape[2]) if la.query_valid[b, i] and la.allowed[b, i, f]]
            want = p[b][:, rows, f].mean(-1)
            assert float(p[b][:, f, f].max()) < 1.0  # the sink took part of the first row
            got = facts[layer]["sink_alpha"][b].double()
            assert torch.allclose(got, want, atol=1e-5), (layer, b, got, want)
