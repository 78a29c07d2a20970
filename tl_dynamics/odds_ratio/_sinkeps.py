"""Gu et al.'s Sink^eps over many prompts, from the sink sums ``HeadStats`` keeps exactly.

Per prompt and head, ``alpha`` of the first real key is its mean weight over the valid queries
that may see it (``_stats.first_key_alpha``, as the report's attention section has it). The
statistics keep two exact sums over prompts per head: ``sink_alpha`` (the alphas) and
``sink_alpha_over`` (how many prompts have ``alpha > eps``, at the ``eps`` they were collected
with). From them, over the prompts seen (docs/math.md §2.3):

- ``sink_epsilon``: Gu et al.'s metric averaged over prompts, as they report it: each prompt's
  fraction of heads with ``alpha > eps``, averaged over prompts (equal to the mean over heads of
  each head's share of prompts with ``alpha > eps``);
- ``of_mean_alpha``: the fraction of heads whose mean ``alpha`` over the prompts exceeds ``eps``
  (Sink^eps of the corpus-mean alpha, the map shown beside it). The two differ where a head's
  alpha straddles ``eps`` across prompts.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tl_dynamics.errors import TLDynamicsError

# Per-head running sums kept exactly (``HeadStats.exact``, axis 1) after the row sums: the sinks
# (the first five are those of statistics files of format version 1), then the first key's alpha.
SINK_SUM_KEYS = (
    "sink_mass",
    "sink_first",
    "sink_by_prior",
    "sink_prior_adv",
    "sink_loglik_adv",
    "sink_alpha",
    "sink_alpha_over",
)
FIRST_SINK_KEYS = SINK_SUM_KEYS[:5]  # before the first key's alpha was kept


def check_sink_keys(keys: tuple[str, ...]) -> tuple[str, ...]:
    """``keys`` when they are ``SINK_SUM_KEYS`` or its first five (older statistics), else a
    ``TLDynamicsError`` naming both.

    Example:
        >>> check_sink_keys(FIRST_SINK_KEYS) == FIRST_SINK_KEYS
        True
    """
    keys = tuple(keys)
    if keys not in (SINK_SUM_KEYS, FIRST_SINK_KEYS):
        raise TLDynamicsError(
            f"sink sums {list(keys)}: expected {list(SINK_SUM_KEYS)} (or its first five, "
            "without the first key's alpha)"
        )
    return keys


def sink_epsilon_summary(
    sink_sums: dict[str, np.ndarray], n_prompts: int, epsilon: float
) -> dict[str, Any] | None:
    """Sink^eps of the first key over ``n_prompts`` prompts from the sink sums, or None where
    they hold no alpha (the module docstring gives the two readings).

    Example:
        >>> sums = {"sink_alpha": np.array([[1.2, 0.2]]), "sink_alpha_over": np.array([[2.0, 0.0]])}
        >>> out = sink_epsilon_summary(sums, 2, 0.3)
        >>> out["alpha"].tolist(), out["share"].tolist(), out["sink_epsilon"], out["of_mean_alpha"]
        ([[0.6, 0.1]], [[1.0, 0.0]], 0.5, 0.5)
    """
    if "sink_alpha" not in sink_sums:
        return None
    n = float(n_prompts)
    alpha = sink_sums["sink_alpha"] / n if n else np.full(sink_sums["sink_alpha"].shape, np.nan)
    share = sink_sums["sink_alpha_over"] / n if n else np.full(alpha.shape, np.nan)
    return {
        "epsilon": float(epsilon),
        "alpha": alpha,
        "share": share,
        "sink_epsilon": float(share.mean()) if n and share.size else float("nan"),
        "of_mean_alpha": float((alpha > epsilon).mean()) if n and alpha.size else float("nan"),
    }
