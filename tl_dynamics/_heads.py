"""Per-head attention summaries for the report's first section, streamed one layer at a time.

Five statistics per head (row 0 of the batch, real tokens only), each a mean over destination
positions ``i`` of the pattern ``A`` (rows sum to 1; on layers with learned sinks, to 1 minus
what the sink absorbs, which the report maps on its own):

- ``previous_token``: ``A[i, i-1]`` (over ``i >= 1``);
- ``first_token``: ``A[i, 0]``, the weight on the first position (an attention sink);
- ``self``: ``A[i, i]``;
- ``entropy``: the row's entropy divided by the log of the number of positions it may attend to
  (0 = all weight on one position, 1 = uniform), over rows with at least two such positions;
- ``induction``: the weight on positions ``j`` whose previous token equals the current token
  (``x[j-1] == x[i]``, ``j <= i``), over rows where such a ``j`` exists (NaN when none does).

Beside them, ``sink_alpha`` (Gu et al. 2025, "When attention sink emerges"): ``alpha`` of the
first key, the mean of ``A[i, 0]`` over the destinations that may see it (``allowed[i, 0]``, the
first destination included); ``sink_epsilon`` is the fraction of all heads, over all layers, whose
``alpha`` exceeds ``epsilon`` (strictly; ``SINK_EPSILON = 0.3``).

Thumbnails keep every head small; full patterns are kept only for the heads singled out (the
top head of each statistic, the lowest-entropy heads, and those asked for) within a budget.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from tl_dynamics.odds_ratio import HeadStats

STATISTICS = ("previous_token", "first_token", "self", "entropy", "induction")
EXPLAINED = {
    "previous_token": "mean weight on the previous position",
    "first_token": "mean weight on the first position (an attention sink when high)",
    "self": "mean weight on the position itself",
    "entropy": "mean row entropy / log(positions it may attend to): 0 = one position, 1 = uniform",
    "induction": "mean weight on positions just after an earlier copy of the current token "
    "(not defined without repeated tokens)",
}
SINK_EPSILON = HeadStats.SINK_EPSILON  # Gu et al.'s default threshold on alpha (strict), 0.3
FULL_DETAIL_CELLS = 8_000_000  # full patterns kept: about 30 heads at 512 tokens, 7 at 1,024
THUMB_CELLS = 48


def head_statistics(
    pattern: Float[Tensor, "head pos pos"], allowed: Tensor, tokens: Tensor
) -> dict[str, Float[np.ndarray, " head"]]:
    """The five statistics of one layer's heads (see the module docstring).

    Example:
        >>> import torch
        >>> eye = torch.eye(3)[None]
        >>> head_statistics(eye, torch.tril(torch.ones(3, 3, dtype=torch.bool)),
        ...                 torch.tensor([5, 6, 5]))["self"]
        array([1.], dtype=float32)
    """
    n = pattern.shape[-1]
    idx = torch.arange(n)
    out = {
        "previous_token": pattern[:, idx[1:], idx[1:] - 1].mean(-1)
        if n > 1
        else torch.full((pattern.shape[0],), float("nan")),
        "first_token": pattern[:, :, 0].mean(-1),
        "self": pattern[:, idx, idx].mean(-1),
    }
    count = allowed.sum(-1).float()
    rows = count > 1
    entropy = torch.special.entr(pattern).sum(-1)[:, rows] / count[rows].log()
    out["entropy"] = entropy.mean(-1) if rows.any() else torch.full_like(out["self"], float("nan"))
    shifted = torch.full_like(tokens, -1)
    shifted[1:] = tokens[:-1]
    match = (shifted[None, :] == tokens[:, None]) & allowed  # [dest i, src j]: x[j-1] == x[i]
    dest, src = match.nonzero(as_tuple=True)  # few pairs: gather them instead of a full product
    per_row = torch.zeros(pattern.shape[0], n, dtype=pattern.dtype)
    per_row.index_add_(1, dest, pattern[:, dest, src])
    has = match.any(-1)
    out["induction"] = (
        per_row[:, has].mean(-1) if has.any() else torch.full_like(out["self"], float("nan"))
    )
    sees = allowed[:, 0]
    out["sink_alpha"] = (
        pattern[:, sees, 0].mean(-1) if sees.any() else torch.full_like(out["self"], float("nan"))
    )
    return {k: v.float().numpy() for k, v in out.items()}


def sink_epsilon(alpha: np.ndarray, epsilon: float = SINK_EPSILON) -> float:
    """Sink^epsilon: the fraction of heads (every entry of ``alpha``, all layers) whose first-key
    ``alpha`` exceeds ``epsilon`` strictly; heads with an undefined ``alpha`` count as not.

    Example:
        >>> sink_epsilon(np.array([[0.3, 0.31], [0.9, 0.0]]))
        0.5
    """
    alpha = np.asarray(alpha, dtype=float)
    return float((np.nan_to_num(alpha, nan=-np.inf) > epsilon).sum() / max(alpha.size, 1))


def thumbnails(
    pattern: Float[Tensor, "head pos pos"], size: int = THUMB_CELLS
) -> Float[np.ndarray, "head r c"]:
    """Max-pool each head's pattern to at most ``size`` x ``size`` cells (thin lines, such as a
    previous-token diagonal, stay visible where a mean would dilute them).

    Example:
        >>> thumbnails(torch.eye(4)[None], 2)[0]
        array([[1., 0.],
               [0., 1.]], dtype=float32)
    """
    n = pattern.shape[-1]
    if n <= size:
        return pattern.float().numpy().copy()
    pooled = torch.nn.functional.adaptive_max_pool2d(pattern.float(), (size, size))
    return pooled.numpy()


@dataclass
class HeadSummaries:
    """Everything the attention section shows, gathered layer by layer with bounded memory."""

    n_heads: int
    n_pos: int
    forced: set[tuple[int, int]] = field(default_factory=set)
    stats: dict[str, list[np.ndarray]] = field(
        default_factory=lambda: {k: [] for k in (*STATISTICS, "sink_alpha")}
    )
    thumbs: list[np.ndarray] = field(default_factory=list)
    layers: list[int] = field(default_factory=list)
    kept: dict[tuple[int, int], Tensor] = field(default_factory=dict)
    _best: dict[str, tuple[float, tuple[int, int], Tensor]] = field(default_factory=dict)
    _focused: list[tuple[float, tuple[int, int], Tensor]] = field(default_factory=list)

    @property
    def capacity(self) -> int:
        return max(1, FULL_DETAIL_CELLS // max(1, self.n_pos * self.n_pos))

    def add_layer(
        self, layer: int, pattern: Float[Tensor, "head pos pos"], allowed: Tensor, tokens: Tensor
    ) -> None:
        """Summarise one layer (``pattern`` restricted to real tokens)."""
        stats = head_statistics(pattern, allowed, tokens)
        self.layers.append(layer)
        for key, values in stats.items():
            self.stats[key].append(values)
        self.thumbs.extend(thumbnails(pattern))
        for head in range(pattern.shape[0]):
            key = (layer, head)
            if key in self.forced:
                self.kept[key] = pattern[head].clone()
            for name in ("previous_token", "first_token", "self", "induction"):
                value = float(stats[name][head])
                if np.isfinite(value) and (name not in self._best or value > self._best[name][0]):
                    self._best[name] = (value, key, pattern[head].clone())
            focus = -float(stats["entropy"][head]) if np.isfinite(stats["entropy"][head]) else -1.0
            item = (focus, key, pattern[head])
            if len(self._focused) < self.capacity:
                heapq.heappush(self._focused, (focus, key, pattern[head].clone()))
            elif item[:2] > self._focused[0][:2]:
                heapq.heapreplace(self._focused, (focus, key, pattern[head].clone()))

    def singled_out(self) -> dict[str, tuple[int, int]]:
        """The top head of each statistic (statistics defined somewhere)."""
        return {name: key for name, (_, key, _) in self._best.items()}

    def top_values(self) -> dict[str, tuple[tuple[int, int], float]]:
        """Each statistic's top head and its value (statistics defined somewhere)."""
        return {name: (key, float(value)) for name, (value, key, _) in self._best.items()}

    def full_patterns(self) -> dict[tuple[int, int], Tensor]:
        """Asked-for heads, then each statistic's top head, then the lowest-entropy heads,
        within the budget (asked-for heads are always kept)."""
        out = dict(self.kept)
        for _, key, pattern in self._best.values():
            if len(out) < max(self.capacity, len(self.kept)) or key in out:
                out.setdefault(key, pattern)
        for _, key, pattern in sorted(self._focused, reverse=True):
            if len(out) >= max(self.capacity, len(self.kept)):
                break
            out.setdefault(key, pattern)
        return out

    def matrix(self, name: str) -> Float[np.ndarray, "layer head"]:
        return np.stack(self.stats[name]) if self.stats[name] else np.zeros((0, self.n_heads))
