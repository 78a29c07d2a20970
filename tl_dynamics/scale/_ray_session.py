"""The Ray cluster of one ``ray_stats`` call: joined or started when asked (``ray_address``),
shut down afterwards whatever happens (a normal end, an error, SIGTERM), and a failure to
start said in one line with what to try.

A local cluster gets the time a loaded machine needs to start (``start``): a worker process
may take ``REGISTER_S`` to register with its raylet (Ray's setting
``worker_register_timeout_seconds``, 60 s by default: a worker imports torch before it
registers), and the node ``START_S`` to register with the GCS. Ray 2.60 waits 30 s for the
latter, a constant in ``ray/_private/node.py`` rather than a setting, while its raylet
registers only once its Python agents have started (10 s on an idle 2-core machine, more than
30 s at load 5): so while ``ray.init`` starts the cluster, the lookup that wait repeats waits
itself, as long as the node's raylet lives. A start that fails anyway ends the processes it
left (Ray's ``shutdown`` cannot reach them: its node object was never made), so no GCS,
raylet, dashboard or agent outlives it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Iterator

from tl_dynamics.errors import TLDynamicsError

REGISTER_S = 600
START_S = 300


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
    """``ray.init(address=address, **options)`` without a dashboard or the workers' logs, with
    the room a loaded machine needs to start a local cluster (``"local"``; see this module's
    docstring). A failure is one ``TLDynamicsError`` line with what to try, and leaves no process
    of the failed start behind."""
    options = {
        "include_dashboard": False,
        "log_to_driver": False,
        "logging_level": "ERROR",
        **options,
    }
    root = os.path.dirname(getattr(ray, "__file__", None) or "")
    local = address == "local"
    if local:
        config = {"worker_register_timeout_seconds": REGISTER_S}
        options["_system_config"] = config | options.get("_system_config", {})
    earlier = set(_descendants()) if local else set()
    try:
        with _patient(ray, root) if local else nullcontext():
            ray.init(address=address, **options)
    except Exception as exc:  # noqa: BLE001 - Ray raises many kinds here; all are one line
        ray.shutdown()  # whatever half started and Ray can still reach
        if local and root:
            _end(pid for pid, line in _descendants().items() if pid not in earlier and root in line)
        raise startup_failure(address, exc) from None


@contextmanager
def _patient(ray: Any, root: str) -> Iterator[None]:
    """While the body runs, Ray's lookup of a starting node waits for the node itself (up to
    ``START_S``, while its raylet lives) instead of failing at once."""
    services = getattr(getattr(ray, "_private", None), "services", None)
    real = getattr(services, "get_node", None)
    if real is None:
        yield
        return
    raylet = os.path.join(root, "core", "src", "ray", "raylet", "raylet")

    def get_node(*args: Any, **kwargs: Any) -> Any:
        deadline = time.monotonic() + START_S
        while True:
            try:
                return real(*args, **kwargs)
            except RuntimeError:  # not registered yet
                alive = not Path("/proc").is_dir() or any(
                    raylet in line for line in _descendants().values()
                )
                if not alive or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    services.get_node = get_node
    try:
        yield
    finally:
        services.get_node = real


def _descendants(pid: int | None = None) -> dict[int, str]:
    """The live processes under ``pid`` (default: this one), with their command lines (Linux
    ``/proc``; none found elsewhere)."""
    parents: dict[int, int] = {}
    lines: dict[int, str] = {}
    try:
        names = [n for n in os.listdir("/proc") if n.isdigit()]
    except OSError:
        return {}
    for name in names:
        try:
            state, parent = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[:2]
            line = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, ValueError):  # gone meanwhile
            continue
        if state not in ("Z", "X"):  # a zombie is dead
            parents[int(name)], lines[int(name)] = int(parent), line.decode(errors="replace")
    found: dict[int, str] = {}
    frontier = [os.getpid() if pid is None else pid]
    while frontier:
        here = frontier.pop()
        for child, parent in parents.items():
            if parent == here and child not in found:
                found[child] = lines[child]
                frontier.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except (OSError, IndexError):
        return False


def _end(pids: Any, grace_s: float = 30.0) -> None:
    """SIGTERM to each process, then SIGKILL to those still alive after ``grace_s``."""
    pids = list(pids)
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
