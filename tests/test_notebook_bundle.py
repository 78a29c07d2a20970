"""Notebooks carry circuitsvis's ~1.3 MB script bundle once per kernel session, not once per
view: the first output that needs it inlines it, later outputs use it (the runtime waits for
``window.CircuitsVis``). ``test_jupyterlab.py`` checks that the later views really draw."""

import numpy as np
import pytest

from tl_dynamics import TLDynamicsError, viz
from tl_dynamics.viz import _component

MARK = "var CircuitsVis="  # how the bundle defines it (and nothing else says it)


@pytest.fixture
def fresh_session(monkeypatch):
    monkeypatch.setitem(_component._BUNDLE, "sent", False)
    monkeypatch.setitem(_component._BUNDLE, "mode", "once")


def outputs(n):
    views = [
        viz.heatmap(np.eye(3)),
        viz.colored_tokens(["a", "b"], [0.0, 1.0]),
        viz.group(viz.colored_tokens(["c"], [1.0]), viz.line_plot(["x"], {"s": [1.0]})),
    ]
    return [views[i % 3]._repr_html_() for i in range(n)]


def test_the_bundle_goes_with_the_first_view_that_needs_it_and_only_that_one(fresh_session):
    shown = outputs(20)
    assert MARK in _component.bundle_js()
    assert [MARK in html for html in shown[:3]] == [False, True, False]  # a heat map needs none
    assert sum(MARK in html for html in shown) == 1
    assert all("TLD.start()" in html for html in shown)  # each output starts the runtime
    assert sum(map(len, shown)) < len(_component.bundle_js()) + 20 * 40_000


def test_every_mode_inlines_it_in_each_output_that_needs_it(fresh_session):
    assert viz.notebook_bundle("every") == "once"
    shown = outputs(6)
    assert [MARK in html for html in shown] == [False, True, True] * 2
    with pytest.raises(
        TLDynamicsError,
        match=r"notebook_bundle\('always'\): valid modes are "
        r"'once' and 'every'",
    ):
        viz.notebook_bundle("always")


@pytest.mark.notebook
def test_a_notebook_with_twenty_views_carries_one_bundle(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    cells = [nbformat.v4.new_code_cell("from tl_dynamics import viz")]
    cells += [
        nbformat.v4.new_code_cell(f"viz.colored_tokens(['a', 'b', 'c'], [0.0, {i}, -1.0])")
        for i in range(20)
    ]
    notebook = nbformat.v4.new_notebook(cells=cells)
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3").execute()
    path = tmp_path / "twenty.ipynb"
    nbformat.write(notebook, path)
    text = path.read_text()
    assert text.count(MARK) == 1
    # measured: 27.7 MB with the bundle in every output, 1.66 MB with it once
    assert path.stat().st_size < 2_500_000
