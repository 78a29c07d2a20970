"""The Ray cluster of one ``ray_stats`` call: joined or started when asked (``ray_address``),
shut down afterwards whatever happens (a normal end, an error, SIGTERM), and a failure to
start said in one line with what to try."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator

from tl_dynamics.errors import TLDynamicsError


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
        ray.init(
            address=address,  # "local": a new cluster here, even where RAY_ADDRESS is set
            include_dashboard=False,
            log_to_driver=False,
            logging_level="ERROR",
        )
    except Exception as exc:  # noqa: BLE001 - Ray raises many kinds here; all are one line
        ray.shutdown()  # whatever half started
        _restore(before)
        raise startup_failure(address, exc) from None
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
