"""``over_prompts``: per component, its mean share across prompts with a bootstrap interval,
beside the same on the weight-shuffled control (docs/math.md §10.6)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import pandas as pd
import torch

from tl_dynamics import viz
from tl_dynamics.adapter import Batch, ModelAdapter, Prompt, shuffled_weights
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.qk_attribution._collect import compute
from tl_dynamics.qk_attribution._result import Baseline, check_side

LEVEL = 0.95
PROMPTS_PER_PASS = 8

# to_dataframe's column names where a statistic's own name is a DataFrame attribute
_COLUMN = {"mean": "mean_share", "control_mean": "control_mean_share"}


def bootstrap_interval(
    values: np.ndarray, n_boot: int, seed: int, level: float = LEVEL
) -> tuple[np.ndarray, np.ndarray]:
    """The percentile bootstrap interval of the mean over axis 0 (the prompts).

    The one place an interval is formed here, so that a shared evidence layer can replace it.

    Args:
        values: ``[prompts, ...]``.
        n_boot: Resamples.
        seed: Seeds the resampling.
        level: The interval's coverage.

    Returns:
        ``(low, high)``, each ``values.shape[1:]``.
    """
    n = values.shape[0]
    if n == 0:
        nan = np.full(values.shape[1:], np.nan)
        return nan, nan
    idx = np.random.default_rng(seed).integers(0, n, size=(n_boot, n))
    means = values[idx].mean(1)
    tail = (1.0 - level) / 2.0
    return np.quantile(means, tail, axis=0), np.quantile(means, 1.0 - tail, axis=0)


def _per_prompt(
    adapter: ModelAdapter, batches: list[Batch], layer: int, heads: list[int], baseline: Baseline
) -> dict[str, np.ndarray]:
    """``[prompts, heads, components]`` mean share per side (prompts without counted rows
    dropped per head: NaN)."""
    out: dict[str, list[np.ndarray]] = {"query": [], "key": []}
    for batch in batches:
        res = compute(adapter, batch, layers=layer, heads=heads)
        for side in ("query", "key"):
            per_head = []
            for h in heads:
                share = res.shares(layer, h, side, baseline)  # [b, pos, n]
                counted: np.ndarray = np.asarray(np.isfinite(share).all(-1))
                sums = np.where(counted[..., None], share, 0.0).sum(1)
                n = counted.sum(1)[:, None]
                with np.errstate(invalid="ignore", divide="ignore"):
                    per_head.append(np.where(n > 0, sums / np.maximum(n, 1), np.nan))
            out[side].append(np.stack(per_head, 1))
    return {side: np.concatenate(v) for side, v in out.items()}


@dataclass(frozen=True)
class PromptSummary(viz.Result):
    """Per head, side and component: the mean share across prompts with its interval, on the
    model and on the weight-shuffled control (``control_*`` NaN without one)."""

    layer: int
    heads: tuple[int, ...]
    names: dict[str, tuple[str, ...]]
    stats: dict[str, dict[str, np.ndarray]]  # side -> {mean, low, high, control_mean, ...}
    n_prompts: int
    baseline: str
    level: float

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

    def show(self) -> viz.Group:
        """Mean shares of the model's heads beside the control's, per side, and the table."""
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
                        f"Mean {side}-side share over {self.n_prompts} prompts (rows: the model, "
                        "then the weight-shuffled control); docs/math.md §10.6."
                    ),
                )
            )
        frame = self.to_dataframe()
        order = np.argsort(-frame["mean_share"].abs().to_numpy(), kind="stable")
        top = frame.iloc[order[:40]]
        return viz.group(
            viz.group(*views, row=True),
            viz.table(top, caption=f"Largest mean shares, {self.level:.0%} bootstrap intervals"),
        )


def over_prompts(
    model: Any,
    prompts: Prompt | Batch | Sequence[Prompt],
    layer: int,
    heads: int | Sequence[int] | None = None,
    *,
    control: bool = True,
    baseline: Baseline = "mean",
    n_boot: int = 1000,
    seed: int = 0,
) -> PromptSummary:
    """Per component, its mean share across prompts with an interval, against the control.

    Each prompt's share of a component is its mean over the prompt's counted rows
    (``QKAttribution.shares``); the interval is a percentile bootstrap over prompts
    (``bootstrap_interval``). The control is the same model with every weight matrix's entries
    shuffled (``adapter.shuffled_weights``, seeded by ``seed``).

    Args:
        model: a TransformerLens model or a ``ModelAdapter``.
        prompts: a list of texts, token ids ``[prompts, pos]`` or a ``Batch`` (one prompt a row).
        layer: the attention layer.
        heads: a head, a list of them, or None (all).
        control: also measure the weight-shuffled control.
        baseline: ``"mean"`` (the lift above the row's average key) or ``"none"``.
        n_boot: bootstrap resamples.
        seed: seeds the resampling and the shuffle.

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
    stats: dict[str, dict[str, np.ndarray]] = {"query": {}, "key": {}}
    for which, ad in zip(("", "control_"), models):
        with torch.no_grad():
            per = _per_prompt(ad, batches, layer, hs, baseline)
        for side, values in per.items():
            mean = np.nanmean(values, 0)
            lows, highs = [], []
            for j in range(len(hs)):
                kept = values[:, j][np.isfinite(values[:, j]).all(-1)]
                low, high = bootstrap_interval(kept, n_boot, seed)
                lows.append(low)
                highs.append(high)
            stats[side].update(
                {
                    f"{which}mean": mean,
                    f"{which}low": np.stack(lows),
                    f"{which}high": np.stack(highs),
                }
            )
    if not control:
        for side in stats:
            for k in ("mean", "low", "high"):
                stats[side][f"control_{k}"] = np.full_like(stats[side][k], np.nan)
    names_of = compute(adapter, batches[0], layers=layer, heads=hs[0])
    return PromptSummary(
        layer=layer,
        heads=tuple(hs),
        names={"query": names_of.query_names(layer), "key": names_of.key_names(layer)},
        stats=stats,
        n_prompts=n,
        baseline=baseline,
        level=LEVEL,
    )
