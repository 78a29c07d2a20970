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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tl_dynamics.evidence import MIN_UNITS, NO, UNDECIDED, YES, decide, units_to_decide
from tl_dynamics.regression._measure import EXPLAINED, MARGIN

UNEXPLAINED = "unexplained"
NO_UNITS = "no units"  # undecided_on where the claim band has no held-out destination
PROMPTS = "prompts"  # the unit kind verdicts need
FEW_UNITS = "too few prompts"  # ... where it has fewer than MIN_UNITS held-out units


@dataclass(frozen=True)
class Reading:
    """Per head (``[layer, head]`` arrays): the reading, the predictor it rests on and the rival
    it was compared with (indices into the predictor names, -1 where none), the comparison's
    value and interval, the step that stopped an undecided reading, and roughly how many
    held-out units would decide it."""

    label: np.ndarray
    claimant: np.ndarray
    rival: np.ndarray
    delta: np.ndarray  # [layer, head, 3]: value, low, high (NaN where no comparison)
    verdicts: dict[str, np.ndarray]  # step -> "yes" / "no" / "undecided"
    undecided_on: np.ndarray  # "" or the step
    units_needed: np.ndarray  # float: NaN where decided or unknown


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

    best_any = np.nan_to_num(r2, nan=-np.inf).argmax(-1)
    steps = {
        "regression": (res.best_regression, res.rival_regression, res.delta_regression),
        "linear": (res.best_linear, res.rival_linear, res.delta_linear),
    }
    verdicts: dict[str, np.ndarray] = {}
    for name, (claimant, _, delta) in steps.items():
        beats = decide(delta[..., 1], delta[..., 2], MARGIN, units)
        expl = explained(claimant)
        both = np.where(
            (beats == YES) & (expl == YES),
            YES,
            np.where((beats == NO) | (expl == NO), NO, UNDECIDED),
        )
        verdicts[name] = both
        verdicts[f"{name}_beats_rival"], verdicts[f"{name}_explains"] = beats, expl
    control = res.rival_linear  # the best control on the held-out units
    verdicts["control_explains"] = explained(control)
    verdicts["best_explains"] = explained(best_any)

    label = np.full((L, H), UNDECIDED, dtype=object)
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
    # how many units would decide: the widest need among the open step's undecided verdicts
    for name, (claim_idx, _, d) in steps.items():
        here = undecided_on == name
        parts = []
        if (verdicts[f"{name}_beats_rival"][here] == UNDECIDED).any():
            parts.append(units_to_decide(d[..., 0], d[..., 1], d[..., 2], MARGIN, units))
        if (verdicts[f"{name}_explains"][here] == UNDECIDED).any():
            parts.append(
                _r2_need(at(r2, claim_idx), at(r2_low, claim_idx), at(r2_high, claim_idx), units)
            )
        if parts:
            need[here] = np.fmax.reduce(parts)[here] if len(parts) > 1 else parts[0][here]
    c = np.maximum(claimant, 0)
    need[rest] = _r2_need(at(r2, c), at(r2_low, c), at(r2_high, c), units)[rest]
    few = (res.units_held[:, -1] > 0) & (units < MIN_UNITS)  # too few units for any verdict
    undecided_on[few], need[few] = FEW_UNITS, np.nan
    none = (
        res.units_held[:, -1] == 0
    )  # nothing measured: no predictor, no rival, nothing that would decide
    claimant[none], rival[none], delta[none], need[none] = -1, -1, np.nan, np.nan
    undecided_on[none] = NO_UNITS
    return Reading(label, claimant, rival, delta, verdicts, undecided_on, need)


def _r2_need(r2: np.ndarray, low: np.ndarray, high: np.ndarray, units: np.ndarray) -> np.ndarray:
    return units_to_decide(r2, low, high, EXPLAINED, units)


def _heads(res, mask: np.ndarray) -> list[str]:
    return [f"L{res.layers[i]}H{res.heads[j]}" for i, j in zip(*np.nonzero(mask))]


def summary(res, rd: Reading) -> str:
    """The readings in plain words: counts per claim with the heads, the undecided ones with
    the step left open and what would decide them (docs/math.md §9)."""
    units = res.units_held[:, -1]
    n_heads = rd.label.size
    prompts = units.max() if res.units == PROMPTS else 0
    if not (res.n_held[:, -1] > 0).any():
        return (
            f"No head is read: no held-out destination sees at least {res.min_visible} keys "
            f"(the claim band). Give prompts longer than {res.min_visible} tokens, several of "
            "them (each prompt is a unit once there are 4)."
        )
    if prompts < MIN_UNITS:
        return (
            f"All {n_heads} heads are undecided for lack of prompts: verdicts rest on held-out "
            f"prompts, at least {MIN_UNITS} of them, and here {int(prompts)} are held out "
            f"(units: {res.units}; the numbers below are described, not claimed). Give at least "
            f"{2 * MIN_UNITS} prompts (half fit the gains, half are held out): `--prompt` several "
            "times on the command line, or a list of prompts in Python."
        )
    parts = []
    for name in ("regression", "linear"):
        heads = _heads(res, rd.label == name)
        parts.append(f"{len(heads)} read {name}" + (f" ({', '.join(heads)})" if heads else ""))
    named = np.isin(rd.label, np.array(res.names, dtype=object))
    parts.append(f"{int(named.sum())} read as their best control")
    parts.append(f"{int((rd.label == UNEXPLAINED).sum())} are unexplained")
    open_ = rd.label == UNDECIDED
    text = f"Of {n_heads} heads, " + ", ".join(parts) + f"; {int(open_.sum())} are undecided"
    if open_.any():
        detail = []
        for i, j in zip(*np.nonzero(open_)):
            need = rd.units_needed[i, j]
            more = (
                f"about {int(need)} held-out prompts would decide it" if np.isfinite(need) else ""
            )
            detail.append(
                f"L{res.layers[i]}H{res.heads[j]} on {rd.undecided_on[i, j]}"
                + (f": {more}" if more else "")
            )
        text += " (" + "; ".join(detail[:8]) + ("; ..." if len(detail) > 8 else "") + ")"
    return (
        text + f". Units: {int(units.max())} held-out {res.units} in the claim band; every "
        "verdict is a 95% interval over them (docs/math.md §9)."
    )
