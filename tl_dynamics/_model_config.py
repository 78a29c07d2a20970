"""A model's sizes read from its config file, without torch (a bottom-layer module).

The command line checks ``--layers``, ``--heads`` and token ids against these before it imports
torch and TransformerLens: a shipped model's ``config.json`` (TransformerLens fields) or a
folder's (Hugging Face or TransformerLens fields; a multimodal config's ``text_config``). A size
the file does not state, a name that is no folder or shipped model (tiny-random, a hub name),
or a file that cannot be read leaves the check to the loaded model
(``_loading.loaded_and_checked``), whose messages these repeat word for word.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from tl_dynamics import _args, _model_names
from tl_dynamics.errors import TLDynamicsError

# The fields each size goes by (TransformerLens first, then Hugging Face families).
LAYER_KEYS = ("n_layers", "num_hidden_layers", "n_layer", "num_layers")
HEAD_KEYS = ("n_heads", "num_attention_heads", "n_head", "num_heads")
VOCAB_KEYS = ("d_vocab", "vocab_size")


@dataclass(frozen=True)
class Sizes:
    """What a config file states (None: not stated there, so not checked before loading)."""

    n_layers: int | None = None
    n_heads: int | None = None
    d_vocab: int | None = None


def config_file(name: str | None) -> Path | None:
    """The config file that states ``name``'s sizes: a shipped model's, or a folder's
    ``config.json``; None for any other name (tiny-random, hub) or a folder without one.

    Example:
        >>> config_file("induction-2l").name, config_file("tiny-random:gpt2")
        ('config.json', None)
    """
    name = name or _model_names.DEFAULT_MODEL
    if name in _model_names.shipped_names():
        from tl_dynamics import zoo  # its names and files need no torch

        folder = Path(zoo.__file__).resolve().parent / "models" / name  # (an optional one: None)
    else:
        folder = Path(name).expanduser()
        if not _model_names.is_dir(folder):
            return None
    path = folder / "config.json"
    return path if path.is_file() else None


def _first(config: dict[str, Any], keys: Sequence[str]) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def sizes(name: str | None) -> Sizes:
    """The layer, head and vocabulary sizes ``name``'s config file states (each None where it
    states none, or where there is no file to read).

    Args:
        name: a ``--model`` value (None: the default model).

    Returns:
        A ``Sizes``.

    Example:
        >>> sizes("induction-2l")
        Sizes(n_layers=2, n_heads=4, d_vocab=64)
    """
    path = config_file(name)
    if path is None:
        return Sizes()
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return Sizes()  # the loader says what is wrong with the file
    if not isinstance(config, dict):
        return Sizes()
    text = config.get("text_config")
    found = [config] + ([text] if isinstance(text, dict) else [])

    def size(keys: Sequence[str]) -> int | None:
        return next((v for c in found if (v := _first(c, keys)) is not None), None)

    return Sizes(size(LAYER_KEYS), size(HEAD_KEYS), size(VOCAB_KEYS))


def _in_range(value: int, what: str, count: int | None, where: str = "") -> None:
    """The loaded model's out-of-range message (``adapter._checks.check_index``), word for word."""
    if count is not None and not 0 <= value < count:
        plural = "layers" if what == "layer" else "heads per layer"
        raise TLDynamicsError(
            f"{what} {value}{where} is out of range: this model has {count} "
            f"{plural} (valid: 0..{count - 1})"
        )


def check_selection(
    name: str | None,
    layers: Sequence[int] | None = None,
    heads: Sequence[tuple[int, int]] | None = None,
    head_indices: Sequence[int] | None = None,
    token_ids: Sequence[int] | None = None,
) -> None:
    """Refuse, before torch is imported, what ``name``'s config file already rules out: a layer
    or head out of range (``heads`` as ``(layer, head)`` pairs, ``head_indices`` in every layer)
    and token ids outside the vocabulary. In the order the loaded model checks them, with the
    same messages.

    Args:
        name: a ``--model`` value (None: the default model).
        layers: ``--layers``.
        heads: ``--heads`` as ``(layer, head)`` pairs.
        head_indices: ``--heads`` as head indices in every layer.
        token_ids: ``--prompt-ids``.

    Raises:
        TLDynamicsError: naming the value and the valid range.

    Example:
        >>> check_selection("induction-2l", layers=[0, 1])
        >>> check_selection("induction-2l", layers=[5])
        Traceback (most recent call last):
        ...
        tl_dynamics.errors.TLDynamicsError: layer 5 is out of range: this model has 2 layers (valid: 0..1)
    """
    found = sizes(name)
    if token_ids is not None and found.d_vocab is not None:
        _args.check_vocab(list(token_ids), found.d_vocab)
    for layer, head in heads or ():
        _in_range(layer, "layer", found.n_layers)
        _in_range(head, "head", found.n_heads, f" in layer {layer}")
    for head in head_indices or ():
        _in_range(head, "head", found.n_heads)
    for layer in layers or ():
        _in_range(layer, "layer", found.n_layers)
