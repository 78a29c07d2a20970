"""A head's label: what its variance attribution says, checked against what its counterfactual
patterns do (docs/math.md §2.2).

The attribution ``attr_* = Cov(term, r) / Var(r)`` says which part of the score carries its
variation along a row; it does not say that the part *alone* makes the head's pattern. The
agreement ``agree_* = sum_i C_i(j*_i) / sum_i S_i(j*_i)`` does: the mass the counterfactual
pattern ``C`` (prior-only or likelihood-only) puts on each row's top key ``j*_i`` under the real
pattern ``S``, over the mass ``S`` puts there, pooled over the same rows as the shares. A part
*reproduces* the head when its agreement is at least ``AGREE_THRESHOLD``.
"""

from __future__ import annotations

import math

# A head is "prior-driven" when the key prior's additive share of the row-centred score
# variance, Cov(prior, r) / Var(r), is at least LABEL_THRESHOLD (and the prior-only pattern
# reproduces the head), "likelihood-driven" likewise. The shares (prior, loglik, bias) add up to
# one, so 2/3 means the term explains at least twice as much as the others together.
LABEL_THRESHOLD = 2.0 / 3.0
# A counterfactual pattern reproduces the head when it keeps at least this share of the mass the
# real pattern puts on its top key (pooled over rows): 1/2 means it still points where the head
# points, at least half as firmly.
AGREE_THRESHOLD = 0.5
# Every label a head can carry.
LABELS = ("prior-driven", "likelihood-driven", "mixed", "needs both")


def label(
    attr_prior: float,
    attr_loglik: float,
    agree_prior: float,
    agree_loglik: float,
    threshold: float = LABEL_THRESHOLD,
    agree: float = AGREE_THRESHOLD,
) -> str:
    """A head's label from its additive shares and its counterfactuals' agreement.

    ``"needs both"`` when neither the prior-only nor the likelihood-only pattern reproduces the
    head (agreement under ``agree``); ``"prior-driven"`` when ``attr_prior >= threshold`` and the
    prior-only pattern reproduces it; ``"likelihood-driven"`` likewise; ``"mixed"`` otherwise, and
    for a head with no qualifying rows (NaN shares).

    >>> label(0.9, 0.1, 0.95, 0.2), label(-0.1, 1.1, 0.1, 0.9), label(-0.1, 1.1, 0.1, 0.0)
    ('prior-driven', 'likelihood-driven', 'needs both')
    >>> label(0.5, 0.5, 0.9, 0.8), label(1.2, -0.2, 0.3, 0.7)
    ('mixed', 'mixed')
    """
    if math.isnan(attr_prior) or math.isnan(attr_loglik):
        return "mixed"
    prior_ok, lik_ok = agree_prior >= agree, agree_loglik >= agree  # NaN: does not reproduce
    if not (prior_ok or lik_ok):
        return "needs both"
    if attr_prior >= threshold and prior_ok:
        return "prior-driven"
    if attr_loglik >= threshold and lik_ok:
        return "likelihood-driven"
    return "mixed"
