"""``chains``: how often each chain shape explains a head's edges over prompts and rows, with an
interval over the prompts, beside the weight-shuffled control (docs/math.md §10.8)."""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from tl_dynamics import viz
from tl_dynamics.adapter import Batch, ModelAdapter, Prompt, shuffled_weights
from tl_dynamics.evidence import MIN_UNITS, N_BOOT, too_few
from tl_dynamics.qk_attribution._edge import shape_of
from tl_dynamics.qk_attribution._explain import edge_links, pass_of, trace
from tl_dynamics.qk_attribution._prompts import PROMPTS_PER_PASS, prompt_interval
from tl_dynamics.qk_attribution._result import check_positions, select_rows

SHOWN = 6  # shapes named in the summary and the table, most frequent first


def _rows(la: Any, row: int, head: int, positions: Any, prompt: int) -> list[tuple[int, int]]:
    """``[(dest, src)]``: the rows of prompt ``row`` of this pass (``prompt`` of all) that
    ``positions`` selects (``select_rows``, as ``QKAttribution.row_mask``; destination
    positions past this pass's end are left out), each at its most attended key."""
    pattern = la.pattern()[row, head]  # [q, k]
    allowed = la.allowed[row]
    n_keys = allowed.sum(-1)
    valid = la.query_valid[row] & (n_keys >= 2)
    top_p, top = pattern.max(-1)
    n = valid.shape[0]
    if isinstance(positions, np.ndarray) and positions.ndim == 2:
        positions = positions[prompt]
    elif isinstance(positions, list):
        positions = [i for i in positions if i < n]
    first = np.array([[int(allowed.any(0).float().argmax())]])
    base, chosen, chosen_p, keys = (t.cpu().numpy()[None] for t in (valid, top, top_p, n_keys))
    keep = select_rows(base, chosen, chosen_p, keys, first, positions)[0]
    return [(int(i), int(top[i])) for i in np.flatnonzero(keep)]


def _shapes(
    adapter: ModelAdapter, batch: Batch, layer: int, head: int, positions: Any, depth: int, top: int
) -> list[collections.Counter]:
    """Per prompt of ``batch``, the count of each chain shape over its selected rows."""
    out = []
    for start in range(0, batch.tokens.shape[0], PROMPTS_PER_PASS):
        part = Batch(
            batch.tokens[start : start + PROMPTS_PER_PASS],
            batch.key_valid[start : start + PROMPTS_PER_PASS],
            batch.padding_side,
        )
        splits, keep = trace(adapter, part, layer)
        la, cache = keep.attn[layer], {}
        for row in range(part.tokens.shape[0]):
            p = pass_of(adapter, part, splits, keep, row, cache)
            counts: collections.Counter = collections.Counter()
            for dest, src in _rows(la, row, head, positions, start + row):
                key, query, _ = edge_links(p, la, layer, head, dest, src, depth, top)
                counts[shape_of(key, query, src, dest)] += 1
            out.append(counts)
    return out


def _shares(counts: list[collections.Counter], shapes: list[str]) -> np.ndarray:
    """``[prompts, shapes]``: each shape's share of a prompt's rows (NaN: no row)."""
    out = np.full((len(counts), len(shapes)), np.nan)
    for i, c in enumerate(counts):
        n = sum(c.values())
        if n:
            out[i] = [c[s] / n for s in shapes]
    return out


@dataclass(frozen=True)
class ChainShapes(viz.Result):
    """How often each chain shape (``EdgeExplanation.shape``) explains a head's edges: per shape,
    its mean share of the selected rows over the prompts with a 95% interval, and the same on the
    weight-shuffled control (NaN without one)."""

    layer: int
    head: int
    shapes: tuple[str, ...]
    stats: dict[str, np.ndarray]  # mean, low, high, control_mean, control_low, control_high
    n_prompts: int
    n_rows: int
    positions: Any
    depth: int

    def to_dataframe(self) -> pd.DataFrame:
        """One row per chain shape (``chain``): its mean share, interval and control."""
        return pd.DataFrame(
            [
                dict(layer=self.layer, head_index=self.head, chain=s)
                | {k: float(v[i]) for k, v in self.stats.items()}
                for i, s in enumerate(self.shapes)
            ]
        ).rename(columns={"mean": "share", "control_mean": "control_share"})

    def summary(self) -> str:
        """The most frequent shapes in one sentence each, from the same numbers as the table."""
        rows = "focused rows" if isinstance(self.positions, str) else "selected rows"
        out = [f"L{self.layer}H{self.head} over its {rows} of {self.n_prompts} prompts "
               f"({self.n_rows} rows)"]  # fmt: skip
        for i, shape in enumerate(self.shapes[:SHOWN]):
            st = self.stats
            text = f"'{shape}' on {st['mean'][i]:.0%} of rows"
            if np.isfinite(st["low"][i]):
                text += f" [{st['low'][i]:.0%}, {st['high'][i]:.0%}]"
            if np.isfinite(st["control_mean"][i]):
                text += f" (weight-shuffled control: {st['control_mean'][i]:.0%})"
            out.append(text)
        if too_few(self.n_prompts):
            out.append(
                f"{self.n_prompts} prompts are too few to decide (a verdict needs {MIN_UNITS})"
            )
        return "; ".join(out) + "."

    def show(self) -> viz.Group:
        """The summary and the table of shapes."""
        return viz.group(
            viz.text(self.summary()),
            viz.table(self.to_dataframe().head(20), caption="Chain shapes, most frequent first"),
        )


def chains(
    model: Any,
    prompts: Prompt | Batch,
    layer: int,
    head: int,
    *,
    positions: Any = "focused",
    depth: int = 2,
    top: int = 1,
    control: bool = True,
    n_boot: int = N_BOOT,
    seed: int = 0,
) -> ChainShapes:
    """How often each chain shape explains head ``head``'s edges: every selected row of every
    prompt explained at its most attended key (``explain``'s links, ``depth`` levels, ``top``
    expanded per link), its shape counted, and each shape's share over the prompts with an
    interval (``evidence``), beside the weight-shuffled control.

    Args:
        model: a TransformerLens model or a ``ModelAdapter``.
        prompts: texts, token ids ``[prompts, pos]`` or a ``Batch``.
        layer: the attention layer.
        head: the head.
        positions: the rows (as ``compute``'s ``positions``; default ``"focused"``).
        depth: the chain's levels (``explain``).
        top: leading parts expanded per link.
        control: also the weight-shuffled control.
        n_boot: bootstrap replicates.
        seed: seeds the replicates and the shuffle.

    Returns:
        A ``ChainShapes``.

    Example:
        >>> from tl_dynamics import qk_attribution, zoo
        >>> s = qk_attribution.chains(zoo.load("induction-2l"),
        ...     ["ABCDEFGHABCDEFGH", "QRSTUVWXQRSTUVWX"], 1, 1, control=False)
        >>> s.shapes[0]
        'key: L0H0 <- the token at src-1 | query: the token at dest'
    """
    adapter = ModelAdapter.of(model)
    layer = adapter.check_attention_layers([layer])[0]
    head = adapter.check_heads([head])[0]
    positions = check_positions(positions)
    batch = adapter.tokenize(prompts)  # type: ignore[arg-type]
    counts = _shapes(adapter, batch, layer, head, positions, depth, top)
    total = collections.Counter()
    for c in counts:
        total.update(c)
    shapes = [s for s, _ in total.most_common()]
    mean, low, high = prompt_interval(_shares(counts, shapes), n_boot, seed)
    nan = np.full(len(shapes), np.nan)
    stats = dict(mean=mean, low=low, high=high, control_mean=nan, control_low=nan, control_high=nan)
    if control and shapes:
        shuffled = shuffled_weights(adapter, seed)
        c_counts = _shapes(shuffled, batch, layer, head, positions, depth, top)
        cm, cl, ch = prompt_interval(_shares(c_counts, shapes), n_boot, seed)
        stats.update(control_mean=np.nan_to_num(cm), control_low=cl, control_high=ch)
    return ChainShapes(
        layer, head, tuple(shapes), stats, int(batch.tokens.shape[0]), sum(total.values()),
        positions, depth,
    )  # fmt: skip
