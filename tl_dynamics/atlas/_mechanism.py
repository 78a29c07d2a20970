"""Mechanism evidence read on the model's own pass: which components wrote the query and the key
behind each attended key (QK attribution, docs/math.md §10), on the repeated probes.

A weights-only circuit (the K-composition of ``W_E``, a previous-token head's OV and a later
head's QK) sees through neither norms, MLPs nor depth: on a pretrained 30-layer model it sits at
chance while the circuit runs plainly in the pass. So the mechanism of a role is read where it
runs, per second-copy row ``i`` of a probe (``j``: the key the head attends most):

- **induction** (``ind_mech``): ``j`` is the token after the earlier copy of ``i``'s token
  (``i - seq_len + 1``), the key side's leading component *carries the previous token* (a head's
  output at ``j`` from a head that, at ``j`` in this pass, puts at least ``CARRY`` of its
  attention on ``j - 1``), and the query side's leading component *carries the current token*
  (the token embedding, an MLP's output, which reads only its own position, or a head's output
  at ``i`` from a head that puts at least ``CARRY`` of its attention on ``i`` itself);
- **duplicate-token** (``dup_mech``): ``j`` is the earlier copy of ``i``'s token
  (``i - seq_len``), and both sides' leading components carry their own position's token.

Each score is the share of second-copy rows where all of it holds, per probe (the units of the
interval), measured on the heads asked for. Its control is a bound, not a second attribution:
a share counts only rows whose most attended key is the target, so no head of the
weight-shuffled control can score more than the share of rows where it attends the target at all
(``ind_top``, ``dup_top``), and the best control head's such share is the control.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import torch
from torch import Tensor

from tl_dynamics.adapter import Batch, LayerState, ModelAdapter
from tl_dynamics.atlas._probes import Probes
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.qk_attribution import QKCollector

# A head's output at a position carries the token of the position it gives at least this share
# of its attention to (the previous one: a previous-token head at work; its own: a self-reader).
CARRY = 0.5
MECHANISM_KEYS = ("ind_mech", "dup_mech")
# component kinds whose output at a position is read from that position alone
_OWN_KINDS = ("embedding", "mlp")


class _MechanismCollector(QKCollector):
    """QK attribution marginals of the asked heads, plus every earlier head's attention on the
    previous position and on its own, per position ``[batch, head, pos]``."""

    def __init__(self, adapter: ModelAdapter, heads_of: dict[int, list[int]], rows: Tensor):
        super().__init__(adapter, sorted(heads_of), heads_of, top_k=1, pairs=False)
        self.query_rows = rows  # the second copy: the only rows the mechanisms read
        self.prev: dict[int, Tensor] = {}
        self.own: dict[int, Tensor] = {}

    def start_pass(self, batch: Any) -> None:
        super().start_pass(batch)
        self.prev, self.own = {}, {}

    def on_layer(self, state: LayerState) -> None:
        la = state.attention
        if la is not None and state.layer < self.last:
            p = la.pattern()  # [b, h, q, k]
            self.own[state.layer] = p.diagonal(dim1=-2, dim2=-1)  # [b, h, pos]
            prev = torch.zeros_like(self.own[state.layer])
            prev[..., 1:] = p.diagonal(offset=-1, dim1=-2, dim2=-1)  # (i, i - 1)
            self.prev[state.layer] = prev
        super().on_layer(state)


def _carries(
    origins: list[tuple[str, int, int]],
    lead: Tensor,
    where: Tensor,
    masses: dict[int, Tensor],
    own_kinds: bool,
) -> Tensor:
    """``[b, rows]`` bool: the leading component ``lead`` (index into ``origins``) at positions
    ``where`` (``[b, rows]``) is a head whose attention there (``masses[layer]``: ``[b, h, pos]``)
    is at least ``CARRY``, or, with ``own_kinds``, a component read from that position alone."""
    out = torch.zeros_like(lead, dtype=torch.bool)
    for c, (kind, layer, head) in enumerate(origins):
        at = lead == c
        if not bool(at.any()):
            continue
        if kind == "head":
            mass = masses[layer][:, head].gather(1, where)  # [b, rows]
            out |= at & (mass >= CARRY)
        elif own_kinds and kind in _OWN_KINDS:
            out |= at
    return out


def _pass_scores(
    collector: _MechanismCollector,
    probes: Probes,
    n: int,
    shape: tuple[int, int],
    feeders: dict[tuple[int, int], Counter],
) -> dict[str, np.ndarray]:
    """``{key: [n, layer, head]}`` of the collector's last pass over ``n`` probes (NaN where not
    asked); counts into ``feeders[(layer, head)]`` the heads whose output leads the key side of
    the rows where the induction mechanism holds."""
    out = {k: np.full((n, *shape), np.nan) for k in MECHANISM_KEYS}
    second = torch.tensor(list(probes.second_copy), dtype=torch.long)
    _, rows_of, _ = collector.passes[-1]
    for (layer, head), r in rows_of.items():
        origins = list(collector.splits[layer].origins) + [("bias", -1, -1)]
        key_lead = (r.key_w - r.key_u).argmax(-1)  # [b, rows]: the second copy's rows only
        query_lead = (r.query_w - r.query_u).argmax(-1)
        chosen = r.chosen
        device = chosen.device
        rows = second.to(device)[None].expand_as(chosen)
        ind_target = chosen == rows - probes.seq_len + 1
        dup_target = chosen == rows - probes.seq_len
        query_own = _carries(origins, query_lead, rows, collector.own, True)
        key_prev = _carries(origins, key_lead, chosen, collector.prev, False)
        key_own = _carries(origins, key_lead, chosen, collector.own, True)
        holds = ind_target & key_prev & query_own
        for c in key_lead[holds].unique().tolist():
            kind, l2, h2 = origins[c]
            feeders.setdefault((layer, head), Counter())[(l2, h2)] += int(
                (key_lead[holds] == c).sum()
            )
        ind = holds.float().mean(1)
        dup = (dup_target & key_own & query_own).float().mean(1)
        out["ind_mech"][:, layer, head] = ind.double().cpu().numpy()
        out["dup_mech"][:, layer, head] = dup.double().cpu().numpy()
    return out


def mechanism_scores(
    adapter: ModelAdapter, probes: Probes, heads_of: dict[int, list[int]], chunk: int = 32
) -> tuple[dict[str, np.ndarray], str | None, dict[tuple[int, int], Counter]]:
    """``({key: [probe, layer, head]}, note, feeders)``: the induction and duplicate-token
    mechanism shares of the heads in ``heads_of`` (``{layer: [head, ...]}``) on the repeated
    probes, NaN elsewhere; where the stream cannot be split exactly (``adapter.ResidualSplit``
    refuses the architecture) every value is NaN and ``note`` says why. ``feeders[(layer,
    head)]`` counts, over the rows where a head's induction mechanism holds, which previous-token
    head's output led its key side.

    Example:
        >>> from tl_dynamics import zoo
        >>> from tl_dynamics.adapter import ModelAdapter
        >>> from tl_dynamics.atlas._probes import build_probes
        >>> ad = ModelAdapter(zoo.load("induction-2l"))
        >>> got, note, feeders = mechanism_scores(ad, build_probes(ad, None, 8, 20, 0), {1: [1]})
        >>> got["ind_mech"].shape, bool(got["ind_mech"][:, 1, 1].mean() > 0.5), note
        ((8, 2, 4), True, None)
        >>> feeders[(1, 1)].most_common(1)[0][0]   # L0H0, the previous-token head
        (0, 0)
    """
    tokens = probes.repeat.tokens
    shape = (adapter.n_layers, adapter.n_heads)
    empty = {k: np.full((tokens.shape[0], *shape), np.nan) for k in MECHANISM_KEYS}
    heads_of = {layer: hs for layer, hs in heads_of.items() if hs}
    feeders: dict[tuple[int, int], Counter] = {}
    if not heads_of:
        return empty, None, feeders
    try:
        second = torch.tensor(list(probes.second_copy), dtype=torch.long)
        collector = _MechanismCollector(adapter, heads_of, second)
    except TLDynamicsError as exc:  # the split's named refusal: no number, the reason
        return empty, f"the mechanism cannot be read on the pass: {exc}", feeders
    parts = []
    for start in range(0, tokens.shape[0], chunk):
        part = Batch(
            tokens[start : start + chunk],
            probes.repeat.key_valid[start : start + chunk],
            probes.repeat.padding_side,
        )
        with torch.no_grad(), adapter.collecting(collector):
            adapter.forward(part)
        parts.append(_pass_scores(collector, probes, part.tokens.shape[0], shape, feeders))
        collector.passes.clear()  # the rows are read: keep no pass
    return {k: np.concatenate([p[k] for p in parts]) for k in MECHANISM_KEYS}, None, feeders
