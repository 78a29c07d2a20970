"""The command line feels native (issue 42): arguments are checked before torch is imported, an
offline hub name fails at once, the help is generated from the registries the code uses, and
every message leads somewhere (no circles, no silent fresh start, one warning per cause).

Cost: a few subprocesses that never import torch (about 1 s each) and two small model runs.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tl_dynamics import _registries, cli, cli_heads, compat, devices, models, report, sphere
from tl_dynamics.scale import DatasetStats

ROOT = Path(__file__).resolve().parent.parent


def run(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def no_torch(script: str) -> str:
    """Run ``script`` in a fresh interpreter; it prints what it found (its last line says
    whether torch or TransformerLens got imported)."""
    code = (
        script
        + "\nprint('imported:', sorted({'torch', 'transformer_lens', 'transformers'} & set(sys.modules)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", "import sys\n" + code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_help_version_and_argument_errors_never_import_torch(tmp_path):
    corpus = tmp_path / "blank.txt"
    corpus.write_text("\n   \n\t\n")
    out = no_torch(
        "from tl_dynamics import cli\n"
        "import contextlib, io\n"
        "for argv in (['--help'], ['report', '--help'], ['stats', '--help'], ['heads', '--help'],"
        " ['--version']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        try:\n"
        "            cli.main(argv)\n"
        "        except SystemExit as exit_:\n"
        "            assert exit_.code == 0, argv\n"
        f"for argv in (['report', '--threads', '0'], ['report', '--sections', 'bogus'],"
        f" ['report', '--layers', 'one'], ['report', '--device', 'gpu'], ['report', '--dtype', 'half'],"
        f" ['report', '--model', 'induction_2l'], ['report', '--model', 'tiny-random:bogus'],"
        f" ['report', '--out', 'page.json'], ['report', '--model', 'no/such/folder/here'],"
        f" ['stats', '--prompts', 'missing.txt', '--out', 's.safetensors'],"
        f" ['stats', '--prompts', {str(corpus)!r}, '--out', 's.safetensors'],"
        f" ['stats', '--prompts', {str(corpus)!r}, '--out', 's.json'],"
        f" ['stats', '--prompts', {str(corpus)!r}, '--out', 's.safetensors', '--analyses', 'x'],"
        f" ['report', '--stats', 'missing.safetensors'], ['heads', '--layers', 'x']):\n"
        "    assert cli.main(argv) == 2, argv\n"
    )
    assert out.strip().endswith("imported: []"), out


def test_an_offline_hub_name_fails_at_once_with_the_hub_message(capsys, monkeypatch):
    def hub(*_args, **_kwargs):
        raise AssertionError("the hub was tried")

    monkeypatch.setattr(models, "_load_hub", hub)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = run(capsys, "report", "--model", "no-such-org/no-such-model")
    assert code == 2
    assert (
        "could not load model 'no-such-org/no-such-model' through TransformerLens (hub models need "
        "a network connection" in err
    )
    assert (
        "HF_HUB_OFFLINE is set and 'no-such-org/no-such-model' is not in the Hugging Face cache"
        in err
    )
    monkeypatch.delenv("HF_HUB_OFFLINE")  # no route to the hub: the same, said at once
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    for proxy in (
        "https_proxy",
        "HTTPS_PROXY",
        "http_proxy",
        "HTTP_PROXY",
        "all_proxy",
        "ALL_PROXY",
    ):
        monkeypatch.delenv(proxy, raising=False)
    monkeypatch.setattr("tl_dynamics._model_names._reachable", lambda host, timeout=2.0: False)
    code, _, err = run(
        capsys, "stats", "--model", "no-such-org/x", "--prompts", __file__, "--out", "s.safetensors"
    )
    assert code == 2 and "no network: huggingface.co cannot be reached from here" in err


def test_help_is_generated_from_the_registries(capsys):
    assert _registries.section_names() == tuple(a.name for a in report.SECTIONS)
    assert _registries.stats_analyses() == DatasetStats.ANALYSES
    assert _registries.bad_line_policies() == DatasetStats.ON_LONG
    assert _registries.eps_grid() == sphere.TRAJECTORY_EPS_GRID
    with pytest.raises(SystemExit):
        cli.main(["report", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    listed = re.search(r"comma-separated, from: (.*?); 'none'", text)
    assert listed and listed.group(1).split(", ") == [a.name for a in report.SECTIONS]
    assert "regression" in listed.group(1)
    assert "tl-dynamics report --stats FILE" in text and "--allow-partial" in text
    assert all(name in text for name in models.shipped_names())
    assert all(arch in text for arch in models.tiny_architectures())
    assert f"TransformerLens ({compat.tl_version()})" in text
    with pytest.raises(SystemExit):
        cli.main(["stats", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"from {', '.join(DatasetStats.ANALYSES)} (default all)" in text
    assert f"{{{','.join(DatasetStats.ON_LONG)}}}" in text  # the choices
    assert "--on-bad-lines" in text and "--on-long" in text
    assert f"default {','.join(f'{e:g}' for e in sphere.TRAJECTORY_EPS_GRID)}" in text
    assert all(name in text for name in models.shipped_names())
    with pytest.raises(SystemExit):
        cli.main(["heads", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(name in text for name in models.shipped_names())
    with pytest.raises(SystemExit):
        cli.main(["report", "--help"])
    text = capsys.readouterr().out
    assert all(choice.split(":")[0] in text for choice in devices.DEVICE_CHOICES)
    assert all(choice in text for choice in devices.DTYPE_CHOICES)


def test_a_source_registry_the_reader_cannot_follow_falls_back_to_the_import(monkeypatch):
    monkeypatch.setattr(_registries, "_sections_from_source", lambda: None)
    assert _registries.section_names() == tuple(a.name for a in report.SECTIONS)
    assert _registries.literal("no/such.py", "X", lambda: ("a",)) == ("a",)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["report", "--out", "r.json"],
            "--out 'r.json': this writes an HTML page, but the name says JSON; name it 'r.html'",
        ),
        (
            ["heads", "--out", "h.txt"],
            "--out 'h.txt': this writes an HTML page, but the name says text; name it 'h.html'",
        ),
        (["report", "--stats", "s.safetensors", "--out", "p.png"], "name it 'p.html'"),
        (
            ["stats", "--prompts", "CORPUS", "--out", "s.json"],
            "this writes a safetensors file, but the name says JSON; name it 's.safetensors'",
        ),
    ],
)
def test_an_output_suffix_that_contradicts_the_format_is_refused(
    argv, message, tmp_path, capsys, monkeypatch
):
    corpus = tmp_path / "c.txt"
    corpus.write_text("a = 1\n")
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, *[str(corpus) if a == "CORPUS" else a for a in argv])
    assert code == 2 and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt"]  # nothing written


def test_an_empty_corpus_is_an_error_and_an_empty_stats_file_renders_no_page(tmp_path, capsys):
    from tl_dynamics import scale, testing

    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n\u3000\n")
    out = tmp_path / "s.safetensors"
    code, _, err = run(capsys, "stats", "--prompts", str(blank), "--out", str(out))
    assert code == 2 and f"--prompts {str(blank)!r} holds no prompt: every line is blank" in err
    assert not out.exists()
    empty = scale.run_stats(testing.cached_model("gpt2"), [], progress=False, model_name="tiny")
    scale.save_stats(empty, out)
    page = tmp_path / "p.html"
    code, _, err = run(capsys, "report", "--stats", str(out), "--out", str(page))
    assert code == 2 and "holds 0 prompts" in err and "nothing to render" in err
    assert not page.exists()


def test_resume_says_when_there_is_nothing_to_resume_and_the_old_switch_name_works(
    tmp_path, capsys
):
    corpus = tmp_path / "c.txt"
    corpus.write_text("a = 1\nb = 2\n")
    out = tmp_path / "s.safetensors"
    argv = ["stats", "--model", "tiny-random", "--prompts", str(corpus), "--out", str(out)]
    code, stdout, err = run(capsys, *argv, "--no-progress", "--resume", "--on-long", "skip")
    assert code == 0 and "wrote" in stdout
    assert f"--resume: there is no checkpoint {out}.partial to continue, so the run starts" in err
    other = tmp_path / "o.safetensors"
    code, _, _ = run(capsys, *argv[:-1], str(other), "--no-progress", "--on-bad-lines", "skip")
    assert code == 0 and other.read_bytes() == out.read_bytes()  # one switch, two names


def test_a_checkpoint_of_other_settings_says_how_out_not_in_a_circle(tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(f"x = {i}" for i in range(8)) + "\n")
    out = tmp_path / "s.safetensors"
    argv = ["stats", "--model", "tiny-random", "--prompts", str(corpus), "--out", str(out)]
    argv += ["--no-progress", "--batch-size", "2"]
    assert run(capsys, *argv, "--max-batches", "1")[0] == 0
    code, _, err = run(capsys, *argv[:-1], "4", "--resume")
    assert code == 2 and "was made by a different run" in err
    assert "run without --resume" not in err and "delete it to start over with these" in err
    code, _, err = run(capsys, *argv)
    assert code == 2 and "pass --resume to continue it, or delete it to start over" in err


def test_an_unknown_token_warns_once(tmp_path, capsys, recwarn):
    out = tmp_path / "r.html"
    code, _, err = run(
        capsys, "report", "--model", "induction-2l", "--out", str(out), "--prompt", "abc!!",
        "--sections", "none", "--layers", "0",
    )  # fmt: skip
    assert code == 0
    said = [line for line in err.splitlines() if "unknown" in line]
    assert len(said) == 1 and "it maps '!' in the prompt 'abc!!'" in said[0], err
    assert [w for w in recwarn if "unknown" in str(w.message)] == []


def test_the_report_names_the_model_the_user_loaded(tmp_path):
    from tl_dynamics import zoo
    from tl_dynamics.adapter import ModelAdapter

    adapter = ModelAdapter(zoo.load("code-2l"))
    assert adapter.info.architecture == "code-2l"  # not TransformerLensNative / HookedTransformer
    page = report.build_report(adapter, "x = 1", "code-2l (shipped)", sections=(), threads=None)
    assert dict(page.meta)["architecture"].startswith("code-2l")
    text = page.write(tmp_path / "r.html").read_text()
    assert "TransformerLensNative" not in text and "HookedTransformer (" not in text


def test_the_heads_table_says_what_each_number_is_and_an_off_distribution_probe(capsys):
    code, out, _ = run(
        capsys, "heads", "--model", "code-2l", "--layers", "0", "--heads", "0", "--n-seq", "2",
        "--seq-len", "8",
    )  # fmt: skip
    assert code == 0
    assert "note: delta_loss = loss with the head mean-ablated - clean loss" in out
    found = re.search(r"its clean loss on the repeated random-token probes is ([\d.]+) nats per "
                      r"token, no better than a uniform guess over its 4096 tokens \(8\.3 = ln 4096\); "
                      r"give --prompt", out)  # fmt: skip
    assert found and float(found.group(1)) >= 8.3, out
    code, out, _ = run(
        capsys,
        "heads",
        "--model",
        "induction-2l",
        "--layers",
        "1",
        "--n-seq",
        "2",
        "--seq-len",
        "8",
    )
    assert code == 0 and "off this model's distribution" not in out  # its own task: below uniform
    assert "head_index" in out


def test_the_off_distribution_note_needs_a_loss_at_or_above_uniform():
    class Result:
        clean_loss = 2.0

    assert cli_heads.off_distribution(Result(), 64, True) is None
    Result.clean_loss = float("nan")  # no causal run
    assert cli_heads.off_distribution(Result(), 64, True) is None
    Result.clean_loss = 5.0
    assert "ln 64" in cli_heads.off_distribution(Result(), 64, False)


def test_model_dependent_checks_come_after_loading_and_before_any_analysis(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(report, "build_report", lambda *a, **k: pytest.fail("analysis ran"))
    out = str(tmp_path / "r.html")
    for argv, message in [
        (["--layers", "5"], "layer 5 is out of range: this model has 2 layers"),
        (["--heads", "L0H9"], "head 9"),
        (["--prompt-ids", "1 2 999"], "token ids 999 are outside this model's vocabulary"),
        (["--prompt", "ab" * 100], "prompt has 201 tokens but this model's context is 128"),
    ]:
        code, _, err = run(capsys, "report", "--model", "induction-2l", "--out", out, *argv)
        assert code == 2 and message in err, (argv, err)
    monkeypatch.setattr("tl_dynamics.atlas.compute", lambda *a, **k: pytest.fail("analysis ran"))
    code, _, err = run(capsys, "heads", "--model", "induction-2l", "--heads", "7", "--no-causal")
    assert code == 2 and "head 7" in err, err
