"""The Ray cluster of one ``ray_stats`` call: joined or started when asked (``ray_address``),
shut down afterwards whatever happens (a normal end, an error, SIGTERM), and a failure to
start said in one line with what to try.

Starting a local cluster on a loaded machine (``start``). Where Ray has a setting, it gets room:
a worker process may take ``REGISTER_S`` to register with its raylet
(``worker_register_timeout_seconds``; Ray's default 60 s is short for a worker that imports
torch at niceness 15 beside busy cores). Two waits have no setting in Ray 2.60: its raylet
aborts when its dashboard agent has not reported its ports within 15 s of starting (about 10 s
on an idle 2-core machine, 20 s at load 6: ``agent_register_timeout_ms`` and
``raylet_start_wait_time_s`` do not reach it), and ``ray.init`` gives the node 30 s to register.
Past them the start fails as one line that says to try again on a less busy machine. A failed
start leaves nothing running: Ray's ``shutdown`` cannot reach its processes (the node object
was never made) and the agents of a raylet that aborted outlive it, so every process the start
began carries a mark in its environment and each one still running is ended.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from tl_dynamics.errors import TLDynamicsError

REGISTER_S = 600
# in the environment of every process a local start begins (its value names the start)
MARK = "TL_DYNAMICS_RAY_START"


def _first_line(exc: BaseException) -> str:
    """The first sentence of an exception's message (Ray's run to many lines)."""
    text = str(exc).strip()
    return (text.splitlines()[0].split(". ")[0] if text else type(exc).__name__).rstrip(".")


def startup_failure(address: str, exc: BaseException) -> TLDynamicsError:
    """The one line for a cluster that could not be started or joined, with what to try."""
    if address == "local":
        doing = "start a local cluster"
        tries = (
            "try again when the machine is less busy (Ray's processes time out starting on a "
            "loaded machine), check free memory and space for Ray's session files in /tmp, or "
            "start one yourself with `ray start --head` and pass --ray auto"
        )
    elif address == "auto":
        doing = "find a running cluster (--ray auto)"
        tries = (
            "start one with `ray start --head`, set RAY_ADDRESS, or pass --ray local to start "
            "one for this run"
        )
    else:
        doing = f"join the cluster at {address!r}"
        tries = (
            f"check that its head node is up and reachable from here (`ray status --address "
            f"{address}`), or pass --ray local to start one for this run"
        )
    return TLDynamicsError(
        f"Ray could not {doing} ({type(exc).__name__}: {_first_line(exc)}); {tries}"
    )


class Terminated(SystemExit):
    """SIGTERM while this call's cluster runs: unwinds (checkpoint, actors, cluster) and exits
    with 128 + 15, as the signal's default would."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated(128 + signum)


def _handlers(main: bool) -> dict[int, Any]:
    """The Python handlers of SIGTERM and SIGINT now (none off the main thread)."""
    if not main:
        return {}
    return {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}


@contextmanager
def cluster(ray: Any, address: str | None) -> Iterator[bool]:
    """Join (``"auto"``, ``ray://HOST:PORT``, ``HOST:PORT``) or start (``"local"``) a Ray
    cluster for the body, unless Ray is initialised already or ``address`` is None; yields
    whether it did. What it started is shut down on leaving, however the body ends. Ray's
    driver installs its own SIGTERM handler (it prints a stack and aborts, leaving the cluster
    behind): the handlers from before are put back, and where SIGTERM had none, one that unwinds
    the body (checkpoint, actors, cluster) and exits with 128 + 15."""
    if address is None or ray.is_initialized():
        yield False
        return
    main = threading.current_thread() is threading.main_thread()
    before = _handlers(main)
    try:
        start(ray, address)  # "local": a new cluster here, even where RAY_ADDRESS is set
    except TLDynamicsError:
        _restore(before)
        raise
    _restore(before, terminate=True)
    try:
        yield True
    finally:
        if main:  # a second SIGTERM must not cut the shutdown short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            ray.shutdown()
        finally:
            _restore(before)


def _restore(before: dict[int, Any], terminate: bool = False) -> None:
    """Put the Python handlers back (``terminate``: SIGTERM's default becomes ``Terminated``)."""
    for sig, handler in before.items():
        if handler is None:  # set outside Python before: not ours to change
            continue
        if terminate and sig == signal.SIGTERM and handler == signal.SIG_DFL:
            handler = _raise_terminated
        signal.signal(sig, handler)


def start(ray: Any, address: str, **options: Any) -> None:
    """``ray.init(address=address, **options)`` without a dashboard or the workers' logs; a
    local cluster (``"local"``) with the room Ray's settings give a loaded machine (see this
    module's docstring). A failure is one ``TLDynamicsError`` line with what to try, and leaves
    no process of the failed start running."""
    options = {
        "include_dashboard": False,
        "log_to_driver": False,
        "logging_level": "ERROR",
        **options,
    }
    local = address == "local"
    if local:
        config = {"worker_register_timeout_seconds": REGISTER_S}
        options["_system_config"] = config | options.get("_system_config", {})
    mark, before = uuid.uuid4().hex, os.environ.get(MARK)
    if local:
        os.environ[MARK] = mark  # inherited by every process the start begins
    try:
        ray.init(address=address, **options)
    except Exception as exc:  # noqa: BLE001 - Ray raises many kinds here; all are one line
        ray.shutdown()  # whatever half started and Ray can still reach
        if local:
            _end(marked(mark))
        raise startup_failure(address, exc) from None
    finally:
        if local:
            if before is None:
                os.environ.pop(MARK, None)
            else:
                os.environ[MARK] = before


def marked(mark: str) -> list[int]:
    """The live processes (this one aside) whose environment holds ``MARK=mark`` (Linux
    ``/proc``, readable for this user's processes only; none found elsewhere)."""
    wanted = f"{MARK}={mark}".encode()
    try:
        names = [n for n in os.listdir("/proc") if n.isdigit() and int(n) != os.getpid()]
    except OSError:
        return []
    found = []
    for name in names:
        try:
            environ = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
        except OSError:  # gone, or another user's
            continue
        if wanted in environ and _alive(int(name)):
            found.append(int(name))
    return found


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie is dead)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except (OSError, IndexError):
        return False


def _end(pids: list[int], grace_s: float = 10.0) -> None:
    """SIGTERM to each process, then SIGKILL to those still alive after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [pid for pid in pids if _alive(pid)]
