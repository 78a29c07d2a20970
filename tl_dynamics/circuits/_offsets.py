"""The QK circuit of a rotary head across relative offsets, summarised without forming it.

For each offset ``delta`` (query position minus key position) and the full vocabulary circuit
``M_delta = c (E W_Q + b_Q) R_delta (E W_K + b_K)^T``:

- ``mean``: the mean of all ``d_vocab^2`` entries, ``mean_q R_delta mean_k^T`` (how much the
  head prefers that offset whatever the tokens);
- ``same_token``: the mean diagonal entry (a token attending to the same token ``delta`` back);
- ``frobenius``: ``|M_delta|_F`` from ``d_head``-sized Gram matrices;
- ``positivity``: ``sum(Re lambda)/sum(|lambda|)`` of ``M_delta``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from tl_dynamics import viz
from tl_dynamics.adapter import ModelAdapter
from tl_dynamics.circuits._build import checked_head, keys, offsets_checked, queries
from tl_dynamics.circuits._circuit import positivity
from tl_dynamics.errors import TLDynamicsError

DEFAULT_OFFSETS = range(0, 32)
STATS = ("mean", "same_token", "frobenius", "positivity")
COLUMNS = {"mean": "mean_score"}  # to_dataframe: no column named like a DataFrame method


@dataclass(frozen=True)
class OffsetSummary(viz.Result):
    """Per-offset statistics of a rotary head's full QK circuit (``[len(offsets)]`` each)."""

    layer: int
    head: int
    offsets: tuple[int, ...]
    mean: Float[Tensor, " offset"]
    same_token: Float[Tensor, " offset"]
    frobenius: Float[Tensor, " offset"]
    positivity: Float[Tensor, " offset"]
    architecture: str

    def __repr__(self) -> str:
        return f"OffsetSummary(L{self.layer}H{self.head}, offsets {self.offsets[0]}..{self.offsets[-1]})"

    def to_dataframe(self):
        import pandas as pd

        return pd.DataFrame(
            dict(
                offset=list(self.offsets),
                **{COLUMNS.get(s, s): getattr(self, s).numpy() for s in STATS},
            )
        )

    def show(self) -> viz.Component:
        """Line plots of each statistic against the offset."""
        from matplotlib.figure import Figure  # imported when drawn

        fig = Figure(figsize=(3.2 * len(STATS), 2.6))
        axes = fig.subplots(1, len(STATS))
        for ax, stat in zip(axes, STATS):
            ax.plot(list(self.offsets), getattr(self, stat).numpy(), marker=".")
            ax.set_title(stat.replace("_", " "), fontsize=9)
            ax.set_xlabel("offset (query - key)", fontsize=8)
        fig.tight_layout()
        return viz.figure(
            fig, caption=f"Full QK circuit of L{self.layer}H{self.head} across rotary offsets"
        )


def offset_summary(
    model: Any,
    layer: int,
    head: int,
    offsets: int | Sequence[int] | range = DEFAULT_OFFSETS,
    biases: bool = True,
) -> OffsetSummary:
    """Summarise a rotary head's full QK circuit at each relative offset.

    For each offset ``delta`` the mean entry, the mean same-token entry, the Frobenius norm and
    the eigenvalue positivity of ``M_delta = c (E W_Q + b_Q) R_delta (E W_K + b_K)^T``, from
    ``d_head``-sized factors.

    Args:
        model: a TransformerLens model or a ``ModelAdapter`` (the layer must be rotary).
        layer: the head's layer.
        head: the head's index.
        offsets: an offset or offsets (query position minus key position, ``|delta| < n_ctx``).
        biases: include ``b_Q`` and ``b_K``.

    Returns:
        ``OffsetSummary``: ``mean``, ``same_token``, ``frobenius`` and ``positivity``, each
        ``[len(offsets)]``.

    Example:
        >>> from tl_dynamics import circuits, testing
        >>> s = circuits.offset_summary(testing.tiny_model("llama"), 0, 1, range(8))
        >>> s.to_dataframe().shape
        (8, 5)
    """
    adapter = ModelAdapter.of(model)
    layer, head = checked_head(adapter, layer, head)
    rmap = adapter.rotation(layer)
    if rmap is None:
        raise TLDynamicsError(
            f"offset_summary needs a rotary layer; layer {layer} of "
            f"{adapter.info.architecture} has none (for learned positions use "
            "qk_circuit(model, layer, head, inputs='positions'))"
        )
    offsets = offsets_checked(offsets if isinstance(offsets, int) else list(offsets), adapter.n_ctx)
    E = adapter.W_E
    q = queries(adapter, layer, head, E, biases)  # [vocab, d_head], scale included
    k = keys(adapter, layer, head, E, biases)
    gram_q, gram_k = q.T @ q, k.T @ k
    cross = q.T @ k  # sum_t q_t^T k_t, for the diagonal mean
    mean_q, mean_k = q.mean(0), k.mean(0)
    n = E.shape[0]
    stats: dict[str, list[float]] = {s: [] for s in STATS}
    for delta in offsets:
        R = rmap.matrix(delta, q.shape[-1]).to(q.device)
        stats["mean"].append(float(mean_q @ R @ mean_k))
        stats["same_token"].append(float((R * cross).sum() / n))
        stats["frobenius"].append(float(torch.trace(R.T @ gram_q @ R @ gram_k).clamp_min(0).sqrt()))
        stats["positivity"].append(float(positivity(torch.linalg.eigvals(k.T @ (q @ R)))))
    return OffsetSummary(
        layer,
        head,
        tuple(offsets),
        **{s: torch.tensor(v) for s, v in stats.items()},
        architecture=adapter.info.architecture,
    )
