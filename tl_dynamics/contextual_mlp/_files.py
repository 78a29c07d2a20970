"""``ContextualMLP.save``/``load``: safetensors tensors plus a JSON description, no pickle.

Reading a file runs no code from it: the tensors come from safetensors (a flat, typed byte
layout) and everything else from JSON, rebuilt only into the four known classes
(``ContextualMLP``, ``RotaryFrame``, ``Rotation``, ``QueryNorm``) with the fields they declare.
Files of the old pickle format (``torch.save``) are refused by name without being unpickled.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open
from safetensors.torch import save as st_save
from torch import Tensor

from tl_dynamics import files
from tl_dynamics.adapter import QueryNorm, Rotation
from tl_dynamics.contextual_mlp._frame import RotaryFrame
from tl_dynamics.errors import TLDynamicsError

KEY = "tl_dynamics.contextual_mlp"
_PICKLE_MAGIC = (b"PK\x03\x04", b"\x80")  # torch.save zip archives and raw pickles


_CLASSES: dict[str, type] = {
    "RotaryFrame": RotaryFrame,
    "Rotation": Rotation,
    "QueryNorm": QueryNorm,
}


def _classes() -> dict[str, type]:
    return _CLASSES


def register(cls: type) -> type:
    """Add ``cls`` (``ContextualMLP``) to the classes a file may name."""
    _CLASSES[cls.__name__] = cls
    return cls


def _encode(value: Any, name: str, tensors: dict[str, Tensor]) -> Any:
    if isinstance(value, Tensor):
        tensors[name] = value.detach().cpu().contiguous()
        return {"tensor": name}
    if is_dataclass(value) and type(value).__name__ in _classes():
        return {
            "type": type(value).__name__,
            "fields": {
                f.name: _encode(getattr(value, f.name), f"{name}.{f.name}", tensors)
                for f in fields(value)
            },
        }
    if isinstance(value, (tuple, list)):
        return {"tuple": [_encode(v, f"{name}.{i}", tensors) for i, v in enumerate(value)]}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            return {"float": repr(value)}
        return value
    raise TLDynamicsError(f"cannot save field {name} of type {type(value).__name__}")


def save(mlp: Any, path: str | os.PathLike, save_format: str) -> Path:
    tensors: dict[str, Tensor] = {}
    tree = _encode(mlp, "mlp", tensors)
    text = json.dumps({"format": save_format, "tree": tree}, sort_keys=True, allow_nan=False)
    return files.write_bytes(Path(path), st_save(tensors, metadata={KEY: text}))


def _decode(node: Any, tensors: dict[str, Tensor], what: str) -> Any:
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, dict) and set(node) == {"tensor"}:
        if node["tensor"] not in tensors:
            raise TLDynamicsError(f"{what}: tensor {node['tensor']!r} is missing")
        return tensors[node["tensor"]]
    if isinstance(node, dict) and set(node) == {"tuple"} and isinstance(node["tuple"], list):
        return tuple(_decode(v, tensors, what) for v in node["tuple"])
    if (
        isinstance(node, dict)
        and set(node) == {"float"}
        and node["float"] in ("inf", "-inf", "nan")
    ):
        return float(node["float"])
    if (
        isinstance(node, dict)
        and set(node) == {"type", "fields"}
        and isinstance(node["fields"], dict)
    ):
        cls = _classes().get(node["type"])
        if cls is None:
            raise TLDynamicsError(f"{what}: unknown type {node['type']!r}")
        known = {f.name for f in fields(cls)}
        unknown = set(node["fields"]) - known
        if unknown:
            raise TLDynamicsError(f"{what}: {node['type']} has no fields {sorted(unknown)}")
        values = {k: _decode(v, tensors, what) for k, v in node["fields"].items()}
        try:
            return cls(**values)
        except (TypeError, ValueError) as exc:
            raise TLDynamicsError(f"{what}: {node['type']} fields do not fit ({exc})") from None
    raise TLDynamicsError(f"{what}: malformed entry {str(node)[:80]!r}")


def load(path: str | os.PathLike, save_format: str) -> Any:
    what = f"{path}"
    path = Path(path)
    if not path.is_file():
        raise TLDynamicsError(f"{what} does not exist")
    with path.open("rb") as handle:
        head = handle.read(4)
    try:  # safetensors first: its header length can start with the pickle byte 0x80
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
            tensors = {k: handle.get_tensor(k) for k in handle.keys()}
        blob = json.loads(meta[KEY])
    except Exception:  # not safetensors, or no description: not ours
        if head.startswith(_PICKLE_MAGIC):
            raise TLDynamicsError(
                f"{what} is not a saved ContextualMLP (expected format "
                f"{save_format!r}): it is a pickle (torch.save), an old or "
                "foreign format that is never unpickled because unpickling "
                "runs code; compute the MLP again and save it"
            ) from None
        raise TLDynamicsError(
            f"{what} is not a saved ContextualMLP (expected format {save_format!r})"
        ) from None
    if not isinstance(blob, dict) or blob.get("format") != save_format:
        got = blob.get("format") if isinstance(blob, dict) else None
        raise TLDynamicsError(
            f"{what} is not a saved ContextualMLP (expected format {save_format!r}, got {got!r})"
        )
    try:
        out = _decode(blob.get("tree"), tensors, what)
    except RecursionError:
        raise TLDynamicsError(
            f"{what}: malformed ContextualMLP description (nested too deeply)"
        ) from None
    if type(out).__name__ != "ContextualMLP":
        raise TLDynamicsError(f"{what} is not a saved ContextualMLP")
    return out
