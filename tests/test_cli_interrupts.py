"""Ctrl-C and SIGTERM are part of the interface (issue 42 item 2): a real ``tl-dynamics``
process, signalled at several points of ``stats`` and ``report``, prints one line saying what
was done, what is kept and the command that resumes, exits 130 (143 for SIGTERM), never a
traceback, and leaves nothing half-written; resuming with the printed command gives the bytes
of an uninterrupted run.

Cost: three stopped processes on the tiny random GPT-2 and induction-2l, and one resumed run in
this process: about 17 s on a loaded 2-core machine.
"""

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tl_dynamics import cli, scale

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


def corpus(folder: Path, n: int = 80) -> Path:
    path = folder / "corpus.txt"
    words = ["def", "x", "return", "a", "b", "+", "=", "(", ")", ":", "1", "2", "if", "else"]
    path.write_text(
        "\n".join(" ".join(words[(i * 7 + j) % 14] for j in range(3 + i % 9)) for i in range(n))
        + "\n"
    )
    return path


def start(argv: list[str], cwd: Path) -> subprocess.Popen:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    return subprocess.Popen(
        [sys.executable, "-m", "tl_dynamics", *argv],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def stop_when(
    process: subprocess.Popen, ready, sig: int, timeout: float = 120.0
) -> tuple[int, str]:
    """Send ``sig`` once ``ready()`` holds; the exit status and what the process wrote on stderr."""
    deadline = time.monotonic() + timeout
    while not ready() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert process.poll() is None, "the run ended before the signal: give it more work"
    process.send_signal(sig)
    _, err = process.communicate(timeout=120)
    return process.returncode, err


def the_line(err: str, how: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "tl-dynamics: stopped by" in line]
    assert len(lines) == 1 and lines[0].startswith(f"tl-dynamics: stopped by {how}: "), err
    return lines[0]


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_stats_stopped_keeps_its_checkpoint_and_resumes_to_the_same_bytes(tmp_path, monkeypatch):
    text = corpus(tmp_path)
    out = tmp_path / "s.safetensors"
    argv = ["stats", "--model", "tiny-random", "--prompts", text.name, "--out", out.name]
    argv += ["--batch-size", "4", "--checkpoint-every", "1", "--no-progress"]
    partial = Path(f"{out}.partial")
    code, err = stop_when(start(argv, tmp_path), partial.exists, signal.SIGINT)
    line = the_line(err, "Ctrl-C")
    assert code == 130 and not out.exists() and leftovers(tmp_path) == []
    kept = scale.load_stats(partial, allow_partial=True).n_prompts  # whole, and readable
    assert f"{partial.name} keeps the statistics of its first {kept} prompts" in line
    assert f"({out.name} is not written); resume with: " in line
    resume = shlex.split(line.split("resume with: ", 1)[1])
    assert resume[:3] == ["python", "-m", "tl_dynamics"] and resume[-1] == "--resume"
    monkeypatch.chdir(tmp_path)  # the printed command, run where it was printed (in-process)
    assert cli.main(resume[3:]) == 0
    once = tmp_path / "once.safetensors"
    assert cli.main([*argv[:4], str(text), "--out", str(once), *argv[7:]]) == 0
    assert out.read_bytes() == once.read_bytes() and not partial.exists()


def test_sigterm_before_the_first_checkpoint_writes_nothing_and_says_how_to_start(tmp_path):
    text = corpus(tmp_path, 40)
    out = tmp_path / "s.safetensors"
    argv = ["stats", "--model", "tiny-random", "--prompts", text.name, "--out", out.name]
    argv += ["--batch-size", "4", "--checkpoint-every", "1000", "--resume"]
    process = start(argv, tmp_path)
    began = time.monotonic()
    code, err = stop_when(process, lambda: time.monotonic() - began > 1.0, signal.SIGTERM)
    line = the_line(err, "SIGTERM")
    assert code == 143 and "no checkpoint was reached, so nothing was written" in line, line
    assert line.endswith(shlex.join(argv[:-1]))  # start again: without --resume
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt"]


def test_report_stopped_while_building_leaves_the_old_page(tmp_path):
    out = tmp_path / "r.html"
    out.write_text("the previous page")
    argv = ["report", "--model", "induction-2l", "--out", out.name, "--layers", "0"]
    process = start(argv, tmp_path)
    seen: list[str] = []

    def building() -> bool:
        seen.append(process.stderr.readline())
        return seen[-1].startswith("section ")

    code, err = stop_when(process, building, signal.SIGINT)
    line = the_line("".join(seen) + err, "Ctrl-C")
    assert code == 130 and re.search(r" s in, while section \w+: ", line), line
    assert line.endswith(
        "nothing was written (r.html is as it was); run it again with: python -m tl_dynamics "
        + shlex.join(argv)
    )
    assert out.read_text() == "the previous page" and leftovers(tmp_path) == []


def test_sigterm_reraised_as_a_plain_keyboardinterrupt_still_reads_as_sigterm(capsys):
    """Ray's ``ray.get`` catches the ``KeyboardInterrupt`` our SIGTERM handler raises in its
    wait and raises a plain one (the subclass is lost); the command must still say SIGTERM and
    exit 143, not 130 (seen as a flaky ``--ray local`` SIGTERM test before)."""
    from tl_dynamics import _interrupt

    def library_wait() -> None:  # what Ray's check_signals does with the handler's exception
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except KeyboardInterrupt:
            raise KeyboardInterrupt() from None

    with _interrupt.signals():
        try:
            library_wait()
        except KeyboardInterrupt as exc:
            assert type(exc) is KeyboardInterrupt
            code = _interrupt.stopped(exc, "test")
    assert code == 143 and "stopped by SIGTERM: test" in capsys.readouterr().err
    with _interrupt.signals():  # a fresh block: Ctrl-C is Ctrl-C again
        assert _interrupt.status(KeyboardInterrupt()) == 130


@pytest.mark.parametrize("where", ["the temporary's lock", "the write"])
def test_ctrl_c_during_an_atomic_write_waits_for_it_and_leaves_no_temporary(
    tmp_path, monkeypatch, where
):
    """Ctrl-C between creating the temporary file and the ``try`` that removes it left
    ``.NAME.XXXXXXXX.tmp`` behind (the stopped ``stats`` test above caught one); now the
    interrupt is held until the temporary is removed, then raised: the old file as it was (what
    every command's stop line says), no temporary."""
    from tl_dynamics import files

    target = tmp_path / "s.safetensors"
    target.write_bytes(b"old")
    fcntl, real_flock, real_fsync = files.fcntl, files.fcntl.flock, os.fsync

    def interrupted(real):
        def call(*args):
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, handled before the next bytecode
            time.sleep(0.05)
            return real(*args)

        return call

    if where == "the temporary's lock":
        monkeypatch.setattr(fcntl, "flock", interrupted(real_flock))
    else:
        monkeypatch.setattr(os, "fsync", interrupted(real_fsync))
    with pytest.raises(KeyboardInterrupt):
        files.write_bytes(target, b"new bytes")
    monkeypatch.undo()
    assert target.read_bytes() == b"old" and leftovers(tmp_path) == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers put back
