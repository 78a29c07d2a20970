"""``over_prompts``: per component, its mean share across prompts with a bootstrap interval,
beside the same on the weight-shuffled control (docs/math.md §10.6)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import pandas as pd
import torch

from tl_dynamics import viz
from tl_dynamics.adapter import Batch, ModelAdapter, Prompt, shuffled_weights
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.qk_attribution._collect import compute
from tl_dynamics.evidence import LEVEL, MIN_UNITS, N_BOOT, interval, poisson_weights, too_few
from tl_dynamics.qk_attribution._result import FOCUS, Baseline, check_positions, check_side

PROMPTS_PER_PASS = 8

# to_dataframe's column names where a statistic's own name is a DataFrame attribute
_COLUMN = {"mean": "mean_share", "control_mean": "control_mean_share", "diff": "diff_mean"}


def prompt_interval(
    values: np.ndarray, n_boot: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(mean, low, high)`` of per-prompt ``values`` ``[prompts, ...]`` over the prompts with a
    value (NaN: the prompt has no selected row): the mean, and its 95% interval from Poisson
    bootstrap replicates over the prompts (``evidence``: the same units, weights and expanded
    percentile interval as every label).

    Example:
        >>> m, lo, hi = prompt_interval(np.array([[0.2], [0.4], [np.nan], [0.3]]), 200, 0)
        >>> round(float(m[0]), 2), bool(lo[0] < 0.3 < hi[0])
        (0.3, True)
    """
    finite = np.isfinite(values)
    x = np.where(finite, values, 0.0)
    n = finite.sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(n > 0, x.sum(0) / np.maximum(n, 1), np.nan)
        w = poisson_weights(np.arange(values.shape[0]), n_boot, seed)  # [prompt, B]
        reps = np.einsum("pb,p...->b...", w, x) / np.einsum("pb,p...->b...", w, finite)
    low, high = interval(reps, np.maximum(n, 2))
    return mean, np.where(n >= 2, low, np.nan), np.where(n >= 2, high, np.nan)


def _per_prompt(
    adapter: ModelAdapter,
    batches: list[Batch],
    layer: int,
    heads: list[int],
    baseline: Baseline,
    positions: Any,
) -> dict[str, np.ndarray]:
    """``[prompts, heads, components]`` mean share per side over each prompt's selected rows
    (``QKAttribution.row_mask``; NaN for a prompt without one), and ``leads``, how often each
    component leads there."""
    out: dict[str, list[np.ndarray]] = {"query": [], "key": [], "query_leads": [], "key_leads": []}
    for batch in batches:
        res = compute(adapter, batch, layers=layer, heads=heads, positions=positions, pairs=False)
        for side in ("query", "key"):
            shares, leads = [], []
            n_comp = len(res.names(layer, side))
            for h in heads:
                share = res.shares(layer, h, side, baseline)  # [b, pos, n]
                counted: np.ndarray = np.asarray(np.isfinite(share).all(-1))
                sums = np.where(counted[..., None], share, 0.0).sum(1)
                n = counted.sum(1)[:, None]
                lead = res.leaders(layer, h, side, baseline)
                hits = np.stack([((lead == c) & counted).sum(1) for c in range(n_comp)], -1)
                with np.errstate(invalid="ignore", divide="ignore"):
                    shares.append(np.where(n > 0, sums / np.maximum(n, 1), np.nan))
                    leads.append(np.where(n > 0, hits / np.maximum(n, 1), np.nan))
            out[side].append(np.stack(shares, 1))
            out[f"{side}_leads"].append(np.stack(leads, 1))
    return {side: np.concatenate(v) for side, v in out.items()}


@dataclass(frozen=True)
class PromptSummary(viz.Result):
    """Per head, side and component, over the selected rows of each prompt (``positions``): the
    mean share across prompts with its interval, how often the component leads (``leads``), the
    same on the weight-shuffled control (``control_*``; NaN without one), and the difference to
    the control paired by prompt (``diff``, with its interval)."""

    layer: int
    heads: tuple[int, ...]
    names: dict[str, tuple[str, ...]]
    stats: dict[str, dict[str, np.ndarray]]  # side -> {mean, low, high, control_mean, ...}
    n_prompts: int
    baseline: str
    level: float
    positions: Any = None
    n_boot: int = N_BOOT
    used: dict[str, np.ndarray] = field(default_factory=dict)  # side -> [head] prompts with rows

    def to_dataframe(self) -> pd.DataFrame:
        """One row per head, side and component."""
        rows = []
        for side, names in self.names.items():
            s = self.stats[side]
            for j, head in enumerate(self.heads):
                for c, name in enumerate(names):
                    rows.append(  # "mean" is a DataFrame method: the column is mean_share
                        dict(layer=self.layer, head_index=head, side=side, component=name)
                        | {_COLUMN.get(k, k): float(v[j, c]) for k, v in s.items()}
                    )
        return pd.DataFrame(rows)

    def rows_said(self) -> str:
        """Which rows the numbers are over, in words."""
        if self.positions is None:
            return "every counted row"
        if isinstance(self.positions, str):
            return (
                f"its '{self.positions}' rows (a key other than the first attended at least "
                f"{FOCUS:g}x the uniform share)"
            )
        return "the given positions"

    def summary(self) -> str:
        """The selected rows in one sentence, then one per head and side: the component that
        leads most often there, its mean share with its interval, and how it compares with the
        control (a verdict from at least ``evidence.MIN_UNITS`` prompts; fewer are said to be
        too few).

        Example:
            >>> from tl_dynamics import qk_attribution, zoo
            >>> s = qk_attribution.over_prompts(zoo.load("induction-2l"),
            ...     ["ABCDEFGHABCDEFGH", "QRSTUVWXQRSTUVWX"], 1, heads=1, positions="focused")
            >>> s.summary().split(". ")[1].startswith("L1H1 key side")
            True
        """
        out = [f"Over {self.rows_said()} of {self.n_prompts} prompts"]
        for j, head in enumerate(self.heads):
            for side in ("key", "query"):
                st, names = self.stats[side], self.names[side]
                leads = np.nan_to_num(st["leads"][j], nan=-1.0)
                c = int(np.argmax(leads))
                n = int(self.used.get(side, np.full(len(self.heads), self.n_prompts))[j])
                if leads[c] < 0:
                    out.append(f"L{self.layer}H{head} {side} side: no selected row")
                    continue
                text = (
                    f"L{self.layer}H{head} {side} side ({n} prompt{'s' if n != 1 else ''} with "
                    f"such rows): {names[c]} leads {leads[c]:.0%} of rows, mean share "
                    f"{st['mean'][j, c]:.2f}"
                )
                if np.isfinite(st["low"][j, c]):
                    text += f" [{st['low'][j, c]:.2f}, {st['high'][j, c]:.2f}]"
                if np.isfinite(st["control_mean"][j, c]):
                    d, lo, hi = st["diff"][j, c], st["diff_low"][j, c], st["diff_high"][j, c]
                    text += f"; the weight-shuffled control {st['control_mean'][j, c]:.2f}, "
                    if too_few(n):
                        text += f"a difference of {d:+.2f} that {n} prompts cannot decide"
                        text += f" (a verdict needs {MIN_UNITS})"
                    else:
                        where = "above" if lo > 0 else "below" if hi < 0 else "not told from"
                        text += f"{where} it by {d:+.2f} [{lo:+.2f}, {hi:+.2f}]"
                out.append(text)
        return ". ".join(out) + "."

    def show(self) -> viz.Group:
        """Mean shares of the model's heads beside the control's, per side, the summary and the
        table."""
        views = []
        for side, names in self.names.items():
            s = self.stats[side]
            score = np.nan_to_num(np.abs(s["mean"])).max(0)
            keep = np.sort(np.argsort(-score)[:12])
            values = np.concatenate([s["mean"][:, keep], s["control_mean"][:, keep]])
            labels = [f"L{self.layer}H{h}" for h in self.heads]
            views.append(
                viz.heatmap(
                    values,
                    row_labels=labels + [f"{x} (shuffled)" for x in labels],
                    col_labels=[names[c] for c in keep],
                    title=f"{side}-side mean share",
                    row_title="head",
                    col_title="component",
                    value_name="mean share",
                    caption=(
                        f"Mean {side}-side share over {self.rows_said()} of {self.n_prompts} "
                        "prompts (rows: the model, then the weight-shuffled control); "
                        "docs/math.md §10.6."
                    ),
                )
            )
        frame = self.to_dataframe()
        order = np.argsort(-frame["mean_share"].abs().to_numpy(), kind="stable")
        top = frame.iloc[order[:40]]
        return viz.group(
            viz.text(self.summary()),
            viz.group(*views, row=True),
            viz.table(
                top,
                caption=(
                    f"Largest mean shares, {self.level:.0%} intervals over the prompts "
                    f"(Poisson bootstrap, {self.n_boot} replicates; docs/math.md §9)"
                ),
            ),
        )


def over_prompts(
    model: Any,
    prompts: Prompt | Batch | Sequence[Prompt],
    layer: int,
    heads: int | Sequence[int] | None = None,
    *,
    positions: Any = None,
    control: bool = True,
    baseline: Baseline = "mean",
    n_boot: int = N_BOOT,
    seed: int = 0,
) -> PromptSummary:
    """Per component, its mean share across prompts with an interval, against the control.

    Each prompt's share of a component is its mean over the prompt's selected rows
    (``positions``: None for every counted row, ``"focused"`` for the rows where the head attends
    a key other than the first at least twice the row's uniform share, destination positions, or
    a bool mask; ``QKAttribution.row_mask``). The interval is over the prompts (``evidence``:
    Poisson bootstrap, expanded percentile). The control is the same model with every weight
    matrix's entries shuffled (``adapter.shuffled_weights``, seeded by ``seed``), read on its own
    selected rows; ``diff`` is the model minus the control, paired by prompt.

    Args:
        model: a TransformerLens model or a ``ModelAdapter``.
        prompts: a list of texts, token ids ``[prompts, pos]`` or a ``Batch`` (one prompt a row).
        layer: the attention layer.
        heads: a head, a list of them, or None (all).
        positions: the rows read (see above).
        control: also measure the weight-shuffled control.
        baseline: ``"mean"`` (the lift above the row's average key) or ``"none"``.
        n_boot: bootstrap replicates.
        seed: seeds the replicates and the shuffle.

    Returns:
        A ``PromptSummary``.

    Example:
        >>> from tl_dynamics import qk_attribution, testing
        >>> s = qk_attribution.over_prompts(
        ...     testing.cached_model("gpt2"), ["a b a b", "c d c d", "e f e f"], 1, heads=0, n_boot=50
        ... )
        >>> s.stats["key"]["mean"].shape == (1, len(s.names["key"]))
        True
    """
    adapter = ModelAdapter.of(model)
    layer = adapter.check_attention_layers([layer])[0]
    hs = adapter.check_heads(heads)
    check_side("key", baseline)
    positions = check_positions(positions)
    if isinstance(n_boot, bool) or not isinstance(n_boot, int) or n_boot < 1:
        raise TLDynamicsError(
            f"qk_attribution.over_prompts: n_boot must be a positive int, got {n_boot!r}"
        )
    batch = adapter.tokenize(prompts)  # type: ignore[arg-type]
    n = batch.tokens.shape[0]
    if n < 2:
        raise TLDynamicsError(
            f"qk_attribution.over_prompts: give at least 2 prompts for an interval, got {n}"
        )
    batches = [
        Batch(
            batch.tokens[i : i + PROMPTS_PER_PASS],
            batch.key_valid[i : i + PROMPTS_PER_PASS],
            batch.padding_side,
        )
        for i in range(0, n, PROMPTS_PER_PASS)
    ]
    models = [adapter] + ([shuffled_weights(adapter, seed)] if control else [])
    per: list[dict[str, np.ndarray]] = []
    for ad in models:
        with torch.no_grad():
            per.append(_per_prompt(ad, batches, layer, hs, baseline, positions))
    stats: dict[str, dict[str, np.ndarray]] = {"query": {}, "key": {}}
    used: dict[str, np.ndarray] = {}
    for side in stats:
        values = per[0][side]  # [prompt, head, component]
        mean, low, high = prompt_interval(values, n_boot, seed)
        leads, _, _ = prompt_interval(per[0][f"{side}_leads"], 1, seed)
        nan = np.full_like(mean, np.nan)
        st = dict(mean=mean, low=low, high=high, leads=leads)
        st.update(control_mean=nan, control_low=nan, control_high=nan, control_leads=nan)
        st.update(diff=nan, diff_low=nan, diff_high=nan)
        if control:
            cm, cl, ch = prompt_interval(per[1][side], n_boot, seed)
            st.update(control_mean=cm, control_low=cl, control_high=ch)
            st["control_leads"] = prompt_interval(per[1][f"{side}_leads"], 1, seed)[0]
            st["diff"], st["diff_low"], st["diff_high"] = prompt_interval(
                values - per[1][side], n_boot, seed
            )
        stats[side] = st
        used[side] = np.isfinite(values).all(-1).sum(0)
    names_of = compute(adapter, batches[0], layers=layer, heads=hs[0], pairs=False)
    return PromptSummary(
        layer=layer,
        heads=tuple(hs),
        names={"query": names_of.query_names(layer), "key": names_of.key_names(layer)},
        stats=stats,
        n_prompts=n,
        baseline=baseline,
        level=LEVEL,
        positions=positions,
        n_boot=n_boot,
        used=used,
    )
