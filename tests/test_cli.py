"""The command line and the one loader, tried as a new user would (issue 14's rows): every bad
input is refused with a message naming it, before the model loads."""

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tl_dynamics import TLDynamicsError, cli, compat, models, report, testing

ROOT = Path(__file__).resolve().parent.parent
ZOO = ROOT / "tl_dynamics" / "zoo" / "models"
HOSTILE_PROMPT = 'say "hi" to `echo X` and $HOME'


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if a model gets loaded: the checks must come first."""

    def refuse(name=None):
        raise AssertionError(f"model {name!r} was loaded before the inputs were checked")

    monkeypatch.setattr(models, "resolve", refuse)


def run(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt", ""], "--prompt is empty"),
        (["--prompt", "   "], "--prompt is empty"),
        (["--prompt-ids", "3 x 5"], "expected non-negative integers"),
        (["--layers", "one"], "--layers 'one': expected non-negative integers"),
        (["--heads", "L3"], "write a head as L<layer>H<head>"),
        (["--prompt-env", "TLD_NO_SUCH_VARIABLE"], "no such environment variable"),
        (["--sections", "circuits,bogus"], "unknown ['bogus']; valid: atlas, circuits, odds_ratio"),
        (["--layers", "1", "--heads", "L0H2"], "names heads outside --layers '1'"),
        (["--threads", "0"], "--threads '0': give a positive integer or 'auto'"),
        (["--threads", "two"], "--threads 'two': give a positive integer or 'auto'"),
    ],
)
def test_bad_prompts_and_focus_options_are_refused_before_loading(
    argv, message, tmp_path, capsys, no_loading
):
    out = tmp_path / "r.html"
    out.write_text("previous page")
    code, _, err = run(capsys, "report", "--out", str(out), *argv)
    assert code == 2 and message in err, err
    assert out.read_text() == "previous page"  # nothing overwritten


def test_empty_model_name_is_an_error_not_the_default(tmp_path, capsys):
    out = tmp_path / "r.html"
    code, _, err = run(capsys, "report", "--model", "", "--out", str(out))
    assert code == 2 and "model name is empty" in err and not out.exists()
    with pytest.raises(TLDynamicsError, match="model name is empty"):
        models.load_model(" ")


def test_output_paths_are_checked_before_the_model_loads(tmp_path, capsys, no_loading):
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    for out, message in [
        (str(tmp_path), "is a directory"),
        ("", "--out is empty"),
        (str(a_file / "r.html"), "is a file, so nothing can be written under it"),
        (str(a_file / "deeper" / "r.html"), "is a file"),
    ]:
        code, _, err = run(capsys, "report", "--out", out)
        assert code == 2 and message in err, (out, err)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_output_folder_is_refused(tmp_path, capsys, no_loading):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    code, _, err = run(capsys, "report", "--out", str(locked / "r.html"))
    assert code == 2 and "is not writable" in err


def test_version_help_and_models_list(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert "tl-dynamics      0.1.0\n" in capsys.readouterr().out  # compat.show_versions()
    with pytest.raises(SystemExit):
        cli.main(["report", "--help"])
    text = capsys.readouterr().out
    runnable = models.tiny_architectures()
    assert "llama" in runnable and all(arch in " ".join(text.split()) for arch in runnable)
    assert cli.main(["models"]) == 0
    listing = capsys.readouterr().out
    assert "code-2l" in listing and "[installed]" in listing
    minilm = "[installed]" if models.is_installed("minilm") else "[optional, NOT installed]"
    assert any(
        line.strip().startswith("minilm") and minilm in line for line in listing.splitlines()
    )


def test_tiny_random_errors_list_what_runs_on_this_transformerlens():
    with pytest.raises(TLDynamicsError, match="valid: .*llama") as err:
        models.load_model("tiny-random:bogus")
    if (
        not compat.has_hooked_transformer()
    ):  # TransformerLens 4: HookedTransformer variants are gone
        assert "gpt2-like" not in str(err.value)
        with pytest.raises(TLDynamicsError, match=r"'gpt2-like' does not run on TransformerLens 4"):
            models.load_model("tiny-random:gpt2-like")
        assert "native" in models.tiny_architectures()
    else:
        assert "gpt2-like" in str(err.value)


def test_malformed_folders_name_the_file(tmp_path):
    garbage = tmp_path / "garbage-config"
    garbage.mkdir()
    (garbage / "config.json").write_text("{not json")
    with pytest.raises(TLDynamicsError, match=r"garbage-config/config.json is not valid JSON"):
        models.load_model(str(garbage))
    hf = testing.hf_folder("gpt2", tmp_path / "hf")
    (hf / "model.safetensors").write_bytes(b"\x00garbage weights")
    with pytest.raises(
        TLDynamicsError,
        match=r"could not load the Hugging Face model folder .*hf/gpt2 "
        r"\(config.json, weights \['model.safetensors'\]\)",
    ):
        models.load_model(str(hf))
    native = tmp_path / "native"
    native.mkdir()
    shutil.copy(ZOO / "induction-2l" / "config.json", native / "tl_config.json")
    (native / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(
        TLDynamicsError, match=r"native/model.safetensors is not a readable safetensors"
    ):
        models.load_model(str(native))


def native_checkpoint(tmp_path, config_name="tl_config.json"):
    """A TransformerLens-native checkpoint folder with no tokenizer: the shipped induction-2l's
    HookedTransformerConfig fields and HookedTransformer state dict, nothing else."""
    folder = tmp_path / "tl-checkpoint"
    folder.mkdir()
    shutil.copy(ZOO / "induction-2l" / "config.json", folder / config_name)
    shutil.copy(ZOO / "induction-2l" / "model.safetensors", folder / "model.safetensors")
    return folder


@pytest.mark.parametrize("config_name", ["tl_config.json", "config.json"])
def test_transformerlens_native_checkpoint_without_tokenizer_takes_token_ids(
    tmp_path, capsys, config_name
):
    folder = native_checkpoint(tmp_path, config_name)
    model = models.load_model(str(folder))
    reference = models.load_model("induction-2l")
    import torch

    ids = torch.tensor([[0, 5, 9, 12, 5, 9]])
    assert torch.allclose(model(ids), reference(ids), atol=1e-5)  # the same weights, loaded
    out = tmp_path / "r.html"
    code, _, err = run(
        capsys, "report", "--model", str(folder), "--out", str(out), "--prompt", "abc"
    )
    assert code == 2 and "has no tokenizer" in err and "--prompt-ids" in err
    code, stdout, _ = run(
        capsys,
        "report",
        "--model",
        str(folder),
        "--out",
        str(out),
        "--prompt-ids",
        "0 5 9 12 5 9 12",
        "--layers",
        "1",
        "--heads",
        "L1H0",
    )
    assert code == 0 and "wrote" in stdout
    assert "0 5 9 12 5 9 12" in out.read_text()


def test_default_prompts_tokenise_without_unknown_tokens():
    from tl_dynamics.adapter import ModelAdapter

    for name in ("code-2l", "induction-2l", "regression-2l") + (
        ("minilm",) if models.is_installed("minilm") else ()
    ):
        loaded = models.resolve(name)
        adapter = ModelAdapter(loaded.model)
        batch = adapter.tokenize(loaded.default_prompt)
        unk = adapter.tokenizer.unk_token_id
        real = batch.tokens[0][batch.key_valid[0]]
        assert unk is None or not (real[1:] == unk).any(), (name, adapter.str_tokens(batch))


def test_unknown_tokens_warn_on_the_console_and_in_the_page(tmp_path, capsys):
    out = tmp_path / "r.html"
    code, _, err = run(
        capsys,
        "report",
        "--model",
        "induction-2l",
        "--out",
        str(out),
        "--prompt",
        "abc def ghi!!",
        "--layers",
        "0",
    )
    assert code == 0
    assert "unknown to this model's tokenizer" in err
    assert "unknown to this model&#x27;s tokenizer" in out.read_text()


def test_prompt_from_the_environment_is_taken_verbatim(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PROMPT", HOSTILE_PROMPT)
    page = {}
    monkeypatch.setattr(
        report,
        "build_report",
        lambda model, prompt, *a, **k: (
            page.setdefault("prompt", prompt) and __import__("tl_dynamics").viz.Page("stub")
        ),
    )
    code, _, _ = run(
        capsys,
        "report",
        "--model",
        "tiny-random",
        "--prompt-env",
        "PROMPT",
        "--out",
        str(tmp_path / "r.html"),
    )
    assert code == 0 and page["prompt"] == HOSTILE_PROMPT


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_report_passes_the_prompt_without_the_shell(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    dump = tmp_path / "seen.json"
    fake = venv / "bin" / "tl-dynamics"
    fake.write_text(
        '#!/bin/sh\nexec python3 -c \'import json, os, sys; json.dump({"argv": '
        f'sys.argv[1:], "prompt": os.environ.get("PROMPT")}}, open("{dump}", "w"))\' '
        '"$@"\n'
    )
    fake.chmod(0o755)
    (venv / ".installed").touch()
    os.utime(venv / ".installed", (4e9, 4e9))  # newer than pyproject.toml: nothing to install
    subprocess.run(
        [
            "make",
            "-s",
            "-C",
            str(ROOT),
            "report",
            f"VENV={venv}",
            f"PROMPT={HOSTILE_PROMPT}",
            f"OUT={tmp_path / 'r.html'}",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    seen = json.loads(dump.read_text())
    assert seen["prompt"] == HOSTILE_PROMPT
    assert "--prompt-env" in seen["argv"] and HOSTILE_PROMPT not in seen["argv"]


def test_report_threads_follow_the_setting_and_the_machine_load(monkeypatch):
    """'auto' leaves torch's one-thread-per-core default on a quiet machine and uses only the
    free cores when other work keeps some busy; the report restores torch's setting after."""
    import torch

    from tl_dynamics import report, testing

    monkeypatch.setattr(report.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(report.torch, "get_num_threads", lambda: 4)
    for busy, threads in ((0.1, None), (0.5, None), (1.0, 3), (2.6, 1), (3.9, 1), (7.0, 1)):
        monkeypatch.setattr(report, "busy_cores", lambda busy=busy: busy)
        assert report.report_threads("auto") == threads, busy
    monkeypatch.setattr(report.torch, "get_num_threads", lambda: 2)  # e.g. OMP_NUM_THREADS=2
    assert report.report_threads("auto") == 1  # busy 7.0: one
    monkeypatch.setattr(report, "busy_cores", lambda: 1.0)
    assert report.report_threads("auto") == 2  # three cores free, torch set to two
    monkeypatch.undo()
    assert 0.0 <= report.busy_cores(0.05) <= (os.cpu_count() or 1) + 1e-9
    assert report.report_threads(2) == 2 and report.report_threads(None) is None
    with pytest.raises(TLDynamicsError, match="give a positive integer"):
        report.report_threads(0)
    before = torch.get_num_threads()
    seen = []
    from tl_dynamics.collect import Analysis

    probe = staticmethod(lambda page, adapter, batch: seen.append(torch.get_num_threads()))
    section = type(
        "Probe", (Analysis,), {"name": "probe", "compute": probe, "report_section": probe}
    )
    report.build_report(testing.tiny_model("gpt2"), "a b", sections=[section], threads=3)
    assert seen == [3] and torch.get_num_threads() == before


# ---------------------------------------------------------------------- issue 24: every argument
def test_prompt_ids_are_checked_against_the_vocabulary_before_any_section(
    tmp_path, capsys, monkeypatch
):
    from tl_dynamics.adapter import ModelAdapter

    built = []
    monkeypatch.setattr(report, "build_report", lambda *a, **k: built.append(a))
    for ids in ("1 2 99999", "1 " + "9" * 23):
        out = tmp_path / "r.html"
        code, _, err = run(
            capsys, "report", "--model", "tiny-random:gpt2", "--prompt-ids", ids, "--out", str(out)
        )
        assert code == 2 and "outside this model's vocabulary (valid: 0..511)" in err, err
        assert "Traceback" not in err and not out.exists() and not built
    code, _, err = run(capsys, "report", "--prompt-ids", "1 ²", "--out", str(tmp_path / "r.html"))
    assert code == 2 and "expected non-negative integers" in err
    adapter = ModelAdapter.of(testing.cached_model("gpt2"))
    with pytest.raises(
        TLDynamicsError,
        match=r"token ids \[512\] are outside this model's "
        r"vocabulary \(valid: 0..511\)",
    ):
        adapter.tokenize(torch.tensor([1, 512, 3]))
    with pytest.raises(TLDynamicsError, match=r"token ids \[-1\]"):
        adapter.tokenize(torch.tensor([[1, -1]]))


def test_a_page_with_failed_sections_does_not_exit_0(tmp_path, capsys, monkeypatch):
    def broken(page, adapter, batch):
        raise RuntimeError("a bug in a section")

    from tl_dynamics.collect import Analysis

    entry = type(
        "Broken",
        (Analysis,),
        {
            "name": "circuits",
            "compute": staticmethod(broken),
            "report_section": staticmethod(broken),
        },
    )
    monkeypatch.setattr(report, "SECTIONS", (entry,))
    out = tmp_path / "r.html"
    code, _, err = run(
        capsys,
        "report",
        "--model",
        "tiny-random:gpt2",
        "--prompt",
        "a = 1",
        "--sections",
        "circuits",
        "--out",
        str(out),
        "--threads",
        "1",
    )
    assert code == 1 and "its sections circuits failed" in err and out.exists()


def test_counts_and_threads_are_validated_with_a_clear_message(
    tmp_path, capsys, caplog, no_loading
):
    corpus = tmp_path / "c.txt"
    corpus.write_text("a = 1\n")
    stats = ["stats", "--prompts", str(corpus), "--out", str(tmp_path / "s.safetensors")]
    cases = [
        (stats + ["--threads", "0"], "--threads '0': give a positive integer (this machine"),
        (stats + ["--threads", "x"], "--threads 'x': give a positive integer"),
        (stats + ["--batch-size", "0"], "--batch-size 0: give a positive integer"),
        (stats + ["--checkpoint-every", "-1"], "--checkpoint-every -1: give a positive"),
        (stats + ["--eps", "inf"], "--eps 'inf': expected positive numbers"),
        (["heads", "--n-seq", "0"], "--n-seq 0: give a positive integer"),
        (["heads", "--seq-len", "-3"], "--seq-len -3: give a positive integer"),
        (["report", "--threads", "0"], "--threads '0': give a positive integer or 'auto'"),
    ]
    for argv, message in cases:
        code, _, err = run(capsys, *argv)
        assert code == 2 and message in err and "Traceback" not in err, (argv, err)
    from tl_dynamics import _args

    with pytest.raises(TLDynamicsError, match="threads must be a positive integer"):
        from tl_dynamics import scale

        scale.run_stats(testing.cached_model("gpt2"), ["a"], threads=0, progress=False)
    assert _args.threads_arg(str(os.cpu_count() + 1)) == os.cpu_count() + 1
    assert f"--threads {os.cpu_count() + 1} is more than this machine's" in caplog.text
    with pytest.raises(SystemExit):
        cli.main(["report", "--help"])
    assert "from: atlas, circuits," in " ".join(capsys.readouterr().out.split())


def test_compute_refuses_what_is_not_a_model_and_load_model_takes_paths(tmp_path):
    from tl_dynamics import atlas, circuits, contextual_mlp, odds_ratio, particles, trajectories

    for thing in ("code-2l", None, Path("code-2l"), 3):
        for compute in (
            odds_ratio.compute,
            trajectories.compute,
            atlas.compute,
            circuits.compute,
            contextual_mlp.compute,
            particles.compute,
            report.build_report,
        ):
            with pytest.raises(
                TLDynamicsError,
                match=f"expected a TransformerLens model .* got {type(thing).__name__}.*load_model",
            ):
                compute(thing, "a = 1")
    folder = ZOO / "induction-2l"
    assert type(models.load_model(folder)).__name__ == type(models.load_model(str(folder))).__name__
    with pytest.raises(TLDynamicsError, match="takes a model name or a folder path"):
        models.load_model(3)


def test_local_paths_that_are_not_folders_are_never_hub_names(tmp_path):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"x")
    cases = [
        (loop, "is a symlink that leads to no folder"),
        (tmp_path / "dangling", "is a symlink that leads to no folder"),
        (a_file, "is a file, not a model folder"),
        (tmp_path / "typo" / "model", f"no such folder \\({tmp_path} exists"),
        ("tests/no-such-model", "no such folder \\(tests exists"),
    ]
    hub = []
    original = models._load_hub
    models._load_hub = lambda name: hub.append(name)
    try:
        for name, message in cases:
            with pytest.raises(TLDynamicsError, match=message):
                models.load_model(str(name))
    finally:
        models._load_hub = original
    assert hub == []


def test_hf_shape_mismatch_names_the_mismatch_not_a_report_above(tmp_path):
    hf = testing.hf_folder("gpt2", tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    config["vocab_size"] += 8  # the weights no longer fit
    (hf / "config.json").write_text(json.dumps(config))
    with pytest.raises(TLDynamicsError) as err:
        models.load_model(hf)
    message = str(err.value)
    assert "above report" not in message and "report above" not in message
    assert "could not load the Hugging Face model folder" in message
    assert (
        "size mismatch): transformer.wte.weight is [512, 64] in the weights but [520, 64] by "
        "config.json" in message
    ), message
