"""The sentences of the atlas's evidence: each role's scores beside their controls, the near misses
(a pattern without its mechanism, a weights-only score the pass does not bear out) and why an
undecided role is undecided."""

from __future__ import annotations

import numpy as np

from tl_dynamics.atlas._rules import (
    FLOORS,
    MARGIN,
    OPTIONAL,
    RULES,
    SINK_PROMPTS,
    _clears,
    _meets,
)
from tl_dynamics.evidence import reason, too_few
from tl_dynamics.odds_ratio import HeadStats


def _head_name(pair: tuple[int, int]) -> str:
    return f"L{pair[0]}H{pair[1]}"


def _weights(s: dict[str, float], c: dict[str, float], key: str, what: str) -> str:
    """The supporting weights-only score, against its chance level (the circuits section's)."""
    if not np.isfinite(s.get(key, float("nan"))):
        return ""
    chance = c.get(key, float("nan"))
    against = f" (chance {chance:.2f})" if np.isfinite(chance) else ""
    return f"; weights only: {what} {s[key]:.2f}{against}"


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
            f"duplicate-token: {vs('dup_pattern')} on the earlier copy of the same token; on the "
            f"pass, {vs('dup_mech', '{:.0%}')} of second-copy rows attend it with both the query "
            f"and the key led by a component carrying its own token"
            + _weights(s, c, "qk_positivity", "QK positivity")
        )
    if role == "induction":
        kcomp = ""
        if np.isfinite(s.get("ind_kcomp", float("nan"))):
            heads = ", ".join(_head_name(p) for p in via)
            kcomp = (
                f"; weights only: the K-circuit through {heads} picks the matching key for "
                f"{vs('ind_kcomp', '{:.0%}')} of tokens"
            )
        return (
            f"induction: {vs('ind_pattern')} on the token after the earlier copy; on the pass, "
            f"{vs('ind_mech', '{:.0%}')} of second-copy rows attend it with the key led by a "
            f"previous-token head's output and the query by a component carrying the current "
            f"token{kcomp}; OV copying on the pass {s['copy_pass']:.2f}"
        )
    if role == "copying":
        return (
            f"copying: on the pass, what it writes from a token raises that token's logit above "
            f"the other probe tokens' by {vs('copy_pass')} (+1: always)"
            + _weights(s, c, "ov_copying", "OV copying")
        )
    ov = (
        f"on the pass, what it writes from a token lowers that token's logit: "
        f"{s['copy_pass']:.2f} (control min {-c['neg_copy_pass']:.2f})"
        + _weights(s, c, "ov_copying", "OV copying")
    )
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


MECHANISM_WORDS = {
    "ind_mech": "on the pass, the key is led by a previous-token head's output and the query by "
    "a component carrying the current token on only {} of second-copy rows (control {})",
    "dup_mech": "on the pass, both sides are led by components carrying their own token on "
    "only {} of second-copy rows (control {})",
}


def _near_misses(
    s: dict[str, float], c: dict[str, float], roles: list[str], via: tuple
) -> list[str]:
    """Patterns that clear their control while a required mechanism does not, and weights-only
    scores that clear their chance level while the pass does not bear them out."""
    out = []
    for role, (primary, needs) in RULES.items():
        if role in roles or not needs or not _clears(s[primary], c[primary]):
            continue
        if role == "copy-suppression":
            qk = (
                f"{s['suppression_qk']:.0%} (control {c['suppression_qk']:.0%})"
                if np.isfinite(s["suppression_qk"])
                else "not measured (a weights-only read-out; see the notes)"
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
        words = [
            MECHANISM_WORDS[k].format(f"{s[k]:.0%}", f"{c[k]:.0%}")
            if k in MECHANISM_WORDS and np.isfinite(s[k])
            else k
            for k in missing
        ]
        if words:
            out.append(
                f"{role} pattern {s[primary]:.2f} (control {c[primary]:.2f}) but not the "
                f"mechanism: {'; '.join(words)}"
            )
    for key, sign in (("ov_copying", 1), ("neg_ov_copying", -1)):
        weight, chance = s.get(key, float("nan")), c.get(key, float("nan"))
        on_pass = "copy_pass" if sign > 0 else "neg_copy_pass"
        if (
            np.isfinite(chance)
            and weight >= chance + MARGIN
            and not _clears(s[on_pass], c[on_pass])
        ):
            out.append(
                f"weights-only OV copying {sign * weight:.2f} (chance {chance:.2f}) is not borne "
                f"out on the pass ({s['copy_pass']:.2f}): the weights read the raw embedding, "
                f"without the norms and MLPs the head's input passes through"
            )
    return out


# what each probed score is, in the reason an undecided role gives
KEY_WORDS = {
    "prev_pattern": "attention on the previous token",
    "dup_pattern": "attention on the earlier copy",
    "ind_pattern": "attention on the induction target",
    "ind_mech": "the induction mechanism's share of rows on the pass",
    "dup_mech": "the duplicate-token mechanism's share of rows on the pass",
    "copy_pass": "OV copying on the pass",
    "neg_copy_pass": "negative OV copying on the pass",
    "sink_mass": "the largest column's mass",
    "sink_dominant": "the share of probes where the sink dominates",
    "local_mass": "attention within a few positions",
}


def _open_reason(key: str, ci: dict[str, tuple[float, float, int]]) -> str:
    """Why a criterion is undecided, from its interval (``evidence.reason``): too few probes, not
    measured, or where its interval lies against its threshold."""
    what = KEY_WORDS.get(key, key)
    if key not in ci:
        return f"{what} was not measured"
    low, high, n = ci[key]
    if not too_few(n) and not (np.isfinite(low) and np.isfinite(high)):
        return f"{what} could not be measured on this pass (see the notes)"
    if key in FLOORS:
        said = reason(low, high, FLOORS[key], n, units="probes", what="95% interval")
        return f"{what}: {said} (its floor), over {n} probes"
    said = reason(low, high, MARGIN, n, units="probes", what="95% interval")
    return f"{what} minus its control: {said} (the margin), over {n} probes"
