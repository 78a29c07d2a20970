"""What a model is, as numbers: its weights checked finite, and fingerprints of its weights,
configuration and tokenizer.

``check_finite`` refuses a model whose weights hold NaN or an infinity, naming the tensor and the
first position (the self-check would otherwise blame the adapter's reading of the layer, and a
weight the 8-token probe never reaches would go unseen). ``fingerprints`` identifies what a
statistics run computes from (``tl_dynamics.scale`` records it in checkpoints and files): SHA-256
over the state dict (each tensor's name, dtype, shape and bytes, in name order; a tensor that
shares another's storage is hashed once), over the configuration as canonical JSON (bookkeeping
fields such as ``transformers_version`` and ``_name_or_path`` left out), and over the tokenizer's
vocabulary, merges, normalisation and special tokens with whether the host prepends BOS. They are
read from the Hugging Face model a bridge wraps (the same weights however it was booted), else
from the TransformerLens model itself.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from tl_dynamics.adapter import _readers
from tl_dynamics.errors import TLDynamicsError

# configuration fields that say how a file was written, not what the model computes
BOOKKEEPING = frozenset({"transformers_version", "_name_or_path", "_commit_hash"})
WRAPPED = "_original_component"  # TransformerLens's wrapper around a Hugging Face module
# a fast tokenizer's runtime state (changed by each padded call), not its vocabulary
RUNTIME = frozenset({"padding", "truncation"})


def _module(model: Any) -> Any:
    """The Hugging Face model a bridge wraps, else the model."""
    inner = _readers.optional(model, "original_model")
    return inner if isinstance(inner, torch.nn.Module) else model


def named_tensors(model: Any, weights_only: bool = False) -> list[tuple[str, torch.Tensor]]:
    """The model's distinct tensors (parameters and persistent buffers; ``weights_only``: the
    parameters), in name order, each once: a bridge wraps Hugging Face modules and lists their
    tensors under several paths (and tied weights share one), so each storage keeps its
    shortest name, wrappers' segments left out."""
    state = _module(model).state_dict(keep_vars=True)  # parameters stay Parameters here
    names: dict[tuple[Any, ...], str] = {}
    tensors: dict[tuple[Any, ...], torch.Tensor] = {}
    for raw, value in state.items():
        if not isinstance(value, torch.nn.Parameter if weights_only else torch.Tensor):
            continue
        name = raw.replace(f".{WRAPPED}", "").replace(f"{WRAPPED}.", "")
        layout = (
            value.device,
            value.untyped_storage().data_ptr() if value.numel() else name,
            value.storage_offset(),
            tuple(value.shape),
            tuple(value.stride()),
            value.dtype,
        )
        if layout not in names or (len(name), name) < (len(names[layout]), names[layout]):
            names[layout] = name
        tensors[layout] = value.detach()
    return sorted(((names[k], t) for k, t in tensors.items()), key=lambda item: item[0])


def check_finite(model: Any) -> None:
    """Refuse a model whose floating-point weights (its parameters: buffers such as a mask's
    ``-inf`` are not weights) hold NaN or an infinity, naming the first such tensor (in name
    order), its position and value.

    Example:
        >>> import torch
        >>> layer = torch.nn.Linear(2, 2)
        >>> check_finite(layer)
        >>> with torch.no_grad():
        ...     layer.weight[1, 0] = float("nan")
        >>> check_finite(layer)
        Traceback (most recent call last):
        ...
        tl_dynamics.errors.TLDynamicsError: the model's weight 'weight' holds nan at [1, 0] (1 of its 4 values are not finite); ...
    """
    for name, tensor in named_tensors(model, weights_only=True):
        if not tensor.is_floating_point() and not tensor.is_complex():
            continue
        wide = torch.float64 if tensor.dtype == torch.float64 else torch.float32
        if bool(torch.isfinite(tensor.sum(dtype=wide))):  # NaN and inf reach the sum
            continue
        finite = torch.isfinite(tensor)
        if bool(finite.all()):  # the sum overflowed: every value is finite
            continue
        bad = (~finite).nonzero()
        where = [int(i) for i in bad[0]]
        value = tensor[tuple(where)].item() if where else tensor.item()
        raise TLDynamicsError(
            f"the model's weight {name!r} holds {value} at {where} ({bad.shape[0]} of its "
            f"{tensor.numel()} values are not finite); its outputs would be NaN or infinite, so "
            "it is refused before any reading: load an intact checkpoint (a diverged training "
            "run or a damaged download writes such values)"
        )


def _weights_digest(model: Any) -> str:
    digest = hashlib.sha256()
    for name, tensor in named_tensors(model):
        digest.update(f"{name}|{tensor.dtype}|{list(tensor.shape)}|".encode())
        flat = tensor.reshape(-1)
        if flat.device.type != "cpu":
            flat = flat.cpu()
        digest.update(flat.contiguous().view(torch.uint8).numpy().data)
    return digest.hexdigest()


def _plain(value: Any) -> Any:
    """A configuration value as JSON, deterministic (no object addresses)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items() if str(k) not in BOOKKEEPING}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return str(value)
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        return _plain(to_dict())
    return type(value).__name__  # an object without a plain form: its kind only


def _config_digest(model: Any) -> str:
    config = _readers.optional(_module(model), "config")
    if config is None:  # a HookedTransformer: its own configuration
        config = _readers.optional(model, "cfg")
    to_dict = getattr(config, "to_dict", None)
    fields = to_dict() if callable(to_dict) else dict(vars(config)) if config is not None else {}
    text = json.dumps(_plain(fields), sort_keys=True, default=str, allow_nan=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _tokenizer_digest(tokenizer: Any, prepend_bos: bool | None) -> str:
    if tokenizer is None:
        return hashlib.sha256(b"no tokenizer").hexdigest()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    state: dict[str, Any]
    if backend is not None:  # a fast tokenizer: its whole serialised pipeline
        state = {k: v for k, v in json.loads(backend.to_str()).items() if k not in RUNTIME}
    else:
        state = {"vocab": sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))}
    state.update(
        kind=type(tokenizer).__name__,
        special=_plain(dict(getattr(tokenizer, "special_tokens_map", {}) or {})),
        ids=[getattr(tokenizer, f"{k}_token_id", None) for k in ("bos", "eos", "pad", "unk")],
        prepend_bos=prepend_bos,
    )
    text = json.dumps(_plain(state), sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def fingerprints(model: Any, tokenizer: Any, prepend_bos: bool | None) -> dict[str, str]:
    """SHA-256 of the model's weights, of its configuration and of its tokenizer (with whether
    the host prepends BOS), as hexadecimal strings under ``weights``, ``config``, ``tokenizer``.

    Example:
        >>> import torch
        >>> a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        >>> with torch.no_grad():
        ...     b.load_state_dict(a.state_dict())
        <All keys matched successfully>
        >>> fingerprints(a, None, None) == fingerprints(b, None, None)
        True
        >>> with torch.no_grad():
        ...     _ = b.bias.add_(1e-7)
        >>> fingerprints(a, None, None)["weights"] == fingerprints(b, None, None)["weights"]
        False
    """
    return {
        "weights": _weights_digest(model),
        "config": _config_digest(model),
        "tokenizer": _tokenizer_digest(tokenizer, prepend_bos),
    }
