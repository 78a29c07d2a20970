"""Points where a process under test stops until the test acts: a signal or a kill lands at the
point named, on an idle machine or a loaded one, never at whatever point the clock reached.

Every point is claimed once (across processes and restarts) through a file in a folder the test
names: the first process to reach it writes its pid to ``POINT.pid`` and waits there; the test
waits for that file (an event), then acts.

**Ray workers** (issue 43's fault tests): ``KillPoints`` is a model loader for ``ray_stats``,
imported on the workers (the test puts this folder on their ``PYTHONPATH``):

- ``loading``: the first worker to load waits there (the test kills it);
- ``mid``: the first forward pass over a batch whose text holds ``mid`` does the same;
- ``hold``: a forward pass over a batch whose text holds ``hold`` writes ``hold.pid`` and waits
  until ``go`` exists (the test kills it after the checkpoint appears, then creates ``go``).

Every process that loads writes ``loaded-PID``, so the test can see which processes a run used.

**The command line** (issue 49's signal tests): run as a program,

    python tests/fault_points.py FOLDER POINT CLI-ARGUMENTS...

is ``tl-dynamics CLI-ARGUMENTS...`` (``tl_dynamics.cli.main``) stopped at ``POINT``, where it
waits until a signal's handler raises there (the interrupt then unwinds from that point, as it
would had the signal come just then) or the test kills it:

- ``batch``: ``stats``, as its first batch starts (before any checkpoint);
- ``checkpoint``: ``stats``, once its first checkpoint (``OUT.partial``) is written;
- ``section``: ``report``, as its first section starts (its ``section NAME ...`` line printed);
- ``write``: inside an atomic write (``tl_dynamics.files``): the temporary file written, not yet
  renamed into place.

A point the code no longer reaches fails the test that waits for it, by name (``reached``).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

# the longest a stopped process waits for the test (a safety net: the test acts in seconds)
WAIT_S = 900.0


def claim(folder: str | os.PathLike, point: str) -> bool:
    """Write this pid to ``FOLDER/POINT.pid`` if no process did before; True if this one did."""
    try:
        fd = os.open(Path(folder) / f"{point}.pid", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    return True


def wait_here(point: str, until: Callable[[], bool] = lambda: False) -> None:
    """Wait at ``point`` until ``until()`` holds, a signal's handler raises (the test's Ctrl-C
    or SIGTERM), or the process is killed; past ``WAIT_S``, exit saying so."""
    deadline = time.monotonic() + WAIT_S
    while not until():
        if time.monotonic() > deadline:
            sys.exit(f"fault_points: nothing came in {WAIT_S:.0f} s at the point {point!r}")
        time.sleep(0.05)


def reached(folder: Path, point: str, process: Any = None, timeout: float = WAIT_S) -> Path | None:
    """Wait until a process claimed ``point`` in ``folder`` (its marker, or None when
    ``process`` ended first); fails naming the point when neither happens in ``timeout`` s (a
    safety net)."""
    marker = Path(folder) / f"{point}.pid"
    deadline = time.monotonic() + timeout
    while not marker.exists():
        if process is not None and process.poll() is not None:
            return None
        assert time.monotonic() < deadline, f"no process reached the point {point!r}"
        time.sleep(0.02)
    return marker


class KillPoints:
    def __init__(self, name: str, folder: str, points: tuple[str, ...]):
        self.name, self.folder, self.points = name, folder, points

    def __call__(self) -> Any:
        from tl_dynamics import models

        (Path(self.folder) / f"loaded-{os.getpid()}").touch()
        self._claim("loading")
        model = models.resolve(self.name).model
        model.register_forward_pre_hook(self._forward, with_kwargs=True)
        return model

    def _claim(self, point: str) -> bool:
        if point not in self.points or not claim(self.folder, point):
            return False
        if point != "hold":
            wait_here(point)  # the test's SIGKILL ends this process here
        return True

    def _forward(self, module: Any, args: tuple, kwargs: dict) -> None:
        tokens = args[0] if args else kwargs.get("input")
        if not hasattr(tokens, "shape") or tokens.ndim != 2 or tokens.shape[0] < 2:
            return  # the self-check's one-row probe, not a batch of the corpus
        text = " ".join(module.tokenizer.decode(row) for row in tokens)
        if "mid" in text:
            self._claim("mid")
        if "hold" in text and "hold" in self.points:
            self._claim("hold")
            wait_here("hold", (Path(self.folder) / "go").exists)


def _stop(folder: str, point: str) -> None:
    if claim(folder, point):
        wait_here(point)


def _before(folder: str, point: str, real: Callable) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        _stop(folder, point)
        return real(*args, **kwargs)

    return call


def stop_cli_at(folder: str, point: str) -> None:
    """Make this process's ``tl_dynamics`` stop at ``point`` (the module docstring's list)."""
    if point == "batch":
        from tl_dynamics.scale import _shard

        _shard.ShardRunner.add = _before(folder, point, _shard.ShardRunner.add)
    elif point == "checkpoint":
        from tl_dynamics import files

        write_bytes = files.write_bytes

        def written(path: Any, data: bytes) -> Path:
            done = write_bytes(path, data)
            if str(path).endswith(files.PARTIAL_SUFFIX):
                _stop(folder, point)
            return done

        files.write_bytes = written
    elif point == "section":
        from tl_dynamics import report

        report.attention_section = _before(folder, point, report.attention_section)
    elif point == "write":
        from tl_dynamics import files

        files.os.fsync = _before(folder, point, os.fsync)
    else:
        raise SystemExit(f"fault_points: no point {point!r}")


if __name__ == "__main__":
    stop_cli_at(sys.argv[1], sys.argv[2])
    from tl_dynamics import cli

    sys.exit(cli.main(sys.argv[3:]))
