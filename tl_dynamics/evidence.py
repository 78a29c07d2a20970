"""The evidence behind every label: units, a bootstrap interval over them, a control, and a
three-way verdict (docs/math.md §9). Every label tl_dynamics prints rests on numbers measured
over **units** (prompts, or stated blocks of destinations); this is the one place that turns
such a number into a claim:

- ``poisson_weights(units, n_boot, seed)``: Poisson(1) bootstrap weights from a counter-based
  generator keyed on each unit, so a unit's weight does not depend on which process, shard or
  batch saw it: weighted sums merge exactly (byte-identical across one process, torchrun, Ray).
- ``interval(replicates, n_units)``: Hesterberg's expanded percentile interval (its tail
  widened for few units to the width of a t interval; it undercovers less than the plain one).
- ``decide(low, high, threshold, n_units)``: ``YES`` where the whole interval clears the
  threshold, ``NO`` where it lies wholly below it, ``UNDECIDED`` where it straddles it or
  there are too few units (``too_few``: fewer than ``MIN_UNITS``). ``Verdict`` members compare,
  hash and print as the strings ``"yes"``, ``"no"``, ``"undecided"``.
- ``all_of(*verdicts)``: the three-valued AND; ``reason(...)``: a verdict in words from the same
  numbers (``"too few prompts (3 of 8)"``, ``"interval [a, b] straddles t"``);
  ``units_to_decide``, ``need_phrase``: what would decide it, never fewer units than measured.
"""

from __future__ import annotations

import math
from enum import Enum
from statistics import NormalDist
from typing import Sequence, overload

import numpy as np

from tl_dynamics.errors import TLDynamicsError


class Verdict(str, Enum):
    """A three-way verdict. A ``str``: it equals, hashes, formats and prints as its value, so
    ``verdict == "yes"``, ``{"yes"} == {YES}`` and ``f"{verdict}"`` read as the plain strings.

    Example:
        >>> YES == "yes", f"{UNDECIDED}", sorted({NO, YES}), Verdict("no") is NO
        (True, 'undecided', ['no', 'yes'], True)
    """

    YES = "yes"
    NO = "no"
    UNDECIDED = "undecided"

    __str__ = str.__str__
    __format__ = str.__format__
    __hash__ = str.__hash__

    def __repr__(self) -> str:
        return repr(self.value)


YES, NO, UNDECIDED = Verdict.YES, Verdict.NO, Verdict.UNDECIDED
LEVEL = 0.95  # every interval shown is a 95% interval
MIN_UNITS = 8  # no verdict from fewer units: fewer than 8 cannot estimate a spread
N_BOOT = 200  # bootstrap replicates by default
_GOLDEN, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # SplitMix64
# Poisson(1): cumulative probabilities P(X <= k), k = 0..19 (the tail beyond is under 1e-18).
_POISSON_CDF = np.cumsum([math.exp(-1.0) / math.factorial(k) for k in range(20)])


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(_M1)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(_M2)
    return x ^ (x >> np.uint64(31))


def unit_keys(tokens: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """One 64-bit key per prompt from its real tokens alone, in order: the same prompt gets the
    same key whatever its padding, batch, pass, process or machine.

    Args:
        tokens: ``[batch, pos]`` token ids.
        valid: ``[batch, pos]`` bool, the real (non-padding) tokens.

    Returns:
        uint64 ``[batch]``.

    Example:
        >>> t = np.array([[5, 6, 7, 0], [0, 5, 6, 7]])
        >>> v = np.array([[1, 1, 1, 0], [0, 1, 1, 1]], dtype=bool)
        >>> k = unit_keys(t, v)
        >>> bool(k[0] == k[1]), bool(k[0] == unit_keys(t[:1, [1, 0, 2, 3]], v[:1])[0])
        (True, False)
    """
    valid = np.asarray(valid, dtype=bool)
    index = (np.cumsum(valid, axis=-1) - 1).astype(np.uint64)  # position among the real tokens
    with np.errstate(over="ignore"):
        x = _mix(np.asarray(tokens).astype(np.uint64) * np.uint64(_GOLDEN) ^ _mix(index + 1))
        return _mix(np.where(valid, x, np.uint64(0)).sum(-1, dtype=np.uint64))


def poisson_weights(units: Sequence[int] | np.ndarray, n_boot: int, seed: int = 0) -> np.ndarray:
    """Poisson(1) bootstrap weights, one row per unit, from a counter-based generator.

    The weight of unit ``u`` in replicate ``b`` is a pure function of ``(seed, u, b)``: it does
    not depend on which other units are drawn, in which order, or by which process. A sum over
    units weighted by row ``u`` therefore merges exactly across batches, shards and machines
    (the Poisson bootstrap: each unit appears ``Poisson(1)`` times in each replicate). Units
    are indices (non-negative ints) or ``unit_keys``.

    Args:
        units: the units' global indices or keys, ``[n]``.
        n_boot: the number of replicates.
        seed: the generator's key.

    Returns:
        float64 ``[n, n_boot]`` of non-negative integers (mean 1).

    Example:
        >>> w = poisson_weights([0, 1, 2], n_boot=4, seed=0)
        >>> w.shape, bool((w == poisson_weights([2, 0, 1], 4)[[1, 2, 0]]).all())
        ((3, 4), True)
        >>> round(float(poisson_weights(range(2000), 50).mean()), 1)
        1.0
    """
    u = np.asarray(units)
    if u.ndim != 1 or (u.size and (u.dtype.kind not in "iu" or int(u.min()) < 0)):
        raise TLDynamicsError(f"poisson_weights: units must be non-negative ints, got {units!r}")
    if isinstance(n_boot, bool) or not isinstance(n_boot, int) or n_boot < 1:
        raise TLDynamicsError(f"poisson_weights: n_boot must be a positive int, got {n_boot!r}")
    with np.errstate(over="ignore"):
        key = _mix(
            np.array([int(seed) % 2**64], dtype=np.uint64) * np.uint64(_GOLDEN) + np.uint64(_GOLDEN)
        )
        x = _mix(u.astype(np.uint64)[:, None] ^ key)
        x = _mix(x + np.arange(1, n_boot + 1, dtype=np.uint64)[None, :] * np.uint64(_GOLDEN))
    uniform = (x >> np.uint64(11)).astype(np.float64) * 2.0**-53  # exact: 53-bit integers
    return np.searchsorted(_POISSON_CDF, uniform, side="right").astype(np.float64)


def _t_quantile(p: float, df: int) -> float:
    """Student's t quantile (Cornish-Fisher expansion in 1/df; within 2e-3 for df >= 3)."""
    z = NormalDist().inv_cdf(p)
    v = float(df)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / v + g2 / v**2 + g3 / v**3 + g4 / v**4


def expanded_tail(n_units: int, level: float = LEVEL) -> float:
    """The tail probability the percentile interval uses so that, with ``n_units`` units, it is
    as wide as a t interval (Hesterberg 2015: ``Phi(-sqrt(n / (n - 1)) t_{n-1})``).

    Args:
        n_units: the number of units (at least 2).
        level: the interval's nominal coverage.

    Returns:
        The lower tail probability (``(1 - level) / 2`` as ``n_units`` grows).

    Example:
        >>> round(expanded_tail(1000), 4), round(expanded_tail(8), 4)
        (0.0248, 0.0057)
    """
    n = max(int(n_units), 2)
    t = _t_quantile(1 - (1 - level) / 2, max(n - 1, 1))
    return NormalDist().cdf(-math.sqrt(n / (n - 1)) * t)


def interval(
    replicates: np.ndarray, n_units: int | np.ndarray, level: float = LEVEL
) -> tuple[np.ndarray, np.ndarray]:
    """The expanded percentile interval of bootstrap ``replicates`` (axis 0).

    Args:
        replicates: ``[n_boot, ...]`` (NaN replicates are left out).
        n_units: the units the replicates resample (an int, or an array broadcast against
            ``replicates.shape[1:]``).
        level: the nominal coverage.

    Returns:
        ``(low, high)``, each of shape ``replicates.shape[1:]`` (NaN where every replicate is).

    Example:
        >>> r = np.random.default_rng(0).normal(0.0, 1.0, size=(4000, 1))
        >>> low, high = interval(r, 1000)
        >>> bool(-2.1 < low[0] < -1.9 and 1.9 < high[0] < 2.1)
        True
    """
    reps = np.asarray(replicates, dtype=np.float64)
    n = np.broadcast_to(np.asarray(n_units), reps.shape[1:])
    low, high = np.full(reps.shape[1:], np.nan), np.full(reps.shape[1:], np.nan)
    for value in np.unique(n):
        tail = expanded_tail(int(value), level)
        sel = n == value
        x = reps[:, sel]
        ok = ~np.isnan(x).all(0)
        if ok.any():
            q = np.nanquantile(x[:, ok], [tail, 1 - tail], axis=0)
            lo, hi = low[sel], high[sel]
            lo[ok], hi[ok] = q[0], q[1]
            low[sel], high[sel] = lo, hi
    return low, high


def too_few(n_units: np.ndarray | int, min_units: int = MIN_UNITS) -> np.ndarray:
    """Where there are too few units for any verdict (fewer than ``min_units``): the one
    definition every labeller uses.

    Args:
        n_units: the units behind each interval.
        min_units: the fewest units a verdict needs.

    Returns:
        bool, the shape of ``n_units``.

    Example:
        >>> too_few([0, 7, 8]).tolist()
        [True, True, False]
    """
    return np.asarray(n_units) < min_units


def decide(
    low: np.ndarray | float,
    high: np.ndarray | float,
    threshold: float,
    n_units: np.ndarray | int,
    min_units: int = MIN_UNITS,
) -> np.ndarray:
    """The three-way verdict of "the quantity exceeds ``threshold``".

    Args:
        low, high: the interval's ends.
        threshold: what the quantity must exceed.
        n_units: the units behind the interval.
        min_units: fewer units than this is always undecided.

    Returns:
        An object array of ``YES`` (``low > threshold``), ``NO`` (``high <= threshold``)
        or ``UNDECIDED`` (straddles, NaN, or too few units), broadcast over the inputs.

    Example:
        >>> decide([0.2, -0.1, 0.0, 0.3], [0.4, 0.01, 0.2, 0.5], 0.05, [20, 20, 20, 4]).tolist()
        ['yes', 'no', 'undecided', 'undecided']
    """
    lo, hi = np.asarray(low, dtype=float), np.asarray(high, dtype=float)
    lo, hi, n = np.broadcast_arrays(lo, hi, np.asarray(n_units))
    out = np.full(lo.shape, UNDECIDED, dtype=object)
    enough = ~too_few(n, min_units)
    out[enough & (lo > threshold)] = YES
    out[enough & (hi <= threshold)] = NO
    return out


@overload
def all_of(*verdicts: str) -> Verdict: ...
@overload
def all_of(*verdicts: np.ndarray | str) -> np.ndarray: ...
def all_of(*verdicts: np.ndarray | str) -> np.ndarray | Verdict:
    """The three-valued AND: ``NO`` where any verdict is no, ``YES`` where all are yes, else
    ``UNDECIDED`` (a label that needs several criteria is a claim only where all hold).

    Args:
        verdicts: verdicts or arrays of them (broadcast together); at least one.

    Returns:
        An object array of ``Verdict``, or one ``Verdict`` where every input is a string.

    Example:
        >>> all_of(np.array(["yes", "yes", "no"]), np.array(["yes", "undecided", "undecided"]))
        array(['yes', 'undecided', 'no'], dtype=object)
        >>> all_of(YES, "undecided"), all_of(YES, YES, NO)
        ('undecided', 'no')
    """
    if not verdicts:
        raise TLDynamicsError("all_of: give at least one verdict")
    arrays = np.broadcast_arrays(*(np.asarray(v, dtype=object) for v in verdicts))
    out = np.full(arrays[0].shape, UNDECIDED, dtype=object)
    out[np.logical_and.reduce([a == YES for a in arrays])] = YES
    out[np.logical_or.reduce([a == NO for a in arrays])] = NO
    if all(isinstance(v, str) for v in verdicts):
        return Verdict(out.item())
    return out


def reason(
    low: float,
    high: float,
    threshold: float,
    n_units: int,
    units: str = "prompts",
    what: str = "interval",
    min_units: int = MIN_UNITS,
) -> str:
    """One verdict of ``decide`` in words, from the same numbers: why it is what it is.

    Args:
        low, high: the interval's ends.
        threshold: what the quantity must exceed.
        n_units: the units behind the interval.
        units: what the units are, plural (``"prompts"``, ``"held-out prompts"``, ``"probes"``).
        what: the name of the interval (``"R² interval"``).
        min_units: the fewest units a verdict needs.

    Returns:
        ``"too few <units> (n of m)"`` (never "straddles"), ``"no <what>"`` where an end is
        missing, else ``"<what> [a, b]"`` and ``"lies above t"``, ``"lies below t"`` or
        ``"straddles t"``.

    Example:
        >>> reason(0.226, 0.517, 0.25, 32, what="R² interval")
        'R² interval [0.226, 0.517] straddles 0.25'
        >>> reason(0.33, 0.33, 0.1, 1, units="probes"), reason(0.0498, 0.11, 0.05, 16)
        ('too few probes (1 of 8)', 'interval [0.0498, 0.110] straddles 0.05')
    """
    n = int(n_units)
    if too_few(n, min_units):
        return f"too few {units} ({n} of {min_units})"
    if not (math.isfinite(low) and math.isfinite(high)):
        return f"no {what}"
    verdict = decide(low, high, threshold, n, min_units).item()
    where = {YES: "lies above", NO: "lies below", UNDECIDED: "straddles"}[verdict]
    ends = [_shown(x, threshold) for x in (low, high)]
    return f"{what} [{ends[0]}, {ends[1]}] {where} {threshold:.3g}"


def _shown(x: float, threshold: float) -> str:
    """``x`` to 3 decimals, more where 3 would print it as the threshold it is not."""
    digits = 3
    while digits < 8 and x != threshold and round(x, digits) == round(threshold, digits):
        digits += 1
    return f"{x:.{digits}f}"


def units_to_decide(
    estimate: np.ndarray | float,
    low: np.ndarray | float,
    high: np.ndarray | float,
    threshold: float,
    n_units: np.ndarray | int,
    min_units: int = MIN_UNITS,
) -> np.ndarray:
    """How many units would decide an undecided verdict, where that can be said.

    The interval narrows as ``1 / sqrt(units)``: if the estimate holds, it clears the threshold
    at about ``n (half / |estimate - threshold|)^2`` units (``half``: the half-width on the
    threshold's side). Given only where the estimate lies at least a standard error
    (``half / z``) from the threshold: nearer, the true gap could be any size down to zero (a
    gap of 0.003 projected 14,764 prompts). Never fewer than ``n + 1`` nor ``min_units``.

    Args:
        estimate, low, high: the point estimate and the interval.
        threshold: the verdict's threshold.
        n_units: the units measured.
        min_units: the fewest units any verdict needs.

    Returns:
        float ``[...]``, rounded up; NaN where it cannot be said (the estimate near the threshold,
        outside its interval or unknown; too few units: ``need_phrase`` says what is needed).

    Example:
        >>> units_to_decide([0.1, 0.053, 0.3], [0.0, -0.017, 0.0], [0.2, 0.121, 0.2], 0.05, 32)
        array([128.,  nan,  nan])
    """
    arrays = (np.asarray(x, dtype=float) for x in (estimate, low, high, n_units))
    est, lo, hi, n = np.broadcast_arrays(*arrays)
    gap = np.abs(est - threshold)
    half = np.where(est >= threshold, est - lo, hi - est)
    tail = np.vectorize(expanded_tail, otypes=[float])(np.maximum(n, max(min_units, 3)))
    z = np.vectorize(NormalDist().inv_cdf, otypes=[float])(1 - tail)  # the interval's z
    inside = (lo <= est) & (est <= hi) & (half > 0)
    said = inside & (gap * z >= half) & ~too_few(n, min_units)
    with np.errstate(divide="ignore", invalid="ignore"):
        need = np.ceil(n * (half / gap) ** 2)
    need = np.maximum(need, np.maximum(n + 1, min_units))
    return np.where(said & np.isfinite(need), need, np.nan)


def need_phrase(
    need: float, n_units: int, units: str = "prompts", min_units: int = MIN_UNITS
) -> str:
    """What would decide an undecided verdict, in words (``units_to_decide``'s number).

    Args:
        need: ``units_to_decide``'s value (NaN: cannot be said).
        n_units: the units measured.
        units: what the units are, plural.
        min_units: the fewest units any verdict needs.

    Returns:
        ``"at least m <units> are needed (n here)"``, ``"about N <units> would decide it (n
        here)"`` or ``"more than the n <units> measured; how many more cannot be said"``.

    Example:
        >>> need_phrase(45.0, 32, "held-out prompts")
        'about 45 held-out prompts would decide it (32 here)'
        >>> need_phrase(float("nan"), 128, "held-out prompts")[:44]
        'more than the 128 held-out prompts measured;'
    """
    n = int(n_units)
    if too_few(n, min_units):
        return f"at least {min_units} {units} are needed ({n} here)"
    if math.isfinite(need):
        return f"about {int(need)} {units} would decide it ({n} here)"
    return f"more than the {n} {units} measured; how many more cannot be said"
