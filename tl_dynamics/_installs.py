"""No package installs while a model loads (a bottom-layer module).

Reading a user's model folder must never change the user's environment. TransformerLens 4.3's
multimodal boot calls ``_ensure_torchvision()``, which runs ``pip install torchvision`` (or
``uv pip install``) when torchvision is missing; on a machine with a CPU torch that pulled a
CUDA build and about 20 packages. ``refusing_installs()`` is held around every load
(``tl_dynamics.models``): while it is held, a subprocess that would run a package installer
(pip, uv, conda, mamba, poetry, easy_install, ``python -m pip``/``ensurepip``) is refused with
``InstallRefused`` (an ``OSError``, as a failed start of a program is, so the host takes its own
fall-back), and each refused command is reported afterwards as a ``UserWarning`` naming what it
would have installed and how to install it by hand. Other subprocesses are left alone.

Example:
    >>> import subprocess, sys
    >>> with refusing_installs() as refused:
    ...     try:
    ...         subprocess.check_call([sys.executable, "-m", "pip", "install", "torchvision"])
    ...     except OSError as exc:
    ...         print(type(exc).__name__)
    InstallRefused
    >>> refused
    ['python -m pip install torchvision']
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import threading
from pathlib import PurePath
from typing import Any, Callable, Iterator, Sequence, TypeVar

_F = TypeVar("_F", bound=Callable[..., Any])

__all__ = ["InstallRefused", "is_installer", "no_installs", "refusing_installs"]

_INSTALLERS = {"pip", "pip3", "uv", "conda", "mamba", "micromamba", "poetry", "easy_install"}
_MODULES = {"pip", "ensurepip", "uv"}
_LOCK = threading.Lock()


class InstallRefused(OSError):
    """A package installer that a library tried to run while tl_dynamics loaded a model."""


def _words(args: Any) -> list[str]:
    if isinstance(args, (str, bytes, os.PathLike)):
        text = os.fsdecode(args) if not isinstance(args, str) else args
        try:
            return shlex.split(text)
        except ValueError:
            return text.split()
    if isinstance(args, Sequence):
        return [os.fsdecode(a) if isinstance(a, (bytes, os.PathLike)) else str(a) for a in args]
    return [str(args)]


def is_installer(args: Any) -> bool:
    """Whether a subprocess command line runs a package installer: its program is one
    (``pip``, ``uv``, ...), or it is a Python running ``-m pip``/``-m ensurepip``/``-m uv``.

    Example:
        >>> is_installer(["uv", "pip", "install", "torchvision", "-q"]), is_installer("git status")
        (True, False)
    """
    words = _words(args)
    if not words:
        return False
    program = PurePath(words[0]).name.lower()
    if program.split(".")[0] in _INSTALLERS:
        return True
    if program.startswith("python"):
        for flag, module in zip(words[1:], words[2:]):
            if flag == "-m" and module in _MODULES:
                return True
    return False


def _shown(args: Any) -> str:
    words = _words(args)
    if words and PurePath(words[0]).name.startswith("python"):
        words = ["python", *words[1:]]
    return " ".join(words)


@contextlib.contextmanager
def refusing_installs() -> Iterator[list[str]]:
    """Refuse package-installer subprocesses while held; yields the list of refused commands
    (filled as they are refused), and warns once per refused command on exit."""
    refused: list[str] = []
    with _LOCK:
        original = subprocess.Popen

        class _Guarded(original):  # type: ignore[misc, valid-type]
            def __init__(self, args: Any, *rest: Any, **kwargs: Any) -> None:
                if is_installer(args):
                    refused.append(_shown(args))
                    raise InstallRefused(
                        f"tl_dynamics does not let a library install packages while it loads a "
                        f"model (refused: {_shown(args)})"
                    )
                super().__init__(args, *rest, **kwargs)

        subprocess.Popen = _Guarded  # type: ignore[misc]
    try:
        yield refused
    finally:
        with _LOCK:
            subprocess.Popen = original  # type: ignore[misc]
        if refused:
            import warnings

            for command in refused:
                wanted = [w for w in command.split() if w not in ("install", "-q", "pip", "uv")]
                warnings.warn(
                    f"while the model loaded, a library (TransformerLens) tried to install a "
                    f"package: `{command}`. tl_dynamics refused it (it never changes your "
                    f"environment); the model loaded without it. If you need it, install it "
                    f"yourself: pip install {' '.join(wanted[-1:]) or '<package>'}",
                    UserWarning,
                    stacklevel=3,
                )


def no_installs(function: _F) -> _F:
    """Decorate a loader so that it runs inside ``refusing_installs()``."""
    import functools

    @functools.wraps(function)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        with refusing_installs():
            return function(*args, **kwargs)

    return guarded  # type: ignore[return-value]
