"""``Circuit``: one head's factored circuit with its provenance, and its top-k read-out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from jaxtyping import Complex, Float, Int
from torch import Tensor
from transformer_lens import FactoredMatrix

from tl_dynamics import viz
from tl_dynamics.circuits import _topk
from tl_dynamics.circuits._labels import Vocabulary, labels
from tl_dynamics.errors import TLDynamicsError

# Rows a read-out view shows when none are named.
SHOW_ROWS = 20


def positivity(eigenvalues: Complex[Tensor, "... n"]) -> Float[Tensor, "..."]:
    """``sum(Re lambda) / sum(|lambda|)``: 1 for a positive (copying) map, -1 for a negative one.

    Example:
        >>> import torch
        >>> round(float(positivity(torch.tensor([2.0, -1.0, 0.0]).to(torch.complex64))), 6)
        0.333333
    """
    denom = eigenvalues.abs().sum(-1)
    return eigenvalues.real.sum(-1) / denom.clamp_min(torch.finfo(denom.dtype).tiny)


@dataclass(frozen=True)
class Circuit(viz.Result):
    """A head's circuit ``A @ B`` (``[rows, cols]``), never formed, with where it came from.

    Attributes:
        kind: ``"QK"``, ``"positional QK"``, ``"OV"`` or a composition path
            (``"K-composition QK"``, ``"Q-composition QK"``, ``"V-composition OV"``).
        layer, head: the head (the later head for composition paths).
        matrix: the TransformerLens ``FactoredMatrix``.
        rows, cols: what rows and columns index: ``"token"``, ``"output token"``,
            ``"position"`` or ``"input"``.
        offset: rotary query-minus-key offset, or None.
        via: earlier heads ``(layer, head)`` a composition path runs through.
        notes: what is and is not included (biases, LayerNorm, soft-cap, ...).
        key_rule: for position x position circuits, the keys each query position may attend
            to (causal, sliding window): ``topk`` and ``own_best_fraction`` rank only those, so
            a previous-token head's best key is the previous position, not a future one the
            model never sees. ``dense`` and ``entries`` stay the unmasked bilinear form.
    """

    kind: str
    layer: int
    head: int
    matrix: FactoredMatrix
    rows: str
    cols: str
    offset: int | None
    notes: tuple[str, ...]
    architecture: str
    via: tuple[tuple[int, int], ...] = ()
    vocab: Vocabulary | None = field(default=None, repr=False, compare=False)
    key_rule: _topk.KeyRule | None = None

    def __repr__(self) -> str:
        via = f" via {self.via}" if self.via else ""
        return (
            f"Circuit({self.kind} L{self.layer}H{self.head}{via}, {self.rows} x {self.cols}, "
            f"shape {tuple(self.matrix.shape)}, offset={self.offset})"
        )

    @property
    def name(self) -> str:
        via = "+".join(f"L{l}H{h}" for l, h in self.via)
        return f"{self.kind} L{self.layer}H{self.head}" + (f" via {via}" if via else "")

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.matrix.shape
        return int(rows), int(cols)

    @property
    def eigenvalues(self) -> Complex[Tensor, " d_head"]:
        """The nonzero spectrum, from the ``d_head x d_head`` factor ``B A``."""
        if self.matrix.ldim != self.matrix.rdim:
            raise TLDynamicsError(
                f"eigenvalues need a square circuit; {self.name} is "
                f"{self.matrix.ldim} x {self.matrix.rdim}"
            )
        return self.matrix.eigenvalues

    def positivity(self) -> float:
        """``sum(Re lambda)/sum(|lambda|)``: the copying score of an OV circuit."""
        return float(positivity(self.eigenvalues))

    def own_best_fraction(self, rows: Sequence[int] | Tensor | None = None) -> float:
        """Fraction of rows whose best column is themselves (e.g. a key token matching the
        query token), streamed; only allowed keys compete (``key_rule``)."""
        return _topk.own_best_fraction(self.matrix, rows, rule=self.key_rule)[0]

    def entries(
        self, rows: Sequence[int] | Tensor, cols: Sequence[int] | Tensor
    ) -> Float[Tensor, "n m"]:
        """The sub-matrix ``[rows, cols]``."""
        A, B = _topk.factors(self.matrix)
        r = _topk.row_ids(rows, A.shape[0])
        c = _topk.row_ids(cols, B.shape[1], "column")
        return A[r] @ B[:, c]

    def dense(self) -> Float[Tensor, "rows cols"]:
        """The whole product, for small circuits only (refuses vocabulary-sized ones)."""
        return _topk.dense(self.matrix)

    def topk(
        self,
        k: int = 10,
        rows: Sequence[int] | Tensor | None = None,
        bottom: bool = True,
        progress: bool = False,
    ) -> "TokenTopK":
        """Top-``k`` (and bottom-``k``) columns of each row, streamed in row chunks; on a
        positional circuit only the keys the query may attend to (``key_rule``): a row with
        fewer than ``k`` of them fills the rest with index -1 (value -inf, +inf at the bottom).

        Example:
            >>> from tl_dynamics import testing, circuits
            >>> ov = circuits.ov_circuit(testing.tiny_model("gpt2"), 0, 0)
            >>> ov.topk(5, rows=[10, 11]).to_dataframe().shape
            (20, 7)
        """
        sides = (True, False) if bottom else (True,)
        out, ids = _topk.streamed_topk(
            self.matrix, k, rows, sides, progress=progress, rule=self.key_rule
        )
        (values, indices), (low_v, low_i) = out[0], out[1] if bottom else (None, None)
        return TokenTopK(
            self.name,
            self.layer,
            self.head,
            self.rows,
            self.cols,
            ids,
            values,
            indices,
            low_v,
            low_i,
            self.notes,
            self.vocab,
            self,
        )

    def to_dataframe(self, k: int = 5, rows: Sequence[int] | Tensor | None = None):
        """Top-``k`` read-out as a long table (see ``TokenTopK.to_dataframe``)."""
        return self.topk(k, rows).to_dataframe()

    def show(self, k: int = 7, rows: Sequence[int] | Tensor | None = None) -> viz.Component:
        """circuitsvis top-k view of ``rows`` (default: the first rows)."""
        n = self.matrix.ldim
        return self.topk(k, rows if rows is not None else range(min(n, SHOW_ROWS))).show()


@dataclass(frozen=True)
class TokenTopK(viz.Result):
    """Top-k columns per row of a circuit: e.g. the key tokens each query token attends to most
    (QK), or the output tokens each source token promotes most (OV)."""

    circuit: str
    layer: int
    head: int
    rows_space: str
    cols_space: str
    rows: Int[Tensor, " n"]
    values: Float[Tensor, "n k"]
    indices: Int[Tensor, "n k"]
    bottom_values: Float[Tensor, "n k"] | None
    bottom_indices: Int[Tensor, "n k"] | None
    notes: tuple[str, ...]
    vocab: Vocabulary | None = field(default=None, repr=False, compare=False)
    source: Circuit | None = field(default=None, repr=False, compare=False)

    def __repr__(self) -> str:
        return f"TokenTopK({self.circuit}: {len(self.rows)} rows, k={self.values.shape[1]})"

    def to_dataframe(self):
        """One line per (row, rank, side): ``row``, ``row_label``, ``side`` (top/bottom),
        ``top_rank`` (0: the largest), ``col``, ``col_label``, ``value``; masked slots (index -1) are left out."""
        import pandas as pd

        frames = []
        sides = [("top", self.values, self.indices)]
        if self.bottom_values is not None and self.bottom_indices is not None:
            sides.append(("bottom", self.bottom_values, self.bottom_indices))
        row_labels = labels(self.rows_space, self.rows, self.vocab)
        for side, vals, idx in sides:
            n, k = idx.shape
            frames.append(
                pd.DataFrame(
                    {
                        "row": self.rows.repeat_interleave(k).numpy(),
                        "row_label": [lab for lab in row_labels for _ in range(k)],
                        "side": side,
                        "top_rank": torch.arange(k).repeat(n).numpy(),
                        "col": idx.reshape(-1).numpy(),
                        "col_label": labels(self.cols_space, idx.reshape(-1), self.vocab),
                        "value": vals.reshape(-1).numpy(),
                    }
                )
            )
        frame = pd.concat(frames, ignore_index=True)
        frame = frame[frame["col"] >= 0].reset_index(drop=True)
        frame.attrs.update(circuit=self.circuit, layer=self.layer, head=self.head)
        return frame

    def show(self, max_rows: int = 50) -> viz.Component:
        """circuitsvis ``TopkTokens``: one sample per row (selectable by its label), its top and
        bottom columns with their values."""
        n = min(len(self.rows), max_rows)
        samples, activations = [], []
        for r in range(n):
            cols = self.indices[r]
            if self.bottom_indices is not None:
                cols = torch.cat([cols, self.bottom_indices[r]])
            cols = torch.unique(cols)
            cols = cols[cols >= 0]
            vals = self._row_values(r, cols)
            samples.append(labels(self.cols_space, cols, self.vocab))
            activations.append(vals[None, :, None])
        row_labels = [
            f"{self.rows_space} {i}: {lab!r}"
            for i, lab in zip(
                self.rows[:n].tolist(), labels(self.rows_space, self.rows[:n], self.vocab)
            )
        ]
        return viz.topk_tokens(
            samples,
            activations,
            max_k=self.values.shape[1],
            first_dimension_name="Head",
            third_dimension_name="Row",
            sample_labels=row_labels,
            caption=f"{self.circuit}: top and bottom {self.cols_space}s per {self.rows_space}",
        )

    def _row_values(self, r: int, cols: Tensor) -> Tensor:
        if self.source is not None:
            return self.source.entries([int(self.rows[r])], cols)[0].cpu()
        merged = {int(i): float(v) for i, v in zip(self.indices[r], self.values[r])}
        if self.bottom_indices is not None and self.bottom_values is not None:
            merged.update(
                {int(i): float(v) for i, v in zip(self.bottom_indices[r], self.bottom_values[r])}
            )
        return torch.tensor([merged[int(c)] for c in cols])
