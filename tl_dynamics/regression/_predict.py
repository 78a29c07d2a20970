"""The float64 predictors of a layer's head outputs from the keys and values it sees
(docs/math.md §8.1-8.3).

For every destination ``t`` the visible keys form an interval ``[lo_t, hi_t]`` of positions (the
causal prefix, a sliding window, all keys of an encoder) less the padding keys, so every sum over
them is a difference of two prefix sums: ``n_t``, ``sum k``, ``sum v``, ``sum k k^T``,
``sum k v^T``, ``sum |v|^2``. The centred Gram matrix ``G_t`` is diagonalised once per
destination and key/value head; every ridge ``lambda``, every gradient-descent step count and
the GCV criterion are spectral filters of that one decomposition. The query heads of a GQA
group share their key/value head's sums and decomposition.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch import Tensor

from tl_dynamics.errors import TLDynamicsError

RIDGE_PATH = (1e-3, 1e-2, 1e-1, 1.0, 10.0)  # lambda in units of tr(G_t) / d_head (§8.2)
GD_STEPS = (1, 2, 4, 16, 64)  # gradient-descent steps from zero, step 1 / s_max(G_t) (§8.3)
BASELINES = ("mean", "first", "self", "previous")
MEMORY_BUDGET = 256 * 2**20  # bytes of float64 temporaries per chunk (two halves: sums, chunk)


def predictor_names(
    ridge_path: Sequence[float] = RIDGE_PATH, gd_steps: Sequence[int] = GD_STEPS
) -> tuple[str, ...]:
    """Every predictor's name, in the order of ``predict``'s output.

    Example:
        >>> predictor_names((0.1,), (1, 4))
        ('linear', 'linear_norm', 'ridge@0.1', 'ridge_gcv', 'gd1', 'gd4', 'mean', 'first', 'self', 'previous')
    """
    ridge = tuple(f"ridge@{r:g}" for r in ridge_path)
    gd = tuple(f"gd{k}" for k in gd_steps)
    return ("linear", "linear_norm", *ridge, "ridge_gcv", *gd, *BASELINES)


def centred(name: str) -> bool:
    """Whether a predictor carries the intercept ``mean(v)``: its fitted gain scales only what it
    adds to the mean (§8.4)."""
    return name == "linear_norm" or name.startswith("ridge") or name.startswith("gd")


def intervals(allowed: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``lo``, ``hi``, ``n`` ``[batch, pos]`` and ``key_valid`` ``[batch, pos]`` of a mask whose
    rows are intervals of valid keys; a mask of another shape is refused."""
    n_pos = allowed.shape[-1]
    idx = torch.arange(n_pos, device=allowed.device)
    n = allowed.sum(-1)
    hi = torch.where(allowed, idx, -1).amax(-1)
    lo = torch.where(allowed, idx, n_pos).amin(-1)
    key_valid = allowed.any(1)
    inside = (idx >= lo[..., None]) & (idx <= hi[..., None]) & key_valid[:, None, :]
    if not torch.equal(inside & (n[..., None] > 0), allowed):
        raise TLDynamicsError(
            "regression: the visible keys of some destination are not an interval of positions "
            "(less padding), so its sums are not prefix differences; masks supported: causal, "
            "sliding window, bidirectional, with key padding"
        )
    return lo, hi, n, key_valid


@dataclass(frozen=True)
class _Sums:
    """Prefix sums (a zero row in front) of one group of key/value heads, float64."""

    k: Tensor  # [b, T+1, g, d]
    v: Tensor  # [b, T+1, g, e]
    kk: Tensor  # [b, T+1, g, d, d]
    kv: Tensor  # [b, T+1, g, d, e]
    vv: Tensor  # [b, T+1, g]
    n: Tensor  # [b, T+1]: valid keys (padding keys inside an interval do not count)

    @classmethod
    def of(cls, k: Tensor, v: Tensor, key_valid: Tensor) -> "_Sums":
        w = key_valid[:, :, None, None].to(k.dtype)
        k, v = k * w, v * w

        def cum(x: Tensor) -> Tensor:
            return torch.cat([torch.zeros_like(x[:, :1]), x.cumsum(1)], dim=1)

        return cls(
            cum(k),
            cum(v),
            cum(k[..., :, None] * k[..., None, :]),
            cum(k[..., :, None] * v[..., None, :]),
            cum((v * v).sum(-1)),
            cum(key_valid.to(k.dtype)[:, :, None])[..., 0],
        )

    def window(self, name: str, b: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
        s = getattr(self, name)
        return s[b, hi + 1] - s[b, lo]


def _filters(
    s: Tensor, lam: Tensor, gd_steps: Sequence[int], n: Tensor, c2: Tensor, vc2: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Ridge filters ``1 / (s + lam)`` ``[N, g, R, d]``, the GCV pick's filter ``[N, g, d]`` and
    the GD filters ``(1 - (1 - s / s_max)^k) / s`` ``[N, g, K, d]``."""
    den = s[:, :, None, :] + lam[..., None]
    ok = den > 0
    ridge = torch.where(ok, 1.0 / torch.where(ok, den, 1.0), 0.0)
    # GCV (one intercept among the parameters): RSS / n / (1 - (df + 1) / n)^2
    rss = vc2[..., None] - (
        c2[:, :, None, :] * (s[:, :, None, :] + 2 * lam[..., None]) * ridge**2
    ).sum(-1)
    df = (s[:, :, None, :] * ridge).sum(-1)
    nn = n.to(s.dtype)[:, None, None]
    room = 1.0 - (df + 1.0) / nn
    gcv = torch.where(room > 0, rss / nn / room.clamp_min(1e-300) ** 2, torch.inf)
    pick = torch.where(
        torch.isinf(gcv).all(-1), lam.shape[-1] - 1, gcv.argmin(-1)
    )  # all undefined: the largest lambda
    best = ridge.gather(2, pick[..., None, None].expand(-1, -1, 1, s.shape[-1]))[:, :, 0]
    smax = s[..., -1:]
    x = torch.where(smax > 0, s / torch.where(smax > 0, smax, 1.0), 0.0)  # eta * s in [0, 1]
    eta = torch.where(smax > 0, 1.0 / torch.where(smax > 0, smax, 1.0), 0.0)
    steps = torch.tensor(list(gd_steps), dtype=s.dtype, device=s.device)
    xs = x[:, :, None, :]
    grow = -torch.expm1(steps[:, None] * torch.log1p(-xs)) / torch.where(xs > 0, xs, 1.0)
    gd = eta[:, :, None, :] * torch.where(xs > 0, grow, steps[:, None])
    return ridge, best, gd


def predict(
    sums: _Sums,
    q: Tensor,
    v: Tensor,
    kv_of: Tensor,
    b: Tensor,
    t: Tensor,
    lo: Tensor,
    hi: Tensor,
    ridge_path: Sequence[float] = RIDGE_PATH,
    gd_steps: Sequence[int] = GD_STEPS,
    sink: Tensor | None = None,
) -> Tensor:
    """Every predictor at destinations ``(b, t)``, ``[N, heads, n_predictors, e]`` (float64).

    ``q`` ``[batch, pos, heads, d]`` are the scaled queries of the query heads, ``v``
    ``[batch, pos, g, e]`` the values of the key/value heads of ``sums``, ``kv_of`` the index
    into those of each query head; ``lo``/``hi`` the visible interval at each destination.
    ``sink`` ``[heads]``: a layer's learned sink logits, read as one more visible key with a
    zero value (docs/math.md §8.1): the keys gain a coordinate, 1 for the sink and 0 for every
    real key, and each query that coordinate's weight, its head's sink logit, so that the
    sink's score is its logit exactly.
    """
    n = sums.window("n", b, lo, hi)
    sk, sv = sums.window("k", b, lo, hi), sums.window("v", b, lo, hi)
    skv, skk = sums.window("kv", b, lo, hi), sums.window("kk", b, lo, hi)
    qt = q[b, t]  # [N, h, d]
    if sink is not None:  # one more key, e_{d+1}, with value 0
        n = n + 1
        sk = torch.cat([sk, torch.ones_like(sk[..., :1])], -1)
        skk = torch.nn.functional.pad(skk, (0, 1, 0, 1))
        skk[..., -1, -1] = 1.0
        skv = torch.nn.functional.pad(skv, (0, 0, 0, 1))
        qt = torch.cat([qt, sink.to(qt.dtype)[None, :, None].expand(qt.shape[0], -1, 1)], -1)
    nk = n[:, None, None]
    kbar, vbar = sk / nk, sv / nk
    G = skk - nk[..., None] * kbar[..., :, None] * kbar[..., None, :]
    Bc = skv - nk[..., None] * kbar[..., :, None] * vbar[..., None, :]
    vc2 = sums.window("vv", b, lo, hi) - n[:, None] * (vbar * vbar).sum(-1)
    s, U = torch.linalg.eigh(0.5 * (G + G.transpose(-1, -2)))
    s = s.clamp_min(0.0)
    C = U.transpose(-1, -2) @ Bc  # [N, g, d, e]
    d = s.shape[-1]
    lam = (
        torch.tensor(list(ridge_path), dtype=s.dtype, device=s.device) * (s.sum(-1) / d)[..., None]
    )
    ridge, best, gd = _filters(s, lam, gd_steps, n, (C * C).sum(-1), vc2)
    filt = torch.cat([ridge, best[:, :, None], gd], dim=2)[:, kv_of]  # [N, h, F, d]
    # read at q_t, not q_t - kbar: a direction, as in linear_norm, so that queries x c and keys / c
    # (the same head) scale every deviation by c^2, which the fitted gain absorbs (§8.2)
    a = (U[:, kv_of].transpose(-1, -2) @ qt[..., None])[..., 0]
    dev = torch.einsum("nhfj,nhje->nhfe", filt, a[..., None] * C[:, kv_of])
    vb = vbar[:, kv_of]
    linear = (qt[..., None, :] @ skv[:, kv_of])[..., 0, :]
    linear_norm = vb + (qt[..., None, :] @ Bc[:, kv_of])[..., 0, :] / n[:, None, None]
    prev = torch.maximum(t - 1, lo)
    base = torch.stack([vbar, v[b, lo], v[b, t], v[b, prev]], dim=2)[:, kv_of]
    return torch.cat(
        [linear[:, :, None], linear_norm[:, :, None], vb[:, :, None] + dev, base], dim=2
    )


def chunks(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Tensor,
    kv_of: Sequence[int],
    dest_b: Tensor,
    dest_t: Tensor,
    budget: int = MEMORY_BUDGET,
    ridge_path: Sequence[float] = RIDGE_PATH,
    gd_steps: Sequence[int] = GD_STEPS,
    sink: Tensor | None = None,
) -> Iterator[tuple[slice, list[int], Tensor]]:
    """The predictions of the query heads, a chunk at a time: ``(destinations, query heads,
    predictions [N, heads, P, e])``.

    ``q`` ``[batch, pos, H, d]`` (scaled), ``k``/``v`` ``[batch, pos, Hkv, d|e]``, ``kv_of[h]``
    the key/value head of query head ``h``; all float64; ``sink`` ``[H]`` a layer's learned sink
    logits (``predict``). Key/value heads are taken in groups
    whose prefix sums fit half of ``budget`` bytes, destinations in chunks whose temporaries fit
    the other half.
    """
    lo, hi, _, key_valid = intervals(allowed)
    b_, n_pos, n_kv, d = k.shape
    e = v.shape[-1]
    n_f = len(ridge_path) + 1 + len(gd_steps)
    per_kv = 8 * b_ * (n_pos + 1) * (d * d + d * e + d + e + 1) * 2
    group = max(1, min(n_kv, (budget // 2) // max(per_kv, 1)))
    kv_of_t = torch.as_tensor(list(kv_of), device=q.device)
    for g0 in range(0, n_kv, group):
        kvs = list(range(g0, min(n_kv, g0 + group)))
        heads = [h for h in range(q.shape[2]) if int(kv_of[h]) in kvs]
        if not heads:
            continue
        sums = _Sums.of(k[:, :, kvs], v[:, :, kvs], key_valid)
        local = kv_of_t[heads] - g0
        per_dest = 8 * (
            len(kvs) * (4 * d * d + 3 * d * e) + len(heads) * (d * d + 2 * n_f * (d + e))
        )
        step = max(1, (budget // 2) // max(per_dest, 1))
        for i0 in range(0, dest_b.numel(), step):
            sl = slice(i0, min(dest_b.numel(), i0 + step))
            bb, tt = dest_b[sl], dest_t[sl]
            yield (
                sl,
                heads,
                predict(
                    sums,
                    q[:, :, heads],
                    v[:, :, kvs],
                    local,
                    bb,
                    tt,
                    lo[bb, tt],
                    hi[bb, tt],
                    ridge_path,
                    gd_steps,
                    None if sink is None else sink[heads],
                ),
            )
