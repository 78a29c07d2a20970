"""``_Scratch``: the CPU's buffers and per-key columns for one pass of ``_fast.row_facts``."""

from __future__ import annotations

import math

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
            self.cols = torch.cat([prior.reshape(-1, w.shape[-1], 1), self.w_col], -1)

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
    ) -> Tensor:
        """``log sum_j A_ij exp(r_ij - P_j)`` of a chunk (``s``: its masked scores, ``p`` its
        pattern, ``lse`` its rows' log-partitions, ``p_min`` the least prior, keys ``j0 .. j1 - 1``).

        On the CPU, from the pattern by one product and no pass of exponentials:
        ``exp(r_ij - P_j) = exp(lse_i - P_min) p_ij w_j``, so the log-partition is
        ``lse_i - P_min + log sum_j p_ij w_j``, a sum of positive terms (no cancellation). Where
        a row's sum falls below ``LIK_FLOOR`` (its mass on keys whose products underflow in
        float32), the chunk takes the masked log-sum-exp of ``s - P`` instead, exact for any
        spread of the priors. Elsewhere always the latter (it needs no read of the device)."""
        if not self.reuse or lse is None:
            return torch.logsumexp(s.sub_(prior), -1)
        b, h, c, m = p.shape
        if lik is None:
            lik = torch.bmm(p.view(-1, c, m), self.w_col[:, j0:j1]).view(b, h, c)
        if float(lik.amin()) < LIK_FLOOR:
            return self.logsumexp_(s.sub_(prior))
        return (lik.double().log_() + (lse.double() - p_min.double())).float()

    def logsumexp_(self, x: Tensor) -> Tensor:
        """``torch.logsumexp(x, -1)`` for rows with a finite maximum, overwriting ``x``: the
        same operations (``amax``, ``(x - max).exp_()``, ``sum``, ``log_``, ``add_``) in place."""
        top = x.amax(-1, keepdim=True)
        return x.sub_(top).exp_().sum(-1).log_().add_(top.squeeze(-1))
