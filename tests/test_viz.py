"""Views: escaping, embedded JSON, and page structure (no browser needed)."""

import base64
import json
import zlib

import numpy as np
import pytest

from tl_dynamics import TLDynamicsError, viz
from tl_dynamics.viz._component import props_json

HOSTILE = ["<img src=x onerror=alert(1)>", "</script><script>alert(2)</script>", "<BOS>", "a & b"]


def test_html_inserted_tokens_are_escaped():
    component = viz.colored_tokens(HOSTILE, [0.0, 1.0, 2.0, 3.0])
    assert component.props["tokens"] == [
        "&lt;img src=x onerror=alert(1)&gt;",
        "&lt;/script&gt;&lt;script&gt;alert(2)&lt;/script&gt;",
        "&lt;BOS&gt;",
        "a &amp; b",
    ]
    for build in (
        lambda: viz.text_neuron_activations(HOSTILE, np.zeros((4, 1, 2))),
        lambda: viz.colored_tokens_multi(HOSTILE, np.zeros((4, 2)), ["x", "y"]),
    ):
        assert "<BOS>" not in build().props["tokens"]
    topk = viz.topk_tokens([HOSTILE], [np.zeros((1, 4, 2))])
    assert "<BOS>" not in topk.props["tokens"][0]


def test_canvas_drawn_tokens_are_left_as_text():
    component = viz.attention_heads(np.zeros((1, 4, 4)), HOSTILE)
    assert component.props["tokens"] == HOSTILE  # drawn on a canvas: never parsed as HTML


def test_embedded_json_cannot_close_the_script():
    text = props_json({"tokens": HOSTILE, "x": float("nan")})
    assert "<" not in text  # every "<" is written \u003c: no "</script" or "<!--" can appear
    assert json.loads(text)["tokens"] == HOSTILE
    assert json.loads(text)["x"] is None


def test_page_has_bundle_once_runtime_once_and_a_no_network_policy(tmp_path):
    page = viz.Page("t <x>")
    page.add_section("s", [viz.colored_tokens(["a"], [1.0]), viz.colored_tokens(["b"], [1.0])])
    html = page.write(tmp_path / "p.html").read_text()
    assert html.count("var CircuitsVis=") == 1  # bundle inlined exactly once
    assert html.count("window.TLD = {}") == 1 and html.count("TLD.start()") == 1
    assert html.count('class="tld-view"') == 2  # drawn lazily by the runtime, not inline
    assert "default-src 'none'" in html and "<title>t &lt;x&gt;</title>" in html


def test_a_page_without_circuitsvis_views_does_not_carry_the_bundle(tmp_path):
    page = viz.Page("maps")
    page.add_section("s", [viz.heatmap(np.eye(3)), viz.attention_pattern(["a", "b"], np.eye(2))])
    assert "var CircuitsVis=" not in page.to_html()


def test_large_arrays_travel_compactly_and_decode_exactly():
    rng = np.random.default_rng(0)
    values = rng.normal(size=(40, 3, 7)).astype(np.float32)
    spec = json.loads(
        props_json(
            viz.text_neuron_activations([f"t{i}" for i in range(40)], values).fragment_spec()
        )
    )
    packed = spec["props"]["activations"]
    assert packed["enc"] == "f32" and packed["shape"] == [40, 3, 7]
    raw = zlib.decompress(base64.b64decode(packed["z"]))
    assert np.array_equal(np.frombuffer(raw, "<f4").reshape(40, 3, 7), values)


def test_attention_is_quantised_to_bytes_with_a_sqrt_scale():
    pattern = np.tril(np.ones((100, 100))) / np.arange(1, 101)[:, None]
    spec = json.loads(
        props_json(viz.attention_pattern([str(i) for i in range(100)], pattern).fragment_spec())
    )
    full = spec["full"]["0"]
    codes = np.frombuffer(zlib.decompress(base64.b64decode(full["z"])), np.uint8).reshape(100, 100)
    decoded = full["lo"] + (full["hi"] - full["lo"]) * (codes / 254.0) ** 2
    assert full["scale"] == "sqrt" and np.abs(decoded - pattern).max() < 1 / 254 * 2
    assert spec["thumbs"]["shape"] == [1, 48, 48]  # max-pooled thumbnail


def test_whitespace_tokens_get_visible_labels():
    assert viz.visible_token("\n") == "\u23ce" and viz.visible_token("  ") == "\u00b7\u00b7"
    assert viz.visible_token(" the") == " the"
    assert viz.colored_tokens(["\n", "\t"], [0.0, 1.0]).props["tokens"] == ["\u23ce", "\u21e5"]
    html = viz.table(__import__("pandas").DataFrame({"token": ["\n", "    ", "x"]})).html
    assert "\u23ce" in html and "\u00b7\u00b7\u00b7\u00b7" in html


def test_heatmap_checks_its_labels_and_colour_map():
    with pytest.raises(TLDynamicsError, match="heatmap: 1 row labels for 2 rows"):
        viz.heatmap(np.zeros((2, 2)), row_labels=["a"])
    with pytest.raises(TLDynamicsError, match="cmap 'jet'; valid"):
        viz.heatmap(np.zeros((2, 2)), cmap="jet")


def test_shape_errors_name_both_sides():
    with pytest.raises(TLDynamicsError, match="colored_tokens: 2 tokens but the values cover 3"):
        viz.colored_tokens(["a", "b"], [1, 2, 3])
    with pytest.raises(
        TLDynamicsError, match=r"attention must have 3 dimensions, got shape \(2, 2\)"
    ):
        viz.attention_heads(np.zeros((2, 2)), ["a", "b"])


def test_coloured_tokens_say_what_their_colours_mean():
    spec = viz.colored_tokens(["a", "b", "c"], [-0.5, 0.0, 2.0]).fragment_spec()
    assert spec["note"].startswith("Colour: blue for positive values, red for negative")
    assert "from -0.5 to 2" in spec["note"]


def test_svg_plots_escape_names_and_place_every_finite_point():
    """Line plots are inline SVG: hostile series names and x labels stay text, every finite
    value is a point with its exact value on hover, a NaN breaks the line instead of drawing
    it, and the y range written beside the panel is the data's."""
    import re

    labels = [HOSTILE[0], "p1", "p2", "p3"]
    plot = viz.line_plot(
        labels, {HOSTILE[1]: [0.5, 1.5, float("nan"), 2.5], "b": [1, 2, 3, 4]}, title=HOSTILE[2]
    )
    html = plot.html
    for bad in HOSTILE[:3]:
        assert bad not in html
    assert "&lt;img src=x onerror=alert(1)&gt;" in html and "<script" not in html
    points = re.findall(r"<circle [^>]*><title>([^<]*)</title>", html)
    assert len(points) == 7 and any(p.endswith("at p3: 2.5") for p in points)
    assert html.count("<polyline") == 2  # series one: p0-p1, then p3 alone (a dot) after the NaN
    grid = viz.small_multiples(["a", "b"], {"norm": [1.0, 3.0], "rank": [-2.0, 5.0]}, columns=1)
    ticks = re.findall(r'text-anchor="end" style="[^"]*">([^<]*)</text>', grid.html)
    assert ticks == ["1", "3", "-2", "5"]  # each panel shows its own range


def test_svg_plots_refuse_mismatched_series():
    with pytest.raises(TLDynamicsError, match=r"series 'x' has shape \(3,\); expected \(2,\)"):
        viz.line_plot(["a", "b"], {"x": [1, 2, 3]})
    with pytest.raises(TLDynamicsError, match="columns must be at least 1"):
        viz.small_multiples(["a"], {"x": [1]}, columns=0)
    with pytest.raises(TLDynamicsError, match="at least one x label"):
        viz.line_plot([], {"x": []})


def test_ordered_series_run_along_one_colour_scale():
    """Depth-ordered series get one sequential scale (first dark, last yellow, all distinct),
    not a palette that repeats after ten."""
    import re

    plot = viz.line_plot(["a", "b"], {f"p{i}": [i, i + 1] for i in range(13)}, ordered=True)
    colours = re.findall(r'<polyline [^>]*stroke="(#[0-9a-f]{6})"', plot.html)
    assert len(colours) == 13 == len(set(colours))
    assert colours[0] == "#440154" and colours[-1] == "#fde725"
    cycled = re.findall(
        r'<polyline [^>]*stroke="(#[0-9a-f]{6})"',
        viz.line_plot(["a", "b"], {f"p{i}": [i, i] for i in range(13)}).html,
    )
    assert cycled[0] == cycled[10]  # the categorical palette repeats
