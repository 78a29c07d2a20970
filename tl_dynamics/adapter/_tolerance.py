"""The tolerance of a recomputed pattern entry against the model's own, per weight dtype (the
self-check at load, ``_selfcheck``; the check of a cached generate's steps, ``_generate``;
docs/math.md §7.1, §7.2)."""

from __future__ import annotations

import torch

# largest |difference| allowed in a pattern entry; z is allowed this times max(1, max |z|)
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def tolerance(dtype: torch.dtype) -> float:
    """The tolerance on a pattern entry for weights of ``dtype``.

    Args:
        dtype: The model's weight dtype.

    Returns:
        The largest allowed absolute difference of a pattern entry.

    Example:
        >>> tolerance(torch.float32), tolerance(torch.bfloat16)
        (0.001, 0.05)
    """
    return TOLERANCE.get(dtype, TOLERANCE[torch.float32])
