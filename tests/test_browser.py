"""Pages really render offline in Debian's headless chromium: components draw, hostile tokens
stay text, nothing executes, and no network request is made."""

import os
import shutil

import numpy as np
import pytest

from tl_dynamics import report, testing, viz

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not os.path.exists(CHROMIUM),
                       reason="Debian chromium is not installed (apt-get install chromium; "
                              ".ci/run installs it)"),
]
playwright = pytest.importorskip("playwright.sync_api", reason="playwright-python not installed")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-quic", "--no-first-run", "--disable-component-update", "--disable-sync"]
HOSTILE = ["<img src=x onerror=\"document.title='PWNED'\">", "</script><script>alert(1)</script>",
           "<BOS>", "a & b"]

RENDERED = """() => [...document.querySelectorAll('.tld-cv')].every(
  d => [...d.children].some(c => c.tagName !== 'SCRIPT'))"""
PROBE = """() => {
  const views = [...document.querySelectorAll('.tld-cv')].map(d => ({
    children: [...d.children].filter(c => c.tagName !== 'SCRIPT').length,
    coloredTokens: d.querySelectorAll('.colored-tokens, .colored-token').length,
    painted: [...d.querySelectorAll('canvas')].map(c => {
      const data = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
      let n = 0; for (let i = 3; i < data.length; i += 4) if (data[i] > 0) n++;
      return n / Math.max(1, data.length / 4); }),
    text: d.innerText }));
  return {title: document.title, views, text: document.body.innerText,
          figures: [...document.querySelectorAll('img.tld-figure')].map(i => i.naturalWidth)};
}"""


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as p:
        instance = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield instance
        instance.close()


def open_page(browser, path):
    page = browser.new_page(viewport={"width": 1200, "height": 4000})
    events = {"errors": [], "requests": [], "dialogs": []}
    page.on("pageerror", lambda e: events["errors"].append(str(e)))
    page.on("request", lambda r: events["requests"].append(r.url))
    page.on("dialog", lambda d: (events["dialogs"].append(d.message), d.dismiss()))
    page.goto(path.as_uri())
    # React mounts asynchronously: wait (bounded) until every view has drawn something.
    page.wait_for_function(RENDERED, timeout=30_000)
    page.wait_for_timeout(300)
    info = page.evaluate(PROBE)
    page.close()
    return info, events


def test_every_component_draws_and_hostile_tokens_stay_text(browser, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    page = viz.Page("hostile <title>")
    page.add_section("all components", [
        viz.attention_heads(np.tril(np.ones((2, 4, 4))) / 4, HOSTILE, ["<b>h0</b>", "h1"]),
        viz.attention_pattern(HOSTILE, np.tril(np.ones((4, 4))) / 4),
        viz.colored_tokens(HOSTILE, [0.0, 1.0, -1.0, 0.5]),
        viz.colored_tokens_multi(HOSTILE, np.ones((4, 2)), ["<i>lab</i>", "y"]),
        viz.text_neuron_activations(HOSTILE, np.ones((4, 2, 3)), "<Layer>", "<Neuron>",
                                    ["<L0>", "L1"], ["n0", "n1", "<n2>"]),
        viz.topk_tokens([HOSTILE], [np.arange(24.0).reshape(2, 4, 3)], sample_labels=["<s0>"]),
        viz.figure(fig, caption="a plot"),
        viz.table(__import__("pandas").DataFrame({"token": HOSTILE, "v": [1.0, 2.0, 3.0, 4.0]})),
    ])
    info, events = open_page(browser, page.write(tmp_path / "hostile.html"))
    assert events["errors"] == [] and events["dialogs"] == []
    assert events["requests"] == [(tmp_path / "hostile.html").as_uri()]
    assert info["title"] == "hostile <title>"  # the onerror payload did not run
    assert [view["children"] >= 1 for view in info["views"]] == [True] * 6, info["views"]
    heads, pattern = info["views"][0], info["views"][1]
    assert len(heads["painted"]) >= 3 and min(heads["painted"]) > 0
    assert pattern["painted"] and min(pattern["painted"]) > 0
    assert info["views"][2]["coloredTokens"] >= 1
    for needle in ("<BOS>", "a\u00a0&\u00a0b", "</script><script>alert(1)</script>"):
        assert needle in info["text"].replace(" ", "\u00a0") or needle.replace("\u00a0", " ") in info["text"]
    assert info["figures"] and info["figures"][0] > 0
    for label in ("<Layer>", "<Neuron>", "<L0>", "<i>lab</i>"):  # labels read as written
        assert label in info["text"], label


def test_report_page_renders_offline(browser, tmp_path):
    path = report.write_report(tmp_path / "report.html", testing.cached_model("gpt2"),
                               "x = 1\ny = <BOS> & x", label="tiny <model>")
    info, events = open_page(browser, path)
    assert events["errors"] == [] and events["dialogs"] == []
    assert events["requests"] == [path.as_uri()]
    assert len(info["views"]) >= 2
    assert all(view["children"] >= 1 for view in info["views"])
    assert "Attention patterns" in info["text"] and "tiny <model>" in info["text"]
