"""One loader for every kind of model: ``tl_dynamics.load_model(name_or_folder)``.

Accepted: a shipped model (``tl_dynamics.zoo.names()``), ``tiny-random`` or ``tiny-random:<arch>``
(an untrained model built on the fly), a Hugging Face model folder, a TransformerLens-native
checkpoint folder (``HookedTransformerConfig`` fields in ``config.json`` or ``tl_config.json``,
weights in ``model.safetensors``, tokenizer files optional: without them prompts are token ids),
or a hub name that TransformerLens loads when the machine is online.

``device`` and ``dtype`` (``tl_dynamics.devices``: ``auto``, ``cpu``, ``cuda[:N]``; ``auto``,
``float32``, ``bfloat16``, ``float16``) are checked before anything loads. A Hugging Face folder
or hub model is loaded straight into its dtype and onto its device (an 8B model in bfloat16 never
exists in float32); the shipped, tiny random and TransformerLens-checkpoint models are built in
float32 on the CPU and then cast and moved (``model.to(dtype)``, as the half-precision tests do).
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tl_dynamics import _model_names, _tl_checkpoint, compat, devices, zoo
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics._hf_folder import boot_folder
from tl_dynamics._installs import no_installs

# the names, decided without torch, live in tl_dynamics/_model_names.py (the CLI asks first)
from tl_dynamics._model_names import DEFAULT_MODEL as DEFAULT_MODEL
from tl_dynamics._model_names import TINY_PREFIX as TINY_PREFIX
from tl_dynamics._model_names import is_installed as is_installed
from tl_dynamics._model_names import shipped_names as shipped_names
from tl_dynamics._model_names import tiny_architectures as tiny_architectures

CODE_PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n"
DEFAULT_PROMPTS = {  # each shipped model's, tokenised without unknown tokens
    "code-2l": CODE_PROMPT,
    "induction-2l": "x7Kq2Gm9Zr4bPw" * 3,  # random symbols, repeated: induction heads at work
    "minilm": "The cat sat on the warm mat because the sun was shining on it.",
    "regression-2l": "x175 y23 x267 y12 x488 y13 x212 y25 x155 y29 x469 y5 x507 y6 x278 y31 x373 y11 x390 y16 x333 y14 x475 y12 x157 y17 x112 y10 x400 y21 x263 y15 x209 y15 x324 y23 x385 y22 x491 y21 x503 y6 x422 y13 x363 y16 x8 y12",  # a held-out sequence of its task
}
ID_PROMPT = list(range(1, 17)) * 2  # a model without a tokenizer: ids 1..16, twice
_TL_CONFIGS = ("tl_config.json", "config.json")
_WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class LoadedModel:
    """A loaded model, what it is (``label``), and the prompt to use when none is given."""

    model: Any
    label: str
    default_prompt: str | list[int]

    @property
    def has_tokenizer(self) -> bool:
        return getattr(self.model, "tokenizer", None) is not None


def load_model(
    name_or_folder: str | os.PathLike | None = None, device: Any = "auto", dtype: Any = "auto"
) -> Any:
    """Load a model by name or folder (see the module docstring) onto ``device`` in ``dtype``
    and return it.

    Example:
        >>> from tl_dynamics import load_model
        >>> type(load_model("tiny-random:llama")).__name__
        'TransformerBridge'
        >>> next(load_model("tiny-random:llama", dtype="bfloat16").parameters()).dtype
        torch.bfloat16
    """
    return resolve(name_or_folder, devices.placement(device, dtype)).model


@no_installs  # reading a model never installs a package (tl_dynamics/_installs.py)
def resolve(
    name: str | os.PathLike | None = None, where: devices.Placement | None = None
) -> LoadedModel:
    """``load_model`` with a label and the model's default prompt (used by the CLI, which checks
    ``where`` from ``--device``/``--dtype`` first; None: ``auto`` for both)."""
    if isinstance(name, os.PathLike):
        name = os.fspath(name)
    if name is not None and not isinstance(name, str):
        raise TLDynamicsError(
            f"load_model takes a model name or a folder path (str or "
            f"os.PathLike), got {type(name).__name__}"
        )
    name = _model_names.check_name(name)  # what needs no loading, first
    where = devices.placement() if where is None else where
    if name in shipped_names():
        return LoadedModel(
            devices.place(zoo.load(name), where),
            f"{name} (shipped with tl_dynamics)",
            DEFAULT_PROMPTS.get(name, CODE_PROMPT),
        )
    if name == TINY_PREFIX or name.startswith(TINY_PREFIX + ":"):
        from tl_dynamics import testing

        arch = name.partition(":")[2] or "gpt2"
        return LoadedModel(
            devices.place(testing.tiny_model(arch), where),
            f"{name}: a tiny RANDOMLY INITIALISED {arch} "
            "model (untrained; patterns show no structure)",
            CODE_PROMPT,
        )
    folder = Path(name).expanduser()
    if _model_names.is_dir(folder):
        model = _load_folder(folder, where)
        prompt = CODE_PROMPT if getattr(model, "tokenizer", None) is not None else ID_PROMPT
        return LoadedModel(model, f"{folder} (local folder)", prompt)
    return LoadedModel(_load_hub(name, where), f"{name} (loaded by TransformerLens)", CODE_PROMPT)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        fields = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise TLDynamicsError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(fields, dict):
        raise TLDynamicsError(f"{path} must hold a JSON object, got {type(fields).__name__}")
    return fields


def _load_folder(folder: Path, where: devices.Placement) -> Any:
    for fname in _TL_CONFIGS:
        path = folder / fname
        if path.is_file():
            fields = _read_json(path)
            if "d_model" in fields and "n_layers" in fields:
                own = devices.Placement(where.device, where.dtype_or(devices.config_dtype(fields)))
                return devices.place(_load_tl_native(folder, path, fields), own)
    if not (folder / "config.json").is_file():
        raise TLDynamicsError(
            f"folder {folder} has no config.json or tl_config.json: expected a "
            "Hugging Face model folder or a TransformerLens checkpoint folder"
        )
    report = _LogLines()
    logger = logging.getLogger("transformers")
    logger.addHandler(report)
    dtype = where.dtype_or(devices.config_dtype(_read_json(folder / "config.json")))
    try:
        return boot_folder(folder, str(where.device), dtype)  # tokenizer files or none
    except Exception as err:  # malformed weights or an unsupported architecture: name the folder
        weights = [p.name for p in folder.iterdir() if p.suffix in (".safetensors", ".bin")]
        message = f"{type(err).__name__}: {err}"
        if "above report" in message:  # transformers logs its report; say it here instead
            message = "the weights do not fit config.json (size mismatch): " + (
                _size_mismatches(folder) or report.text() or "transformers gave no details"
            )
        raise TLDynamicsError(
            f"could not load the Hugging Face model folder {folder} "
            f"(config.json, weights {weights or 'missing'}): {message}"
        ) from err
    finally:
        logger.removeHandler(report)


def _size_mismatches(folder: Path) -> str:
    """Which weights have another shape in the files than config.json gives them (read from
    the safetensors headers and a model built on the meta device; empty if that fails)."""
    try:
        import torch
        import transformers
        from safetensors import safe_open

        config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        found: dict[str, tuple[int, ...]] = {}
        for path in sorted(folder.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():
                    found[key] = tuple(handle.get_slice(key).get_shape())
    except Exception:  # best effort: the caller falls back to what transformers logged
        return ""
    rows = [
        f"{k} is {list(found[k])} in the weights but {list(expected[k])} by config.json"
        for k in sorted(found)
        if k in expected and found[k] != expected[k]
    ]
    return "; ".join(rows[:6]) + (f"; ... ({len(rows) - 6} more)" if len(rows) > 6 else "")


class _LogLines(logging.Handler):
    """Warnings transformers logs while loading (its load report), kept for an error."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(re.sub(r"\x1b\[[0-9;]*m", "", record.getMessage()))

    def text(self, limit: int = 1500) -> str:
        text = "\n".join(self.lines).strip()
        return text if len(text) <= limit else text[:limit] + " ..."


def _tokenizer(folder: Path) -> Any:
    if not (folder / "tokenizer.json").is_file():
        return None
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception:  # tokenizer.json alone, no tokenizer_config.json
        return PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))


def _load_tl_native(folder: Path, config: Path, fields: dict[str, Any]) -> Any:
    """A TransformerLens checkpoint: config fields plus ``model.safetensors``; every field kept
    or refused by name (``tl_dynamics/_tl_checkpoint.py``)."""
    _tl_checkpoint.check_fields(fields, compat.has_hooked_transformer())  # before any work
    weights = folder / _WEIGHTS
    if not weights.is_file():
        raise TLDynamicsError(
            f"TransformerLens checkpoint {folder}: missing {weights} "
            f"(the weights for {config.name})"
        )
    from safetensors.torch import load_file

    try:
        state = load_file(str(weights))
    except Exception as err:
        raise TLDynamicsError(f"{weights} is not a readable safetensors file: {err}") from err
    return _tl_checkpoint.build(folder, config, fields, state, _tokenizer(folder))


def _load_hub(name: str, where: devices.Placement) -> Any:
    """The real loading path for hub models; it needs a network connection (``auto`` dtype: the
    hub config's); where it cannot load (offline, not cached) it says so at once."""
    _model_names.check_hub(name)
    try:
        dtype = where.dtype
        if dtype is None:
            from transformers import AutoConfig

            dtype = devices.config_dtype(AutoConfig.from_pretrained(name).to_dict())
        if compat.has_hooked_transformer():
            from transformer_lens import HookedTransformer

            # TransformerLens 3.x's class; pyright sees 4.x, where the name is the bridge
            return HookedTransformer.from_pretrained(  # pyright: ignore[reportAttributeAccessIssue]
                name, device=str(where.device), dtype=dtype
            ).eval()
        return (
            compat.bridge_class()
            .boot_transformers(name, device=str(where.device), dtype=dtype)
            .eval()
        )
    except Exception as exc:  # offline, unknown name, ...: say what was tried
        raise TLDynamicsError(
            _model_names.hub_failure(name, f"{type(exc).__name__}: {exc}")
        ) from exc
