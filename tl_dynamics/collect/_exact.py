"""Exactly mergeable float64 sums, stored compactly as int64 limbs.

Floating-point addition is not associative, so summing batch totals in a different grouping
(one run vs. two half runs merged) changes the last bits. ``ExactSum`` holds every total as an
exact integer multiple of one power of two shared by the whole array, ``2**exponent``; the
integer (the mantissa) is split into base ``2**32`` limbs kept in int64 arrays. Adding two
sums is then integer arithmetic (align the exponents, add limbs, propagate carries): any
grouping and any order give the same integers, and ``value()`` rounds each one once, correctly.

The stored form is canonical, a function of the exact values alone (not of how they were
summed), so equal sums have equal limbs, and serialised sums are byte-identical:

- ``limbs`` ``[n_limbs, *shape]`` int64; value ``= sum_i limbs[i] * 2**(exponent + 32 i)``;
  every limb but the last lies in ``[0, 2**32)``, the last (signed) in ``[-2**31, 2**31)``;
- ``exponent`` is a multiple of 32, the largest such that every value is a multiple of it;
  ``n_limbs`` is the fewest that hold every value; an all-zero array is one zero limb with
  exponent 0 (the identity of ``+``);
- non-finite inputs are kept apart in ``special`` (uint8: 1 = +inf, 2 = -inf, 3 = nan, with
  inf + -inf = nan, as float addition gives), None when every value is finite.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import EllipsisType
from typing import Sequence

import numpy as np
import torch
from jaxtyping import Int
from torch import Tensor

from tl_dynamics.errors import TLDynamicsError

_BITS = 32
_MASK = (1 << _BITS) - 1
_HALF = 1 << (_BITS - 1)


def _carry(limbs: np.ndarray) -> None:
    """Normalise in place: every limb but the last into ``[0, 2**32)``, carries upwards."""
    for i in range(limbs.shape[0] - 1):
        carry = limbs[i] >> _BITS
        limbs[i] &= _MASK
        limbs[i + 1] += carry


def _canonical(exponent: int, limbs: np.ndarray) -> tuple[int, np.ndarray]:
    """Fewest limbs and the largest exponent (``limbs`` carried already)."""
    if not limbs.any():
        return 0, np.zeros((1,) + limbs.shape[1:], dtype=np.int64)
    low = 0
    while not limbs[low].any():
        low += 1
    top = limbs.shape[0]
    while top - low > 1:
        t, below = limbs[top - 1], limbs[top - 2]
        if top < limbs.shape[0]:  # a limb below the original top: read it as signed
            t = np.where(t >= _HALF, t - (1 << _BITS), t)
        if not np.all(((t == 0) & (below < _HALF)) | ((t == -1) & (below >= _HALF))):
            break
        top -= 1
    out = limbs[low:top]  # every caller's own fresh array: a view, not a copy
    last = out[-1]
    np.subtract(last, 1 << _BITS, out=last, where=last >= _HALF)
    return exponent + _BITS * low, out


def _special_add(a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray | None:
    if a is None or b is None:
        return b if a is None else a
    return np.where(a == 0, b, np.where((b == 0) | (a == b), a, 3)).astype(np.uint8)


def _aligned(parts: Sequence["ExactSum"]) -> tuple[int, list[np.ndarray]]:
    """Every part's limbs on the smallest exponent, zero-padded to one more limb than the
    widest (room for the carries of adding them all)."""
    exponent = min(p.exponent for p in parts)
    shifts = [(p.exponent - exponent) // _BITS for p in parts]
    n = max(s + p.limbs.shape[0] for s, p in zip(shifts, parts)) + 1  # carries of < 2**31 parts
    out = []
    for s, p in zip(shifts, parts):
        full = np.zeros((n,) + p.limbs.shape[1:], dtype=np.int64)
        full[s : s + p.limbs.shape[0]] = p.limbs
        out.append(full)
    return exponent, out


@dataclass(frozen=True, eq=False)
class ExactSum:
    """A fixed-shape array of exact sums of float64 values.

    Example:
        >>> a = ExactSum.of(torch.tensor([0.1, 1e20], dtype=torch.float64))
        >>> b = ExactSum.of(torch.tensor([0.2, -1e20], dtype=torch.float64))
        >>> (a + b).value().tolist()   # exact: 0.1 + 0.2 rounded once, 1e20 - 1e20 == 0
        [0.30000000000000004, 0.0]
        >>> (a + b) == (b + a) and (a + ExactSum.zeros([2])) == a
        True
    """

    shape: tuple[int, ...]
    exponent: int
    limbs: Int[np.ndarray, " limb *shape"]
    special: np.ndarray | None = None

    @staticmethod
    def zeros(shape: Sequence[int]) -> "ExactSum":
        shape = tuple(int(s) for s in shape)
        return ExactSum(shape, 0, np.zeros((1,) + shape, dtype=np.int64))

    @staticmethod
    def of(values: Tensor | np.ndarray) -> "ExactSum":
        """Exact representation of ``values`` (converted to float64 first)."""
        if isinstance(values, Tensor):
            values = values.detach() if values.requires_grad else values
            values = values.to(torch.float64).cpu().numpy()
        x = np.asarray(values, dtype=np.float64)
        shape, flat = tuple(x.shape), x.reshape(-1)
        finite = np.isfinite(flat)
        special = None
        if not finite.all():
            special = np.where(
                finite, 0, np.where(np.isnan(flat), 3, np.where(flat > 0, 1, 2))
            ).astype(np.uint8)
            special = special.reshape(shape)
            flat = np.where(finite, flat, 0.0)
        frac, ex = np.frexp(flat)
        m = (frac * float(1 << 53)).astype(np.int64)  # exact: |m| < 2**53
        e = ex.astype(np.int64) - 53
        nonzero = m != 0
        if not nonzero.any():
            return ExactSum(shape, 0, np.zeros((1,) + shape, dtype=np.int64), special)
        exponent = int(e[nonzero].min()) // _BITS * _BITS
        b = np.where(nonzero, e - exponent, 0)
        li, s = b // _BITS, b % _BITS
        limbs = np.zeros((int(li.max()) + 4, flat.size), dtype=np.int64)
        cols = np.arange(flat.size)
        low, high = (m & _MASK) << s, (m >> _BITS) << s  # < 2**63 and < 2**52 in size
        limbs[li, cols] += low & _MASK
        limbs[li + 1, cols] += (low >> _BITS) + (high & _MASK)
        limbs[li + 2, cols] += high >> _BITS
        _carry(limbs)
        exponent, limbs = _canonical(exponent, limbs)
        return ExactSum(shape, exponent, limbs.reshape((-1,) + shape), special)

    @staticmethod
    def total(parts: Sequence["ExactSum"]) -> "ExactSum":
        """The sum of many exact sums of one shape at once (same result as adding them)."""
        if not parts:
            raise TLDynamicsError("ExactSum.total needs at least one sum")
        shapes = {p.shape for p in parts}
        if len(shapes) > 1:
            raise TLDynamicsError(f"cannot add exact sums of shapes {sorted(shapes)}")
        exponent, limbs = _aligned(parts)
        acc = limbs[0]
        for other in limbs[1:]:
            acc += other
        _carry(acc)
        exponent, acc = _canonical(exponent, acc)
        special = None
        for p in parts:
            special = _special_add(special, p.special)
        return ExactSum(parts[0].shape, exponent, acc, special)

    def weighted(self, weights: np.ndarray) -> "ExactSum":
        """``sum_n weights[n, c] * self[n]`` for every column ``c``, exactly: integer weights
        scale the limbs (no rounding at all; ``self`` ``[n, ...]`` finite).

        Args:
            weights: non-negative integers ``[n, columns]`` (e.g. Poisson bootstrap counts),
                each column summing to under ``2**30``.

        Returns:
            An ``ExactSum`` of shape ``[columns, ...]``.

        Example:
            >>> x = ExactSum.of(np.array([[0.1, 2.0], [1e20, -1.0]]))
            >>> x.weighted(np.array([[3, 0], [1, 2]])).value().tolist()
            [[1e+20, 5.0], [2e+20, -2.0]]
        """
        w = np.asarray(weights)
        if (
            w.ndim != 2
            or w.shape[0] != (self.shape[0] if self.shape else -1)
            or not np.array_equal(w, np.floor(w))
            or (w.size and (w.min() < 0 or w.sum(0).max() >= 1 << 30))
        ):
            raise TLDynamicsError(
                f"ExactSum.weighted: weights must be non-negative integers [n, columns] with n = "
                f"{self.shape[:1]} and column sums under 2**30, got shape {w.shape}"
            )
        if self.special is not None:
            raise TLDynamicsError("ExactSum.weighted: the sums hold non-finite values")
        # one limb more holds the carries: a limb below the top is < 2**32 and the top one
        # < 2**31 in size, so with column sums of the weights < 2**30 every product sum is
        # < 2**62 and the carry out of the top < 2**30
        n_limbs = self.limbs.shape[0]
        limbs = np.zeros((n_limbs + 1, w.shape[1]) + self.shape[1:], dtype=np.int64)
        np.einsum("ln...,nc->lc...", self.limbs, w.astype(np.int64), out=limbs[:n_limbs])
        _carry(limbs)
        exponent, limbs = _canonical(self.exponent, limbs)
        return ExactSum((w.shape[1],) + self.shape[1:], exponent, limbs)

    @staticmethod
    def stack(parts: Sequence["ExactSum"]) -> "ExactSum":
        """Stack sums of one shape along a new first axis (like ``np.stack``), exactly."""
        if not parts or len({p.shape for p in parts}) > 1:
            raise TLDynamicsError("ExactSum.stack needs one or more sums of one shape")
        exponent, limbs = _aligned(parts)
        acc = np.stack(limbs, axis=1)
        _carry(acc)
        exponent, acc = _canonical(exponent, acc)
        special = None
        if any(p.special is not None for p in parts):
            special = np.stack(
                [np.zeros(p.shape, np.uint8) if p.special is None else p.special for p in parts]
            )
        return ExactSum((len(parts),) + parts[0].shape, exponent, acc, special)

    def __add__(self, other: "ExactSum") -> "ExactSum":
        if not isinstance(other, ExactSum) or self.shape != other.shape:
            raise TLDynamicsError(
                f"cannot add exact sums of shapes {self.shape} and "
                f"{getattr(other, 'shape', type(other).__name__)}"
            )
        return ExactSum.total([self, other])

    def __getitem__(self, index: int | slice | EllipsisType | tuple) -> "ExactSum":
        """A sub-array (numpy indexing on the value axes), still exact and canonical."""
        idx = index if isinstance(index, tuple) else (index,)
        limbs = np.array(self.limbs[(slice(None),) + idx], dtype=np.int64)
        limbs = np.concatenate([limbs, np.zeros((1,) + limbs.shape[1:], dtype=np.int64)])
        _carry(limbs)
        exponent, limbs = _canonical(self.exponent, limbs)
        special = None if self.special is None else np.array(self.special[idx])
        if special is not None and not special.any():
            special = None
        return ExactSum(tuple(limbs.shape[1:]), exponent, limbs, special)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ExactSum):
            return NotImplemented
        return (
            self.shape == other.shape
            and self.exponent == other.exponent
            and np.array_equal(self.limbs, other.limbs)
            and (self.special is None) == (other.special is None)
            and (
                self.special is None
                or other.special is None
                or np.array_equal(self.special, other.special)
            )
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"ExactSum(shape={self.shape}, limbs={self.limbs.shape[0]}, exponent={self.exponent})"
        )

    def value(self) -> np.ndarray:
        """The sums, each correctly rounded to float64 (beyond the float range: +-inf)."""
        flat = self.limbs.reshape(self.limbs.shape[0], -1)
        slow = np.ones(flat.shape[1], dtype=bool)
        out = np.zeros(flat.shape[1], dtype=np.float64)
        if flat.shape[0] <= 2:  # the integer fits int64: one correctly rounded conversion,
            ints64 = flat[0] if flat.shape[0] == 1 else (flat[1] << _BITS) + flat[0]
            with np.errstate(over="ignore"):  # then an exact scaling unless out of normal range
                out = np.ldexp(ints64.astype(np.float64), self.exponent)
            slow = ~np.isfinite(out) | ((out != 0) & (np.abs(out) < np.finfo(np.float64).tiny))
        if slow.any():
            ints = flat[-1, slow].astype(object)
            for i in range(flat.shape[0] - 2, -1, -1):
                ints = (ints << _BITS) + flat[i, slow].astype(object)
            try:
                scaled = (
                    ints * (1 << self.exponent)
                    if self.exponent >= 0
                    else ints / (1 << -self.exponent)
                )  # int / int: correctly rounded
                out[slow] = np.asarray(scaled, dtype=object).astype(np.float64)
            except OverflowError:
                out[slow] = [_round(int(v), self.exponent) for v in ints]
        out = out.reshape(self.shape)
        if self.special is not None:
            out = np.where(
                self.special == 1,
                np.inf,
                np.where(self.special == 2, -np.inf, np.where(self.special == 3, np.nan, out)),
            )
        return out

    # ------------------------------------------------------------------ storage
    def arrays(self) -> dict[str, np.ndarray]:
        """Plain arrays that store the sum exactly (``from_arrays`` reads them back)."""
        out = {"limbs": self.limbs, "exponent": np.array([self.exponent], dtype=np.int64)}
        if self.special is not None:
            out["special"] = self.special
        return out

    @staticmethod
    def from_arrays(arrays: dict[str, np.ndarray], what: str = "exact sum") -> "ExactSum":
        """Read ``arrays()`` back, refusing anything that is not a canonical exact sum."""
        limbs, exponent = arrays.get("limbs"), arrays.get("exponent")
        if (
            limbs is None
            or exponent is None
            or limbs.dtype != np.int64
            or limbs.ndim < 1
            or exponent.shape != (1,)
            or exponent.dtype != np.int64
            or limbs.shape[0] < 1
        ):
            raise TLDynamicsError(
                f"{what}: not an exact sum (needs int64 limbs [n, ...] and a "
                "one-element int64 exponent)"
            )
        special = arrays.get("special")
        if special is not None and (
            special.dtype != np.uint8
            or special.shape != limbs.shape[1:]
            or special.max(initial=0) > 3
            or not special.any()
        ):
            raise TLDynamicsError(f"{what}: corrupt special-value flags")
        out = ExactSum(tuple(limbs.shape[1:]), int(exponent[0]), np.array(limbs), special)
        if out.exponent % _BITS or out != out[...]:
            raise TLDynamicsError(f"{what}: the limbs are not in canonical form (corrupt data)")
        return out


def _round(value: int, exponent: int) -> float:
    try:
        return float(value << exponent) if exponent >= 0 else value / (1 << -exponent)
    except OverflowError:
        return float("inf") if value > 0 else float("-inf")
