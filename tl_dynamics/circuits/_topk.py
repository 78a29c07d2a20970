"""Row-wise read-outs of a factored ``[n_rows, n_cols]`` circuit, streamed in row chunks.

The product ``A @ B`` of a vocabulary circuit is ``d_vocab x d_vocab`` (2.5e9 entries for
GPT-2): it is never formed. Rows are taken ``chunk`` at a time, so at most ``chunk_elements``
entries of the product exist at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from tl_dynamics.errors import TLDynamicsError

# Entries of the product alive at once: 2**20 float32 = 4 MiB, small enough to stay in cache
# (the product has an inner width of only d_head, so writing it out costs more than computing it;
# 4 MiB chunks were ~20% faster than 32 MiB ones on the benchmark's CPU).
CHUNK_ELEMENTS = 2**20
# Largest product ``dense`` agrees to build: 2**26 float32 = 256 MiB.
DENSE_LIMIT = 2**26


@dataclass(frozen=True)
class KeyRule:
    """Which key positions a query position may attend to, as the model masks them: causal
    (``j <= i``) and a sliding window ``w`` (``j > i - w``; two-sided, ``|i - j| < w``, when not
    causal), the adapter's ``allowed`` rule for a
    layer (docs/math.md §1). Positional read-outs rank only allowed keys.

    Example:
        >>> import torch
        >>> KeyRule(causal=True, window=2).allowed(torch.tensor([0, 3]), 4).int().tolist()
        [[1, 0, 0, 0], [0, 0, 1, 1]]
    """

    causal: bool
    window: int | None = None

    def allowed(self, rows: Int[Tensor, " n"], n_cols: int) -> Bool[Tensor, "n cols"]:
        i = rows.reshape(-1, 1).long()
        j = torch.arange(n_cols, device=rows.device)[None, :]
        ok = torch.ones(len(i), n_cols, dtype=torch.bool, device=rows.device)
        if self.causal:
            ok = ok & (j <= i)
        if self.window is not None:
            ok = ok & (j > i - self.window)
            if not self.causal:  # bidirectional: two-sided window, |i - j| < w
                ok = ok & (j < i + self.window)
        return ok

    @property
    def masks(self) -> bool:
        return self.causal or self.window is not None


def factors(matrix) -> tuple[Tensor, Tensor]:
    """``(A, B)`` of a 2-d ``FactoredMatrix`` (a circuit of one head)."""
    A, B = matrix.A, matrix.B
    if A.ndim != 2 or B.ndim != 2:
        raise TLDynamicsError(
            f"expected the factored circuit of one head (2-d factors), got "
            f"A {tuple(A.shape)} and B {tuple(B.shape)}"
        )
    return A, B


def row_ids(
    rows: Sequence[int] | Tensor | None, n_rows: int, what: str = "row"
) -> Int[Tensor, " n"]:
    """Validated row indices (all rows when None)."""
    if rows is None:
        return torch.arange(n_rows)
    ids = torch.as_tensor(rows).reshape(-1).cpu()  # indices stay on the CPU; chunks move
    if ids.numel() == 0 or ids.is_floating_point() or ids.dtype == torch.bool:
        raise TLDynamicsError(f"{what}s must be a non-empty list of integer indices, got {rows!r}")
    bad = ids[(ids < 0) | (ids >= n_rows)]
    if bad.numel():
        raise TLDynamicsError(
            f"{what} indices {bad.tolist()[:5]} are out of range (valid: 0..{n_rows - 1})"
        )
    return ids.long()


def chunk_rows(n_cols: int, chunk_elements: int = CHUNK_ELEMENTS) -> int:
    return max(1, int(chunk_elements) // max(1, n_cols))


def topk_rows(
    matrix,
    k: int,
    rows: Sequence[int] | Tensor | None = None,
    largest: bool = True,
    chunk_elements: int = CHUNK_ELEMENTS,
    progress: bool = False,
    rule: KeyRule | None = None,
) -> tuple[Float[Tensor, "n k"], Int[Tensor, "n k"], Int[Tensor, " n"]]:
    """Top-``k`` columns of each row of ``A @ B`` without forming it.

    Returns ``(values, indices, rows)``; ``largest=False`` gives the most negative entries.
    With a ``rule``, only allowed columns rank; a row with fewer than ``k`` allowed columns
    fills the rest with index ``-1`` and value ``-inf`` (``+inf`` for the bottom side).

    Example:
        >>> import torch
        >>> from transformer_lens import FactoredMatrix
        >>> m = FactoredMatrix(torch.eye(3), torch.tensor([[1., 3, 2], [0, 0, 5], [4, 1, 0]]))
        >>> topk_rows(m, 1)[1].flatten().tolist()
        [1, 2, 0]
    """
    out, ids = streamed_topk(matrix, k, rows, (largest,), chunk_elements, progress, rule)
    return out[0][0], out[0][1], ids


def _masked_topk(block: Tensor, k: int, largest: bool, ok: Tensor | None) -> tuple[Tensor, Tensor]:
    if ok is None:
        return block.topk(k, dim=1, largest=largest)
    fill = float("-inf") if largest else float("inf")
    values, indices = block.masked_fill(~ok, fill).topk(k, dim=1, largest=largest)
    return values, indices.masked_fill(~ok.gather(1, indices), -1)


def streamed_topk(
    matrix,
    k: int,
    rows: Sequence[int] | Tensor | None,
    sides: Sequence[bool],
    chunk_elements: int = CHUNK_ELEMENTS,
    progress: bool = False,
    rule: KeyRule | None = None,
) -> tuple[list[tuple[Tensor, Tensor]], Tensor]:
    """One pass over the row chunks, keeping the top-``k`` (``True``) and/or bottom-``k``
    (``False``) columns of each row: ``([(values, indices) per side], rows)``; with a ``rule``
    only the columns it allows (see ``topk_rows``)."""
    A, B = factors(matrix)
    n_cols = B.shape[1]
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= n_cols:
        raise TLDynamicsError(
            f"k={k!r} is not a valid number of columns to keep: valid is 1..{n_cols}"
        )
    ids = row_ids(rows, A.shape[0])
    step = chunk_rows(n_cols, chunk_elements)
    kept: list[list[tuple[Tensor, Tensor]]] = [[] for _ in sides]
    starts = range(0, len(ids), step)
    for start in tqdm(
        starts, desc="top-k rows", disable=not progress or len(starts) < 2, leave=False
    ):
        chunk = ids[start : start + step].to(A.device)
        block = A[chunk] @ B
        ok = rule.allowed(chunk, n_cols) if rule is not None and rule.masks else None
        for store, largest in zip(kept, sides):
            store.append(_masked_topk(block, k, largest, ok))
        del block
    return [
        (torch.cat([v for v, _ in s]).cpu(), torch.cat([i for _, i in s]).cpu()) for s in kept
    ], ids


def argmax_rows(
    matrix,
    rows: Sequence[int] | Tensor | None = None,
    chunk_elements: int = CHUNK_ELEMENTS,
    rule: KeyRule | None = None,
) -> tuple[Int[Tensor, " n"], Int[Tensor, " n"]]:
    """Best (allowed) column of each row, streamed: ``(best, rows)``."""
    values, indices, ids = topk_rows(matrix, 1, rows, True, chunk_elements, rule=rule)
    return indices[:, 0], ids


def own_best_fraction(
    matrix,
    rows: Sequence[int] | Tensor | None = None,
    chunk_elements: int = CHUNK_ELEMENTS,
    rule: KeyRule | None = None,
) -> tuple[float, Int[Tensor, " n"], Int[Tensor, " n"]]:
    """Fraction of rows whose best column is the row's own index (square circuits):
    ``(fraction, best, rows)``."""
    A, B = factors(matrix)
    if A.shape[0] != B.shape[1]:
        raise TLDynamicsError(
            f"own-best fraction needs a square circuit (rows and columns over "
            f"the same tokens), got {A.shape[0]} rows x {B.shape[1]} columns"
        )
    best, ids = argmax_rows(matrix, rows, chunk_elements, rule)
    return float((best == ids).float().mean()), best, ids


def dense(matrix, limit: int = DENSE_LIMIT) -> Float[Tensor, "rows cols"]:
    """The product ``A @ B``, for small circuits only (at most ``limit`` entries)."""
    A, B = factors(matrix)
    n = A.shape[0] * B.shape[1]
    if n > limit:
        raise TLDynamicsError(
            f"refusing to form a {A.shape[0]} x {B.shape[1]} circuit ({n:,} "
            f"entries > limit {limit:,}); use top-k read-outs, or index rows "
            "first"
        )
    return A @ B
