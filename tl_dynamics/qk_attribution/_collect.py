"""``compute`` and ``attach``: one forward pass, each asked layer's heads attributed as the layer
is delivered (docs/math.md §10). ``layers`` and ``heads`` follow the one convention of every
analysis (``docs/developing.md``)."""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from tl_dynamics.adapter import (
    Batch,
    LayerAttention,
    LayerState,
    ModelAdapter,
    Prompt,
    ResidualSplit,
)
from tl_dynamics.collect import Collector, to_host
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.qk_attribution._core import HeadRows, head_rows
from tl_dynamics.qk_attribution._pair import check_sae_side, side_residuals
from tl_dynamics.qk_attribution._result import QKAttribution, check_positions

TOP_K = 5
# Bytes of query and key parts formed at once for a group of heads of one layer.
PARTS_BUDGET = 128 * 2**20
# Relative error (to the largest entry) within which the parts must sum to the queries and keys
# the model scored, per model dtype (docs/math.md §7; float32 reorders sums, bfloat16 rounds).
SUM_RTOL = {torch.float32: 1e-4, torch.float64: 1e-6, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def _check_top_k(top_k: int) -> int:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise TLDynamicsError(f"qk_attribution: top_k must be a positive int, got {top_k!r}")
    return top_k


class QKCollector(Collector):
    """Collects every asked head's attribution during the passes run while attached."""

    inputs = True

    def __init__(
        self,
        adapter: ModelAdapter,
        layers: Sequence[int],
        heads: Sequence[int] | Mapping[int, Sequence[int]],
        top_k: int,
        sae: Any = None,
        sae_side: str = "both",
        pairs: bool = True,
    ):
        # heads: the same heads in every layer, or per layer (the atlas asks a few per layer)
        self.positions: Any = None  # the rows the result reads by default
        # only these query rows are attributed (the atlas's second copy; HeadRows then holds
        # those rows, not every position: a caller's own reading, not a QKAttribution)
        self.query_rows: Tensor | None = None
        self.heads_of = {L: list(heads[L] if isinstance(heads, Mapping) else heads) for L in layers}
        self.heads = (
            sorted({h for hs in self.heads_of.values() for h in hs})
            if isinstance(heads, Mapping)
            else list(heads)
        )
        self.adapter, self.top_k, self.pairs = adapter, top_k, pairs
        self.sae_side = check_sae_side(sae_side)
        self.splits = {L: ResidualSplit(adapter, L, sae=sae) for L in layers}
        self.features: dict[int, dict[str, tuple[str, ...]]] = {}
        self.layers = tuple(sorted({l for s in self.splits.values() for l in s.layers}))
        self.points = tuple(sorted({p for s in self.splits.values() for p in s.points}))
        self.last = max(self.splits)
        self._kept: dict[int, dict[str, Any]] = {}
        self._batch: Batch | None = None
        self._pass: dict[tuple[int, int], HeadRows] = {}
        self._errors: dict[tuple[int, int], dict[str, float]] = {}
        self.passes: list[tuple[Batch, dict, dict]] = []

    def start_pass(self, batch: Any) -> None:
        if batch is None:
            raise TLDynamicsError(
                "qk_attribution.attach(): the pass was called with something that is not token "
                "ids or text, so its tokens (and the components' names) are unknown"
            )
        self._kept, self._batch, self._pass, self._errors = {}, batch, {}, {}

    def on_layer(self, state: LayerState) -> None:
        l = state.layer
        if l > self.last:
            return
        split = self.splits.get(l) or self.splits[self.last]
        kept = split.keep(state)
        if l < self.last and "z" not in kept and state.attention is not None:
            la = state.attention
            kept.update(z=la.z(), W_O=la.W_O, b_O=la.b_O)
        self._kept[l] = kept
        if l in self.splits:
            self._attribute(self.splits[l], state)

    def _attribute(self, split: ResidualSplit, state: LayerState) -> None:
        la, batch = state.attention, self._batch
        if la is None or batch is None:
            raise TLDynamicsError(f"qk attribution: layer {split.layer} was not delivered")
        res = split.gather(self._kept, batch)
        pattern = la.pattern()
        valid = res.valid
        qres, kres = side_residuals(split, res, self.sae_side)
        if split.sae is not None:
            sides = {"query": qres.names, "key": kres.names}
            self.features[split.layer] = {s: n for s, n in sides.items() if n != res.names}
        heads = self.heads_of[split.layer]
        rows = self.query_rows
        if rows is not None:  # only these query rows (the keys stay at every position)
            rows = rows.to(pattern.device)
            qres = qres.rows(rows)
            la = replace_rows(la, rows)
            pattern = pattern[:, :, rows]
        # heads per group: the parts of a group of heads are projected and rotated at once, within
        # PARTS_BUDGET bytes (one head at a time on large inputs)
        per_head = 4 * (len(res.names) + 1) * int(res.scale.numel()) * la.q.shape[-1]
        step = max(1, PARTS_BUDGET // max(1, per_head))
        for g0 in range(0, len(heads), step):
            group = heads[g0 : g0 + step]
            Qg, Kg = split.queries(qres, group), split.keys(kres, group)
            errors = {**qres.errors, **kres.errors}
            for i, h in enumerate(group):
                self._head(split, la, pattern, valid, errors, h, Qg[..., i, :], Kg[..., i, :])

    def _head(
        self,
        split: ResidualSplit,
        la: LayerAttention,
        pattern: Tensor,
        valid: Tensor,
        errors_in: dict[str, float],
        h: int,
        Q: Tensor,
        K: Tensor,
    ) -> None:
        """Check one head's parts ``Q``/``K`` ``[part, batch, pos, d_head]`` against the queries
        and keys it scored, and attribute it."""
        tol = SUM_RTOL.get(self.adapter.dtype, 5e-2)
        errors = dict(errors_in)
        for side, parts, ref in (("query", Q, la.q[:, :, h]), ("key", K, la.k[:, :, h])):
            ok = valid[:, : ref.shape[1]] if ref.shape[1] == valid.shape[1] else la.query_valid
            diff = (parts.sum(0) - ref)[ok].abs().max()
            errors[side] = float(diff / ref[ok].abs().max().clamp_min(1e-30))
            if errors[side] > tol:
                raise TLDynamicsError(
                    f"qk attribution: the {side} parts of L{split.layer}H{h} on "
                    f"{self.adapter.info.architecture} do not sum to the {side}s it scored "
                    f"(relative error {errors[side]:.2e} > {tol:g})"
                )
        bias = la.bias([h])
        self._pass[(split.layer, h)] = head_rows(
            Q, K, pattern[:, h], la.allowed, la.query_valid, la.scale,
            None if bias is None else bias[:, 0].expand(la.allowed.shape), self.top_k,
            self.pairs,
        )  # fmt: skip
        self._errors[(split.layer, h)] = errors

    def end_pass(self) -> None:
        if self._batch is not None and self._pass:
            self.passes.append((self._batch, self._pass, self._errors))
        self._kept, self._pass = {}, {}

    def result(self) -> QKAttribution:
        """The ``QKAttribution`` of every pass so far (prompts stacked, padded to the longest)."""
        if not self.passes:
            raise Collector.no_passes("qk_attribution")
        ad = self.adapter
        batches = [b for b, _, _ in self.passes]
        n = max(b.tokens.shape[1] for b in batches)
        tokens = np.concatenate([_pad(b.tokens.cpu().numpy(), n, 0) for b in batches])
        key_valid = np.concatenate([_pad(b.key_valid.cpu().numpy(), n, False) for b in batches])
        rows: dict[tuple[int, int], dict[str, np.ndarray]] = {}
        errors: dict[tuple[int, int], dict[str, float]] = {}
        fields = list(HeadRows.__dataclass_fields__)
        for key in self.passes[0][1]:
            parts = []
            for _, p, _ in self.passes:  # one read per dtype per pass (collect.to_host)
                host = to_host({f: getattr(p[key], f) for f in fields})
                parts.append({f: v.numpy() for f, v in host.items()})
            rows[key] = {f: np.concatenate([_pad(x[f], n, 0) for x in parts]) for f in fields}
            errors[key] = {
                k: max(e[key][k] for _, _, e in self.passes) for k in self.passes[0][2][key]
            }
        softcap = any(ad.specs[L].softcap is not None for L in self.splits)
        return QKAttribution(
            architecture=ad.info.architecture,
            layers=tuple(sorted(self.splits)),
            heads=tuple(self.heads),
            components={L: s.names for L, s in self.splits.items()},
            kinds={L: s.kinds for L, s in self.splits.items()},
            tokens=tokens,
            str_tokens=tuple(tuple(ad.decode(row)) for row in tokens),
            key_valid=key_valid,
            rows=rows,
            errors=errors,
            precap=softcap,
            features=dict(self.features),
            positions=self.positions,
        )


def replace_rows(la: LayerAttention, rows: Tensor) -> LayerAttention:
    """``la`` with its queries, masks and position bias at the query ``rows`` only (the keys and
    values at every position)."""
    bias = la.position_bias
    return dataclasses.replace(
        la,
        q=la.q[:, rows],
        allowed=la.allowed[:, rows],
        query_valid=la.query_valid[:, rows],
        position_bias=None if bias is None else bias[:, :, rows],
    )


def _pad(x: np.ndarray, n: int, fill: Any) -> np.ndarray:
    """``x`` padded along its second axis (positions) to ``n``."""
    if x.shape[1] == n:
        return x
    width = [(0, 0)] * x.ndim
    width[1] = (0, n - x.shape[1])
    return np.pad(x, width, constant_values=fill)


def _setup(
    model: Any,
    layers: Any,
    heads: Any,
    top_k: int,
    sae: Any = None,
    sae_side: str = "both",
    positions: Any = None,
    pairs: bool = True,
) -> QKCollector:
    adapter = ModelAdapter.of(model)
    chosen = adapter.check_attention_layers(layers)
    hs = adapter.check_heads(heads)
    if not isinstance(pairs, bool):
        raise TLDynamicsError(f"qk_attribution: pairs must be True or False, got {pairs!r}")
    collector = QKCollector(adapter, chosen, hs, _check_top_k(top_k), sae, sae_side, pairs)
    collector.positions = check_positions(positions)
    return collector


def compute(
    model: Any,
    prompt: Prompt | Batch,
    *,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
    top_k: int = TOP_K,
    sae: Any = None,
    sae_side: str = "both",
    positions: Any = None,
    pairs: bool = True,
) -> QKAttribution:
    """Why each head attends where it does: every score split over the components that wrote
    its query and its key, on this pass (docs/math.md §10).

    The residual stream entering each selected layer is split into the token and positional
    embeddings, every earlier head's output, attention bias and MLP output; with the layer's
    norm scale frozen at the pass's own value each query and key is an exact sum of per-component
    parts, and each score an exact sum over (query component, key component) pairs plus the
    position term. Per row: each component's share of the attention-weighted score (pattern- and
    uniform-weighted, so a part equal on every key cancels), the top pairs at the row's most
    attended key, and the odds-ratio parts. Soft-capped layers are attributed before the cap.
    Not a counterfactual: it is an exact decomposition of this pass.

    Args:
        model: a TransformerLens model or a ``ModelAdapter``.
        prompt: anything ``adapter.tokenize`` takes.
        layers: a layer index, a list of them, or None (all attention layers).
        heads: a head index, a list of them, or None (all heads), in every selected layer.
        top_k: component pairs kept per row.
        sae: a SAELens SAE on ``blocks.<layer>.hook_resid_pre`` of the one selected layer: split
            ``sae_side`` into the features active in this pass (``"SAE feature 1234"``), the
            decoder bias and the error term instead of components, still exactly (docs/math.md
            §10.7; ``QKAttribution.features``).
        sae_side: ``"query"``, ``"key"`` or ``"both"``.
        positions: the rows the result reads by default (``QKAttribution.row_mask``): None
            (every counted row), ``"focused"`` (rows where the head attends a key other than the
            first at least twice the row's uniform share), destination positions, or a bool
            mask ``[pos]`` or ``[batch, pos]``.
        pairs: also the top component pairs and the odds-ratio parts per row (False: the
            marginals only, cheaper on deep models).

    Returns:
        A ``QKAttribution``.

    Example:
        >>> from tl_dynamics import qk_attribution, testing
        >>> res = qk_attribution.compute(testing.cached_model("gpt2"), "a b c a b", layers=1, heads=0)
        >>> res.errors[(1, 0)]["key"] < 1e-4
        True
        >>> res.leaders(1, 0, side="key").shape   # batch, positions
        (1, 6)
    """
    collector = _setup(model, layers, heads, top_k, sae, sae_side, positions, pairs)
    adapter = collector.adapter
    batch = adapter.tokenize(prompt)
    with torch.no_grad(), adapter.collecting(collector):
        adapter.forward(batch)
    return collector.result()


@contextmanager
def attach(
    model: Any,
    *,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
    top_k: int = TOP_K,
    positions: Any = None,
) -> Iterator[QKCollector]:
    """Collect the attribution of ``compute`` during the user's own forward passes.

    Args:
        model: a TransformerLens model or a ``ModelAdapter``.
        layers: as in ``compute``.
        heads: as in ``compute``.
        top_k: as in ``compute``.
        positions: as in ``compute``.

    Returns:
        A context manager yielding a collector whose ``result()`` is a ``QKAttribution`` over
        every pass run inside (prompts stacked).

    Example:
        >>> from tl_dynamics import qk_attribution, testing
        >>> model = testing.cached_model("gpt2")
        >>> with qk_attribution.attach(model, layers=1, heads=[0, 1]) as qk:
        ...     _ = model("a b c a b")
        ...     _ = model("x y x y")
        >>> qk.result().tokens.shape
        (2, 7)
    """
    collector = _setup(model, layers, heads, top_k, positions=positions)
    with collector.adapter.collecting(collector):
        yield collector
