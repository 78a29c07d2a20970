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
SCORE_COLUMNS = (
    "prev_pattern",
    "prev_circuit",
    "dup_pattern",
    "dup_mech",
    "qk_positivity",
    "ind_pattern",
    "ind_mech",
    "ind_kcomp",
    "copy_pass",
    "ov_copying",
    "suppression_qk",
    "sink_mass",
    "sink_first",
    "sink_dominant",
    "sink_prior_adv",
    "sink_loglik_adv",
    "learned_sink",
    "local_mass",
)


@dataclass(frozen=True)
class HeadAtlas(viz.Result):
    """The atlas of the asked heads: ranked roles with evidence, controls and causal costs.

    ``roles[(layer, head)]`` holds each head's ranked roles with score, control and evidence;
    ``scores`` and ``control_scores`` every raw score ``[n_layers, n_heads]`` of the model and of
    its weight-shuffled control; ``controls`` the control value each score must clear by
    ``margin``; ``delta_loss[kind]`` (``"mean"``, ``"prior"``, ``"likelihood"``,
    ``"mean_unrepeated"``) the change in next-token loss on the natural probes under each
    intervention (NaN when not run). Built by ``atlas.compute``.

    Attributes:
        model: the model's name (its architecture).
        n_layers: layers of the model.
        n_heads: heads per layer.
        layers: the analysed layers.
        heads: the analysed heads of each analysed layer.
        roles: ``{(layer, head): HeadRoles}`` for every analysed head.
        scores: ``{name: [n_layers, n_heads] array}`` raw scores of the model.
        control_scores: the same scores on the weight-shuffled control.
        controls: ``{name: float}`` the control value each score must clear.
        delta_loss: ``{kind: [n_layers, n_heads] array}`` change in loss (nats); ``"atp"``:
            the attribution-patching estimate of ``"mean"`` for every asked head.
        clean_loss: next-token loss of the unmodified model on the natural probes (nats).
        delta_ci: ``{kind: (low, high)}``, the 95% interval of each over the probes.
        exact: the heads ablated exactly (the rest have the estimate only).
        atp_agreement: the estimate against the exact mean ablation on the heads with both
            (``spearman``, ``pearson``, ``median_abs`` nats, ``heads``).
        pairs: the asked ``(layer, head)`` pairs.
        probes: the probe token ids and metadata.
        notes: caveats shown with the view.
        margin: how far a score must clear its control for a role.

    Example:
        >>> from tl_dynamics import atlas, zoo
        >>> res = atlas.compute(zoo.load("induction-2l"), causal=False)
        >>> res.n_layers, res.n_heads, res.scores["ov_copying"].shape
        (2, 4, (2, 4))
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
    delta_ci: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict, repr=False)
    exact: tuple[tuple[int, int], ...] = ()
    atp_agreement: dict[str, float] = field(default_factory=dict, repr=False)
    pairs: tuple[tuple[int, int], ...] = ()

    def __repr__(self) -> str:
        counts: dict[str, int] = {}
        for entry in self.roles.values():
            counts[entry.roles[0]] = counts.get(entry.roles[0], 0) + 1
        summary = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        return f"HeadAtlas({self.model}, {len(self.roles)} heads: {summary})"

    def _check(self, layer: int, head: int) -> HeadRoles:
        if (layer, head) not in self.roles:
            raise TLDynamicsError(
                f"head L{layer}H{head} is not in this atlas; analysed layers "
                f"{list(self.layers)}, heads {list(self.heads)}"
            )
        return self.roles[(layer, head)]

    def roles_of(self, layer: int, head: int) -> tuple[str, ...]:
        """The ranked roles of one head (``("unclassified",)`` when none applies).

        Args:
            layer: the head's layer (an analysed one).
            head: the head's index (an analysed one).

        Returns:
            The role names, strongest first.

        Example:
            >>> from tl_dynamics import atlas, zoo
            >>> atlas.compute(zoo.load("induction-2l"), layers=1, causal=False).roles_of(1, 0)
            ('induction', 'sink')
        """
        return self._check(layer, head).roles

    def evidence(self, layer: int, head: int) -> str:
        """The evidence for one head's roles, as a sentence per role (scores beside controls).

        Args:
            layer: the head's layer (an analysed one).
            head: the head's index (an analysed one).

        Returns:
            One string, e.g. ``"induction: 0.63 (control 0.04) on the token after ..."``.

        Example:
            >>> from tl_dynamics import atlas, zoo
            >>> res = atlas.compute(zoo.load("induction-2l"), layers=1, causal=False)
            >>> res.evidence(1, 0).split(":")[0]
            'induction'
        """
        return self._check(layer, head).evidence

    def heads_with(self, role: str) -> list[tuple[int, int]]:
        """Every analysed head holding ``role`` (at any rank), as ``(layer, head)``.

        Args:
            role: a role name (``"previous-token"``, ``"duplicate-token"``, ``"induction"``,
                ``"copying"``, ``"copy-suppression"``, ``"negative copying"``, ``"sink"``,
                ``"positional/local"`` or ``"unclassified"``).

        Returns:
            The sorted ``(layer, head)`` pairs.

        Example:
            >>> from tl_dynamics import atlas, zoo
            >>> atlas.compute(zoo.load("induction-2l"), causal=False).heads_with("induction")
            [(1, 0), (1, 1), (1, 2), (1, 3)]
        """
        from tl_dynamics.atlas._roles import ROLES

        if role not in ROLES:
            raise TLDynamicsError(f"unknown role {role!r}; valid: {list(ROLES)}")
        return sorted(key for key, entry in self.roles.items() if role in entry.roles)

    def to_dataframe(self) -> pd.DataFrame:
        """One row per analysed head: its top role, score, control, evidence and causal costs.

        Columns: ``layer, head_index, role`` (the top-ranked), ``score, baseline`` (its score and control),
        ``evidence``, ``delta_loss`` (mean ablation; NaN where the head was not ablated exactly)
        with ``delta_loss_low``/``delta_loss_high`` (its 95% interval over the probes),
        ``delta_loss_atp`` (the attribution-patching estimate, every head) with its interval,
        then ``delta_loss_prior``,
        ``delta_loss_likelihood`` (pattern patched to the prior-only / likelihood-only
        counterfactual), ``delta_loss_unrepeated``, ``roles`` (all, ranked), ``margin_low`` and
        ``margin_high`` (the 95% interval over the probes of the top role's score minus its
        control; NaN for a weight score), ``threshold`` (the margin it must clear), ``units``
        (the probes behind that interval), ``undecided`` (roles whose interval straddles the
        margin), ``sink_position``, ``sink_cause`` and the raw scores.

        Returns:
            A pandas DataFrame with one row per head, sorted by ``(layer, head_index)``.

        Example:
            >>> from tl_dynamics import atlas, zoo
            >>> frame = atlas.compute(zoo.load("induction-2l"), causal=False).to_dataframe()
            >>> frame[["layer", "head_index", "role"]].head(2).values.tolist()
            [[0, 0, 'previous-token'], [0, 1, 'positional/local']]
        """
        records = []
        nan = np.full((self.n_layers, self.n_heads), np.nan)

        def bounds(kind: str, layer: int, head: int) -> tuple[float, float]:
            low, high = self.delta_ci.get(kind, (nan, nan))
            return float(low[layer, head]), float(high[layer, head])

        for (layer, head), entry in sorted(self.roles.items()):
            low, high = bounds("mean", layer, head)
            atp_low, atp_high = bounds("atp", layer, head)
            rec: dict[str, Any] = {
                "layer": layer,
                "head_index": head,
                "role": entry.roles[0],
                "score": entry.scores[0],
                "baseline": entry.baselines[0],
                "evidence": entry.evidence,
                "delta_loss": float(self.delta_loss["mean"][layer, head]),
                "delta_loss_low": low,
                "delta_loss_high": high,
                "delta_loss_atp": float(self.delta_loss.get("atp", nan)[layer, head]),
                "delta_loss_atp_low": atp_low,
                "delta_loss_atp_high": atp_high,
                "delta_loss_prior": float(self.delta_loss["prior"][layer, head]),
                "delta_loss_likelihood": float(self.delta_loss["likelihood"][layer, head]),
                "delta_loss_unrepeated": float(self.delta_loss["mean_unrepeated"][layer, head]),
                "roles": ", ".join(entry.roles),
                "margin_low": entry.margins[0][0] if entry.margins else float("nan"),
                "margin_high": entry.margins[0][1] if entry.margins else float("nan"),
                "threshold": self.margin,
                "units": entry.units[0] if entry.units else 0,
                "undecided": ", ".join(entry.undecided),
                "sink_position": entry.sink_position,
                "sink_cause": entry.sink_cause,
            }
            rec.update(
                {k: float(self.scores[k][layer, head]) for k in SCORE_COLUMNS if k in self.scores}
            )
            records.append(rec)
        return pd.DataFrame.from_records(records)

    def show(self) -> viz.Group:
        """The layer x head grid coloured by role (evidence on hover), its legend, then the table.

        Returns:
            A ``viz.Group``: the grid, the role legend, the notes and the per-head table.

        Example:
            >>> from tl_dynamics import atlas, zoo
            >>> view = atlas.compute(zoo.load("induction-2l"), causal=False).show()
            >>> "L1H0: induction" in view.components[0].html
            True
        """
        frame = self.to_dataframe()
        cells = {
            (int(r["layer"]), int(r["head_index"])): {
                "roles": tuple(r["roles"].split(", ")),
                "evidence": r["evidence"],
                "delta_loss": r["delta_loss"],
            }
            for r in frame.to_dict("records")
        }
        grid = _views.grid_view(
            self.n_layers, self.n_heads, cells, f"What each head does: {self.model}", self.notes
        )
        shown = frame[
            [
                "layer",
                "head_index",
                "role",
                "score",
                "baseline",
                "delta_loss",
                "delta_loss_low",
                "delta_loss_high",
                "delta_loss_atp",
                "delta_loss_prior",
                "delta_loss_likelihood",
                "roles",
                "evidence",
            ]
        ]
        return _views.atlas_view(grid, shown, f"Head atlas of {self.model} (margin {self.margin})")
