"""``HeadAtlas``: what every asked head does, with the evidence, controls and causal costs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from tl_dynamics import viz
from tl_dynamics.atlas import _views
from tl_dynamics.atlas._roles import MARGIN, HeadRoles
from tl_dynamics.errors import TLDynamicsError

# Raw scores copied into the table (beside the role's own score and control).
SCORE_COLUMNS = ("prev_pattern", "prev_circuit", "dup_pattern", "qk_positivity", "ind_pattern",
                 "ind_kcomp", "ov_copying", "suppression_qk", "sink_mass", "sink_first",
                 "sink_dominant", "sink_prior_adv", "sink_loglik_adv", "learned_sink", "local_mass")


@dataclass(frozen=True)
class HeadAtlas:
    """The atlas of the asked heads.

    ``roles[(layer, head)]`` holds each head's ranked roles with score, control and evidence;
    ``scores`` and ``control_scores`` every raw score ``[n_layers, n_heads]`` of the model and of
    its weight-shuffled control; ``controls`` the control value each score must clear by
    ``margin``; ``delta_loss[kind]`` (``"mean"``, ``"prior"``, ``"likelihood"``) the change in
    next-token loss on the natural probes under each intervention (NaN when not run).
    """

    model: str
    n_layers: int
    n_heads: int
    layers: tuple[int, ...]
    heads: tuple[int, ...]
    roles: dict[tuple[int, int], HeadRoles] = field(repr=False)
    scores: dict[str, np.ndarray] = field(repr=False)
    control_scores: dict[str, np.ndarray] = field(repr=False)
    controls: dict[str, float] = field(repr=False)
    delta_loss: dict[str, np.ndarray] = field(repr=False)
    clean_loss: float
    probes: dict[str, Any] = field(repr=False)
    notes: tuple[str, ...] = ()
    margin: float = MARGIN

    def __repr__(self) -> str:
        counts: dict[str, int] = {}
        for entry in self.roles.values():
            counts[entry.roles[0]] = counts.get(entry.roles[0], 0) + 1
        summary = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        return f"HeadAtlas({self.model}, {len(self.roles)} heads: {summary})"

    def _check(self, layer: int, head: int) -> HeadRoles:
        if (layer, head) not in self.roles:
            raise TLDynamicsError(f"head L{layer}H{head} is not in this atlas; analysed layers "
                                  f"{list(self.layers)}, heads {list(self.heads)}")
        return self.roles[(layer, head)]

    def roles_of(self, layer: int, head: int) -> tuple[str, ...]:
        """The ranked roles of one head (``("unclassified",)`` when none applies)."""
        return self._check(layer, head).roles

    def evidence(self, layer: int, head: int) -> str:
        return self._check(layer, head).evidence

    def heads_with(self, role: str) -> list[tuple[int, int]]:
        """Every analysed head holding ``role`` (at any rank), as ``(layer, head)``."""
        from tl_dynamics.atlas._roles import ROLES

        if role not in ROLES:
            raise TLDynamicsError(f"unknown role {role!r}; valid: {list(ROLES)}")
        return sorted(key for key, entry in self.roles.items() if role in entry.roles)

    def to_dataframe(self) -> pd.DataFrame:
        """One row per head: ``layer, head, role`` (the top-ranked), ``score, baseline`` (its
        score and control), ``evidence``, ``delta_loss`` (mean ablation), then
        ``delta_loss_prior``, ``delta_loss_likelihood`` (pattern patched to the prior-only /
        likelihood-only counterfactual), ``delta_loss_unrepeated``, ``roles`` (all, ranked), ``sink_position``,
        ``sink_cause`` and the raw scores."""
        records = []
        for (layer, head), entry in sorted(self.roles.items()):
            rec: dict[str, Any] = {
                "layer": layer, "head": head, "role": entry.roles[0], "score": entry.scores[0],
                "baseline": entry.baselines[0], "evidence": entry.evidence,
                "delta_loss": float(self.delta_loss["mean"][layer, head]),
                "delta_loss_prior": float(self.delta_loss["prior"][layer, head]),
                "delta_loss_likelihood": float(self.delta_loss["likelihood"][layer, head]),
                "delta_loss_unrepeated": float(self.delta_loss["mean_unrepeated"][layer, head]),
                "roles": ", ".join(entry.roles), "sink_position": entry.sink_position,
                "sink_cause": entry.sink_cause}
            rec.update({k: float(self.scores[k][layer, head]) for k in SCORE_COLUMNS if k in self.scores})
            records.append(rec)
        return pd.DataFrame.from_records(records)

    def show(self) -> viz.Group:
        """The layer x head grid coloured by role (evidence on hover), then the table."""
        frame = self.to_dataframe()
        cells = {(int(r["layer"]), int(r["head"])): {"roles": tuple(r["roles"].split(", ")),
                                                     "evidence": r["evidence"],
                                                     "delta_loss": r["delta_loss"]}
                 for r in frame.to_dict("records")}
        grid = _views.grid_view(self.n_layers, self.n_heads, cells,
                                f"What each head does: {self.model}", self.notes)
        shown = frame[["layer", "head", "role", "score", "baseline", "delta_loss",
                       "delta_loss_prior", "delta_loss_likelihood", "roles", "evidence"]]
        return _views.atlas_view(grid, shown, f"Head atlas of {self.model} (margin {self.margin})")
