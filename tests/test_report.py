"""The main job: the report command writes one offline page; bad models get a clear error."""

import pytest

from tl_dynamics import cli, report, testing
from tl_dynamics.models import load_model, shipped_names


def test_report_on_a_tiny_model_has_every_installed_section(tmp_path):
    page = report.build_report(testing.cached_model("llama"), "def f(x):\n    return x\n")
    titles = [section.title for section in page.sections]
    assert titles[0] == "Attention patterns"
    assert page.failed_sections == [], page.failed_sections
    html = page.to_html()
    assert "CircuitsVis.render(" in html and "default-src 'none'" in html


def test_cli_report_with_the_default_model(tmp_path, capsys):
    out = tmp_path / "report.html"
    assert cli.main(["report", "--out", str(out), "--prompt", "import os\nos.getcwd()"]) == 0
    text = out.read_text()
    default = "code-2l" if "code-2l" in shipped_names() else "RANDOMLY INITIALISED"
    assert default in text
    assert "wrote" in capsys.readouterr().out


def test_cli_unknown_model_names_what_is_valid(tmp_path, capsys):
    code = cli.main(["report", "--model", "./no/such/folder.bin", "--out", str(tmp_path / "r.html")])
    assert code == 2
    err = capsys.readouterr().err
    assert "no such folder" in err and "shipped model" in err


def test_tiny_random_models_are_labelled_as_such():
    _, label = load_model("tiny-random:llama")
    assert "RANDOMLY INITIALISED llama" in label


def test_hub_ids_with_dots_go_to_the_hub_not_the_file_system(monkeypatch):
    from tl_dynamics import models

    asked = []
    monkeypatch.setattr(models, "_load_hub", lambda name: asked.append(name) or object())
    load_model("Qwen/Qwen2.5-0.5B")
    assert asked == ["Qwen/Qwen2.5-0.5B"]
    with pytest.raises(Exception, match="no such folder"):
        load_model("./models/Qwen2.5-0.5B")
