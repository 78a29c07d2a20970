"""Mean ablation, written once: a head's ``z`` replaced by its mean over each prompt's real
positions, and the pooled loss change with its 95% interval over the units (docs/math.md §9).

The atlas (``atlas/_causal.py``, ``atlas/_ablate.py``: its causal columns, with the prior-only and
likelihood-only patterns beside) and the regression view (``regression/_ablation.py``: the
causal weight of each head at the measured destinations) both ablate this way and pool the same
way: a loss change summed per unit, over the units' counts of target positions, with Poisson
bootstrap replicates of the same ratio (``evidence``), ``evidence.N_BOOT`` of them by default.
"""

from __future__ import annotations

import warnings

import numpy as np
from jaxtyping import Float
from torch import Tensor

from tl_dynamics.evidence import interval, poisson_weights


def position_mean(
    z: Float[Tensor, "rows pos head d_head"], key_valid: Tensor
) -> Float[Tensor, "rows 1 head d_head"]:
    """Each row's ``z`` averaged over its real positions (``key_valid`` ``[rows, pos]``): what a
    mean-ablated head writes at every position.

    Example:
        >>> import torch
        >>> z = torch.arange(6.0).reshape(1, 3, 1, 2)          # positions 0, 1, 2
        >>> position_mean(z, torch.tensor([[True, True, False]]))[0, 0, 0].tolist()
        [1.0, 2.0]
    """
    v = key_valid.to(z.device, z.dtype)[:, :, None, None]
    return (z * v).sum(1, keepdim=True) / v.sum(1, keepdim=True).clamp(min=1.0)


def pooled_effect(
    sums: np.ndarray, counts: np.ndarray, n_boot: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(estimate, low, high)`` of a loss change pooled over units: ``sums`` ``[units, ...]``
    (each unit's summed change, NaN where not measured) over ``counts`` ``[units]`` (its target
    positions); the interval from Poisson bootstrap replicates of the same ratio over the units.

    Example:
        >>> est, low, high = pooled_effect(np.array([[2.0], [4.0], [3.0]] * 4), np.ones(12), 200, 0)
        >>> float(est[0]), bool(low[0] < 3.0 < high[0])
        (3.0, True)
    """
    n = sums.shape[0]
    x = np.nan_to_num(sums)
    total = max(float(counts.sum()), 1e-300)
    estimate = np.tensordot(np.ones(n), x, axes=1) / total
    w = poisson_weights(np.arange(n), n_boot, seed)  # [units, B]
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a replicate that drew no unit: NaN
        reps = np.tensordot(w.T, x, axes=1) / (w.T @ counts).reshape(-1, *([1] * (x.ndim - 1)))
    low, high = interval(reps, n)
    missing = np.isnan(sums).all(0)
    return tuple(np.where(missing, np.nan, a) for a in (estimate, low, high))  # type: ignore[return-value]
