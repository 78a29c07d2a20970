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
from importlib import metadata
from typing import Any, Literal

from tl_dynamics.errors import TLDynamicsError

Host = Literal["hooked", "bridge"]
HOSTS: tuple[Host, ...] = ("hooked", "bridge")

__all__ = [
    "HOSTS",
    "Host",
    "bridge_class",
    "default_host",
    "detect_host",
    "has_hooked_transformer",
    "tl_major_version",
    "tl_version",
]


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
