"""The README's Python runs as written (issue 42 item 7, issue 47 item 8): every ```python block
of README.md and of docs/python.md, in order, each file's blocks sharing one namespace as a
reader's session would, and every call in the README's table of analyses, on the model and prompt
of its quick start. Before: the table's ``qk_attribution.compute(model, prompt, layer, head)``
raised a TypeError (``layers=`` and ``heads=`` are keyword-only), and the quick start printed
nothing outside a notebook. Cost: induction-2l, about 15 s (the atlas's 8 s of it)."""

import re
from pathlib import Path

import pytest

import tl_dynamics
from tl_dynamics import odds_ratio, viz

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
ANALYSES = (
    "atlas",
    "circuits",
    "odds_ratio",
    "qk_attribution",
    "contextual_mlp",
    "regression",
    "trajectories",
    "particles",
)


def _blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), re.S)


def _run(path: Path, block: str, scope: dict) -> None:
    exec(compile(block, str(path), "exec"), scope)  # noqa: S102 (the page, as written)


def test_the_quick_start_runs_and_prints_its_labels(tmp_path, monkeypatch, capsys):
    text = README.read_text(encoding="utf-8")
    quick = text[text.index("## Quick start") : text.index("## What each analysis answers")]
    blocks = re.findall(r"```python\n(.*?)```", quick, re.S)
    assert len(blocks) == 1 and len(blocks[0].strip().splitlines()) <= 12, blocks
    for step in ("load_model(", ".attach(", "run_with_cache(", ".show()", "print("):
        assert step in blocks[0], step
    monkeypatch.chdir(tmp_path)  # it saves its view to the working folder
    scope: dict = {}
    _run(README, blocks[0], scope)
    result = scope["result"]
    assert isinstance(result, odds_ratio.OddsRatioResult) and result.stats.n_prompts == 8
    assert result.stats.layers == (1,) and isinstance(result.show(), viz.Group)
    assert (tmp_path / "odds_ratio.html").stat().st_size > 0
    out = capsys.readouterr().out
    frame = result.to_dataframe()
    for head, label in frame["label"].items():  # the printed table is the result's
        assert re.search(rf"{head}\s+{re.escape(label)}", out), (head, label, out)
    # the sentence under the block says what the table shows
    assert frame.loc[["L1H1", "L1H2", "L1H3"], "label"].eq("needs both").all()
    assert (frame.loc[["L1H1", "L1H2", "L1H3"], "kept_loglik"] < 0.05).all()
    assert frame.loc["L1H0", "label"] == "mixed"
    section = re.search(r"### (\d+\.\d+) ", out).group(1)
    assert "labels" in str(tl_dynamics.docs.math(section)).splitlines()[0].lower()
    assert "### 2.2 " in out  # the section that defines the labels (2.3 is the sinks)


@pytest.mark.parametrize("page", ["README.md", "docs/python.md"])
def test_every_python_block_runs(page, tmp_path, monkeypatch):
    path = ROOT / page
    blocks = _blocks(path)
    assert blocks, page
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    for block in blocks:
        _run(path, block, scope)


def test_every_call_in_the_table_runs():
    """Each "one call" of the README's table, with the quick start's model and prompt."""
    text = README.read_text(encoding="utf-8")
    table = text[text.index("## What each analysis answers") : text.index("Every label")]
    for name in (*ANALYSES, "scale"):
        assert f"| `{name}` |" in table, name
    calls = re.findall(r"`((\w+)\.compute\([^`]*\))`", table)
    assert sorted({module for _, module in calls}) == sorted(ANALYSES), calls
    scope = {name: getattr(tl_dynamics, name) for name in ANALYSES}
    scope.update(model=tl_dynamics.load_model("induction-2l"), prompt="KQZ7XMBW2RKQZ7XMBW2R")
    for call, module in calls:
        result = eval(call, scope)  # noqa: S307 (the README, as written)
        assert result is not None, call
        assert type(result).__module__.startswith(f"tl_dynamics.{module}"), (call, type(result))
