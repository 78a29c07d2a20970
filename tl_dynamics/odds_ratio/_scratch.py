"""``_Scratch``: the CPU's buffers and per-key columns for one pass of ``_fast.row_facts``."""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import Tensor

# The smallest ``sum_j p_ij w_j`` the CPU's likelihood log-partition trusts (``_Scratch.lse_lik``):
# terms lost to float32 underflow (< 1.4e-45 each) are then below 1e-11 of the sum at 4,096 keys.
LIK_FLOOR = 2.0**-100


class _Scratch:
    """On the CPU, each chunk's score-sized tensors are written into buffers kept for the pass
    (``out=``): a fresh 2 MB tensor was a fresh mapping, page-faulted in at every chunk (150 us
    against 48 us for the same pass in place). Elsewhere ``get`` gives None (allocate: a GPU's
    caching allocator costs nothing, and each buffer view would be one more launch)."""

    def __init__(
        self,
        reuse: bool,
        size: int,
        like: Tensor,
        shifted_prior: Tensor,
        kv: Tensor,
        prior: Tensor | None = None,
    ):
        self.reuse, self.size, self.like = reuse, size, like
        self.buffers: dict[int, Tensor] = {}
        if reuse:  # per key w_j = exp(-(P_j - P_min)), 0 at keys not valid (``lse_lik``)
            w = torch.exp(-shifted_prior).masked_fill_(~kv, 0.0)
            self.w_col = w.view(-1, w.shape[-1], 1)
            # the prior beside it: the pattern's two per-key products in one [.., 2] product
            self.cols = torch.cat([cast(Tensor, prior).reshape(-1, w.shape[-1], 1), self.w_col], -1)

    def get(self, slot: int, shape: tuple[int, ...]) -> Tensor | None:
        if not self.reuse:
            return None
        if slot not in self.buffers:
            self.buffers[slot] = self.like.new_empty(self.size)
        return self.buffers[slot][: math.prod(shape)].view(shape)

    def vecdot(self, a: Tensor, b: Tensor) -> Tensor:
        """``linalg.vecdot`` (real: ``(a * b).sum(-1)``), its product in a buffer."""
        if not self.reuse:
            return torch.linalg.vecdot(a, b)
        return torch.mul(a, b, out=self.get(3, tuple(a.shape))).sum(-1)

    def lse_lik(
        self,
        s: Tensor,
        prior: Tensor,
        p: Tensor,
        lse: Tensor | None,
        p_min: Tensor,
        j0: int,
        j1: int,
        lik: Tensor | None = None,
        own: bool = True,
    ) -> Tensor:
        """``log sum_j A_ij exp(r_ij - P_j)`` of a chunk (``s``: its masked scores, ``p`` its
        pattern, ``lse`` its rows' log-partitions, ``p_min`` the least prior, keys ``j0 .. j1 - 1``).

        On the CPU, from the pattern by one product and no pass of exponentials:
        ``exp(r_ij - P_j) = exp(lse_i - P_min) p_ij w_j``, so the log-partition is
        ``lse_i - P_min + log sum_j p_ij w_j``, a sum of positive terms (no cancellation). Where
        a row's sum falls below ``LIK_FLOOR`` (its mass on keys whose products underflow in
        float32), the chunk takes the masked log-sum-exp of ``s - P`` instead, exact for any
        spread of the priors. Elsewhere always the latter (it needs no read of the device).
        ``own``: ``s`` may be overwritten (else a copy is)."""
        if not self.reuse or lse is None:
            return torch.logsumexp(s.sub_(prior), -1)
        b, h, c, m = p.shape
        if lik is None:
            lik = torch.bmm(p.view(-1, c, m), self.w_col[:, j0:j1]).view(b, h, c)
        if float(lik.amin()) < LIK_FLOOR:
            return self.logsumexp_((s if own else s.clone()).sub_(prior))
        return (lik.double().log_() + (lse.double() - p_min.double())).float()

    def logsumexp_(self, x: Tensor) -> Tensor:
        """``torch.logsumexp(x, -1)`` for rows with a finite maximum, overwriting ``x``: the
        same operations (``amax``, ``(x - max).exp_()``, ``sum``, ``log_``, ``add_``) in place."""
        top = x.amax(-1, keepdim=True)
        return x.sub_(top).exp_().sum(-1).log_().add_(top.squeeze(-1))


# Rows at least this long find their maximum's index from block maxima (``first_max``).
FIRST_MAX_ROWS = 512
FIRST_MAX_BLOCK = 64


def first_max(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x.max(-1, keepdim=True)``: each row's maximum and the first index holding it. On the
    CPU a reduction that keeps indices is an order of magnitude slower than one that does not;
    long rows take the maxima of blocks of ``FIRST_MAX_BLOCK`` without indices, then the first
    block holding the row's maximum, then the first index in it (the same value and index).

    Example:
        >>> x = torch.zeros(2, 600)
        >>> x[0, 70] = x[0, 500] = 1.0
        >>> [t.flatten().tolist() for t in first_max(x)]
        [[1.0, 0.0], [70, 0]]
    """
    m, block = x.shape[-1], FIRST_MAX_BLOCK
    if m < FIRST_MAX_ROWS:
        return x.max(-1, keepdim=True)
    full = m - m % block
    blocks = x[..., :full].unflatten(-1, (full // block, block)).amax(-1)
    if full < m:
        blocks = torch.cat([blocks, x[..., full:].amax(-1, keepdim=True)], -1)
    first = blocks.max(-1, keepdim=True)[1]
    idx = (first * block + torch.arange(block, device=x.device)).clamp_max_(m - 1)
    value, at = x.gather(-1, idx).max(-1, keepdim=True)
    return value, idx.gather(-1, at)
