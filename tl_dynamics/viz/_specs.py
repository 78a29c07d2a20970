"""What a component sends to the page: compact data specs for the page's runtime.

Attention maps and heat maps are drawn by the runtime on canvases (``_runtime.py``): quantised
bytes, a colour legend, tokens on hover. Every other circuitsvis component keeps its props, with
large numeric arrays packed as float32 (decoded back to plain arrays before circuitsvis sees them).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tl_dynamics.viz._encode import (
    PACK_MIN_SIZE,
    as_array,
    downsample_max,
    finite_range,
    pack_f32,
    pack_u8,
)

THUMB_CELLS = 48  # thumbnails are at most 48 x 48 cells (max-pooled)
CANVAS_KINDS = ("AttentionGrid", "AttentionHeads", "AttentionPattern", "Heatmap")
_HEIGHTS = {
    "ColoredTokens": 80,
    "ColoredTokensMulti": 160,
    "TextNeuronActivations": 260,
    "TopkTokens": 320,
}


def _packed_props(value: Any) -> Any:
    """Props with large numeric arrays packed (float32, exact); small ones stay JSON."""
    if hasattr(value, "detach") or isinstance(value, np.ndarray):
        arr = as_array(value)
        if arr.size >= PACK_MIN_SIZE:
            return pack_f32(arr)
        return arr
    if isinstance(value, dict):
        return {k: _packed_props(v) for k, v in value.items()}
    if (
        isinstance(value, (list, tuple))
        and value
        and (hasattr(value[0], "detach") or isinstance(value[0], np.ndarray))
    ):
        return [_packed_props(v) for v in value]
    return value


def _scale(arr: np.ndarray, lo: float | None, hi: float | None) -> tuple[float, float, str, str]:
    """Range, scale and colour map: attention (no range given, values in [0, 1]) on a
    square-root scale; signed values on a diverging map centred on 0."""
    finite = arr[np.isfinite(arr)]
    if lo is None and hi is None and (not finite.size or finite.min() >= 0):
        top = float(finite.max()) if finite.size else 1.0
        return 0.0, max(1.0, top), "sqrt", "blues"
    low, high = finite_range(arr, lo, hi)
    return low, high, "linear", "rdbu" if low < 0 < high else "blues"


def _heads_spec(
    attention: np.ndarray,
    full: dict[int, np.ndarray],
    props: dict[str, Any],
    lo: float,
    hi: float,
    scale: str,
    cmap: str,
) -> dict[str, Any]:
    thumbs = (
        np.stack([downsample_max(a, THUMB_CELLS) for a in attention])
        if attention.ndim == 3
        else as_array(props["thumbs"])
    )
    n = len(thumbs)
    names = props.get("attentionHeadNames") or [f"head {h}" for h in range(n)]
    return dict(
        kind="heads",
        thumbs=pack_u8(thumbs, lo, hi, scale),
        full={str(h): pack_u8(a, lo, hi, scale) for h, a in full.items()},
        tokens=props["tokens"],
        names=list(names),
        columns=props.get("columns") or n,
        rowNames=props.get("rowNames"),
        selected=props.get("selected") or 0,
        mask=bool(props.get("maskUpperTri")),
        cmap=cmap,
        valueName=props.get("valueName") or ("attention weight" if scale == "sqrt" else "value"),
        rowTitle="destination (query)",
        colTitle="source (key)",
    )


def canvas_spec(name: str, props: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The runtime spec of a canvas-drawn component and a placeholder height in pixels."""
    if name == "Heatmap":
        arr = as_array(props["values"])
        lo, hi, _, cmap = _scale(arr, props.get("minValue"), props.get("maxValue"))
        cmap = props.get("cmap") or cmap
        spec = {k: v for k, v in props.items() if k not in ("values", "minValue", "maxValue")}
        spec.update(kind="heatmap", data=pack_u8(arr, lo, hi), cmap=cmap)
        longest = max(max(arr.shape, default=0), 1)  # an empty or one-cell map draws too
        cell = min(float(props.get("cell") or 16), 480.0 / longest)
        return spec, int(arr.shape[0] * cell + 140)
    if name == "AttentionGrid":
        full = {int(h): as_array(a) for h, a in props["full"].items()}
        thumbs = as_array(props["thumbs"])
        lo, hi, scale, cmap = _scale(thumbs, None, None)
        spec = _heads_spec(np.zeros((0,)), full, props, lo, hi, scale, cmap)
        rows = -(-len(thumbs) // max(int(props.get("columns") or len(thumbs)), 1))
        return spec, rows * 40 + 700
    arr = as_array(props["attention"])
    if name == "AttentionPattern":
        arr = arr[None]
        props = dict(props, attentionHeadNames=[""])  # one pattern: its caption says what it is
    lo, hi, scale, cmap = _scale(arr, props.get("minValue"), props.get("maxValue"))
    spec = _heads_spec(arr, dict(enumerate(arr)), props, lo, hi, scale, cmap)
    if name == "AttentionPattern":
        spec.update(columns=1)
    return spec, 720


def _colour_note(props: dict[str, Any]) -> str:
    """circuitsvis colours tokens without a legend: say what the colours mean."""
    arr = as_array(props["values"])
    finite = arr[np.isfinite(arr)]
    if not finite.size:
        return ""
    lo = props.get("minValue")
    hi = props.get("maxValue")
    low = float(finite.min()) if lo is None else float(lo)
    high = float(finite.max()) if hi is None else float(hi)
    return (
        f"Colour: blue for positive values, red for negative, white for 0; values run from "
        f"{low:.3g} to {high:.3g}. Hover a token to read its value."
    )


def cv_spec(name: str, props: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The runtime spec of a circuitsvis component (props with packed arrays), with a note on
    the colours where circuitsvis draws no legend."""
    spec = dict(kind="cv", name=name, props=_packed_props(props))
    if name in ("ColoredTokens", "ColoredTokensMulti"):
        spec["note"] = _colour_note(props)
    return spec, _HEIGHTS.get(name, 200)
