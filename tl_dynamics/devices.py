"""Where a model runs and in which dtype: one parser for ``--device`` and ``--dtype`` (every
command: ``report``, ``heads``, ``stats``) and for ``load_model(name, device=, dtype=)``.

- ``device``: ``auto`` (the default: the first CUDA device when torch sees one, else the CPU),
  ``cpu``, ``cuda`` or ``cuda:N``. Asking for CUDA where torch sees none, or for ``cuda:N`` past
  the last device, is refused before anything loads.
- ``dtype``: ``auto`` (the default: the model's own dtype: ``torch_dtype``/``dtype`` in a
  Hugging Face ``config.json``, ``dtype`` in a TransformerLens checkpoint's config, float32 for
  the shipped and tiny random models), ``float32``, ``bfloat16`` or ``float16``.

Every analysis runs where its model is, in the model's dtype (half-precision models are read in
float32 upcasts; docs/math.md §7.2): the place is chosen once, when the model loads.

Example:
    >>> from tl_dynamics import devices
    >>> devices.resolve_device("cpu"), devices.resolve_dtype("bfloat16")
    (device(type='cpu'), torch.bfloat16)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from dataclasses import dataclass
from typing import Any

from tl_dynamics.errors import TLDynamicsError

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
_CUDA = re.compile(r"^cuda(?::(\d+))?$")


def _dtypes() -> dict[str, Any]:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cuda_count() -> int:
    """How many CUDA devices torch sees here (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(device: Any = "auto", what: str = "device") -> Any:
    """``device`` (see the module docstring; a ``torch.device`` too) as a ``torch.device``,
    checked against the CUDA devices torch sees. ``what`` names the option in messages."""
    import torch

    text = "auto" if device is None else str(device).strip()
    count = cuda_count()
    if text == "auto":
        return torch.device("cuda", 0) if count else torch.device("cpu")
    if text == "cpu":
        return torch.device("cpu")
    match = _CUDA.match(text)
    if not match:
        raise TLDynamicsError(
            f"{what} {text!r}: valid are {', '.join(DEVICE_CHOICES)} "
            "(N: a CUDA device index, from 0)"
        )
    if count == 0:
        raise TLDynamicsError(
            f"{what} {text!r}: torch sees no CUDA device here (torch "
            f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'}); "
            "use cpu, or auto to take CUDA only where there is one"
        )
    index = int(match.group(1) or 0)
    if index >= count:
        valid = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
        raise TLDynamicsError(
            f"{what} {text!r}: this machine has {count} CUDA device"
            f"{'s' if count > 1 else ''} ({valid})"
        )
    return torch.device("cuda", index)


def resolve_dtype(dtype: Any = "auto", what: str = "dtype") -> Any:
    """``dtype`` as a ``torch.dtype``, or None for ``auto`` (the model's own)."""
    table = _dtypes()
    if dtype is None or (isinstance(dtype, str) and dtype.strip() == "auto"):
        return None
    if isinstance(dtype, str) and dtype.strip() in table:
        return table[dtype.strip()]
    if dtype in table.values():
        return dtype
    raise TLDynamicsError(f"{what} {dtype!r}: valid are {', '.join(DTYPE_CHOICES)}")


def config_dtype(fields: dict[str, Any]) -> Any:
    """The dtype a model's config names (``torch_dtype`` or ``dtype``, as ``"bfloat16"`` or
    ``"torch.bfloat16"``), or float32 where it names none or one outside ``DTYPE_CHOICES``."""
    table = _dtypes()
    for key in ("torch_dtype", "dtype"):
        value = fields.get(key)
        if isinstance(value, str) and value.removeprefix("torch.") in table:
            return table[value.removeprefix("torch.")]
    return table["float32"]


@dataclass(frozen=True)
class Placement:
    """A checked device, and a dtype (None: the model's own)."""

    device: Any
    dtype: Any = None

    def dtype_or(self, own: Any) -> Any:
        """The dtype to load in, given the model's ``own``."""
        return own if self.dtype is None else self.dtype


def placement(device: Any = "auto", dtype: Any = "auto", cli: bool = False) -> Placement:
    """Both settings checked (as ``--device``/``--dtype`` in messages when ``cli``)."""
    return Placement(
        resolve_device(device, "--device" if cli else "device"),
        resolve_dtype(dtype, "--dtype" if cli else "dtype"),
    )


def place(model: Any, where: Placement) -> Any:
    """``model`` in ``where.dtype`` (``model.to(dtype)``, the cast the half-precision tests
    cover) and on ``where.device``; unchanged where it already is."""
    param = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    if param is None:
        return model
    with contextlib.redirect_stdout(io.StringIO()):  # TransformerLens prints "Changing ..."
        if where.dtype is not None and param.dtype != where.dtype:
            model = model.to(where.dtype)
        if param.device != where.device:
            model = model.to(where.device)
    return model


def add_options(parser: argparse.ArgumentParser) -> None:
    """``--device`` and ``--dtype`` on a command's parser (checked by ``placement(cli=True)``)."""
    parser.add_argument(
        "--device",
        default="auto",
        help="where the model runs: auto (CUDA when present, else cpu), cpu, "
        "cuda or cuda:N (default auto)",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        help="the model's dtype: auto (its own: the config's torch_dtype; "
        "float32 for shipped and tiny models), float32, bfloat16 or "
        "float16 (default auto)",
    )
