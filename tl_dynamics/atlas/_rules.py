"""The atlas's rules as data: the roles, each role's primary score and required mechanism scores,
the margin and floors every score is read against (``_roles`` applies them, ``_sentences`` words
them)."""

from __future__ import annotations

import numpy as np

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
    "duplicate-token": ("dup_pattern", ("dup_mech",)),
    "induction": ("ind_pattern", ("ind_mech",)),
    "copying": ("copy_pass", ()),
    "copy-suppression": ("neg_copy_pass", ("suppression_qk",)),
    "negative copying": ("neg_copy_pass", ()),
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


def _clears(value: float, control: float) -> bool:
    return bool(np.isfinite(value)) and (not np.isfinite(control) or value >= control + MARGIN)


def _meets(key: str, s: dict[str, float], c: dict[str, float]) -> bool:
    """Whether a required score holds: above its floor (``FLOORS``) or clear of its control."""
    if key in FLOORS:
        return bool(np.isfinite(s[key])) and s[key] >= FLOORS[key]
    return _clears(s[key], c[key])
