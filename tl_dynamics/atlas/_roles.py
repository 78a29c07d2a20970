"""Roles from mechanism: each role needs its pattern *and* the weights that produce it, every
score against its value on the weight-shuffled control, by a stated margin.

| role | score (shown) | also required |
|---|---|---|
| previous-token | attention from ``i`` to ``i-1`` on repeated random tokens | the masked positional QK circuit puts ``i-1`` first (learned positions) |
| duplicate-token | attention to the earlier copy of the same token | QK positivity (tokens attend to themselves in the full QK circuit) |
| induction | attention to the token after the earlier copy | the token-level K-circuit through earlier previous-token heads picks the matching key; OV copying |
| copying | OV copying ``sum Re(lambda) / sum abs(lambda)`` | not already induction |
| copy-suppression | minus OV copying | the QK circuit with the unembedding on the query side ranks the predicted token's key first (``suppression_qk``) |
| negative copying | minus OV copying | not already copy-suppression (the OV side alone) |
| sink | mass on the most-attended key | it dominates (``odds_ratio.HeadStats.SINK_DOMINANCE``) in at least ``SINK_PROMPTS`` of the prompts; its cause from the odds-ratio split (prior- or likelihood-driven) |
| positional/local | attention within ``LOCAL_WINDOW`` positions | not already previous-token |
| learned sink | mass the head's learned attention sink absorbs (GPT-OSS) | at least ``LEARNED_SINK_FLOOR``; ranked last |

A learned sink (a per-head logit in every softmax denominator, docs/math.md §2.6) is read
against a fixed floor, not the control: the weight-shuffled control permutes the sink logits
among the heads, so its best head is the model's own best. It is listed after the mechanism
roles (it writes nothing), and alone instead of "unclassified".

A head can hold several roles; they are ranked by how far each score clears its control.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tl_dynamics.evidence import NO, UNDECIDED, YES, decide
from tl_dynamics.odds_ratio import HeadStats

# A score counts when it is at least its control's value plus MARGIN. Every score is a share
# of attention, a share of rows or tokens, or an eigenvalue ratio in [-1, 1], so one absolute
# margin of 0.1 serves them all.
MARGIN = 0.1
ROLES = (
    "previous-token",
    "duplicate-token",
    "induction",
    "copying",
    "copy-suppression",
    "negative copying",
    "sink",
    "positional/local",
    "learned sink",
    "unclassified",
    "undecided",
)
# A head's learned sink is named when it absorbs at least this share of its attention on the
# natural probes (the mean over rows; the same absolute margin as every other score).
LEARNED_SINK_FLOOR = MARGIN
# role -> (primary score, mechanism scores that must clear their controls too)
RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "previous-token": ("prev_pattern", ("prev_circuit",)),
    "duplicate-token": ("dup_pattern", ("qk_positivity",)),
    "induction": ("ind_pattern", ("ind_kcomp", "ov_copying")),
    "copying": ("ov_copying", ()),
    "copy-suppression": ("neg_ov_copying", ("suppression_qk",)),
    "negative copying": ("neg_ov_copying", ()),
    "sink": ("sink_mass", ("sink_dominant",)),
    "positional/local": ("local_mass", ()),
}
# A role not listed on its own when the head holds the role that includes it (previous-token
# attention is local; an induction head's OV copying is part of its induction mechanism).
SUBSUMED = {
    "positional/local": "previous-token",
    "copying": "induction",
    "negative copying": "copy-suppression",
}
# Requirements read against a fixed floor, not the control: a sink must dominate (its column at
# least HeadStats.SINK_DOMINANCE times the next-largest) in at least this share of the prompts.
SINK_PROMPTS = 0.5
FLOORS = {"sink_dominant": SINK_PROMPTS}
# Scores allowed to be missing (NaN) without failing a role, and why (said in the evidence).
OPTIONAL = {"prev_circuit": "no learned positions, so no positional circuit"}


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


def controls(shuffled: dict[str, np.ndarray]) -> dict[str, float]:
    """The control value of each score: its largest value over every head of the control
    model (the weight-shuffled copy), so a role must beat the best head chance produced."""
    out = {}
    for key, values in shuffled.items():
        finite = values[np.isfinite(values)]
        out[key] = float(finite.max()) if finite.size else float("nan")
    return out


def _clears(value: float, control: float) -> bool:
    return bool(np.isfinite(value)) and (not np.isfinite(control) or value >= control + MARGIN)


def _meets(key: str, s: dict[str, float], c: dict[str, float]) -> bool:
    """Whether a required score holds: above its floor (``FLOORS``) or clear of its control."""
    if key in FLOORS:
        return bool(np.isfinite(s[key])) and s[key] >= FLOORS[key]
    return _clears(s[key], c[key])


def _head_name(pair: tuple[int, int]) -> str:
    return f"L{pair[0]}H{pair[1]}"


def _sentence(role: str, s: dict[str, float], c: dict[str, float], via: tuple) -> str:
    def vs(key: str, fmt: str = "{:.2f}") -> str:
        return f"{fmt.format(s[key])} (control {fmt.format(c[key])})"

    if role == "previous-token":
        circuit = (
            f"; the positional circuit ranks the previous position first in "
            f"{vs('prev_circuit', '{:.0%}')} of rows"
            if np.isfinite(s["prev_circuit"])
            else f"; {OPTIONAL['prev_circuit']}"
        )
        return f"previous-token: {vs('prev_pattern')} of attention on the previous token{circuit}"
    if role == "duplicate-token":
        return (
            f"duplicate-token: {vs('dup_pattern')} on the earlier copy of the same token; "
            f"QK positivity {vs('qk_positivity')}"
        )
    if role == "induction":
        heads = ", ".join(_head_name(p) for p in via)
        return (
            f"induction: {vs('ind_pattern')} on the token after the earlier copy; the K-circuit "
            f"through {heads} picks the matching key for {vs('ind_kcomp', '{:.0%}')} of tokens; "
            f"OV copying {vs('ov_copying')}"
        )
    if role == "copying":
        return f"copying: OV copying score {vs('ov_copying')}"
    ov = f"OV copying score {s['ov_copying']:.2f} (control min {-c['neg_ov_copying']:.2f})"
    if role == "copy-suppression":
        return (
            f"copy-suppression: {ov}; with the unembedding of the predicted token on the "
            f"query side, the QK circuit ranks that token's key first for "
            f"{vs('suppression_qk', '{:.0%}')} of probe tokens"
        )
    if role == "negative copying":
        return f"negative copying: {ov}"
    if role == "sink":
        where = (
            "the first token" if s["sink_first"] >= SINK_PROMPTS else "a token other than the first"
        )
        cause = "likelihood" if s["sink_loglik_adv"] >= s["sink_prior_adv"] else "key prior"
        return (
            f"sink: {vs('sink_mass')} of attention on {where}, dominant in "
            f"{s['sink_dominant']:.0%} of prompts, won by its {cause} "
            f"(advantage: key prior {s['sink_prior_adv']:.2f}, log-likelihood "
            f"{s['sink_loglik_adv']:.2f} nats)"
        )
    return f"positional/local: {vs('local_mass')} of attention within a few positions"


def _near_misses(
    s: dict[str, float], c: dict[str, float], roles: list[str], via: tuple
) -> list[str]:
    """Patterns that clear their control while a required mechanism does not."""
    out = []
    for role, (primary, needs) in RULES.items():
        if role in roles or not needs or not _clears(s[primary], c[primary]):
            continue
        if role == "copy-suppression":
            qk = (
                f"{s['suppression_qk']:.0%} (control {c['suppression_qk']:.0%})"
                if np.isfinite(s["suppression_qk"])
                else "not measured (W_U and W_E differ in vocabulary)"
            )
            out.append(
                f"not copy-suppression: the QK circuit with the predicted token's "
                f"unembedding on the query side ranks that token's key first for {qk} "
                f"of probe tokens"
            )
            continue
        if role == "sink":
            out.append(
                f"largest column {s['sink_mass']:.2f} (control {c['sink_mass']:.2f}) but "
                f"not a sink: it dominates the next-largest column (ratio >= "
                f"{HeadStats.SINK_DOMINANCE:g}) in only {s['sink_dominant']:.0%} of prompts"
            )
            continue
        missing = [k for k in needs if k not in OPTIONAL and not _meets(k, s, c)]
        if role == "induction" and not via:
            missing = ["no earlier previous-token head to compose with"]
        out.append(
            f"{role} pattern {s[primary]:.2f} (control {c[primary]:.2f}) but not the "
            f"mechanism: {', '.join(missing)}"
        )
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
        >>> s = dict(prev_pattern=0.9, prev_circuit=1.0, dup_pattern=0.0, qk_positivity=0.0,
        ...          ind_pattern=0.0, ind_kcomp=float("nan"), ov_copying=0.1, neg_ov_copying=-0.1,
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
    for role, (primary, needs) in RULES.items():
        if primary in ci:
            low, high, n = ci[primary]
            verdict = str(decide(low, high, MARGIN, n))
        else:
            verdict = YES if _clears(s[primary], c[primary]) else NO
        for k in needs:  # each required score: yes, no or undecided too
            if k in OPTIONAL and not np.isfinite(s[k]):
                continue
            if k in FLOORS and k in ci:
                low, high, n = ci[k]
                met = str(decide(low, high, FLOORS[k], n))
            else:
                met = YES if _meets(k, s, c) else NO
            verdict = (
                NO if NO in (verdict, met) else UNDECIDED if UNDECIDED in (verdict, met) else YES
            )
        if verdict == NO:
            continue
        if any(r == SUBSUMED.get(role) for _, r in found):
            continue
        if SUBSUMED.get(role) in undecided:  # the role that includes it is open: so is this one
            verdict = UNDECIDED
        if verdict == YES:
            found.append((s[primary] - c[primary], role))
        else:
            undecided.append(role)
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
    parts += [
        f"undecided {role}: a 95% interval over the probes straddles its threshold "
        f"({_margin(ci, RULES[role][0])})"
        for role in undecided
    ]
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
    )


def _margin(ci: dict[str, tuple[float, float, int]], key: str) -> str:
    if key not in ci:
        return "a required score"
    low, high, n = ci[key]
    return f"score minus control [{low:+.2f}, {high:+.2f}] over {n} probes"
