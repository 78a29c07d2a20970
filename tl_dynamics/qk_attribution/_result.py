"""``QKAttribution``: per head and row, each component's share of the attention-weighted score on
the query and key sides, the top pairs at the row's most attended key, and the odds-ratio parts
(docs/math.md §10.3-9.5)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import pandas as pd

from tl_dynamics import viz
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.qk_attribution import _views

Side = Literal["query", "key"]
Baseline = Literal["mean", "none"]
PRECAP = (
    "Scores of soft-capped layers are attributed before the cap (cap * tanh(s / cap) acts on "
    "the whole score and cannot be split over components)."
)


def check_side(side: str, baseline: str) -> None:
    if side not in ("query", "key"):
        raise TLDynamicsError(f"qk_attribution: side {side!r}; valid: 'query', 'key'")
    if baseline not in ("mean", "none"):
        raise TLDynamicsError(f"qk_attribution: baseline {baseline!r}; valid: 'mean', 'none'")


@dataclass(frozen=True)
class QKAttribution(viz.Result):
    """Which components wrote the queries and keys that made each head attend where it does.

    ``rows[(layer, head)]`` holds ``[batch, pos, ...]`` arrays (``HeadRows``' fields):
    ``query_w``/``query_u`` ``[.., A]`` and ``key_w``/``key_u`` ``[.., B]``, the components'
    parts of the pattern-weighted and uniform-weighted score; ``chosen``, the row's most attended
    key; ``top_a``/``top_b``/``top_v``, its top pairs; ``prior``, ``like_q``, ``like_k``, the
    odds-ratio parts there; ``rows``, the rows that count (valid, at least two keys). Query
    components are ``query_names(layer)``, key components ``key_names(layer)``. ``errors`` holds
    the relative errors of the checked sums (parts vs. the queries and keys the model scored, each
    earlier attention output vs. the stream, the frozen norm vs. the attention input).
    ``precap``: some layer is soft-capped, and its scores are attributed before the cap.
    ``features[layer][side]``: where an SAE split that side, its parts (``"SAE feature 1234"``,
    ``"SAE decoder bias"``, ``"SAE error"``) in place of ``components[layer]``.
    """

    architecture: str
    layers: tuple[int, ...]
    heads: tuple[int, ...]
    components: dict[int, tuple[str, ...]]
    kinds: dict[int, tuple[str, ...]]
    tokens: np.ndarray
    str_tokens: tuple[tuple[str, ...], ...]
    key_valid: np.ndarray
    rows: dict[tuple[int, int], dict[str, np.ndarray]]
    errors: dict[tuple[int, int], dict[str, float]]
    precap: bool
    features: dict[int, dict[str, tuple[str, ...]]] = field(default_factory=dict)

    def _key(self, layer: int, head: int) -> tuple[int, int]:
        if (layer, head) not in self.rows:
            raise TLDynamicsError(
                f"qk_attribution: L{layer}H{head} was not computed; computed: {sorted(self.rows)}"
            )
        return (layer, head)

    def query_names(self, layer: int) -> tuple[str, ...]:
        """The query-side components of ``layer`` (the last: the query bias)."""
        return (*self.features.get(layer, {}).get("query", self.components[layer]), "query bias")

    def key_names(self, layer: int) -> tuple[str, ...]:
        """The key-side components of ``layer`` (the last: the key bias)."""
        return (*self.features.get(layer, {}).get("key", self.components[layer]), "key bias")

    def names(self, layer: int, side: Side) -> tuple[str, ...]:
        """``query_names`` or ``key_names``."""
        return self.query_names(layer) if side == "query" else self.key_names(layer)

    def lifts(
        self, layer: int, head: int, side: Side = "key", baseline: Baseline = "mean"
    ) -> np.ndarray:
        """``[batch, pos, components]``: each component's part of the attention-weighted score,
        minus its part of the row's uniform average (``baseline="mean"``, what the softmax sees)
        or not (``"none"``); NaN off the counted rows."""
        check_side(side, baseline)
        r = self.rows[self._key(layer, head)]
        w = r[f"{side}_w"].astype(np.float64)
        if baseline == "mean":
            w = w - r[f"{side}_u"]
        return np.where(r["rows"][..., None], w, np.nan)

    def shares(
        self, layer: int, head: int, side: Side = "key", baseline: Baseline = "mean"
    ) -> np.ndarray:
        """``lifts`` over their sum per row (the components' shares; NaN where the sum is not
        positive: a row whose attention is no higher than its average key)."""
        lift = self.lifts(layer, head, side, baseline)
        total = lift.sum(-1, keepdims=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(total > 0, lift / np.where(total > 0, total, 1.0), np.nan)

    def leaders(
        self, layer: int, head: int, side: Side = "key", baseline: Baseline = "mean"
    ) -> np.ndarray:
        """``[batch, pos]``: the index of each row's largest component (``names(layer,
        side)``), -1 off the counted rows."""
        lift = self.lifts(layer, head, side, baseline)
        out = np.nanargmax(np.nan_to_num(lift, nan=-np.inf), axis=-1)
        return np.where(np.isfinite(lift).all(-1), out, -1)

    def leader_names(
        self, layer: int, head: int, side: Side = "key", baseline: Baseline = "mean"
    ) -> np.ndarray:
        """``leaders`` as component names (``""`` off the counted rows)."""
        names = np.array(self.names(layer, side) + ("",), dtype=object)
        return names[self.leaders(layer, head, side, baseline)]

    def to_dataframe(self, baseline: Baseline = "mean") -> pd.DataFrame:
        """One row per layer, head, side and component: its mean share over the counted rows
        (rows whose lift is positive), how often it leads, and its mean lift."""
        out = []
        for layer, head in sorted(self.rows):
            for side in ("query", "key"):
                share = self.shares(layer, head, side, baseline)
                lift = self.lifts(layer, head, side, baseline)
                lead = self.leaders(layer, head, side, baseline)
                counted = np.isfinite(share).all(-1)
                n = max(1, int(counted.sum()))
                for c, name in enumerate(self.names(layer, side)):
                    out.append(
                        dict(
                            layer=layer,
                            head_index=head,
                            side=side,
                            component=name,
                            mean_share=float(np.nansum(share[..., c][counted]) / n),
                            leads=float(((lead == c) & counted).sum() / n),
                            mean_lift=float(np.nanmean(lift[..., c])) if counted.any() else np.nan,
                            rows=int(counted.sum()),
                        )
                    )
        return pd.DataFrame(out)

    def rows_frame(self, layer: int, head: int, row: int = 0) -> pd.DataFrame:
        """One row per counted destination of prompt ``row``: its token, the most attended key
        and its attention, the leading key-side and query-side components and the top pair."""
        r = self.rows[self._key(layer, head)]
        toks = self.str_tokens[row]
        ks, qs = self.shares(layer, head, "key"), self.shares(layer, head, "query")
        kn, qn = self.key_names(layer), self.query_names(layer)
        out = []
        for i in np.flatnonzero(r["rows"][row]):
            j = int(r["chosen"][row, i])
            kb, qa = int(np.nanargmax(ks[row, i])), int(np.nanargmax(qs[row, i]))
            a, b = int(r["top_a"][row, i, 0]), int(r["top_b"][row, i, 0])
            out.append(
                dict(
                    dest=int(i),
                    token=toks[i],
                    src=j,
                    src_token=toks[j],
                    attention=float(r["chosen_p"][row, i]),
                    key_leader=kn[kb],
                    key_share=float(ks[row, i, kb]),
                    query_leader=qn[qa],
                    query_share=float(qs[row, i, qa]),
                    top_pair=f"{qn[a]} x {kn[b]}",
                    top_pair_lift=float(r["top_v"][row, i, 0]),
                )
            )
        return pd.DataFrame(out)

    def show(self, layer: int | None = None, head: int | None = None, row: int = 0) -> viz.Group:
        """Per destination, the key-side and query-side shares of the components that lead
        somewhere, and the table of each row's top pair, for one head (the first computed by
        default)."""
        layer = self.layers[0] if layer is None else layer
        head = self.heads[0] if head is None else head
        self._key(layer, head)
        dests = np.flatnonzero(self.rows[(layer, head)]["rows"][row])
        views = []
        for side in ("key", "query"):
            views.append(
                _views.share_strips(
                    self.shares(layer, head, side)[row, dests],
                    self.names(layer, side),
                    [self.str_tokens[row][i] for i in dests],
                    f"L{layer}H{head}: {side}-side shares",
                )
            )
        notes = [viz.text(PRECAP)] if self.precap else []
        table = viz.table(
            self.rows_frame(layer, head, row), caption=f"L{layer}H{head}: each row's top pair"
        )
        return viz.group(*notes, viz.group(*views, row=True), table)
