"""Which TransformerLens is installed, and which host a model is: the one place that asks.

TransformerLens 3.x ships both the legacy ``HookedTransformer`` and ``TransformerBridge``;
4.x ships only ``TransformerBridge``. Everything in tl_dynamics that depends on the installed
version or on a model's class asks here (the adapter, the zoo, ``models`` and ``testing``).

Example:
    >>> from tl_dynamics import compat
    >>> compat.tl_major_version() in (3, 4)
    True
    >>> compat.has_hooked_transformer() == (compat.tl_major_version() < 4)
    True
"""

from __future__ import annotations

import importlib
import platform
from importlib import metadata
from typing import Any, Literal

from tl_dynamics.errors import TLDynamicsError

Host = Literal["hooked", "bridge"]
HOSTS: tuple[Host, ...] = ("hooked", "bridge")

__all__ = [
    "HOSTS",
    "TESTED_ON",
    "Host",
    "bridge_class",
    "default_host",
    "detect_host",
    "has_hooked_transformer",
    "show_versions",
    "tl_major_version",
    "tl_version",
    "versions",
    "versions_line",
]

# The versions the test suite last passed with: the pins of requirements/lock-tl4.txt and
# lock-tl3.txt (tests/test_versions.py holds this table to the lock files, so `make lock`
# followed by a green `make test` is what moves it). Error messages about host internals name them.
TESTED_ON: dict[str, str] = {
    "torch": "2.13.0",
    "transformers": "5.24.0",
    "transformer-lens": "4.3.0 and 3.9.0",
}


def tl_version() -> str:
    """The installed TransformerLens version string (``"unknown"`` if it cannot be read)."""
    try:
        return metadata.version("transformer-lens")
    except metadata.PackageNotFoundError:
        return str(getattr(importlib.import_module("transformer_lens"), "__version__", "unknown"))


def tl_major_version() -> int:
    """The installed TransformerLens major version (3 or 4)."""
    head = tl_version().split(".")[0]
    return int(head) if head.isdigit() else 0


def has_hooked_transformer() -> bool:
    """Whether this TransformerLens still ships ``HookedTransformer`` (3.x does, 4.x does not)."""
    tl = importlib.import_module("transformer_lens")
    try:
        return getattr(tl, "HookedTransformer", None) is not None
    except ImportError:  # 4.x raises ImportError with a migration note
        return False


def default_host() -> Host:
    """``"hooked"`` where ``HookedTransformer`` exists (TransformerLens 3.x), else ``"bridge"``."""
    return "hooked" if has_hooked_transformer() else "bridge"


def bridge_class() -> Any:
    """``TransformerBridge`` from wherever this TransformerLens version keeps it."""
    tl = importlib.import_module("transformer_lens")
    if hasattr(tl, "TransformerBridge"):
        return tl.TransformerBridge
    return importlib.import_module("transformer_lens.model_bridge").TransformerBridge


def detect_host(model: Any) -> Host:
    """``"hooked"`` for a ``HookedTransformer``, ``"bridge"`` for a ``TransformerBridge``.

    Anything else raises ``TLDynamicsError`` naming the type that was given.

    Example:
        >>> detect_host(object())
        Traceback (most recent call last):
        ...
        tl_dynamics.errors.TLDynamicsError: expected a TransformerLens model (HookedTransformer or TransformerBridge), got an object of type builtins.object
    """
    names = {cls.__name__ for cls in type(model).__mro__}
    if "HookedTransformer" in names:
        return "hooked"
    if "TransformerBridge" in names:
        return "bridge"
    raise TLDynamicsError(
        f"expected a TransformerLens model (HookedTransformer or TransformerBridge), "
        f"got an object of type {type(model).__module__}.{type(model).__name__}"
    )


def _dist_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def versions(device: bool = True) -> dict[str, str]:
    """What this session runs on: tl-dynamics, Python, torch, transformers, TransformerLens and
    the device torch would use first (``cuda:0`` and its name, else ``cpu``). Without
    ``device``, every version is read from the installed packages' metadata: nothing is
    imported (``tl-dynamics --version``, instantly), and the device is not asked.

    Example:
        >>> sorted(versions())
        ['device', 'python', 'tl-dynamics', 'torch', 'transformer-lens', 'transformers']
        >>> "device" in versions(device=False)
        False
    """
    from tl_dynamics import __version__

    found = {
        "tl-dynamics": __version__,
        "python": platform.python_version(),
        "torch": _dist_version("torch"),
        "transformers": _dist_version("transformers"),
        "transformer-lens": tl_version(),
    }
    if not device:
        return found
    import torch

    if torch.cuda.is_available():
        found["device"] = f"cuda:0 ({torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda})"
    else:
        found["device"] = "cpu (no CUDA device visible to torch)"
    return {**found, "torch": torch.__version__}


def versions_line() -> str:
    """``versions()`` on one line (the report's header, error messages)."""
    return ", ".join(f"{name} {value}" for name, value in versions().items())


def show_versions(device: bool = True) -> None:
    """Print ``versions()``, one per line, with the versions the tests last passed with: paste
    it into a bug report (``tl-dynamics --version`` prints the same without the device, which
    needs torch imported).

    Example:
        >>> show_versions()  # doctest: +ELLIPSIS
        tl-dynamics      0.1.0
        ...
        tested with      ...
    """
    import sys

    lines = [f"{name:<16} {value}" for name, value in versions(device).items()]
    if not device:
        lines.append(f"{'device':<16} not asked (in Python: tl_dynamics.show_versions())")
    tested = ", ".join(f"{name} {value}" for name, value in TESTED_ON.items())
    sys.stdout.write("\n".join([*lines, f"{'tested with':<16} {tested}"]) + "\n")
