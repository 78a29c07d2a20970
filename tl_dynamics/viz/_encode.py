"""Compact array encodings for pages: numbers travel as zlib-compressed base64, not JSON lists.

The page's runtime (``_runtime.py``) decodes them with the browser's own ``DecompressionStream``
(no network, no library). ``pack_u8`` quantises to 255 levels (code 255 marks a missing value);
``pack_f32`` keeps float32 exactly (non-finite values become NaN, shown as missing).
"""

from __future__ import annotations

import base64
import zlib
from typing import Any

import numpy as np
from jaxtyping import Float

LEVELS = 254  # codes 0..254 carry values; 255 marks a missing (NaN or masked) cell
MISSING = 255
PACK_MIN_SIZE = 64  # smaller arrays stay plain JSON (cheaper than the envelope)


def as_array(values: Any) -> np.ndarray:
    """A tensor or nested list as a float32 numpy array (detached, on the CPU)."""
    if hasattr(values, "detach"):
        values = values.detach().cpu().float().numpy()
    return np.asarray(values, dtype=np.float32)


def _b64z(raw: bytes) -> str:
    return base64.b64encode(zlib.compress(raw, 6)).decode("ascii")


def pack_u8(values: Any, lo: float, hi: float, scale: str = "linear") -> dict[str, Any]:
    """Quantise ``values`` over ``[lo, hi]`` to bytes; ``scale="sqrt"`` spends the levels on
    small values (attention on long prompts). The page decodes ``lo + (hi - lo) * t`` with
    ``t = q / 254`` (linear) or ``t = (q / 254) ** 2`` (sqrt).

    Example:
        >>> packed = pack_u8([[0.0, 0.5], [1.0, float("nan")]], 0.0, 1.0)
        >>> packed["enc"], packed["shape"], packed["lo"], packed["hi"]
        ('u8', [2, 2], 0.0, 1.0)
    """
    arr = as_array(values)
    lo, hi = float(lo), float(hi)
    span = hi - lo if hi > lo else 1.0
    t = np.clip((arr - lo) / span, 0.0, 1.0)
    if scale == "sqrt":
        t = np.sqrt(t)
    codes = np.rint(np.nan_to_num(t, nan=0.0) * LEVELS).astype(np.uint8)
    codes[~np.isfinite(arr)] = MISSING
    return {
        "$tld": 1,
        "enc": "u8",
        "shape": list(arr.shape),
        "lo": lo,
        "hi": hi,
        "scale": scale,
        "z": _b64z(codes.tobytes()),
    }


def pack_f32(values: Any) -> dict[str, Any]:
    """Float32 values, exact (non-finite values become NaN, which the page shows as missing).

    Example:
        >>> pack_f32([1.0, 2.0])["shape"]
        [2]
    """
    arr = np.nan_to_num(as_array(values), nan=np.nan, posinf=np.nan, neginf=np.nan)
    return {
        "$tld": 1,
        "enc": "f32",
        "shape": list(arr.shape),
        "z": _b64z(np.ascontiguousarray(arr, dtype="<f4").tobytes()),
    }


def finite_range(
    values: Float[np.ndarray, "..."], lo: float | None = None, hi: float | None = None
) -> tuple[float, float]:
    """``(lo, hi)`` over the finite values unless given; a flat range is widened to stay valid.

    Example:
        >>> finite_range(np.array([1.0, np.nan, 3.0]))
        (1.0, 3.0)
    """
    finite = values[np.isfinite(values)]
    low = float(lo) if lo is not None else (float(finite.min()) if finite.size else 0.0)
    high = float(hi) if hi is not None else (float(finite.max()) if finite.size else 1.0)
    if not high > low:
        high = low + 1.0
    return low, high


def downsample_max(pattern: Float[np.ndarray, "rows cols"], size: int) -> Float[np.ndarray, "r c"]:
    """Max-pool a map to at most ``size`` x ``size`` cells (a thumbnail that keeps thin lines:
    a previous-token diagonal stays visible where a mean would dilute it).

    Example:
        >>> downsample_max(np.eye(4), 2)
        array([[1., 0.],
               [0., 1.]], dtype=float32)
    """
    arr = np.nan_to_num(np.asarray(pattern, dtype=np.float32), nan=0.0)
    rows, cols = arr.shape
    r_edges = np.linspace(0, rows, min(rows, size) + 1).astype(int)[:-1]
    c_edges = np.linspace(0, cols, min(cols, size) + 1).astype(int)[:-1]
    return np.maximum.reduceat(np.maximum.reduceat(arr, r_edges, axis=0), c_edges, axis=1)
