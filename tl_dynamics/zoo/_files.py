"""Reading and writing a shipped model folder, with errors that name the file.

A folder holds ``config.json`` (TransformerLens config fields), ``model.safetensors``
(a ``HookedTransformer.state_dict()``), the tokenizer files written by
``PreTrainedTokenizerFast.save_pretrained``, ``MODEL_CARD.md``, ``reference.safetensors``
(next-token log-probabilities for the cross-host test) and ``checksums.sha256`` in
``sha256sum`` format, which ``load`` checks before reading anything.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tl_dynamics.errors import TLDynamicsError

if TYPE_CHECKING:  # the zoo's names are read without torch (the command line's first checks)
    import torch

MODELS_DIR = Path(__file__).resolve().parent / "models"
CHECKSUMS = "checksums.sha256"
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
REFERENCE = "reference.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Everything except the card and the checksum file itself is checked.
CHECKED_FILES = (CONFIG, WEIGHTS, *TOKENIZER_FILES, REFERENCE)
_REINSTALL = "reinstall tl-dynamics, or rebuild it with `python -m tl_dynamics.zoo.train {name}`"


def _read_bytes(path: Path, name: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise TLDynamicsError(
            f"zoo model {name!r}: missing file {path}; " + _REINSTALL.format(name=name)
        ) from None
    except OSError as err:
        raise TLDynamicsError(f"zoo model {name!r}: cannot read {path}: {err}") from err


def expected_checksums(folder: Path, name: str) -> dict[str, str]:
    path = folder / CHECKSUMS
    lines = _read_bytes(path, name).decode("utf-8", errors="replace").splitlines()
    sums: dict[str, str] = {}
    for line in lines:
        digest, _, fname = line.partition("  ")
        if len(digest) != 64 or not fname:
            raise TLDynamicsError(f"zoo model {name!r}: corrupted file {path}: bad line {line!r}")
        sums[fname] = digest
    return sums


def read_checked(folder: Path, name: str, fname: str, sums: dict[str, str]) -> bytes:
    """The bytes of ``folder/fname`` after checking them against ``checksums.sha256``."""
    path = folder / fname
    data = _read_bytes(path, name)
    digest = hashlib.sha256(data).hexdigest()
    if sums.get(fname) != digest:
        raise TLDynamicsError(
            f"zoo model {name!r}: corrupted file {path}: sha256 {digest} does not match "
            f"{sums.get(fname)} in {folder / CHECKSUMS}; " + _REINSTALL.format(name=name)
        )
    return data


def read_config(folder: Path, name: str, sums: dict[str, str]) -> dict[str, Any]:
    data = read_checked(folder, name, CONFIG, sums)
    try:
        return json.loads(data)
    except ValueError as err:
        raise TLDynamicsError(
            f"zoo model {name!r}: corrupted file {folder / CONFIG}: {err}"
        ) from err


def read_tensors(
    folder: Path, name: str, fname: str, sums: dict[str, str]
) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    data = read_checked(folder, name, fname, sums)
    try:
        return load(data)
    except (SafetensorError, ValueError) as err:
        raise TLDynamicsError(
            f"zoo model {name!r}: corrupted file {folder / fname}: {err}"
        ) from err


def read_tokenizer(folder: Path, name: str, sums: dict[str, str]):
    """The saved ``PreTrainedTokenizerFast``, built from the checked files."""
    from transformers import PreTrainedTokenizerFast

    for fname in TOKENIZER_FILES:
        read_checked(folder, name, fname, sums)
    return PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)


def write_checksums(folder: Path) -> None:
    lines = [
        f"{hashlib.sha256((folder / f).read_bytes()).hexdigest()}  {f}"
        for f in CHECKED_FILES
        if (folder / f).exists()
    ]
    (folder / CHECKSUMS).write_text("\n".join(lines) + "\n")


def write_folder(folder: Path, model: torch.nn.Module, cfg: dict[str, Any], tokenizer: Any) -> None:
    """Weights, config, tokenizer and checksums of a model in the zoo layout (no card, no
    reference)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(folder / WEIGHTS))
    (folder / CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
    tokenizer.save_pretrained(str(folder))
    write_checksums(folder)
