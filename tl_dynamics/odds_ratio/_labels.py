"""A head's label: what its variance attribution says, checked against what its counterfactual
patterns do, each criterion a three-way verdict (docs/math.md §2.2, §9).

The attribution ``attr_* = Cov(term, r) / Var(r)`` says which part of the score carries its
variation along a row; it does not say that the part *alone* makes the head's choice. The kept
mass ``kept_* = sum_i C_i(j*_i) / rows`` does: the attention the counterfactual pattern ``C``
(prior-only or likelihood-only) puts on each row's top key ``j*_i`` under the real pattern,
averaged over the same rows. A head makes a choice when its own pattern puts at least ``SHARP``
on that key on average (``top_real``); a part *reproduces* the choice when its counterfactual
keeps at least ``KEEP`` there.

A one-part label ("prior-driven", "likelihood-driven") is the claim of a mechanism: the part
carries the variation and its pattern alone keeps at least ``KEEP`` of the attention on the
head's choice. Random heads (untrained, or the weights shuffled) have their score variation in
the likelihood too, but their likelihood-only patterns keep little on any one key (they are
diffuse, or sharp by chance and not reproduced by one part alone), so these claims are rare on
them (the measured rate, docs/math.md §9.3).
"""

from __future__ import annotations

import numpy as np

from tl_dynamics.evidence import NO, UNDECIDED, YES, all_of

# A head is "prior-driven" when the key prior's additive share of the row-centred score
# variance, Cov(prior, r) / Var(r), is at least LABEL_THRESHOLD (and the prior-only pattern
# reproduces the head), "likelihood-driven" likewise. The shares (prior, loglik, bias) add up to
# one, so 2/3 means the term explains at least twice as much as the others together.
LABEL_THRESHOLD = 2.0 / 3.0
# A head makes a choice when its pattern puts at least half of its attention on one key (the
# mean over rows of the top key's mass): below that it spreads, and no part "drives" a choice.
SHARP = 0.5
# A counterfactual pattern reproduces the choice when it keeps at least half of the attention on
# the head's top key (mean over rows): it still points where the head points, and firmly.
KEEP = 0.5
# The one-part labels claim a learned mechanism; the others do not (docs/math.md §9.3).
MECHANISM = ("prior-driven", "likelihood-driven")
# Every label a head can carry.
LABELS = ("prior-driven", "likelihood-driven", "needs both", "mixed", "diffuse", "undecided")


def rule(v: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The labels from the criteria's verdicts, and the criterion an undecided one waits on.

    ``v`` holds ``"yes"``/``"no"``/``"undecided"`` arrays for ``attr_prior`` and
    ``attr_loglik`` (over ``LABEL_THRESHOLD``), ``kept_prior`` and ``kept_loglik`` (over
    ``KEEP``) and ``choice`` (``top_real`` over ``SHARP``). ``"prior-driven"``
    (``"likelihood-driven"``) where that part carries the variation and its pattern alone keeps
    the head's choice; where neither holds, ``"diffuse"`` where the head makes no choice,
    ``"needs both"`` where it does and neither part alone keeps it, ``"mixed"`` where one part
    keeps it without carrying the variation; else ``"undecided"``.

    >>> Y, N, U = "yes", "no", "undecided"
    >>> v = dict(choice=np.array([Y, Y, Y, N, U]), attr_prior=np.array([N, N, Y, N, N]),
    ...          attr_loglik=np.array([Y, Y, N, Y, Y]), kept_prior=np.array([N, N, N, N, N]),
    ...          kept_loglik=np.array([Y, N, U, N, U]))
    >>> rule(v)[0].tolist()
    ['likelihood-driven', 'needs both', 'undecided', 'diffuse', 'undecided']
    """
    arr = {k: np.asarray(x, dtype=object) for k, x in v.items()}
    prior = np.asarray(all_of(arr["attr_prior"], arr["kept_prior"]), dtype=object)
    lik = np.asarray(all_of(arr["attr_loglik"], arr["kept_loglik"]), dtype=object)
    shape = prior.shape
    label = np.full(shape, UNDECIDED.value, dtype=object)  # a label, not a verdict: plain str
    waits = np.full(shape, "", dtype=object)
    settled = np.zeros(shape, bool)

    def put(name: str, where: np.ndarray) -> None:
        nonlocal settled
        here = ~settled & where
        label[here], settled = name, settled | here

    put("prior-driven", prior == YES)
    put("likelihood-driven", lik == YES)
    waits[~settled & (prior == UNDECIDED)] = "prior"
    waits[~settled & (prior == NO) & (lik == UNDECIDED)] = "likelihood"
    rest = (prior == NO) & (lik == NO)  # no one-part label: what the head is instead
    kept = [arr["kept_prior"], arr["kept_loglik"]]
    choice = arr["choice"]
    put("diffuse", rest & (choice == NO))
    put("needs both", rest & (choice == YES) & (kept[0] == NO) & (kept[1] == NO))
    put("mixed", rest & (choice == YES) & ((kept[0] == YES) | (kept[1] == YES)))
    open_ = ~settled & rest
    waits[open_ & (choice == UNDECIDED)] = "choice"
    waits[open_ & (choice == YES)] = "kept mass"
    return label, waits


def point_label(
    attr_prior: float, attr_loglik: float, top_real: float, kept_prior: float, kept_loglik: float
) -> str:
    """The label ``rule`` gives to point values (no interval: every criterion decided by its
    value alone, NaN undecided); for hand-built heads and the docs, where there is one exact
    value and no sample of prompts.

    >>> point_label(0.9, 0.1, 0.95, 0.9, 0.2), point_label(-0.1, 1.1, 0.9, 0.1, 0.85)
    ('prior-driven', 'likelihood-driven')
    >>> point_label(-0.1, 1.1, 0.9, 0.1, 0.05), point_label(-0.1, 1.1, 0.2, 0.1, 0.2)
    ('needs both', 'diffuse')
    """
    values = dict(
        choice=(top_real, SHARP),
        attr_prior=(attr_prior, LABEL_THRESHOLD),
        attr_loglik=(attr_loglik, LABEL_THRESHOLD),
        kept_prior=(kept_prior, KEEP),
        kept_loglik=(kept_loglik, KEEP),
    )
    verdicts = {
        k: np.array(UNDECIDED if np.isnan(x) else (YES if x >= t else NO), dtype=object)
        for k, (x, t) in values.items()
    }
    return str(rule(verdicts)[0])
