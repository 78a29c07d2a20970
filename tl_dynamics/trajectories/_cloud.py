"""The token cloud at one trajectory point: standardisation, cosine histograms, effective rank.

Pure tensor functions (no model); unit vectors, cosines and clusters come from
``tl_dynamics.sphere``. Every function takes the valid-token mask ``mask [batch, pos]`` so
padded rows never count.
"""

from __future__ import annotations

import struct

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from tl_dynamics.collect import Collector, torch_threads
from tl_dynamics.sphere import NORM_FLOOR

N_BINS = 40
"""Pairwise-cosine histograms use ``N_BINS`` equal bins on ``[-1, 1]`` (width 0.05), the same
for every layer and model, so histograms are comparable and merge by adding counts."""
BIN_EDGES = torch.linspace(-1.0, 1.0, N_BINS + 1, dtype=torch.float64)


def standardize_prompt(
    z: Float[Tensor, "batch pos d"], mask: Bool[Tensor, "batch pos"]
) -> Float[Tensor, "batch pos d"]:
    """Per prompt and dimension, subtract the mean and divide by the std over valid tokens.

    Tames "rogue dimensions" (a few coordinates with huge variance dominating cosines).
    """
    w = mask[..., None].to(z.dtype)
    n = w.sum(1, keepdim=True).clamp_min(1.0)
    mean = (z * w).sum(1, keepdim=True) / n
    var = (((z - mean) * w) ** 2).sum(1, keepdim=True) / n
    return (z - mean) / var.sqrt().clamp_min(1e-6) * w


def cos_histogram(
    cos: Float[Tensor, "batch pos pos"], pairs: Bool[Tensor, "batch pos pos"]
) -> Int[Tensor, "batch bins"]:
    """Counts of pairwise cosines per fixed bin (``BIN_EDGES``), per prompt."""
    b = cos.shape[0]
    if cos.dtype != torch.float32:
        idx = ((cos.double() + 1.0) * (N_BINS / 2.0)).floor().long().clamp(0, N_BINS - 1)
        idx = idx + N_BINS * torch.arange(b, device=cos.device)[:, None, None]
        idx = idx.masked_fill(~pairs, b * N_BINS).flatten()  # one spare bin for what is not a pair
        counts = torch.zeros(b * N_BINS + 1, dtype=torch.long, device=cos.device)
        return counts.scatter_add_(0, idx, torch.ones_like(idx))[:-1].reshape(b, N_BINS)
    # the same bins in one pass: _THRESHOLDS are the float32 values where that float64 floor
    # steps, so counting the thresholds <= c is the bin (2-4x faster at 1,024 tokens, issue 15).
    # Pairs are i < j: blocks of rows bin only their columns from the block's first row on
    # (about half the matrix rather than all of it).
    n = cos.shape[-1]
    thresholds = _THRESHOLDS.to(cos.device)
    # the CPU bins by arithmetic (``bins``) and counts with a bincount; a GPU bins with
    # ``bucketize`` and counts in place (a bincount would wait for the device), all rows in one
    # block (a few launches rather than half the elements)
    cpu = not Collector.launch_bound(cos.device)
    step = max(1, -(-n // HIST_BLOCKS)) if cpu else n
    offset = (N_BINS * torch.arange(b, device=cos.device))[:, None, None]
    counts = torch.zeros(b * N_BINS + 1, dtype=torch.long, device=cos.device)
    for i0 in range(0, n, step):
        block, block_pairs = cos[:, i0 : i0 + step, i0:], pairs[:, i0 : i0 + step, i0:]
        idx = bins(block) if cpu else torch.bucketize(block.contiguous(), thresholds, right=True)
        if b > 1:
            idx += offset.to(idx.dtype)
        idx.masked_fill_(~block_pairs, b * N_BINS)  # one spare bin for what is not a pair
        flat = idx.flatten()
        if cpu:
            counts += torch.bincount(flat, minlength=b * N_BINS + 1)
        else:
            counts.scatter_add_(0, flat, torch.ones_like(flat))
    return counts[:-1].reshape(b, N_BINS)


def bins(c: Float[Tensor, "*shape"]) -> Int[Tensor, "*shape"]:
    """The bin (int32) of each float32 cosine, the same as ``bucketize(c, _THRESHOLDS, right=True)``
    (the float64 floor of ``(c + 1) * N_BINS / 2``) in a few vectorised passes: the float32
    floor is never low and at most one bin high (its product rounds up onto an edge), so one
    comparison with the bin's least cosine corrects it. A binary search per element was
    12 ns per cosine on one CPU thread; this is 3x faster, and equal to it on every float32 in
    [-1, 1] (checked exhaustively once; tests/test_trajectories.py checks every float32 near
    each edge)."""
    k = torch.add(c, 1.0).mul_(N_BINS / 2.0).floor_().clamp_(0, N_BINS - 1).to(torch.int32)
    return k.sub_((c < _OWN_EDGE.index_select(0, k.flatten()).view_as(c)).to(torch.int32))


# Row blocks of the cosine histogram (each bins its rows' columns from its first row on).
HIST_BLOCKS = 4


def _bin_thresholds() -> Tensor:
    """For each bin k >= 1 the least float32 ``c`` with ``(float64(c) + 1) * N_BINS / 2 >= k``
    (a bisection over the float32 values in [-1, 1], in their order)."""

    def value(key: int) -> float:
        return struct.unpack("<f", struct.pack("<I", key if key >= 0 else -key | 0x80000000))[0]

    def key(x: float) -> int:
        bits = struct.unpack("<I", struct.pack("<f", x))[0]
        return bits if bits < 0x80000000 else -(bits & 0x7FFFFFFF)

    out = []
    for k in range(1, N_BINS):
        lo, hi = key(-1.0), key(1.0)  # the step lies in (lo, hi]
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if (value(mid) + 1.0) * (N_BINS / 2.0) >= k:
                hi = mid
            else:
                lo = mid
        out.append(value(hi))
    return torch.tensor(out, dtype=torch.float32)


_THRESHOLDS = _bin_thresholds()
# the least float32 cosine of each bin
_OWN_EDGE = torch.cat([torch.tensor([float("-inf")]), _THRESHOLDS])


def effective_rank(
    u: Float[Tensor, "batch pos d"], mask: Bool[Tensor, "batch pos"]
) -> Float[Tensor, " batch"]:
    """Effective rank ``exp(H(sigma / sum sigma))`` of the prompt's unit-vector cloud.

    The singular values ``sigma`` of the (uncentred) unit vectors are the square roots of the
    Gram matrix's eigenvalues (in float64: a float32 Gram's rounding noise ~1e-7 would become
    singular values ~3e-4 of a rank-deficient cloud); 1 for a cloud collapsed to one point.
    The Gram is taken on the smaller side (``[pos, pos]`` or ``[d, d]``: the same nonzero
    eigenvalues, without ``pos - d`` rounding-noise zeros), and the eigenvalues on one CPU
    thread: LAPACK's tridiagonal reduction synchronises its threads at every column, and on a
    loaded 2-core machine two threads were 15x slower than one (benchmarks/README.md).
    """
    return rank_and_pair_sum(u.double() * mask[..., None])[0]


def rank_and_pair_sum(
    ud: Float[Tensor, "batch pos d"],
) -> tuple[Float[Tensor, " batch"], Float[Tensor, " batch"]]:
    """``effective_rank`` of float64 unit vectors already zero at the tokens left out, and the
    sum of their cosines over the pairs ``i < j``: ``(|sum_i u_i|^2 - trace(Gram)) / 2``, from
    the same Gram, with no pass over the pairs (float32 products are exact in float64; the
    cosine matrix's own sum, clamped to [-1, 1] in float32, differs from it by rounding only).
    """
    small = ud.shape[-2] <= ud.shape[-1]
    gram = _lower_gram(ud if small else ud.transpose(1, 2))
    total = ud.sum(1)
    pair_sum = (torch.linalg.vecdot(total, total) - gram.diagonal(dim1=1, dim2=2).sum(-1)) / 2.0
    sigma = _eigvalsh_one_thread(gram).clamp_min(0.0).sqrt()
    p = sigma / sigma.sum(-1, keepdim=True).clamp_min(NORM_FLOOR)
    ent = -(p * torch.log(p.clamp_min(1e-300))).sum(-1)
    return torch.exp(ent), pair_sum


# Column blocks of the Gram matrix (see ``_lower_gram``).
GRAM_BLOCKS = 4


def _lower_gram(x: Float[Tensor, "batch n k"]) -> Float[Tensor, "batch n n"]:
    """``x x^T`` on and below the diagonal only, in blocks of rows (``eigvalsh`` reads the lower
    triangle alone): ``(GRAM_BLOCKS + 1) / (2 GRAM_BLOCKS)`` of the products of the full matrix.
    Entries above the diagonal blocks are zero."""
    n = x.shape[-2]
    step = -(-n // GRAM_BLOCKS)
    if n < 2 * step or n <= 128:
        return x @ x.transpose(1, 2)
    gram = x.new_zeros(x.shape[0], n, n)
    for i0 in range(0, n, step):
        i1 = min(n, i0 + step)
        gram[:, i0:i1, :i1] = x[:, i0:i1] @ x[:, :i1].transpose(1, 2)
    return gram


def _eigvalsh_one_thread(gram: Tensor) -> Tensor:
    if gram.device.type != "cpu":
        return torch.linalg.eigvalsh(gram)
    with torch_threads(1):
        return torch.linalg.eigvalsh(gram)
