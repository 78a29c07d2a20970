"""Roles from mechanism: each role needs its pattern *and* the weights that produce it, every
score against its value on the weight-shuffled control, by a stated margin.

| role | score (shown) | also required |
|---|---|---|
| previous-token | attention from ``i`` to ``i-1`` on repeated random tokens | the masked positional QK circuit puts ``i-1`` first (learned positions) |
| duplicate-token | attention to the earlier copy of the same token | on the pass: both sides led by components that carry their own token (``dup_mech``) |
| induction | attention to the token after the earlier copy | on the pass: the key side led by a previous-token head's output, the query side by a component that carries the current token (``ind_mech``) |
| copying | OV copying on the pass (``copy_pass``) | not already induction |
| copy-suppression | minus ``copy_pass`` | the QK circuit with the unembedding on the query side ranks the predicted token's key first (``suppression_qk``; attention-only models) |
| negative copying | minus ``copy_pass`` | not already copy-suppression |
| sink | mass on the most-attended key | it dominates (``odds_ratio.HeadStats.SINK_DOMINANCE``) in at least ``SINK_PROMPTS`` of the prompts; its cause from the odds-ratio split (prior- or likelihood-driven) |
| positional/local | attention within ``LOCAL_WINDOW`` positions | not already previous-token |
| learned sink | mass the head's learned attention sink absorbs (GPT-OSS) | at least ``LEARNED_SINK_FLOOR``; ranked last |

Mechanisms are read on the model's own pass (``_mechanism``, ``_copying``): a weights-only circuit
sees through no norm, MLP or depth. The weights-only scores stay beside them as supporting
evidence where they apply: OV copying and QK positivity against the circuits section's chance
level (one null per score), the K-composition circuit on attention-only models.

A learned sink (a per-head logit in every softmax denominator, docs/math.md §2.6) is read
against a fixed floor, not the control: the weight-shuffled control permutes the sink logits
among the heads, so its best head is the model's own best. It is listed after the mechanism
roles (it writes nothing), and alone instead of "unclassified".

A head can hold several roles; they are ranked by how far each score clears its control.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tl_dynamics.atlas._rules import (
    FLOORS,
    LEARNED_SINK_FLOOR,
    MARGIN,
    OPTIONAL,
    ROLES,
    RULES,
    SINK_PROMPTS,
    SUBSUMED,
    _meets,
)
from tl_dynamics.atlas._sentences import _near_misses, _open_reason, _sentence
from tl_dynamics.evidence import MIN_UNITS, NO, UNDECIDED, YES, all_of, decide, too_few


@dataclass(frozen=True)
class HeadRoles:
    """One head's ranked roles with the primary score, its control and a sentence each; the
    roles whose score's interval straddles its control's margin (``undecided``), and per role
    the 95% interval of its score minus its control (``margins``; NaN for weight scores, read as
    they are). A head whose only candidates are undecided has the role ``"undecided"``."""

    roles: tuple[str, ...]
    scores: tuple[float, ...]
    baselines: tuple[float, ...]
    evidence: str
    sink_position: str
    sink_cause: str
    undecided: tuple[str, ...] = ()
    margins: tuple[tuple[float, float], ...] = ()
    units: tuple[int, ...] = ()  # probes behind each role's interval (0: a weights-only score)


def controls(shuffled: dict[str, np.ndarray]) -> dict[str, float]:
    """The control value of each score: its largest value over every head of the control
    model (the weight-shuffled copy), so a role must beat the best head chance produced."""
    out = {}
    for key, values in shuffled.items():
        finite = values[np.isfinite(values)]
        out[key] = float(finite.max()) if finite.size else float("nan")
    return out


def classify(
    s: dict[str, float],
    c: dict[str, float],
    via: tuple[tuple[int, int], ...] = (),
    ci: dict[str, tuple[float, float, int]] | None = None,
) -> HeadRoles:
    """The ranked roles of one head from its scores ``s`` and the controls ``c``; ``ci`` gives,
    for scores measured over probes, the 95% interval of the score minus its control and the
    probes behind it (``_evidence.margins``): such a score clears its control only where the
    whole interval lies above ``MARGIN``, fails where it lies below, else its role is undecided.

    Example:
        >>> s = dict(prev_pattern=0.9, prev_circuit=1.0, dup_pattern=0.0, dup_mech=0.0,
        ...          qk_positivity=0.0, ind_pattern=0.0, ind_mech=0.0, ind_kcomp=float("nan"),
        ...          ov_copying=0.1, neg_ov_copying=-0.1, copy_pass=0.1, neg_copy_pass=-0.1,
        ...          suppression_qk=float("nan"), sink_mass=0.1, sink_first=0.0,
        ...          sink_dominant=0.0, sink_prior_adv=0.0, sink_loglik_adv=0.0, local_mass=0.95)
        >>> c = {k: 0.2 for k in s}
        >>> classify(s, c).roles
        ('previous-token',)
        >>> classify(s, c, ci={"prev_pattern": (0.05, 0.9, 16)}).roles  # the interval straddles
        ('undecided',)
    """
    ci = ci or {}
    found: list[tuple[float, str]] = []
    undecided: list[str] = []
    open_on: dict[str, str] = {}  # an undecided role -> the criterion that is open
    short_of: dict[str, int] = {}  # an undecided role -> its probes, where too few decide it
    for role, (primary, needs) in RULES.items():
        verdicts = {primary: _verdict(primary, s, c, ci)}
        for k in needs:  # each required score: yes, no or undecided too
            if not (k in OPTIONAL and not np.isfinite(s[k])):
                verdicts[k] = _verdict(k, s, c, ci)
        verdict = all_of(*verdicts.values())
        if verdict == NO:
            continue
        if any(r == SUBSUMED.get(role) for _, r in found):
            continue
        if SUBSUMED.get(role) in undecided:  # the role that includes it is open: so is this one
            verdict = UNDECIDED
            open_on.setdefault(role, f"the role {SUBSUMED[role]!r} that includes it is undecided")
        if verdict == YES:
            found.append((s[primary] - c[primary], role))
        else:
            undecided.append(role)
            k = next((k for k, v in verdicts.items() if v == UNDECIDED), primary)
            open_on.setdefault(role, _open_reason(k, ci))
            if k in ci and too_few(ci[k][2]):
                short_of[role] = int(ci[k][2])
    found.sort(key=lambda item: -item[0])
    learned = float(s.get("learned_sink", float("nan")))  # NaN: the layer has no learned sink
    named = bool(np.isfinite(learned)) and learned >= LEARNED_SINK_FLOOR
    roles = [role for _, role in found] + (["learned sink"] if named else [])
    roles = roles or (["undecided"] if undecided else ["unclassified"])
    parts = [
        _sentence(role, s, c, via)
        for role in roles
        if role not in ("unclassified", "learned sink", "undecided")
    ]
    # roles that too few probes leave open are said in one clause, the count once
    few = [r for r in undecided if r in short_of]
    parts += [f"undecided {role}: {open_on[role]}" for role in undecided if role not in few]
    if few:
        n = min(short_of[r] for r in few)
        parts.append(
            f"undecided on {n} probe{'s' if n != 1 else ''} (too few: a role needs "
            f"{MIN_UNITS}): {', '.join(few)}"
        )
    parts += _near_misses(s, c, roles + undecided, via)
    if np.isfinite(learned):
        parts.append(
            f"learned sink: absorbs {learned:.2f} of attention"
            + ("" if named else f" (below the {LEARNED_SINK_FLOOR:.2f} floor)")
        )
    if roles == ["unclassified"] and not parts:
        parts = ["no score clears its control by the margin"]
    primary = [
        RULES[r][0] if r in RULES else "learned_sink" if r == "learned sink" else None
        for r in roles
    ]
    sink = "sink" in roles
    return HeadRoles(
        roles=tuple(roles),
        scores=tuple(float(s[k]) if k else float("nan") for k in primary),
        baselines=tuple(float(c.get(k, float("nan"))) if k else float("nan") for k in primary),
        evidence="; ".join(parts) + ".",
        sink_position=("first-token" if s["sink_first"] >= SINK_PROMPTS else "other")
        if sink
        else "",
        sink_cause=(
            ("likelihood-driven" if s["sink_loglik_adv"] >= s["sink_prior_adv"] else "prior-driven")
            if sink
            else ""
        ),
        undecided=tuple(undecided),
        margins=tuple(
            (float(ci[k][0]), float(ci[k][1])) if k in ci else (float("nan"), float("nan"))
            for k in primary
        ),
        units=tuple(int(ci[k][2]) if k in ci else 0 for k in primary),
    )


def _verdict(
    key: str, s: dict[str, float], c: dict[str, float], ci: dict[str, tuple[float, float, int]]
) -> str:
    """Yes, no or undecided for one criterion: from its interval over the probes where it has
    one (score minus control against ``MARGIN``, or the score against its floor), else from the
    point values (weights, read as they are)."""
    if key in ci:
        low, high, n = ci[key]
        return str(decide(low, high, FLOORS.get(key, MARGIN), n))
    return YES if _meets(key, s, c) else NO


__all__ = [
    "FLOORS",
    "LEARNED_SINK_FLOOR",
    "MARGIN",
    "OPTIONAL",
    "ROLES",
    "RULES",
    "SINK_PROMPTS",
    "SUBSUMED",
    "HeadRoles",
    "classify",
    "controls",
]
