"""Views: escaping, embedded JSON, and page structure (no browser needed)."""

import json

import numpy as np
import pytest

from tl_dynamics import TLDynamicsError, viz
from tl_dynamics.viz._component import props_json

HOSTILE = ["<img src=x onerror=alert(1)>", "</script><script>alert(2)</script>", "<BOS>", "a & b"]


def test_html_inserted_tokens_are_escaped():
    component = viz.colored_tokens(HOSTILE, [0.0, 1.0, 2.0, 3.0])
    assert component.props["tokens"] == ["&lt;img src=x onerror=alert(1)&gt;",
                                         "&lt;/script&gt;&lt;script&gt;alert(2)&lt;/script&gt;",
                                         "&lt;BOS&gt;", "a &amp; b"]
    for build in (lambda: viz.text_neuron_activations(HOSTILE, np.zeros((4, 1, 2))),
                  lambda: viz.colored_tokens_multi(HOSTILE, np.zeros((4, 2)), ["x", "y"])):
        assert "<BOS>" not in build().props["tokens"]
    topk = viz.topk_tokens([HOSTILE], [np.zeros((1, 4, 2))])
    assert "<BOS>" not in topk.props["tokens"][0]


def test_canvas_drawn_tokens_are_left_as_text():
    component = viz.attention_heads(np.zeros((1, 4, 4)), HOSTILE)
    assert component.props["tokens"] == HOSTILE  # drawn on a canvas: never parsed as HTML


def test_embedded_json_cannot_close_the_script():
    text = props_json({"tokens": HOSTILE, "x": float("nan")})
    assert "</" not in text and "<!--" not in text
    assert json.loads(text.replace("<\\/", "</").replace("<\\!--", "<!--"))["tokens"] == HOSTILE
    assert json.loads(text.replace("<\\/", "</"))["x"] is None


def test_page_has_bundle_once_and_a_no_network_policy(tmp_path):
    page = viz.Page("t <x>")
    page.add_section("s", [viz.colored_tokens(["a"], [1.0]), viz.colored_tokens(["b"], [1.0])])
    html = page.write(tmp_path / "p.html").read_text()
    assert html.count("var CircuitsVis=") == 1  # bundle inlined exactly once
    assert html.count("CircuitsVis.render(") == 2
    assert "default-src 'none'" in html and "<title>t &lt;x&gt;</title>" in html


def test_shape_errors_name_both_sides():
    with pytest.raises(TLDynamicsError, match="colored_tokens: 2 tokens but the values cover 3"):
        viz.colored_tokens(["a", "b"], [1, 2, 3])
    with pytest.raises(TLDynamicsError, match=r"attention must have 3 dimensions, got shape \(2, 2\)"):
        viz.attention_heads(np.zeros((2, 2)), ["a", "b"])
