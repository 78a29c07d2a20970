"""A head's reading from its evidence (docs/math.md §8.4, §9): three answers, never two.

The reading is decided in order, each step a three-way verdict on a 95% interval over held-out
units (``tl_dynamics.evidence``):

1. ``"regression"``: the best ridge or GD predictor (chosen on the fitting units) beats the best
   linear or control predictor *on the held-out units* by more than ``MARGIN`` R², and explains
   at least ``EXPLAINED`` of z's variance.
2. ``"linear"``: the best linear predictor so beats the best control, and explains as much.
3. The best control's name (``mean``, ``first``, ``self``, ``previous``) where it explains at
   least ``EXPLAINED``; ``"unexplained"`` where no predictor does.

A step that is neither decided yes nor decided no stops the reading at ``"undecided"``: so a
head can move between a claim and "undecided" as the units grow, never from one claim to
another. Fewer than ``evidence.MIN_UNITS`` held-out units in the claim band is undecided.

Every sentence about the readings (``summary``, each head's ``reason``) is generated from the
same ``Reading`` as the claims table: ``tally`` puts every head under exactly one reading.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tl_dynamics.evidence import (
    MIN_UNITS,
    NO,
    UNDECIDED,
    YES,
    all_of,
    decide,
    need_phrase,
    reason,
    too_few,
    units_to_decide,
)
from tl_dynamics.regression._measure import EXPLAINED, MARGIN
from tl_dynamics.regression._predict import BASELINES

UNEXPLAINED = "unexplained"
NO_UNITS = "no units"  # undecided_on where the claim band has no held-out destination
PROMPTS = "prompts"  # the unit kind verdicts need
FEW_UNITS = "too few prompts"  # ... where it has fewer than MIN_UNITS held-out units
HELD = "held-out prompts"  # what the verdicts count
ORDER = ("regression", "linear", *BASELINES, UNEXPLAINED, UNDECIDED.value)  # the tally's order


@dataclass(frozen=True)
class Reading:
    """Per head (``[layer, head]`` arrays): the reading, the predictor it rests on and the rival
    it was compared with (indices into the predictor names, -1 where none), the comparison's
    value and interval, the step that stopped an undecided reading and why (the undecided
    criterion with its interval and threshold), and how many held-out units would decide it
    (NaN where that cannot be said)."""

    label: np.ndarray
    claimant: np.ndarray
    rival: np.ndarray
    delta: np.ndarray  # [layer, head, 3]: value, low, high (NaN where no comparison)
    verdicts: dict[str, np.ndarray]  # criterion -> evidence.Verdict
    undecided_on: np.ndarray  # "" or the step
    units_needed: np.ndarray  # float: NaN where decided or where it cannot be said
    reason: np.ndarray  # "" where decided, else the sentence


def _need(shape: tuple[int, ...], parts: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """The units that would decide every undecided criterion: the largest need among them,
    NaN where one of them cannot be said (or none is undecided)."""
    out = np.full(shape, -np.inf)
    for verdict, need in parts:
        out = np.where(verdict == UNDECIDED, np.maximum(out, need), out)
    return np.where(np.isneginf(out), np.nan, out)


def read(res) -> Reading:
    """The reading of every head of a ``RegressionResult`` (claim band)."""
    L, H = res.best_regression.shape
    # verdicts rest on held-out prompts: blocks of one prompt's destinations are not independent
    units = res.units_held[:, -1] if res.units == PROMPTS else np.zeros((L, H), int)
    r2, r2_low, r2_high = res.r2[:, -1], res.r2_low[:, -1], res.r2_high[:, -1]

    def at(arr: np.ndarray, idx: np.ndarray) -> np.ndarray:
        return np.take_along_axis(arr, idx[..., None], axis=-1)[..., 0]

    def explained(idx: np.ndarray) -> np.ndarray:
        return decide(at(r2_low, idx), at(r2_high, idx), EXPLAINED, units)

    def r2_need(idx: np.ndarray) -> np.ndarray:
        return units_to_decide(at(r2, idx), at(r2_low, idx), at(r2_high, idx), EXPLAINED, units)

    best_any = np.nan_to_num(r2, nan=-np.inf).argmax(-1)
    steps = {
        "regression": (res.best_regression, res.rival_regression, res.delta_regression),
        "linear": (res.best_linear, res.rival_linear, res.delta_linear),
    }
    verdicts: dict[str, np.ndarray] = {}
    for name, (claimant, _, delta) in steps.items():
        beats = decide(delta[..., 1], delta[..., 2], MARGIN, units)
        expl = explained(claimant)
        verdicts[name] = all_of(beats, expl)
        verdicts[f"{name}_beats_rival"], verdicts[f"{name}_explains"] = beats, expl
    control = res.rival_linear  # the best control on the held-out units
    verdicts["control_explains"] = explained(control)
    verdicts["best_explains"] = explained(best_any)

    label = np.full((L, H), UNDECIDED.value, dtype=object)
    claimant = np.full((L, H), -1)
    rival = np.full((L, H), -1)
    delta = np.full((L, H, 3), np.nan)
    undecided_on = np.full((L, H), "", dtype=object)
    need = np.full((L, H), np.nan)
    open_ = np.ones((L, H), bool)  # heads whose reading is not settled yet
    for name, (claim_idx, rival_idx, d) in steps.items():
        v = verdicts[name]
        here = open_ & (v != NO)
        label[here & (v == YES)] = name
        claimant[here], rival[here], delta[here] = claim_idx[here], rival_idx[here], d[here]
        undecided_on[here & (v == UNDECIDED)] = name
        open_ &= v == NO
        step_need = _need(
            (L, H),
            [
                (
                    verdicts[f"{name}_beats_rival"],
                    units_to_decide(d[..., 0], d[..., 1], d[..., 2], MARGIN, units),
                ),
                (verdicts[f"{name}_explains"], r2_need(claim_idx)),
            ],
        )
        need = np.where(undecided_on == name, step_need, need)
    names = np.array(res.names, dtype=object)
    ctl, best = verdicts["control_explains"], verdicts["best_explains"]
    named = open_ & (ctl == YES)
    label[named] = names[control[named]]
    claimant[named] = control[named]
    gone = open_ & ~named & (best == NO)
    label[gone] = UNEXPLAINED
    claimant[gone] = best_any[gone]
    rest = open_ & ~named & ~gone
    undecided_on[rest] = "explained"
    claimant[rest] = control[rest]
    rest_need = _need((L, H), [(ctl, r2_need(control)), (best, r2_need(best_any))])
    need = np.where(rest, rest_need, need)
    few = (res.units_held[:, -1] > 0) & too_few(units)  # too few units for any verdict
    undecided_on[few], need[few] = FEW_UNITS, np.nan
    none = res.units_held[:, -1] == 0  # nothing measured: no predictor, rival or need
    claimant[none], rival[none], delta[none], need[none] = -1, -1, np.nan, np.nan
    undecided_on[none] = NO_UNITS
    why = np.full((L, H), "", dtype=object)
    steps["explained"] = (control, best_any, None)
    for i, j in zip(*np.nonzero(label == UNDECIDED)):
        why[i, j] = _why(res, i, j, str(undecided_on[i, j]), int(units[i, j]), verdicts, steps)
    return Reading(label, claimant, rival, delta, verdicts, undecided_on, need, why)


def _r2_reason(res, i: int, j: int, k: int, n: int) -> str:
    what = f"{res.names[k]} R² interval"
    return reason(res.r2_low[i, -1, j, k], res.r2_high[i, -1, j, k], EXPLAINED, n, HELD, what)


def _why(res, i: int, j: int, step: str, n: int, verdicts: dict, steps: dict) -> str:
    """The undecided criteria of head ``(i, j)`` with their intervals and thresholds, then the
    decided ones of the same step (``steps``: step -> claimant, rival, difference; the
    ``"explained"`` step: best control, best predictor, None)."""
    if step == NO_UNITS:
        return (
            f"no held-out destination sees at least {res.min_visible} keys (the claim band): "
            f"give prompts longer than {res.min_visible} tokens"
        )
    if step == FEW_UNITS:
        why = reason(np.nan, np.nan, MARGIN, n, HELD)
        return why if res.units == PROMPTS else f"{why}: the units are {res.units}"
    claim_idx, rival_idx, d = steps[step]
    k, r = int(claim_idx[i, j]), int(rival_idx[i, j])
    if d is None:  # "explained": the best control's R², and the best predictor's
        return "; ".join(_r2_reason(res, i, j, c, n) for c in dict.fromkeys((k, r)))
    diff = f"{res.names[k]} minus {res.names[r]} R² interval"
    parts = [
        (verdicts[f"{step}_explains"][i, j], _r2_reason(res, i, j, k, n)),
        (
            verdicts[f"{step}_beats_rival"][i, j],
            reason(d[i, j, 1], d[i, j, 2], MARGIN, n, HELD, diff),
        ),
    ]
    parts.sort(key=lambda p: p[0] != UNDECIDED)  # the undecided criteria first
    return "; ".join(text for _, text in parts)


def _heads(res, mask: np.ndarray) -> list[str]:
    return [f"L{res.layers[i]}H{res.heads[j]}" for i, j in zip(*np.nonzero(mask))]


def tally(res, rd: Reading) -> dict[str, list[str]]:
    """Every head under exactly one reading, in ``ORDER`` (any other reading after them):
    ``{reading: [head names]}``; the counts add up to the heads shown.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> res = NS(layers=(0,), heads=(0, 1, 2))
        >>> rd = NS(label=np.array([["linear", "self", "undecided"]], dtype=object))
        >>> tally(res, rd)
        {'linear': ['L0H0'], 'self': ['L0H1'], 'undecided': ['L0H2']}
    """
    seen = list(ORDER) + sorted(set(rd.label.flat) - set(ORDER))
    out = {name: _heads(res, rd.label == name) for name in seen}
    return {name: heads for name, heads in out.items() if heads}


def held_text(res) -> str:
    """The held-out units in the claim band, in words: the one count the summary, the caption
    and the table's ``units_held`` column give (its range where heads differ)."""
    held = res.units_held[:, -1]
    lo, hi = int(held.min()), int(held.max())
    n = f"{lo}" if lo == hi else f"{lo} to {hi}"
    if res.units == PROMPTS:
        return f"{n} held-out prompt{'s' * (hi != 1)} in the claim band"
    prompts = int(getattr(res, "n_prompts", 0))
    unit = res.units.replace("blocks", "block" if hi == 1 else "blocks", 1)
    source = f" of {prompts} prompt{'s' * (prompts != 1)}" if prompts else ""
    return f"{n} held-out {unit}{source} in the claim band"


def _verb(name: str, one: bool) -> str:
    if name == UNEXPLAINED:
        return "is unexplained" if one else "are unexplained"
    if name in ("regression", "linear"):
        return ("reads " if one else "read ") + name
    return f"reads as its best control, {name}" if one else f"read as their best control, {name}"


def summary(res, rd: Reading) -> str:
    """The readings in plain words: counts per reading with the heads (from ``tally``: they add
    up to the heads shown), the undecided ones with the criterion left open, its interval and
    threshold, and what would decide them (docs/math.md §9)."""
    units = res.units_held[:, -1]
    n_heads = rd.label.size
    prompts = units.max() if res.units == PROMPTS else 0
    if not (res.n_held[:, -1] > 0).any():
        return (
            f"No head is read: no held-out destination sees at least {res.min_visible} keys "
            f"(the claim band). Give prompts longer than {res.min_visible} tokens, several of "
            "them (each prompt is a unit once there are 4)."
        )
    if too_few(prompts):
        return (
            f"All {n_heads} heads are undecided for lack of prompts: verdicts rest on held-out "
            f"prompts, at least {MIN_UNITS} of them, and here there are {held_text(res)} "
            f"(the numbers below are described, not claimed). Give at least {2 * MIN_UNITS} "
            "prompts (half fit the gains, half are held out): `--prompt` several times on the "
            "command line, or a list of prompts in Python."
        )
    groups = tally(res, rd)
    parts = []
    for name, heads in groups.items():
        if name == UNDECIDED:
            continue
        parts.append(f"{len(heads)} {_verb(name, len(heads) == 1)} ({', '.join(heads)})")
    open_ = groups.get(UNDECIDED, [])
    is_are = "is" if len(open_) == 1 else "are"
    text = f"Of {n_heads} heads, " + "; ".join(parts) + f"; {len(open_)} {is_are} undecided"
    if open_:
        detail = []
        for i, j in zip(*np.nonzero(rd.label == UNDECIDED)):
            n = int(units[i, j]) if res.units == PROMPTS else 0
            detail.append(
                f"L{res.layers[i]}H{res.heads[j]} on {rd.undecided_on[i, j]}: {rd.reason[i, j]}; "
                + need_phrase(float(rd.units_needed[i, j]), n, HELD)
            )
        text += " (" + "; ".join(detail[:8]) + ("; ..." if len(detail) > 8 else "") + ")"
    return (
        text + f". Units: {held_text(res)}; every verdict is a 95% interval over them "
        "(docs/math.md §9)."
    )
