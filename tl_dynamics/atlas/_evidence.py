"""The evidence behind a role: each probed score against its control, with a 95% interval over
the probes (docs/math.md §9; ``tl_dynamics.evidence``).

A role's score must clear its control, the largest value of that score over every head of the
weight-shuffled copy, by ``MARGIN``. For a score measured over probes (attention patterns and
sinks), the difference ``score(head) - max over control heads`` is formed in each Poisson
bootstrap replicate of the probes (the same weights for the model and its control: the same
probes), so its interval carries both sides' sampling and the control's selection; the verdict is
yes, no or undecided (``evidence.decide``; fewer than ``evidence.MIN_UNITS`` probes: undecided).
Weight scores (OV copying, QK positivity, circuits) involve no sample of probes: they are read
as they are.
"""

from __future__ import annotations

import warnings

import numpy as np

from tl_dynamics.evidence import N_BOOT, interval, poisson_weights


def margins(
    real: dict[str, np.ndarray],
    control: dict[str, np.ndarray],
    seed: int,
    floors: tuple[str, ...] = (),
    n_boot: int = N_BOOT,
) -> dict[str, tuple[np.ndarray, np.ndarray, int]]:
    """``{score: (low, high, probes)}``: per head ``[layer, head]``, the 95% interval of the
    score minus its control (the best control head), for every score measured per probe
    (``real[key]`` and ``control[key]``: ``[probe, layer, head]``); for the scores in
    ``floors``, read against a fixed floor, the interval of the score itself."""
    out = {}
    for key, x in real.items():
        y = control.get(key)
        if y is None or x.shape[0] != y.shape[0] or x.shape[0] == 0:
            continue
        n = x.shape[0]
        w = poisson_weights(np.arange(n), n_boot, seed)  # [probe, B]
        total = w.sum(0)[:, None, None]
        with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN: a score that does not apply
            rx = np.einsum("nb,nlh->blh", w, np.nan_to_num(x)) / total
            ry = np.einsum("nb,nlh->blh", w, np.nan_to_num(y)) / total
            best = np.nanmax(np.where(np.isnan(y).all(0), np.nan, ry).reshape(n_boot, -1), -1)
        diff = np.where(
            np.isnan(x).all(0), np.nan, rx - (0 if key in floors else best[:, None, None])
        )
        low, high = interval(diff, n)
        out[key] = (low, high, n)
    return out
