"""Resolve ``--model``: a shipped model, a local folder, a tiny random model, or a hub name."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from tl_dynamics.compat import bridge_class, default_host, has_hooked_transformer
from tl_dynamics.errors import TLDynamicsError

DEFAULT_MODEL = "code-2l"
TINY_PREFIX = "tiny-random"


def shipped_names() -> dict[str, str]:
    """The zoo's models (empty if the zoo is not installed)."""
    try:
        zoo = importlib.import_module("tl_dynamics.zoo")
    except ImportError:
        return {}
    return zoo.names()


def load_model(name: str | None = None) -> tuple[Any, str]:
    """Load ``name`` and return ``(model, label)``; ``label`` says what the model is.

    ``name`` may be a shipped model (``tl_dynamics.zoo.names()``), ``tiny-random`` or
    ``tiny-random:<arch>`` (an untrained model built on the fly, for smoke tests), a local
    folder (a Hugging Face model folder, or a folder in the zoo's TransformerLens layout), or a
    hub name that TransformerLens loads when the machine is online.
    """
    name = name or (DEFAULT_MODEL if DEFAULT_MODEL in shipped_names() else TINY_PREFIX)
    if name in shipped_names():
        return importlib.import_module("tl_dynamics.zoo").load(name), f"{name} (shipped with tl_dynamics)"
    if name == TINY_PREFIX or name.startswith(TINY_PREFIX + ":"):
        from tl_dynamics import testing

        arch = name.partition(":")[2] or "gpt2"
        return (testing.tiny_model(arch),
                f"{name}: a tiny RANDOMLY INITIALISED {arch} model (untrained; patterns show no structure)")
    folder = Path(name).expanduser()
    if folder.is_dir():
        return _load_folder(folder), f"{folder} (local folder)"
    if _looks_like_path(name):
        raise TLDynamicsError(f"model {name!r}: no such folder, and not a shipped model "
                              f"({sorted(shipped_names())}) or a hub name")
    return _load_hub(name), f"{name} (loaded by TransformerLens)"


def _looks_like_path(name: str) -> bool:
    """A local path, not a hub id (``owner/name``, which may contain dots: ``Qwen/Qwen2.5-0.5B``)."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name


def _load_folder(folder: Path) -> Any:
    config = folder / "config.json"
    if not config.exists():
        raise TLDynamicsError(f"folder {folder} has no config.json: expected a Hugging Face model "
                              "folder or a tl_dynamics zoo model folder")
    fields = json.loads(config.read_text())
    if "d_model" in fields and "n_layers" in fields:  # TransformerLens layout (zoo)
        zoo = importlib.import_module("tl_dynamics.zoo._load")
        return zoo.load_folder(folder, folder.name, default_host())
    return bridge_class().boot_transformers(str(folder), device="cpu").eval()


def _load_hub(name: str) -> Any:
    """The real loading path for hub models; it needs a network connection."""
    try:
        if has_hooked_transformer():
            from transformer_lens import HookedTransformer

            return HookedTransformer.from_pretrained(name, device="cpu").eval()
        return bridge_class().boot_transformers(name, device="cpu").eval()
    except Exception as exc:  # offline, unknown name, ...: say what was tried
        raise TLDynamicsError(
            f"could not load model {name!r} through TransformerLens (hub models need a network "
            f"connection; shipped models: {sorted(shipped_names())}; or pass a local folder): "
            f"{type(exc).__name__}: {exc}") from exc
