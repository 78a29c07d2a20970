"""Rows of ``S`` as barycentric coordinates over the per-source outputs ``o_j = v_j W_O``
(docs/math.md §2.5).

For query ``i`` of one head the output is ``sum_j S_ij o_j``. Given a target ``y_i`` (default
the next token's unembedding column ``W_U[:, t_{i+1}]``) the best coordinates are
``A_i = argmin_{A in simplex} |sum_j A_j o_j - y_i|^2`` over the keys ``i`` may attend to, and
the gap between the head's own coordinates and the best ones is
``(S_i - A_i)^T G (S_i - A_i) = |sum_j (S_ij - A_ij) o_j|^2`` with ``G_jk = <o_j, o_k>``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Union

import pandas as pd
import torch
from jaxtyping import Float
from torch import Tensor

from tl_dynamics import viz
from tl_dynamics.adapter import Batch, ModelAdapter, Prompt
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.odds_ratio._simplex import simplex_lstsq

Target = Union[Literal["unembed", "embed"], Tensor]


@dataclass(frozen=True)
class BarycentricView(viz.Result):
    """Per query row ``i`` (real positions that have a target): the head's coordinates
    ``S[i]``, the best simplex coordinates ``A[i]``, the gap ``(S-A)^T G (S-A)``, the fit error
    ``|O^T A - y|^2``, the head's own error ``|O^T S - y|^2`` and the solver's KKT residual.
    On a layer with learned sinks the simplex has one more vertex, the virtual key's output 0
    (docs/math.md §2.6): ``S_sink`` and ``A_sink`` are its coordinates (None elsewhere)."""

    layer: int
    head: int
    target: str
    tokens: tuple[str, ...]
    rows: tuple[int, ...]
    S: Float[Tensor, "row pos"]
    A: Float[Tensor, "row pos"]
    gap: Float[Tensor, " row"]
    fit_error: Float[Tensor, " row"]
    head_error: Float[Tensor, " row"]
    kkt: Float[Tensor, " row"]
    S_sink: Float[Tensor, " row"] | None = None
    A_sink: Float[Tensor, " row"] | None = None

    def to_dataframe(self) -> pd.DataFrame:
        return pd.DataFrame(
            {
                "position": list(self.rows),
                "token": [self.tokens[i] for i in self.rows],
                "gap": self.gap.tolist(),
                "fit_error": self.fit_error.tolist(),
                "head_error": self.head_error.tolist(),
                "kkt": self.kkt.tolist(),
                "A_support": (self.A > 0).sum(-1).tolist(),
            }
        )

    def show(self) -> Any:
        """The head's coordinates beside the best simplex coordinates, and the gap per token."""
        from tl_dynamics import viz

        n = len(self.tokens)
        grid = torch.zeros(2, n, n)
        rows = list(self.rows)
        grid[0, rows] = self.S.float()
        grid[1, rows] = self.A.float()
        gap = torch.zeros(n)
        gap[rows] = self.gap.float()
        name = f"L{self.layer}H{self.head}"
        return viz.group(
            viz.attention_heads(
                grid,
                list(self.tokens),
                [f"{name} S (head)", f"{name} A (best)"],
                caption=f"{name}: attention rows vs the simplex least-squares "
                f"coordinates for target '{self.target}'",
            ),
            viz.colored_tokens(
                list(self.tokens), gap, caption=f"{name}: gap (S-A)^T G (S-A) per query"
            ),
            caption=f"Barycentric view of {name}",
        )


def barycentric(
    model: Any,
    prompt: Prompt | Batch,
    layer: int,
    head: int,
    target: Target = "unembed",
    row: int = 0,
) -> BarycentricView:
    """Barycentric coordinates of one head's rows against a target vector per query.

    For each query the simplex weights over its allowed sources whose mix of the head's
    per-source outputs comes closest to the target, beside the head's own pattern (its actual
    mix). ``target``: ``"unembed"`` (``W_U[:, t_{i+1}]``), ``"embed"`` (``W_E[t_{i+1}]``), a
    vector ``[d_model]`` used for every query, or ``[pos, d_model]`` (one per query). With
    next-token targets the last position has none and is skipped.

    Args:
        model: a TransformerLens model or a ``ModelAdapter``.
        prompt: text, a list of texts, ``[batch, pos]`` token ids or a ``Batch``.
        layer: the head's layer.
        head: the head's index.
        target: ``"unembed"``, ``"embed"``, or a ``[d_model]`` / ``[pos, d_model]`` tensor.
        row: which prompt of the batch.

    Returns:
        ``BarycentricView``: per analysed query the pattern ``S`` and the best coordinates ``A``
        (``[rows, pos]``), their ``gap``, ``fit_error``, ``head_error`` and the optimality check
        ``kkt`` (``[rows]``).

    Example:
        >>> from tl_dynamics import odds_ratio, testing
        >>> view = odds_ratio.barycentric(testing.tiny_model("gpt2"), "x = 1 + 2", 1, 0)
        >>> float(view.kkt.max()) < 1e-6  # the coordinates are optimal
        True
    """

    adapter = ModelAdapter.of(model)
    adapter.check_layer(layer)
    adapter.check_head(head, layer)
    batch = adapter.tokenize(prompt)
    if not 0 <= row < batch.tokens.shape[0]:
        raise TLDynamicsError(
            f"row {row!r} is out of range: the batch has {batch.tokens.shape[0]} "
            f"prompts (valid: 0..{batch.tokens.shape[0] - 1})"
        )
    la = adapter.attention(batch, layers=[layer], sinks=True)[layer]
    sunk = la.sink_logit is not None  # the learned sink: one more vertex, at the origin
    pattern = la.pattern([head])[row, 0].double().cpu()  # the simplex solver works on the CPU
    outputs = la.source_outputs([head])[row, :, 0].double().cpu()  # [pos, d_model]
    tokens = batch.tokens[row]
    valid = batch.key_valid[row]
    positions = torch.nonzero(valid).flatten().tolist()
    targets, label = _targets(adapter, target, tokens, positions)
    S_rows, A_rows, gaps, fits, errs, kkts, rows = [], [], [], [], [], [], []
    S_sink, A_sink = [], []
    for i in positions:
        y = targets.get(i)
        if y is None or not bool(la.query_valid[row, i]):
            continue
        keys = torch.nonzero(la.allowed[row, i]).flatten().cpu()
        O = outputs[keys]  # [n, d_model]
        sol = simplex_lstsq((torch.cat([O, O.new_zeros(1, O.shape[1])]) if sunk else O).T, y)
        coords = torch.from_numpy(sol.coords)
        a = torch.zeros_like(pattern[i])
        a[keys] = coords[: len(keys)]
        if sunk:
            A_sink.append(float(coords[-1]))
            S_sink.append(float(1.0 - pattern[i, keys].sum()))
        diff = (pattern[i, keys] - a[keys]) @ O
        S_rows.append(pattern[i])
        A_rows.append(a)
        gaps.append(float(diff @ diff))
        fits.append(sol.objective)
        err = pattern[i, keys] @ O - y
        errs.append(float(err @ err))
        kkts.append(sol.kkt)
        rows.append(i)
    if not rows:
        raise TLDynamicsError(
            "no query position has a target: a next-token target needs a prompt "
            "of at least two tokens"
        )
    return BarycentricView(
        layer=layer,
        head=head,
        target=label,
        tokens=tuple(adapter.str_tokens(batch, row)),
        rows=tuple(rows),
        S=torch.stack(S_rows),
        A=torch.stack(A_rows),
        gap=torch.tensor(gaps),
        fit_error=torch.tensor(fits),
        head_error=torch.tensor(errs),
        kkt=torch.tensor(kkts),
        S_sink=torch.tensor(S_sink, dtype=torch.float64) if sunk else None,
        A_sink=torch.tensor(A_sink, dtype=torch.float64) if sunk else None,
    )


def _targets(
    adapter: Any, target: Target, tokens: Tensor, positions: list[int]
) -> tuple[dict[int, Tensor], str]:
    if isinstance(target, Tensor):
        t = target.detach().double().cpu()
        if t.shape == (adapter.d_model,):
            return {i: t for i in positions}, "vector"
        if t.ndim == 2 and t.shape[1] == adapter.d_model and t.shape[0] == tokens.shape[0]:
            return {i: t[i] for i in positions}, "vectors"
        raise TLDynamicsError(
            f"target tensor must be [d_model={adapter.d_model}] or [pos="
            f"{tokens.shape[0]}, d_model]; got {tuple(t.shape)}"
        )
    if target == "unembed":
        table = adapter.W_U.T
    elif target == "embed":
        table = adapter.W_E
    else:
        raise TLDynamicsError(f"unknown target {target!r}; valid: 'unembed', 'embed', or a tensor")
    out = {i: table[int(tokens[j])].double().cpu() for i, j in zip(positions, positions[1:])}
    return out, f"{target} of next token"
