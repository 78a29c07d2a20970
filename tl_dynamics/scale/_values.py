"""The values of a statistics file that a page or a merge converts, checked where they lie
(after the header and the tensors' shapes, ``_validate``): counts that are whole numbers in range,
named by tensor and position, never a raw error from ``int(nan)`` or an int64 that wraps."""

from __future__ import annotations

from typing import Any

import numpy as np

from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.scale._validate import MAX_COUNT

# odds-ratio sums that count (rows, or prompts: the rest of COUNTS): whole numbers >= 0
COUNTS = ("rows", "sink_first", "sink_by_prior", "sink_alpha_over")


def check_values(heads: Any, trajectories: Any, what: str) -> None:
    """Every value a page or a merge converts, checked where it lies: the odds-ratio counts
    (``COUNTS``: rows, and prompts, at most ``n_prompts``) are finite whole numbers >= 0, and
    every trajectory count is at most ``MAX_COUNT`` (a merge adds them in int64). ``heads`` is
    a ``HeadStats`` or None, ``trajectories`` a ``TrajectoryStats`` or None."""
    if heads is not None and heads.exact is not None:
        values = heads.exact.value()  # [layer, key, head]
        keys = list(heads.sum_keys) + list(heads.sink_keys)
        for key in (k for k in COUNTS if k in keys):
            column = values[:, keys.index(key), :]
            bound = MAX_COUNT if key == "rows" else heads.n_prompts
            with np.errstate(invalid="ignore"):
                bad = ~np.isfinite(column) | (column < 0) | (column > bound)
                bad |= np.isfinite(column) & (column != np.floor(column))
            if bad.any():
                a, b = (int(i) for i in np.argwhere(bad)[0])
                raise TLDynamicsError(
                    f"{what}: tensor 'odds_ratio.sums' holds {float(column[a, b])} at layer "
                    f"{heads.layers[a]}, head {heads.heads[b]} of the count {key!r} (index "
                    f"[{a}, {keys.index(key)}, {b}]): a count must be a whole number in "
                    f"0..{bound}; the file is damaged or was not written by tl-dynamics"
                )
    if trajectories is not None:
        for name, array in sorted(trajectories.ints.items()):
            bad = (np.asarray(array) < 0) | (np.asarray(array) > MAX_COUNT)
            if bad.any():
                where = [int(i) for i in np.argwhere(bad)[0]] if bad.ndim else []
                raise TLDynamicsError(
                    f"{what}: tensor 'trajectories.ints.{name}' holds "
                    f"{int(np.asarray(array)[tuple(where)])} at {where}: a count must lie in "
                    f"0..{MAX_COUNT} (more would overflow when files are merged)"
                )
