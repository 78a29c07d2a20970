"""The measure (docs/math.md §8.4): sufficient sums per unit, band, head and predictor, a gain
fitted per head and predictor on the fitting units, R² on the held-out units with bootstrap
intervals over units.

For a predictor ``P = base + D`` (``base`` the visible mean for the centred predictors, zero
otherwise) the fitted prediction is ``base + g D``; its squared error on a set of destinations is
``A - 2 g X + g^2 C`` with ``A = sum |z - base|^2``, ``X = sum <z - base, D>``,
``C = sum |D|^2``, so three numbers per unit give every gain, error and bootstrap resample.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from tl_dynamics.evidence import interval, poisson_weights
from tl_dynamics.regression._predict import BASELINES, centred

MARGIN = 0.05  # R² by which a head's best regression predictor must beat its best control
BAND_EDGES = (0.5, 1.0, 2.0, 4.0)  # visible keys in units of d_head: the destination bands
# A reading names a predictor only where it explains at least this share of z's variance
# (held-out R², over its whole interval). A quarter: the induction heads of induction-2l, which
# none of these predictors models, stay below it (docs/math.md §8.4).
EXPLAINED = 0.25
CLAIM = 2.0  # claims only where the visible keys number at least CLAIM * d_head


def band_labels() -> tuple[str, ...]:
    """The destination bands by visible keys ``n`` (in units of ``d`` = d_head), then the claim
    band.

    Example:
        >>> band_labels()
        ('n<0.5d', '0.5d<=n<1d', '1d<=n<2d', '2d<=n<4d', 'n>=4d', 'claim: n>=2d')
    """
    edges = BAND_EDGES
    inner = tuple(f"{a:g}d<=n<{b:g}d" for a, b in zip(edges[:-1], edges[1:]))
    return (f"n<{edges[0]:g}d", *inner, f"n>={edges[-1]:g}d", f"claim: n>={CLAIM:g}d")


class Sums:
    """Float64 sums ``[units, bands, heads, predictors]`` (``A``, ``X``, ``C``) and
    ``[units, bands, heads]`` (``Z2``, ``N``) plus ``Z1`` ``[units, bands, heads, e]``."""

    def __init__(self, n_units: int, n_heads: int, names: Sequence[str], e: int, device):
        nb = len(band_labels())
        shape = (n_units * nb, n_heads)
        f64: dict[str, Any] = dict(dtype=torch.float64, device=device)
        self.n_units, self.n_bands = n_units, nb
        self.names = tuple(names)
        self.A = torch.zeros(*shape, len(names), **f64)
        self.X = torch.zeros_like(self.A)
        self.C = torch.zeros_like(self.A)
        self.Z2 = torch.zeros(*shape, **f64)
        self.Z1 = torch.zeros(*shape, e, **f64)
        self.N = torch.zeros(*shape, **f64)
        self.mask = torch.tensor([centred(n) for n in names], device=device)

    def add(self, unit: Tensor, n: Tensor, d: int, heads: Sequence[int], z: Tensor, P: Tensor):
        """Add destinations: their units and visible counts ``[N]``, ``z`` ``[N, h, e]`` and the
        predictions ``P`` ``[N, h, predictors, e]`` of the query heads ``heads``."""
        base = torch.where(self.mask[:, None], P[:, :, BASELINE_MEAN(self.names)][:, :, None], 0)
        r = z[:, :, None] - base
        D = P - base
        stats = ((r * r).sum(-1), (r * D).sum(-1), (D * D).sum(-1))
        band = torch.bucketize(
            n / d, torch.tensor(BAND_EDGES, dtype=n.dtype, device=n.device), right=True
        )
        idx = [unit * self.n_bands + band]
        claim = n >= CLAIM * d
        idx.append(unit[claim] * self.n_bands + self.n_bands - 1)
        sel = [slice(None), claim]
        for i, s in zip(idx, sel):
            for acc, val in zip((self.A, self.X, self.C), stats):
                acc[:, heads] = acc[:, heads].index_add(0, i, val[s])
            self.Z2[:, heads] = self.Z2[:, heads].index_add(0, i, (z * z).sum(-1)[s])
            self.Z1[:, heads] = self.Z1[:, heads].index_add(0, i, z[s])
            self.N[:, heads] = self.N[:, heads].index_add(0, i, torch.ones_like(z[s][..., 0]))

    def per_unit(self) -> dict[str, np.ndarray]:
        """The sums as numpy arrays with a leading ``[units, bands]``."""
        out = {}
        for name in ("A", "X", "C", "Z2", "Z1", "N"):
            t = getattr(self, name).cpu().numpy()
            out[name] = t.reshape(self.n_units, self.n_bands, *t.shape[1:])
        return out


def BASELINE_MEAN(names: Sequence[str]) -> int:
    """The index of the ``mean`` baseline among the predictors."""
    return list(names).index(BASELINES[0])


def families(names: Sequence[str]) -> dict[str, np.ndarray]:
    """Masks over the predictors: ``regression`` (ridge and GD of at least two steps: more than
    linearised softmax), ``linear`` (linear attention, its normalised variant, one GD step) and
    ``control`` (the baselines)."""
    names = list(names)
    linear = np.array([n in ("linear", "linear_norm", "gd1") for n in names])
    control = np.array([n in BASELINES for n in names])
    return dict(regression=~linear & ~control, linear=linear, control=control)


@dataclass(frozen=True)
class Scores:
    """R² per ``[bands, heads, predictors]`` on the held-out units with a bootstrap interval,
    the fitted gains, and the per-head comparisons in the claim band (docs/math.md §8.4, §9):
    ``regression`` (the best ridge or GD predictor, chosen on the fitting units) against the best
    linear or control predictor on the held-out units, ``linear`` (the best linear predictor,
    chosen on the fitting units) against the best control on the held-out units. In every
    bootstrap replicate the rival is the best of that replicate, so the interval of a difference
    carries the rival's selection."""

    gain: np.ndarray
    r2: np.ndarray
    r2_low: np.ndarray
    r2_high: np.ndarray
    fit_r2: np.ndarray
    n_fit: np.ndarray  # [bands, heads]
    n_held: np.ndarray
    units_held: np.ndarray  # [bands, heads]: held-out units with a destination in the band
    best: dict[str, np.ndarray]  # "regression", "linear" -> [heads]: chosen on the fitting units
    rival: dict[str, np.ndarray]  # "regression", "linear" -> [heads]: best on the held-out units
    delta: dict[str, np.ndarray]  # "regression", "linear" -> [heads, 3]: value, low, high


def _r2(s: dict[str, np.ndarray], gain: np.ndarray) -> np.ndarray:
    """R² ``[..., bands, heads, predictors]`` of summed stats ``s`` at the gains."""
    sse = s["A"] - 2 * gain * s["X"] + gain**2 * s["C"]
    n = np.maximum(s["N"], 1.0)
    sst = s["Z2"] - (s["Z1"] ** 2).sum(-1) / n
    with np.errstate(divide="ignore", invalid="ignore"):
        r2 = 1.0 - sse / sst[..., None]
    return np.where((s["N"] > 1)[..., None] & (sst[..., None] > 0), r2, np.nan)


def _best(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Index of the largest of ``x[..., mask]`` along the last axis (NaN counts as lowest)."""
    return np.where(mask, np.nan_to_num(x, nan=-np.inf), -np.inf).argmax(-1)


def _max_over(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The largest of ``x[..., mask]`` (NaN where all are NaN)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmax(np.where(mask, x, np.nan), axis=-1)


def score(sums: Sums, fit_units: np.ndarray, n_boot: int, seed: int) -> Scores:
    """Gains on the fitting units; R², the claim band's comparisons and their expanded
    percentile intervals on the held-out units, from Poisson bootstrap weights keyed on each
    unit's index (``evidence.poisson_weights``)."""
    u = sums.per_unit()
    held = ~fit_units
    fit = {k: v[fit_units].sum(0) for k, v in u.items()}
    test = {k: v[held].sum(0) for k, v in u.items()}
    with np.errstate(divide="ignore", invalid="ignore"):
        gain = np.where(fit["C"] > 0, fit["X"] / fit["C"], 0.0)
    r2, fit_r2 = _r2(test, gain), _r2(fit, gain)
    w = poisson_weights(np.nonzero(held)[0], n_boot, seed)  # [held units, boot]
    boot = {k: np.tensordot(w, v[held], axes=(0, 0)) for k, v in u.items()}
    r2b = _r2(boot, gain)  # [boot, bands, heads, P]
    units_held = (u["N"][held] > 0).sum(0)  # [bands, heads]
    r2_low, r2_high = interval(r2b, units_held[..., None])
    fam = families(sums.names)
    rivals = dict(regression=fam["linear"] | fam["control"], linear=fam["control"])
    heads = np.arange(r2.shape[1])
    best, rival, delta = {}, {}, {}
    for claim, against in rivals.items():
        best[claim] = _best(fit_r2[-1], fam[claim])  # the claimant: chosen on the fitting units
        rival[claim] = _best(r2[-1], against)  # the rival: the best held out
        d = r2[-1, heads, best[claim]] - r2[-1, heads, rival[claim]]
        db = r2b[:, -1, heads, best[claim]] - _max_over(r2b[:, -1], against)
        low, high = interval(db, units_held[-1])
        delta[claim] = np.stack([d, low, high], axis=-1)
    return Scores(
        gain=gain,
        r2=r2,
        r2_low=r2_low,
        r2_high=r2_high,
        fit_r2=fit_r2,
        n_fit=fit["N"],
        n_held=test["N"],
        units_held=units_held,
        best=best,
        rival=rival,
        delta=delta,
    )
