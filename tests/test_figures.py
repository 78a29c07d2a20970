"""Figures for papers: every view saves as .html, heat maps / attention maps / line plots as .svg
with the page's labels, legend and colours, and as .png (headless Debian chromium, marked
``browser``); ``tl-dynamics report --figures DIR`` writes every figure of the page."""

import os
import re
import shutil
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from tl_dynamics import TLDynamicsError, cli, viz
from tl_dynamics.viz import _export, _svg

SVG = "{http://www.w3.org/2000/svg}"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
browser = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="Debian chromium not installed")


def texts(path):
    """Every text of an SVG file (which must parse as XML)."""
    root = ET.parse(path).getroot()
    assert root.tag == f"{SVG}svg"
    return [t.text or "" for t in root.iter(f"{SVG}text")]


def heat():
    return viz.heatmap(
        np.arange(12.0).reshape(3, 4) - 5,
        ["L0", "L1", "L2"],
        ["H0", "H1", "H2", "H3"],
        title="demo <map>",
        row_title="layer",
        col_title="head",
        value_name="score",
        caption="what the map shows",
    )


def test_heatmap_svg_carries_title_labels_legend_caption_and_the_page_colours(tmp_path):
    path = heat().save(tmp_path / "map.svg")
    words = texts(path)
    for label in (
        "demo <map>",
        "L0",
        "L2",
        "H3",
        "layer down, head across",
        "-5",
        "6",
        "what the map shows",
    ):
        assert label in words, label
    assert any(w.startswith("score; grey: masked") for w in words)
    root = ET.parse(path).getroot()
    cells = [
        r
        for r in root.iter(f"{SVG}rect")
        if r.get("width") == r.get("height")
        and r.get("fill", "").startswith("#")
        and r.get("width") != "100%"
    ]
    assert len(cells) == 12
    # signed values: the diverging map centred on 0, its ends at -6 and +6 (|max| = 6)
    fills = [c.get("fill") for c in cells]
    expected = _svg.colours(np.arange(12.0) - 5, -5.0, 6.0, "linear", "rdbu")
    assert fills == ["#" + "".join(f"{v:02x}" for v in rgb) for rgb in expected]
    assert fills[11] == "#2166ac" and fills[5] == "#f7f7f7"  # +6: the end; 0: white


def test_colours_match_the_page_runtime_stops():
    assert _svg.colours([0.0, 0.5, 1.0], 0.0, 1.0, "linear", "blues").tolist() == [
        [247, 251, 255],
        [107, 174, 214],
        [8, 48, 107],
    ]
    assert _svg.colours([np.nan], 0.0, 1.0, "sqrt", "blues").tolist() == [[226, 226, 226]]


def test_attention_and_line_plot_svgs_parse_and_name_what_they_show(tmp_path):
    att = np.tril(np.ones((2, 5, 5))) / np.arange(1, 6)[:, None]
    words = texts(
        viz.attention_heads(att, list("abcde"), ["h0", "h1"], mask_upper_tri=True).save(
            tmp_path / "heads.svg"
        )
    )
    assert {"h0", "h1", "a", "e", "destination (query) down, source (key) across"} <= set(words)
    assert any("attention weight (colour spaced by square root)" in w for w in words)
    grid = viz.attention_grid(
        att, {1: att[1]}, list("abcde"), ["L0H0", "L0H1"], columns=2, row_names=["L0"], selected=1
    )
    assert {"L0H0", "L0H1", "L0"} <= set(texts(grid.save(tmp_path / "grid.svg")))
    plot = viz.line_plot(["p0", "p1"], {"norm": [1.0, 2.0]}, title="growth", caption="c <1>")
    assert {"growth", "norm", "p0", "c <1>"} <= set(texts(plot.save(tmp_path / "plot.svg")))
    both = viz.group(heat(), plot, caption="together")
    assert {"demo <map>", "growth", "together"} <= set(texts(both.save(tmp_path / "both.svg")))


def test_large_maps_embed_their_cells_as_one_image(tmp_path):
    big = viz.heatmap(np.random.default_rng(0).random((100, 100)), title="big")
    root = ET.parse(big.save(tmp_path / "big.svg")).getroot()
    assert len(list(root.iter(f"{SVG}image"))) == 1 and len(list(root.iter(f"{SVG}rect"))) < 10


def test_unsupported_formats_are_refused_naming_what_is_supported(tmp_path):
    tokens = viz.colored_tokens(["a", "b"], [0.0, 1.0])
    with pytest.raises(
        TLDynamicsError,
        match=r"this view is a colored_tokens: \.svg is written "
        r"for heatmap, attention_pattern, attention_heads, "
        r"attention_grid, line_plot, small_multiples",
    ):
        tokens.save(tmp_path / "t.svg")
    with pytest.raises(
        TLDynamicsError,
        match=r"cannot save a view as 'x\.pdf': give a file "
        r"ending in \.html, \.svg, \.png",
    ):
        heat().save(tmp_path / "x.pdf")
    with pytest.raises(TLDynamicsError, match="this view is a group"):
        viz.group(heat(), tokens).save(tmp_path / "g.svg")
    assert not list(tmp_path.iterdir())  # refused before anything was written


def test_html_is_a_standalone_offline_page(tmp_path):
    page = viz.colored_tokens(["<BOS>", "b"], [0.0, 1.0], caption="tokens").save(
        tmp_path / "t.html"
    )
    text = page.read_text()
    assert "default-src 'none'" in text and "var CircuitsVis=" in text  # bundle inlined
    assert "<title>tokens</title>" in text and "&lt;BOS&gt;" in text
    assert not re.search(r"""(src|href)=["']https?:""", text)


def test_figure_names_follow_the_page_order_and_leave_text_out():
    page = viz.Page("p")
    page.add_section(
        "Attention patterns",
        [
            viz.group(heat(), viz.text("words")),
            viz.line_plot(["a"], {"s": [1.0]}, title="Depth <1>"),
        ],
    )
    page.add_section("Second", [viz.text("only words")])
    assert [stem for stem, _ in _export.figures(page.sections)] == [
        "01-attention-patterns_01-heatmap-demo-map",
        "01-attention-patterns_02-line-plot-depth-1",
    ]


def test_figures_folder_is_checked_before_the_model_loads(tmp_path, capsys, monkeypatch):
    from tl_dynamics import models

    monkeypatch.setattr(models, "resolve", lambda name=None: pytest.fail("model loaded"))
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    code = cli.main(["report", "--out", str(tmp_path / "r.html"), "--figures", str(a_file)])
    err = capsys.readouterr().err
    assert (
        code == 2 and f"--figures {str(a_file)!r}: give a folder for the PNG and SVG files" in err
    )


def blank(png):
    """Whether a PNG is (nearly) one colour: fewer than 1% of its pixels differ from the corner."""
    from PIL import Image

    image = np.asarray(Image.open(png).convert("RGB")).astype(int)
    differs = np.abs(image - image[0, 0]).sum(axis=-1) > 30
    return differs.mean() < 0.01 or len(np.unique(image.reshape(-1, 3), axis=0)) < 4


def mpl_figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([0, 1], [1, 0])
    return viz.figure(fig, caption="a line")


def test_a_matplotlib_figure_is_written_from_its_own_png_without_a_browser(tmp_path, monkeypatch):
    monkeypatch.setattr(_export, "Renderer", lambda: pytest.fail("a browser was started"))
    path = mpl_figure().save(tmp_path / "f.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not blank(path)


@pytest.mark.browser
@browser
def test_png_of_every_kind_of_view_is_drawn(tmp_path):
    pytest.importorskip("playwright.sync_api")
    from PIL import Image

    views = {
        "heat": heat(),
        "tokens": viz.colored_tokens(["a", "b"], [0.0, 1.0]),
        "heads": viz.attention_pattern(list("abc"), np.tril(np.ones((3, 3))) / 3),
        "plot": viz.line_plot(["a", "b"], {"s": [0.0, 1.0]}),
        "table": viz.table(__import__("pandas").DataFrame({"x": [1.5, 2.5]})),
        "text": viz.text("a paragraph"),
        "figure": mpl_figure(),
        "group": viz.group(viz.colored_tokens(["a"], [1.0]), heat(), row=True),
    }
    with _export.Renderer() as renderer:
        for name, view in views.items():
            path = _export.save(view, tmp_path / f"{name}.png", renderer)
            assert not blank(path), name
    image = np.asarray(Image.open(tmp_path / "heat.png").convert("RGB")).reshape(-1, 3)
    assert ((image == [33, 102, 172]).all(axis=1)).sum() > 100  # the +6 cell, at 2x


@pytest.mark.browser
@browser
def test_report_figures_writes_png_and_svg_for_every_figure(tmp_path, capsys):
    pytest.importorskip("playwright.sync_api")
    out = tmp_path / "figures"
    code = cli.main(
        [
            "report",
            "--model",
            "tiny-random:gpt2",
            "--out",
            str(tmp_path / "r.html"),
            "--sections",
            "trajectories",
            "--threads",
            "1",
            "--figures",
            str(out),
        ]
    )
    assert code == 0, capsys.readouterr().err
    pngs, svgs = sorted(out.glob("*.png")), sorted(out.glob("*.svg"))
    stems = [p.stem for p in pngs]
    assert "01-attention-patterns_01-heatmap-previous-token" in stems
    assert any("attention-grid" in s for s in stems) and any("line-plot" in s for s in stems)
    assert {p.stem for p in svgs} == {
        s for s in stems if re.search(r"heatmap|attention|line-plot|small-multiples", s)
    }
    assert [p for p in pngs if blank(p)] == []
    words = texts(out / "01-attention-patterns_01-heatmap-previous-token.svg")
    assert {"previous token", "L0", "L1", "H0", "layer down, head across"} <= set(words)


def test_docstring_examples_run():
    import doctest

    from tl_dynamics.viz import _component

    for module in (_svg, _component):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__
