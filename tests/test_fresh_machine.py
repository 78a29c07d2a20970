"""A fresh machine and the newest releases (issue 31 items 1, 2, 5, 6, 7): locked installs, the
canary's diff, versions on record, writes that fail say so, and no package installs at load."""

import errno
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tl_dynamics import compat, files
from tl_dynamics._installs import InstallRefused, is_installer, refusing_installs
from tl_dynamics.errors import TLDynamicsError

ROOT = Path(__file__).resolve().parents[1]
LOCKS = {
    "tl4": ROOT / "requirements" / "lock-tl4.txt",
    "tl3": ROOT / "requirements" / "lock-tl3.txt",
}
sys.path.insert(0, str(ROOT / "scripts"))
import lock  # noqa: E402  (scripts/lock.py)


# -- 1. the lock -------------------------------------------------------------------------------
def test_lock_files_pin_the_host_stack_and_agree_with_TESTED_ON():
    pins = {name: lock.read_lock(path) for name, path in LOCKS.items()}
    for env, major in (("tl4", "4."), ("tl3", "3.")):
        assert pins[env]["transformer-lens"].startswith(major), (env, pins[env]["transformer-lens"])
        assert pins[env]["transformers"] == compat.TESTED_ON["transformers"], env
        assert pins[env]["torch"] == compat.TESTED_ON["torch"], env
        assert all("==" not in v and v for v in pins[env].values())
        assert "tl-dynamics" not in pins[env]  # the project itself is never pinned
    tested = compat.TESTED_ON["transformer-lens"]
    assert pins["tl4"]["transformer-lens"] in tested and pins["tl3"]["transformer-lens"] in tested


@pytest.mark.parametrize(
    "target, env", [(".venv/.installed", "tl4"), (".venv-tl3/.installed", "tl3")]
)
def test_make_installs_every_package_of_the_test_environments_from_its_lock(target, env):
    plan = subprocess.run(
        ["make", "-n", "-B", target], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    pip_lines = [line for line in plan.splitlines() if "/bin/pip install" in line]
    rel = f"requirements/{LOCKS[env].name}"
    # every pip call but torch's own (the local CPU wheel, pinned by TORCH and by the lock) is
    # constrained by the lock
    unconstrained = [
        line for line in pip_lines if f"-c {rel}" not in line and "torch==" not in line
    ]
    assert pip_lines and not unconstrained, unconstrained
    assert any("-e " in line and f"-c {rel}" in line for line in pip_lines)
    torch_line = next(line for line in pip_lines if "torch==" in line)
    assert f"torch=={lock.read_lock(LOCKS[env])['torch']}" in torch_line


def test_lock_diff_names_exactly_the_packages_that_moved(tmp_path, capsys):
    venv = Path(sys.prefix)
    here = tmp_path / "lock.txt"
    lock.freeze(venv, here)
    pins = lock.read_lock(here)
    import torch

    # the local label (+cpu, +cu130) is dropped; the installed release need not be the locked one
    # (the canary runs this in environments of the newest releases)
    assert pins["torch"] == torch.__version__.split("+")[0]
    moved = here.read_text().replace(f"\nnumpy=={pins['numpy']}\n", "\nnumpy==0.0.1\n")
    here.write_text(moved + "a-package-that-left==1.0\n")
    capsys.readouterr()
    assert lock.diff(venv, here) == 2
    out = capsys.readouterr().out
    assert f"numpy: lock 0.0.1 -> newest {pins['numpy']}" in out
    assert "a-package-that-left: lock 1.0 -> newest -" in out


# -- 5. versions on record ----------------------------------------------------------------------
def test_versions_name_the_stack_and_the_device(capsys):
    import torch
    import transformers

    found = compat.versions()
    assert found["torch"] == torch.__version__
    assert found["transformers"] == transformers.__version__
    assert found["transformer-lens"] == compat.tl_version()
    assert found["device"].startswith("cuda:0" if torch.cuda.is_available() else "cpu")
    from tl_dynamics import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])  # read from the packages' metadata: torch is not asked
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for name, value in found.items():
        assert f"{name:<16} {value}" in out or name == "device"
    assert "device           not asked (in Python: tl_dynamics.show_versions())" in out
    assert "tested with" in out and compat.TESTED_ON["transformers"] in out
    compat.show_versions()  # the device, from torch
    assert f"{'device':<16} {found['device']}" in capsys.readouterr().out


def test_the_report_header_names_the_versions():
    from tl_dynamics import report, testing

    page = report.build_report(testing.cached_model("gpt2"), "ab", sections=(), threads=None)
    meta = dict(page.meta)
    assert meta["versions"] == compat.versions_line()
    assert f"transformers {compat.versions()['transformers']}" in meta["versions"]


# -- 6. writes that fail say so -----------------------------------------------------------------
def test_an_output_folder_that_takes_no_files_is_refused_before_any_work(monkeypatch):
    from tl_dynamics import cli, models

    def must_not_load(*_a, **_k):
        raise AssertionError("the model was loaded although the output cannot be written")

    monkeypatch.setattr(models, "resolve", must_not_load)
    with pytest.raises(TLDynamicsError, match=r"/proc/x\.html.*cannot create a file in /proc"):
        files.check_output("/proc/x.html")
    assert cli.main(["report", "--out", "/proc/x.html"]) == 2
    assert not Path("/proc/x.html").exists()


def test_a_failed_write_is_an_error_naming_the_path_and_leaves_the_old_file_whole(
    tmp_path, monkeypatch
):
    target = tmp_path / "report.html"
    target.write_text("the old report")

    def disk_full(_fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(TLDynamicsError, match=rf"could not write {target}.*No space left"):
        files.write_text(target, "a new report")
    assert target.read_text() == "the old report"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]  # no temporary left


def test_check_output_leaves_no_probe_behind(tmp_path):
    files.check_output(tmp_path / "x.html")
    assert list(tmp_path.iterdir()) == []


# -- 7. no installs at load ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "command, installer",
    [
        (["uv", "pip", "install", "torchvision", "-q"], True),
        ([sys.executable, "-m", "pip", "install", "torchvision", "-q"], True),
        ("/usr/bin/pip3 install x", True),
        (["python3.11", "-m", "ensurepip"], True),
        (["conda", "install", "x"], True),
        (["git", "status"], False),
        (["python", "-c", "print('pip install')"], False),
        ("", False),
    ],
)
def test_installer_command_lines_are_recognised(command, installer):
    assert is_installer(command) is installer


def test_refusing_installs_refuses_installers_only_and_restores_popen():
    before = subprocess.Popen
    with refusing_installs() as refused:
        with pytest.raises(InstallRefused):
            subprocess.check_call([sys.executable, "-m", "pip", "install", "nothing-at-all"])
        assert subprocess.run([sys.executable, "-c", "pass"], check=True).returncode == 0
    assert subprocess.Popen is before
    assert refused == ["python -m pip install nothing-at-all"]


@pytest.mark.slow
def test_loading_a_multimodal_folder_starts_no_subprocess(tmp_path, monkeypatch):
    """TransformerLens 4.3 runs ``pip install torchvision`` while booting a multimodal folder
    when torchvision is missing; loading through tl_dynamics must start no subprocess."""
    import torch
    import transformers

    from tl_dynamics import load_model, testing

    started = []
    real = subprocess.Popen

    class Recording(real):  # records, and never lets a command run (no install, even if failing)
        def __init__(self, args, *rest, **kwargs):
            started.append(args)
            raise OSError("subprocess blocked by the test")

    monkeypatch.setattr(subprocess, "Popen", Recording)
    tok = testing.tokenizer()
    text = transformers.MistralConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    vision = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=16, patch_size=8,
    )  # fmt: skip
    config = transformers.LlavaConfig(
        text_config=text, vision_config=vision, image_token_index=len(tok) - 1
    )
    torch.manual_seed(0)
    transformers.LlavaForConditionalGeneration(config).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            load_model(tmp_path)
        except TLDynamicsError as exc:  # a host that cannot boot Llava: still, nothing may start
            print("not loaded:", exc)
    assert started == []
    try:
        import torchvision  # noqa: F401
    except ImportError:
        if compat.tl_major_version() >= 4:  # 4.x tries to install it: refused, and said so
            said = [str(w.message) for w in caught if "install a package" in str(w.message)]
            assert said and "pip install torchvision" in said[0], said
