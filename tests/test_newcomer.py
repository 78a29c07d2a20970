"""A newcomer's first hour (issue 30 item 5): each friction seen on main, as a test that failed
before its fix."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tl_dynamics import cli, contextual_mlp, docs, models, odds_ratio, testing, trajectories, zoo
from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.errors import TLDynamicsError, UnknownTokenWarning

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def induction():
    return ModelAdapter(zoo.load("induction-2l"))


def test_an_adapter_of_a_name_is_refused_with_how_to_load_it():
    for name in ("induction-2l", Path("some/folder")):
        with pytest.raises(TLDynamicsError, match=r"tl_dynamics\.load_model\("):
            ModelAdapter(name)  # was: a raw AttributeError
    with pytest.raises(TLDynamicsError, match="load one with tl_dynamics.load_model"):
        ModelAdapter(3)


def test_docs_math_is_reachable_after_import_tl_dynamics_as_the_readme_shows():
    code = "import tl_dynamics; print(tl_dynamics.docs.math('2.3')[:40])"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "2.3" in out.stdout
    assert 'tl_dynamics.docs.math("2.2")' in (ROOT / "README.md").read_text(encoding="utf-8")


def test_math_doc_names_no_private_api_as_if_public():
    text = (ROOT / "docs" / "math.md").read_text(encoding="utf-8")
    assert "decompose_layer" not in text
    assert "`Decomposition` (`tl_dynamics/odds_ratio/_result.py`), is not exported" in text
    for name in ("split_scores", "counterfactual_patterns", "HeadStats"):
        assert name in odds_ratio.__all__


def test_an_svg_refusal_names_the_member_that_blocks_it(tmp_path):
    view = odds_ratio.compute(testing.tiny_model("gpt2"), "x = 1", layers=1).show(heads=0)
    with pytest.raises(TLDynamicsError, match=r"member 0 of \d+ \(a table"):
        view.save(tmp_path / "x.svg")
    assert not (tmp_path / "x.svg").exists()


def test_a_model_name_a_typo_away_is_refused_before_any_hub_attempt(monkeypatch):
    def hub(*_args, **_kwargs):
        raise AssertionError("the hub was tried")

    monkeypatch.setattr(models, "_load_hub", hub)
    with pytest.raises(TLDynamicsError, match="did you mean 'induction-2l'"):
        models.resolve("induction_2l")
    with pytest.raises(TLDynamicsError, match="did you mean 'code-2l'"):
        models.resolve("Code-2L")
    assert cli.main(["heads", "--model", "induction_2l", "--no-causal"]) == 2


def test_heads_takes_layers_and_heads_as_atlas_compute_does(capsys):
    argv = ["heads", "--model", "induction-2l", "--no-causal", "--n-seq", "2", "--seq-len", "8"]
    assert cli.main(argv + ["--layers", "1", "--heads", "L1H3,L1H1"]) == 0
    table = capsys.readouterr().out.split("\n", 1)[1]
    rows = [line.split()[:2] for line in table.splitlines()[1:] if line.strip()]
    assert [r for r in rows if r[0] != "note:"] == [["1", "1"], ["1", "3"]], table
    assert cli.main(argv + ["--layers", "0", "--heads", "2"]) == 0
    table = capsys.readouterr().out.split("\n", 1)[1]
    rows = [line.split()[:2] for line in table.splitlines()[1:] if line.strip()]
    assert [r for r in rows if r[0] != "note:"] == [["0", "2"]]
    assert cli.main(argv + ["--layers", "0", "--heads", "L1H3"]) == 2
    assert "outside --layers" in capsys.readouterr().err


def test_a_prompt_mapped_to_unk_warns_naming_the_characters(induction):
    with pytest.warns(UnknownTokenWarning, match=r"'é'.*'ü'.*<unk>"):
        batch = induction.tokenize("ABéCüD")
    assert "<unk>" in induction.str_tokens(batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownTokenWarning)
        readme = "KQZ7XMBW2R P3LD8VNC4T A9FJ2YHE6S W4GU7TKB1Q M8RX3ZDP5V C2NH9LAY7E T6BQ4WFJ8K Y1EV5SMU3G"
        for half in readme.split():  # the README's prompts: every character kept
            assert induction.str_tokens(induction.tokenize(half + half))[1:] == list(half + half)
        ModelAdapter(testing.cached_model("gpt2")).tokenize("x = é ü")  # byte-level: no unk
    assert readme in (ROOT / "README.md").read_text(encoding="utf-8")


def test_where_the_split_is_introduced_it_says_hook_attn_scores_holds_the_pattern(induction):
    assert induction.specs[0].scores_hook == (
        "pattern" if induction.info.host != "hooked" else "logits"
    )
    intro = str(docs.math("2")).split("### 2.1")[0]
    for text in (intro, odds_ratio.__doc__ or ""):
        assert "hook_attn_scores" in text and "pattern" in text


def test_trajectory_points_sort_in_depth_order():
    res = trajectories.compute(testing.tiny_model("gpt2"), "def f(x): return x")
    labels = list(res.labels)
    assert labels.index("resid_pre0") < labels.index("resid_post1")
    frame = res.to_dataframe().sort_values("point", kind="stable")
    assert list(dict.fromkeys(frame["point"].astype(str))) == labels
    stats = res.stats.to_dataframe().sort_index()
    assert [str(p) for p in stats.index] == labels


def test_exactness_has_a_short_repr():
    mlps = contextual_mlp.compute(testing.tiny_model("gpt2"), "a b c a b c", layers=1, heads=0)
    text = repr(mlps[1, 0].exactness())
    assert len(text) < 200 and "tensor" not in text and "max" in text, text
