"""The main job: the report command writes one offline page from an explicit registry of
sections; bad models get a clear error; the attention section scales with the prompt."""

import numpy as np
import pytest
import torch

from tl_dynamics import TLDynamicsError, cli, report, testing, viz
from tl_dynamics._heads import HeadSummaries, head_statistics
from tl_dynamics.models import load_model, resolve, shipped_names


def test_report_on_a_tiny_model_has_every_registered_section():
    page = report.build_report(testing.cached_model("llama"), "def f(x):\n    return x\n")
    titles = [section.title for section in page.sections]
    assert titles[0] == "Attention patterns" and len(titles) == 1 + len(report.SECTIONS)
    assert page.failed_sections == [], page.failed_sections
    html = page.to_html()
    assert 'class="tld-view"' in html and "default-src 'none'" in html
    assert '<nav class="toc">' in html and all(
        f'href="#{s}' in html for s in ("attention-patterns",)
    )


def test_registry_is_explicit_and_complete():
    from tl_dynamics import atlas, circuits, contextual_mlp, odds_ratio, particles, regression
    from tl_dynamics import qk_attribution, trajectories
    from tl_dynamics.collect import Analysis

    packages = [atlas, circuits, odds_ratio, qk_attribution, contextual_mlp, regression]
    packages += [trajectories, particles]
    assert [a.name for a in report.SECTIONS] == [p.__name__.split(".")[-1] for p in packages]
    for analysis, pkg in zip(report.SECTIONS, packages):  # "What each head does" first
        assert issubclass(analysis, Analysis)
        assert analysis.report_section is pkg.report_section and analysis.compute is pkg.compute
        assert analysis.attach is getattr(pkg, "attach", None)
        # the registry lives in report.py: no package face exports its entry class
        assert analysis.__module__ == "tl_dynamics.report" and not any(
            name.endswith("Analysis") for name in pkg.__all__
        )


def section(name, fn):
    """A registry entry for a report section function."""
    from tl_dynamics.collect import Analysis

    return type(
        name,
        (Analysis,),
        {"name": name, "compute": staticmethod(fn), "report_section": staticmethod(fn)},
    )


def test_not_applicable_sections_get_one_message_and_bugs_are_reported():
    def not_here(page, adapter, batch):
        raise TLDynamicsError("needs rotary embeddings")

    def broken(page, adapter, batch):
        raise ValueError("boom")

    page = report.build_report(
        testing.cached_model("gpt2"),
        "x = 1",
        sections=(section("needs_rotary", not_here), section("broken", broken)),
    )
    html = page.to_html()
    assert "Not shown for this model: needs rotary embeddings" in html
    assert page.failed_sections == ["broken"] and "This section failed: ValueError: boom" in html


def test_a_bug_inside_a_collector_is_a_failure_not_a_refusal():
    """An exception raised by a collector's own code, inside a hook during the forward pass,
    reaches the report as itself: the section reads "failed", never "Not shown"."""
    from tl_dynamics.collect import Collector

    class Buggy(Collector):
        layers = (1,)

        def on_layer(self, state):
            return state.attention.q.shape[0] / 0  # a planted bug

    def attached(page, adapter, batch):
        with adapter.collecting(Buggy()):
            adapter.forward(batch)

    model = testing.cached_model("gpt2")
    before = {name: len(point.fwd_hooks) for name, point in model.hook_dict.items()}
    page = report.build_report(model, "x = 1", sections=(section("buggy", attached),))
    html = page.to_html()
    assert page.failed_sections == ["buggy"] and "This section failed: ZeroDivisionError" in html
    assert "Not shown for this model" not in html
    assert {name: len(point.fwd_hooks) for name, point in model.hook_dict.items()} == before


def test_head_statistics_on_planted_patterns():
    n = 6
    allowed = torch.tril(torch.ones(n, n, dtype=torch.bool))
    previous = torch.zeros(n, n)
    previous[0, 0] = 1
    previous[torch.arange(1, n), torch.arange(n - 1)] = 1
    uniform = allowed.float() / allowed.sum(-1, keepdim=True)
    tokens = torch.tensor([7, 8, 9, 7, 8, 9])
    induction = torch.zeros(n, n)
    induction[:3, 0] = 1
    induction[3, 1], induction[4, 2], induction[5, 3] = 1, 1, 1  # x[j-1] == x[i]
    stats = head_statistics(torch.stack([previous, uniform, induction]), allowed, tokens)
    assert stats["previous_token"][0] == 1 and stats["entropy"][0] == 0
    assert np.isclose(stats["entropy"][1], 1) and np.isclose(
        stats["first_token"][1], np.mean(1 / np.arange(1, n + 1))
    )
    assert stats["induction"][2] == 1 and stats["induction"][0] == 0
    no_repeats = head_statistics(uniform[None], allowed, torch.arange(n))
    assert np.isnan(no_repeats["induction"][0])


def test_full_patterns_stay_within_budget_and_keep_asked_heads(monkeypatch):
    from tl_dynamics import _heads

    monkeypatch.setattr(_heads, "FULL_DETAIL_CELLS", 3 * 16 * 16)
    summary = HeadSummaries(n_heads=4, n_pos=16, forced={(1, 2)})
    allowed = torch.tril(torch.ones(16, 16, dtype=torch.bool))
    gen = torch.Generator().manual_seed(0)
    for layer in range(3):
        scores = torch.randn(4, 16, 16, generator=gen) * (1 + 3 * layer)
        pattern = scores.masked_fill(~allowed, -torch.inf).softmax(-1)
        summary.add_layer(layer, pattern, allowed, torch.arange(16))
    full = summary.full_patterns()
    assert (1, 2) in full and len(full) <= 3
    assert len(summary.thumbs) == 12 and summary.matrix("entropy").shape == (3, 4)


def test_attention_section_thumbnails_every_head_and_focuses_on_request():
    model = testing.cached_model("gpt2")
    page = viz.Page("t")
    from tl_dynamics.adapter import ModelAdapter

    adapter = ModelAdapter(model)
    report.attention_section(
        page, adapter, adapter.tokenize("x = 1\ny = x + x\n"), layers=[1], heads=[(1, 3)]
    )
    grid = [c for c in page.sections[0].items if getattr(c, "name", None) == "AttentionGrid"][0]
    assert grid.props["attentionHeadNames"] == [f"L1H{h}" for h in range(adapter.n_heads)]
    assert 3 in grid.props["full"]
    with pytest.raises(TLDynamicsError, match="layer"):
        report.attention_section(page, adapter, adapter.tokenize("x"), heads=[(9, 0)])
    with pytest.raises(
        TLDynamicsError, match=r"heads \['L0H1'\] are in layers not shown \(layers \[1\]\)"
    ):
        report.attention_section(page, adapter, adapter.tokenize("x"), layers=[1], heads=[(0, 1)])


def test_cli_report_with_the_default_model(tmp_path, capsys):
    out = tmp_path / "report.html"
    assert cli.main(["report", "--out", str(out), "--prompt", "import os\nos.getcwd()"]) == 0
    text = out.read_text()
    assert "code-2l" in text
    assert "wrote" in capsys.readouterr().out


def test_cli_unknown_model_names_what_is_valid(tmp_path, capsys):
    code = cli.main(
        ["report", "--model", "./no/such/folder.bin", "--out", str(tmp_path / "r.html")]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "no such folder" in err and "shipped model" in err


def test_tiny_random_models_are_labelled_as_such():
    assert "RANDOMLY INITIALISED llama" in resolve("tiny-random:llama").label
    assert "code-2l" in shipped_names()


def test_hub_ids_with_dots_go_to_the_hub_not_the_file_system(monkeypatch):
    from tl_dynamics import models

    asked = []
    monkeypatch.setattr(
        models, "_load_hub", lambda name, where: asked.append((name, where)) or object()
    )
    load_model("Qwen/Qwen2.5-0.5B", device="cpu", dtype="float16")
    assert asked == [
        ("Qwen/Qwen2.5-0.5B", models.devices.Placement(torch.device("cpu"), torch.float16))
    ]
    with pytest.raises(TLDynamicsError, match="no such folder"):
        load_model("./models/Qwen2.5-0.5B")


def test_public_loader_is_the_package_attribute():
    import tl_dynamics

    assert tl_dynamics.load_model is load_model


def _attention_sentence(model, tokens):
    from tl_dynamics.adapter import ModelAdapter

    adapter = ModelAdapter(model)
    page = viz.Page("t")
    report.attention_section(page, adapter, adapter.tokenize(tokens))
    import html

    return " ".join(
        html.unescape(c.html)
        for c in page.sections[0].items
        if isinstance(c, viz.Component) and c.name is None and c.html
    )


def test_attention_headline_names_a_head_only_where_it_does_the_thing():
    """Planted structure: induction-2l's previous-token head L0H0 (card: 0.98) is named on a
    repeated random sequence; an untrained model of the same shape names no previous-token head
    (its heads spread attention), and the sentence says so instead of naming a 'top' head."""
    from tl_dynamics import zoo

    gen = torch.Generator().manual_seed(0)
    half = torch.randint(3, 40, (24,), generator=gen)
    tokens = torch.cat([half, half])[None]
    trained = _attention_sentence(zoo.load("induction-2l"), tokens)
    assert "At least half of a head's attention: previous token L0H0" in trained, trained
    assert "induction L1H" in trained, trained
    untrained = _attention_sentence(testing.tiny_model("gpt2"), tokens)
    assert "No head reaches half for: previous token" in untrained, untrained
    assert "previous token L" not in untrained.split("No head")[0], untrained
