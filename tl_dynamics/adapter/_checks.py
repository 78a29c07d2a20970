"""Argument checks shared by every entry point: layer and head indices, and the model itself.

Each wrong argument gets a ``TLDynamicsError`` that says what was given and what is expected:
the wrong *type* (a float, a string, a ``(layer, head)`` pair where a head index goes) is told
apart from an index out of range, and an empty selection is refused where it is made rather than
failing later inside an analysis.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch

from tl_dynamics.errors import TLDynamicsError

__all__ = ["check_attention", "check_index", "check_indices", "check_materialised"]


def check_index(value: Any, what: str, count: int, where: str = "") -> int:
    """``value`` as an index in ``0..count-1`` (``what`` is "layer" or "head").

    Example:
        >>> check_index(1, "layer", 2)
        1
        >>> check_index(1.0, "layer", 2)
        Traceback (most recent call last):
        ...
        tl_dynamics.errors.TLDynamicsError: layer must be an integer index (valid: 0..1), got 1.0 of type float
    """
    if isinstance(value, (bool, float, str, bytes)) or (
        isinstance(value, torch.Tensor) and value.ndim
    ):
        index = None
    else:
        try:
            index = operator.index(value)  # int, numpy integers, 0-d integer tensors
        except TypeError:
            index = None
    if index is None:
        hint = ""
        if isinstance(value, (tuple, list)) and what == "head":
            hint = "; to select head h of layer l pass layers=l, heads=h"
        raise TLDynamicsError(
            f"{what}{where} must be an integer index (valid: 0..{count - 1}), got "
            f"{value!r} of type {type(value).__name__}{hint}"
        )
    if not 0 <= index < count:
        plural = "layers" if what == "layer" else "heads per layer"
        raise TLDynamicsError(
            f"{what} {index}{where} is out of range: this model has {count} "
            f"{plural} (valid: 0..{count - 1})"
        )
    return index


def check_indices(values: Any, what: str, count: int) -> list[int]:
    """``None`` (all), one index, or a non-empty sequence of them, as a list of indices.

    Example:
        >>> check_indices(None, "head", 3), check_indices([2, 0], "head", 3)
        ([0, 1, 2], [2, 0])
        >>> check_indices([], "layer", 2)
        Traceback (most recent call last):
        ...
        tl_dynamics.errors.TLDynamicsError: layers=[] selects nothing: give a layer index, a non-empty sequence of them, or None for all 2
    """
    if values is None:
        return list(range(count))
    if isinstance(values, (str, bytes, float, bool)):
        raise TLDynamicsError(
            f"{what}s must be a {what} index, a sequence of them, or None, got "
            f"{values!r} of type {type(values).__name__}"
        )
    if isinstance(values, torch.Tensor):
        values = values.reshape(-1).tolist() if values.ndim else values
    if not isinstance(values, (Sequence, set, frozenset)):
        return [check_index(values, what, count)]
    items = sorted(values) if isinstance(values, (set, frozenset)) else list(values)
    if not items:
        raise TLDynamicsError(
            f"{what}s={values!r} selects nothing: give a {what} index, a non-empty "
            f"sequence of them, or None for all {count}"
        )
    return [check_index(item, what, count) for item in items]


def check_materialised(model: Any) -> None:
    """Refuse a model whose weights are not materialised (``meta`` device): nothing can run."""
    meta = [name for name, param in model.named_parameters() if param.is_meta]
    if meta:
        raise TLDynamicsError(
            f"{len(meta)} of the model's weights are on the 'meta' device (e.g. "
            f"{meta[0]}): they hold no values, so no analysis can run; load the "
            "weights first (e.g. model.to_empty(device='cpu') and load a state dict)"
        )


def check_attention(specs: Sequence[Any], layers: list[int], architecture: str) -> list[int]:
    """``layers`` if every one has softmax attention the host hooks, else a TLDynamicsError
    naming the first layer that has not, its type and the attention layers there are.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> specs = [NS(layer=0, kind="state_space"), NS(layer=1, kind="attention")]
        >>> check_attention(specs, [1], "JambaForCausalLM")
        [1]
        >>> check_attention(specs, [0], "JambaForCausalLM")
        Traceback (most recent call last):
        ...
        tl_dynamics.errors.TLDynamicsError: layer 0 of JambaForCausalLM is not an attention layer: it is a 'state_space' layer (a state-space (Mamba) mixer, no attention pattern); attention layers: [1]
    """
    from tl_dynamics.adapter._kinds import KIND_WHAT

    attention = [spec.layer for spec in specs if spec.kind == "attention"]
    if not attention:
        kinds = sorted({spec.kind for spec in specs})
        raise TLDynamicsError(
            f"{architecture} has no attention layers (its layers are {kinds}: "
            f"{'; '.join(str(KIND_WHAT.get(k, k)) for k in kinds)}), so attention "
            "analyses do not apply; residual-stream analyses (trajectories) do"
        )
    for layer in layers:
        kind = specs[layer].kind
        if kind != "attention":
            raise TLDynamicsError(
                f"layer {layer} of {architecture} is not an attention layer: it "
                f"is a {kind!r} layer ({KIND_WHAT.get(kind, kind)}); attention "
                f"layers: {attention}"
            )
    return layers


def sink_refusal(layer: int, analysis: str) -> TLDynamicsError:
    """The refusal, naming ``analysis``, of layer ``layer``'s learned attention sinks."""
    return TLDynamicsError(
        f"{analysis}: layer {layer} has learned attention sinks (a per-head logit joins every "
        "softmax denominator, p_ij = exp(s_ij) / (sum_j exp(s_ij) + exp(sink_h)), so rows sum "
        "to less than 1), which it does not model"
    )
