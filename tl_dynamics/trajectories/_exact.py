"""Exactly mergeable float64 sums.

Floating-point addition is not associative, so summing batch totals in a different grouping
(one run vs. two half runs merged) changes the last bits. ``ExactSum`` holds every total as an
integer multiple of 2**-1074 (the smallest float64 step), so adding batch totals is integer
arithmetic: any grouping gives the same integer, and ``value()`` rounds it once, correctly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from tl_dynamics.errors import TLDynamicsError

_SHIFT = 1074
_ONE = 1 << _SHIFT


def _to_int(value: float) -> int:
    num, den = float(value).as_integer_ratio()
    return num * (_ONE // den)


@dataclass(frozen=True)
class ExactSum:
    """A fixed-shape array of exact sums of float64 values.

    Example:
        >>> a = ExactSum.of(torch.tensor([0.1, 1e20], dtype=torch.float64))
        >>> b = ExactSum.of(torch.tensor([0.2, -1e20], dtype=torch.float64))
        >>> (a + b).value().tolist()   # exact: 0.1 + 0.2 rounded once, 1e20 - 1e20 == 0
        [0.30000000000000004, 0.0]
    """

    shape: tuple[int, ...]
    ints: tuple[int, ...]

    @staticmethod
    def zeros(shape: Sequence[int]) -> "ExactSum":
        shape = tuple(int(s) for s in shape)
        return ExactSum(shape, (0,) * int(np.prod(shape, dtype=np.int64)))

    @staticmethod
    def of(values: Tensor) -> "ExactSum":
        """Exact representation of ``values`` (converted to float64 first)."""
        flat = values.detach().to(torch.float64).reshape(-1).cpu().tolist()
        return ExactSum(tuple(values.shape), tuple(_to_int(v) for v in flat))

    def __add__(self, other: "ExactSum") -> "ExactSum":
        if self.shape != other.shape:
            raise TLDynamicsError(f"cannot add exact sums of shapes {self.shape} and {other.shape}")
        return ExactSum(self.shape, tuple(a + b for a, b in zip(self.ints, other.ints)))

    def value(self) -> np.ndarray:
        """The sums, each correctly rounded to float64."""
        return np.array([i / _ONE for i in self.ints], dtype=np.float64).reshape(self.shape)
