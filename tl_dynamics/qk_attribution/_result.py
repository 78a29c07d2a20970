"""``QKAttribution``: per head and row, each component's share of the attention-weighted score on
the query and key sides, the top pairs at the row's most attended key, and the odds-ratio parts
(docs/math.md §10.3-10.5)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

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


# Rows selected by ``positions="focused"``: the row's most attended key is not the first real
# position (not a sink row) and holds at least FOCUS times the uniform share of the row's keys.
FOCUS = 2.0
PRESETS = ("focused",)


def check_positions(positions: Any) -> Any:
    """``positions`` as the results take it: None (every counted row), ``"focused"`` (rows where
    the head attends a key other than the first at least ``FOCUS`` times the row's uniform share),
    destination positions (ints, the same in every prompt), or a bool mask ``[pos]`` or
    ``[batch, pos]``; anything else raises naming what is valid.

    Example:
        >>> check_positions([3, 5]), check_positions("focused")
        ([3, 5], 'focused')
    """
    if positions is None or (isinstance(positions, str) and positions in PRESETS):
        return positions
    if isinstance(positions, str):
        raise TLDynamicsError(
            f"qk_attribution: positions {positions!r}; valid: None, {', '.join(map(repr, PRESETS))}, "
            "destination positions (ints) or a bool mask [pos] or [batch, pos]"
        )
    arr = np.asarray(positions)
    if arr.dtype == bool and arr.ndim in (1, 2):
        return arr
    if arr.ndim == 1 and arr.dtype.kind in "iu" and (arr.size == 0 or int(arr.min()) >= 0):
        return [int(i) for i in arr]
    raise TLDynamicsError(
        f"qk_attribution: positions must be None, 'focused', non-negative destination positions "
        f"or a bool mask [pos] or [batch, pos]; got {positions!r}"
    )


def select_rows(
    base: np.ndarray,
    chosen: np.ndarray,
    chosen_p: np.ndarray,
    n_keys: np.ndarray,
    first: np.ndarray,
    positions: Any,
) -> np.ndarray:
    """``[batch, pos]`` bool: the rows of ``base`` (counted: valid, at least two keys) that
    ``positions`` (checked by ``check_positions``) selects, given each row's most attended key
    ``chosen``, its attention ``chosen_p``, the row's key count ``n_keys`` and each prompt's first
    real position ``first`` (``[batch, 1]``). Destination positions past the last raise.

    Example:
        >>> base = np.ones((1, 3), dtype=bool)
        >>> select_rows(base, np.array([[0, 0, 1]]), np.array([[1.0, 0.5, 0.9]]),
        ...             np.array([[1, 2, 3]]), np.zeros((1, 1), int), "focused").tolist()
        [[False, False, True]]
    """
    if positions is None:
        return base
    if isinstance(positions, str):  # "focused"
        share = chosen_p * np.maximum(n_keys, 1.0)  # attention over the uniform share
        return base & (chosen != first) & (share >= FOCUS)
    if isinstance(positions, np.ndarray):
        try:
            return base & np.broadcast_to(positions, base.shape)
        except ValueError as exc:
            raise TLDynamicsError(
                f"qk_attribution: a positions mask of shape {positions.shape} does not fit "
                f"the rows {base.shape} (batch, pos)"
            ) from exc
    keep = np.zeros(base.shape[1], dtype=bool)
    inside = [i for i in positions if i < base.shape[1]]
    if len(inside) < len(positions):
        raise TLDynamicsError(
            f"qk_attribution: positions {sorted(set(positions) - set(inside))} are past the "
            f"last position {base.shape[1] - 1}"
        )
    keep[inside] = True
    return base & keep[None]


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
    positions: Any = None  # the rows read by default (``row_mask``); None: every counted row

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

    def row_mask(self, layer: int, head: int, positions: Any = None) -> np.ndarray:
        """``[batch, pos]`` bool: the counted rows (valid, at least two keys) that ``positions``
        selects (``check_positions``; None: the result's own ``positions``, set by ``compute``).

        Example:
            >>> from tl_dynamics import qk_attribution, zoo
            >>> res = qk_attribution.compute(zoo.load("induction-2l"), "ABCDEABCDE", layers=1, heads=1)
            >>> int(res.row_mask(1, 1).sum()), int(res.row_mask(1, 1, [7, 8]).sum())
            (10, 2)
        """
        r = self.rows[self._key(layer, head)]
        first = self.key_valid.argmax(-1)[:, None]  # the first real position of each prompt
        positions = check_positions(self.positions if positions is None else positions)
        return select_rows(
            r["rows"].astype(bool), r["chosen"], r["chosen_p"], r["n_keys"], first, positions
        )

    def lifts(
        self,
        layer: int,
        head: int,
        side: Side = "key",
        baseline: Baseline = "mean",
        positions: Any = None,
    ) -> np.ndarray:
        """``[batch, pos, components]``: each component's part of the attention-weighted score,
        minus its part of the row's uniform average (``baseline="mean"``, what the softmax sees)
        or not (``"none"``); NaN off the rows ``row_mask(layer, head, positions)`` keeps."""
        check_side(side, baseline)
        r = self.rows[self._key(layer, head)]
        w = r[f"{side}_w"].astype(np.float64)
        if baseline == "mean":
            w = w - r[f"{side}_u"]
        return np.where(self.row_mask(layer, head, positions)[..., None], w, np.nan)

    def shares(
        self,
        layer: int,
        head: int,
        side: Side = "key",
        baseline: Baseline = "mean",
        positions: Any = None,
    ) -> np.ndarray:
        """``lifts`` over their sum per row (the components' shares; NaN where the sum is not
        positive: a row whose attention is no higher than its average key). A share can exceed 1
        and a lift can be negative: a component that works against the attended key makes the
        others' shares of the total larger than 1."""
        lift = self.lifts(layer, head, side, baseline, positions)
        total = lift.sum(-1, keepdims=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(total > 0, lift / np.where(total > 0, total, 1.0), np.nan)

    def leaders(
        self,
        layer: int,
        head: int,
        side: Side = "key",
        baseline: Baseline = "mean",
        positions: Any = None,
    ) -> np.ndarray:
        """``[batch, pos]``: the index of each row's largest component (``names(layer,
        side)``), -1 off the selected rows."""
        lift = self.lifts(layer, head, side, baseline, positions)
        out = np.nanargmax(np.nan_to_num(lift, nan=-np.inf), axis=-1)
        return np.where(np.isfinite(lift).all(-1), out, -1)

    def leader_names(
        self,
        layer: int,
        head: int,
        side: Side = "key",
        baseline: Baseline = "mean",
        positions: Any = None,
    ) -> np.ndarray:
        """``leaders`` as component names (``""`` off the selected rows)."""
        names = np.array(self.names(layer, side) + ("",), dtype=object)
        return names[self.leaders(layer, head, side, baseline, positions)]

    def to_dataframe(self, baseline: Baseline = "mean", positions: Any = None) -> pd.DataFrame:
        """One row per layer, head, side and component: its mean share over the selected rows
        (``row_mask``; rows whose lift is positive), how often it leads, and its mean lift."""
        out = []
        for layer, head in sorted(self.rows):
            for side in ("query", "key"):
                share = self.shares(layer, head, side, baseline, positions)
                lift = self.lifts(layer, head, side, baseline, positions)
                lead = self.leaders(layer, head, side, baseline, positions)
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

    def rows_frame(
        self, layer: int, head: int, row: int = 0, positions: Any = None
    ) -> pd.DataFrame:
        """One row per selected destination of prompt ``row`` (``row_mask``): its token, the most
        attended key and its attention, the leading key-side and query-side components (by lift)
        with their shares, and the top pair."""
        r = self.rows[self._key(layer, head)]
        toks = self.str_tokens[row]
        ks, qs = self.shares(layer, head, "key"), self.shares(layer, head, "query")
        kl, ql = self.leaders(layer, head, "key"), self.leaders(layer, head, "query")
        kn, qn = self.key_names(layer), self.query_names(layer)
        out = []
        for i in np.flatnonzero(self.row_mask(layer, head, positions)[row]):
            j = int(r["chosen"][row, i])
            kb, qa = int(kl[row, i]), int(ql[row, i])
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

    def show(
        self, layer: int | None = None, head: int | None = None, row: int = 0, positions: Any = None
    ) -> viz.Group:
        """Per selected destination (``row_mask``), the key-side and query-side shares of the
        components that lead somewhere, and the table of each row's top pair, for one head (the
        first computed by default)."""
        layer = self.layers[0] if layer is None else layer
        head = self.heads[0] if head is None else head
        self._key(layer, head)
        dests = np.flatnonzero(self.row_mask(layer, head, positions)[row])
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
            self.rows_frame(layer, head, row, positions),
            caption=f"L{layer}H{head}: each row's top pair",
        )
        return viz.group(*notes, viz.group(*views, row=True), table)
