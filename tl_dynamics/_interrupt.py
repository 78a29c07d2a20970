"""Ctrl-C and SIGTERM on the command line: one line, an exit status (130, 143), no traceback.

``signals()`` makes SIGTERM raise ``Terminated`` (a ``KeyboardInterrupt``) where the program is,
as Ctrl-C raises ``KeyboardInterrupt``: the same clean-up runs (``finally`` blocks, the atomic
writes of ``tl_dynamics.files`` that remove their temporary file), so nothing is half-written.
Each command catches the interrupt and says, in one line, what was done, what is kept and the
command that resumes (``stopped``).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
import threading
from typing import Iterator, Sequence


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C's ``KeyboardInterrupt``."""


# Whether SIGTERM arrived inside ``signals()``: a library that catches the ``KeyboardInterrupt``
# raised in its own wait and raises a plain one (Ray's ``ray.get`` does) loses the subclass, so
# the signal that stopped the command is read from here too.
_terminated = False


def _raise_terminated(signum: int, frame: object) -> None:
    global _terminated
    _terminated = True
    raise Terminated()


def _is_sigterm(exc: BaseException) -> bool:
    return isinstance(exc, Terminated) or _terminated


@contextlib.contextmanager
def signals() -> Iterator[None]:
    """SIGTERM raises ``Terminated`` inside the block (the main thread only; the previous
    handler is restored after)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    global _terminated
    _terminated = False
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def status(exc: BaseException) -> int:
    """The exit status of a process stopped by this signal: 128 + its number."""
    return 128 + (signal.SIGTERM if _is_sigterm(exc) else signal.SIGINT)


def command(argv: Sequence[str], add: Sequence[str] = (), drop: Sequence[str] = ()) -> str:
    """The command line that ran, as the user can paste it, with ``add`` switches appended
    (when absent) and ``drop`` switches removed."""
    main = os.path.basename(sys.argv[0] or "")
    prog = ["tl-dynamics"] if main in ("tl-dynamics", "") else ["python", "-m", "tl_dynamics"]
    words = [w for w in argv if w not in drop]
    words += [w for w in add if w not in words]
    line = shlex.join([*prog, *words])
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        line = f"the same torchrun command with: {shlex.join(words)}"
    return line


def stopped(exc: BaseException, text: str) -> int:
    """Print ``text`` as the one line about an interrupt (further signals are ignored while
    it prints) and return the exit status."""
    how = "SIGTERM" if _is_sigterm(exc) else "Ctrl-C"
    with _quiet():
        sys.stderr.write(f"\ntl-dynamics: stopped by {how}: {text}\n")
        sys.stderr.flush()
    return status(exc)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
