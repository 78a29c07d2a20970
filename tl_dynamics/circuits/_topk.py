"""Row-wise read-outs of a factored ``[n_rows, n_cols]`` circuit, streamed in row chunks.

The product ``A @ B`` of a vocabulary circuit is ``d_vocab x d_vocab`` (2.5e9 entries for
GPT-2): it is never formed. Rows are taken ``chunk`` at a time, so at most ``chunk_elements``
entries of the product exist at once.
"""

from __future__ import annotations

from typing import Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor
from tqdm.auto import tqdm

from tl_dynamics.errors import TLDynamicsError

# Entries of the product alive at once: 2**20 float32 = 4 MiB, small enough to stay in cache
# (the product has an inner width of only d_head, so writing it out costs more than computing it;
# 4 MiB chunks were ~20% faster than 32 MiB ones on the benchmark's CPU).
CHUNK_ELEMENTS = 2 ** 20
# Largest product ``dense`` agrees to build: 2**26 float32 = 256 MiB.
DENSE_LIMIT = 2 ** 26


def factors(matrix) -> tuple[Tensor, Tensor]:
    """``(A, B)`` of a 2-d ``FactoredMatrix`` (a circuit of one head)."""
    A, B = matrix.A, matrix.B
    if A.ndim != 2 or B.ndim != 2:
        raise TLDynamicsError(f"expected the factored circuit of one head (2-d factors), got "
                              f"A {tuple(A.shape)} and B {tuple(B.shape)}")
    return A, B


def row_ids(rows: Sequence[int] | Tensor | None, n_rows: int, what: str = "row") -> Int[Tensor, " n"]:
    """Validated row indices (all rows when None)."""
    if rows is None:
        return torch.arange(n_rows)
    ids = torch.as_tensor(rows).reshape(-1)
    if ids.numel() == 0 or ids.is_floating_point() or ids.dtype == torch.bool:
        raise TLDynamicsError(f"{what}s must be a non-empty list of integer indices, got {rows!r}")
    bad = ids[(ids < 0) | (ids >= n_rows)]
    if bad.numel():
        raise TLDynamicsError(f"{what} indices {bad.tolist()[:5]} are out of range "
                              f"(valid: 0..{n_rows - 1})")
    return ids.long()


def chunk_rows(n_cols: int, chunk_elements: int = CHUNK_ELEMENTS) -> int:
    return max(1, int(chunk_elements) // max(1, n_cols))


def topk_rows(matrix, k: int, rows: Sequence[int] | Tensor | None = None, largest: bool = True,
              chunk_elements: int = CHUNK_ELEMENTS, progress: bool = False
              ) -> tuple[Float[Tensor, "n k"], Int[Tensor, "n k"], Int[Tensor, " n"]]:
    """Top-``k`` columns of each row of ``A @ B`` without forming it.

    Returns ``(values, indices, rows)``; ``largest=False`` gives the most negative entries.

    Example:
        >>> import torch
        >>> from transformer_lens import FactoredMatrix
        >>> m = FactoredMatrix(torch.eye(3), torch.tensor([[1., 3, 2], [0, 0, 5], [4, 1, 0]]))
        >>> topk_rows(m, 1)[1].flatten().tolist()
        [1, 2, 0]
    """
    out, ids = streamed_topk(matrix, k, rows, (largest,), chunk_elements, progress)
    return out[0][0], out[0][1], ids


def streamed_topk(matrix, k: int, rows: Sequence[int] | Tensor | None, sides: Sequence[bool],
                  chunk_elements: int = CHUNK_ELEMENTS, progress: bool = False
                  ) -> tuple[list[tuple[Tensor, Tensor]], Tensor]:
    """One pass over the row chunks, keeping the top-``k`` (``True``) and/or bottom-``k``
    (``False``) columns of each row: ``([(values, indices) per side], rows)``."""
    A, B = factors(matrix)
    n_cols = B.shape[1]
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= n_cols:
        raise TLDynamicsError(f"k={k!r} is not a valid number of columns to keep: "
                              f"valid is 1..{n_cols}")
    ids = row_ids(rows, A.shape[0])
    step = chunk_rows(n_cols, chunk_elements)
    kept: list[list[tuple[Tensor, Tensor]]] = [[] for _ in sides]
    starts = range(0, len(ids), step)
    for start in tqdm(starts, desc="top-k rows", disable=not progress or len(starts) < 2, leave=False):
        block = A[ids[start:start + step].to(A.device)] @ B
        for store, largest in zip(kept, sides):
            store.append(block.topk(k, dim=1, largest=largest))
        del block
    return [(torch.cat([v for v, _ in s]).cpu(), torch.cat([i for _, i in s]).cpu()) for s in kept], ids


def argmax_rows(matrix, rows: Sequence[int] | Tensor | None = None,
                chunk_elements: int = CHUNK_ELEMENTS) -> tuple[Int[Tensor, " n"], Int[Tensor, " n"]]:
    """Best column of each row, streamed: ``(best, rows)``."""
    values, indices, ids = topk_rows(matrix, 1, rows, True, chunk_elements)
    return indices[:, 0], ids


def own_best_fraction(matrix, rows: Sequence[int] | Tensor | None = None,
                      chunk_elements: int = CHUNK_ELEMENTS) -> tuple[float, Int[Tensor, " n"], Int[Tensor, " n"]]:
    """Fraction of rows whose best column is the row's own index (square circuits):
    ``(fraction, best, rows)``."""
    A, B = factors(matrix)
    if A.shape[0] != B.shape[1]:
        raise TLDynamicsError(f"own-best fraction needs a square circuit (rows and columns over "
                              f"the same tokens), got {A.shape[0]} rows x {B.shape[1]} columns")
    best, ids = argmax_rows(matrix, rows, chunk_elements)
    return float((best == ids).float().mean()), best, ids


def dense(matrix, limit: int = DENSE_LIMIT) -> Float[Tensor, "rows cols"]:
    """The product ``A @ B``, for small circuits only (at most ``limit`` entries)."""
    A, B = factors(matrix)
    n = A.shape[0] * B.shape[1]
    if n > limit:
        raise TLDynamicsError(f"refusing to form a {A.shape[0]} x {B.shape[1]} circuit ({n:,} "
                              f"entries > limit {limit:,}); use top-k read-outs, or index rows "
                              "first")
    return A @ B
