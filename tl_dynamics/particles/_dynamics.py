"""The vector fields (SA) and (USA) on (S^{d-1})^n, their parameters, and initial conditions.

Shapes: particles are rows, ``x: [runs, n, d]``. ``Q, K: [m, d]`` and ``V: [d, d]`` act on
column vectors as in the paper, so the score of particle ``i`` for ``j`` is
``<Q x_i, K x_j> = x_i^T Q^T K x_j`` and the value is ``V x_j``. Each may also carry a
leading ``runs`` axis (one matrix per run); ``None`` means the identity (the fast path).

    (SA)   dx_i/dt = P_{x_i}( sum_j softmax_j(beta <Q x_i, K x_j>) V x_j )
    (USA)  dx_i/dt = P_{x_i}( (1/n) sum_j exp(beta <Q x_i, K x_j>) V x_j )

with ``P_x y = y - <x, y> x``. With ``causal=True`` particle ``i`` only sees ``j <= i``
(a decoder's mask; USA keeps the ``1/n``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from tl_dynamics.particles._checks import (
    Problems,
    check_beta,
    check_dynamics,
    check_matrix,
    check_states,
    shape_str,
)

#: Largest beta * ||Q^T K||_2 for which exp() in (USA) cannot overflow, per dtype.
USA_EXP_LIMIT = {torch.float64: 700.0, torch.float32: 85.0}


def random_init(
    runs: int,
    n: int,
    d: int,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float64,
) -> Float[Tensor, "runs n d"]:
    """``[runs, n, d]`` points drawn independently and uniformly on ``S^{d-1}``.

    Args:
        runs: independent systems.
        n: particles per system.
        d: dimension (``>= 2``).
        generator: a seeded ``torch.Generator`` (None: torch's global one).
        dtype: the points' dtype.

    Returns:
        ``[runs, n, d]`` unit vectors.

    Example:
        >>> x0 = random_init(4, 32, 2, torch.Generator().manual_seed(0))
        >>> tuple(x0.shape), bool(torch.allclose(x0.norm(dim=-1), torch.ones(4, 32, dtype=torch.float64)))
        ((4, 32, 2), True)
    """
    p = Problems("random_init")
    for name, v, low in (("runs", runs, 1), ("n", n, 1), ("d", d, 2)):
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            p.add(f"{name} must be an int >= {low}, got {v!r}")
    p.raise_if_any()
    g = torch.randn(runs, n, d, generator=generator, dtype=dtype)
    return g / g.norm(dim=-1, keepdim=True)


def identity_qkv(
    d: int, dtype: torch.dtype = torch.float64
) -> tuple[Float[Tensor, "d d"], Float[Tensor, "d d"], Float[Tensor, "d d"]]:
    """``(Q, K, V) = (I_d, I_d, I_d)``: the paper's clustering setting. (``None`` means the same.)

    >>> Q, K, V = identity_qkv(3)
    >>> bool(torch.equal(Q, torch.eye(3, dtype=torch.float64)))
    True
    """
    eye = torch.eye(d, dtype=dtype)
    return eye, eye.clone(), eye.clone()


def random_qkv(
    d: int,
    kind: str = "gaussian",
    generator: torch.Generator | None = None,
    runs: int | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[Tensor, Tensor, Tensor]:
    """Random ``(Q, K, V)``, each ``[d, d]`` (or ``[runs, d, d]``).

    ``kind="gaussian"``: i.i.d. ``N(0, 1/d)`` entries (operator norm about 2).
    ``kind="goe"``: symmetric ``(A + A^T)/sqrt(2)`` with ``A`` as above (spectrum in about [-2, 2]).

    >>> Q, K, V = random_qkv(4, "goe", torch.Generator().manual_seed(0))
    >>> bool(torch.equal(V, V.T))
    True
    """
    p = Problems("random_qkv")
    if kind not in ("gaussian", "goe"):
        p.add(f"kind must be 'gaussian' or 'goe', got {kind!r}")
    if not isinstance(d, int) or d < 2:
        p.add(f"d must be an int >= 2, got {d!r}")
    if runs is not None and (not isinstance(runs, int) or runs < 1):
        p.add(f"runs must be None or an int >= 1, got {runs!r}")
    p.raise_if_any()
    shape = (3,) + ((runs,) if runs is not None else ()) + (d, d)
    a = torch.randn(shape, generator=generator, dtype=dtype) / math.sqrt(d)
    if kind == "goe":
        a = (a + a.transpose(-1, -2)) / math.sqrt(2.0)
    return a[0], a[1], a[2]


@dataclass(frozen=True)
class Field:
    """The parameters of one (SA)/(USA) vector field in the form the integrators use.

    ``beta`` is a scalar or ``[runs, 1, 1]``; the score matrix is ``beta * x B x^T`` with
    ``B = Q^T K`` (``[d, d]`` or ``[runs, d, d]``), or ``beta * (x Q^T)(x K^T)^T`` when
    ``Q, K`` are thin (``m < d``); ``Vt = V^T``, or its first factor when ``V`` was given as a
    head's ``(W_V, W_O)`` (``V^T = W_V W_O`` = ``Vt @ Vo``, ``Vo`` its second). ``None`` stands
    for the identity.
    """

    beta: Tensor
    B: Tensor | None
    Qt: Tensor | None
    Kt: Tensor | None
    Vt: Tensor | None
    dynamics: str
    causal: bool
    Vo: Tensor | None = None

    def select(self, idx: Tensor) -> "Field":
        """The same field restricted to the runs ``idx`` (per-run parameters are indexed)."""

        def pick(t: Tensor | None) -> Tensor | None:
            return t if t is None or t.ndim < 3 else t.index_select(0, idx)

        return replace(
            self,
            beta=pick(self.beta),
            B=pick(self.B),
            Qt=pick(self.Qt),
            Kt=pick(self.Kt),
            Vt=pick(self.Vt),
            Vo=pick(self.Vo),
        )

    def drive(self, x: Float[Tensor, "runs n d"]) -> Float[Tensor, "runs n d"]:
        """The unprojected field ``g_i = sum_j w_ij V x_j`` (``[runs, n, d]``); velocity is ``P_x g``."""
        # beta scales the [runs, n, d] factor, never the [runs, n, n] scores
        xb = x * self.beta
        if self.B is not None:
            s = (xb @ self.B) @ x.transpose(-1, -2)
        elif self.Qt is not None and self.Kt is not None:
            s = (xb @ self.Qt) @ (x @ self.Kt).transpose(-1, -2)
        else:
            s = xb @ x.transpose(-1, -2)
        n = x.shape[-2]
        if self.dynamics == "SA":
            if self.causal:
                s = s.masked_fill_(_upper(n, x.device), float("-inf"))
            w = torch.softmax(s, dim=-1)
        else:
            w = s.sub_(math.log(n)).exp_()  # exp(s) / n in one pass
            if self.causal:
                w = w.masked_fill_(_upper(n, x.device), 0.0)
        vx = x if self.Vt is None else x @ self.Vt
        if self.Vo is not None:  # the factored OV: weights on the d_head values, then W_O
            return (w @ vx) @ self.Vo
        return w @ vx


def _upper(n: int, device: torch.device) -> Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).triu(1)


def _is_eye(m: Tensor | None) -> bool:
    return m is None or (
        m.ndim == 2
        and m.shape[0] == m.shape[1]
        and torch.equal(m, torch.eye(m.shape[0], dtype=m.dtype))
    )


def make_field(
    p: Problems,
    x0: Tensor,
    beta: float | Tensor,
    Q: Tensor | None,
    K: Tensor | None,
    V: Tensor | tuple[Tensor, Tensor] | None,
    dynamics: str,
    causal: bool,
) -> Field | None:
    """Validate parameters against ``x0`` and build a :class:`Field` (``None`` if ``p`` has problems)."""
    check_dynamics(p, dynamics)
    if not check_states(p, x0):
        return None
    runs, _, d = x0.shape
    b = check_beta(p, beta, runs)
    if (Q is None) != (K is None):
        p.add("Q and K must be given together (or both None for the identity)")
    ok = check_matrix(p, "Q", Q, d, None, runs) & check_matrix(p, "K", K, d, None, runs)
    V, Vo, ok_v = _value_map(p, V, d, runs)
    ok &= ok_v
    if ok and Q is not None and K is not None and Q.shape[-2] != K.shape[-2]:
        p.add(
            f"Q and K must have the same number of rows m (scores are <Q x, K y>), got {list(Q.shape)} and {list(K.shape)}"
        )
    if not isinstance(causal, bool):
        p.add(f"causal must be True or False, got {causal!r}")
    if p.items or b is None:
        return None
    dt = x0.dtype
    Q = None if Q is None else Q.detach().to(dt)
    K = None if K is None else K.detach().to(dt)
    V = None if V is None else V.detach().to(dt)
    B = Qt = Kt = None
    if Q is not None and K is not None and not (_is_eye(Q) and _is_eye(K)):
        if Q.shape[-2] >= d:
            B = Q.transpose(-1, -2) @ K
        else:
            Qt, Kt = Q.transpose(-1, -2), K.transpose(-1, -2)
    if Vo is not None:  # factored: V is W_V, and x V^T = (x W_V) W_O
        Vt, Vo = V, Vo.detach().to(dt)
    else:
        Vt = None if V is None or _is_eye(V) else V.transpose(-1, -2)
    if dynamics == "USA":
        qk = float(b.max()) * _opnorm(B, Qt, Kt)
        limit = USA_EXP_LIMIT[dt]
        if qk > limit:
            p.add(
                f"(USA) weights exp(beta <Qx, Ky>) can overflow {dt}: beta * ||Q^T K||_2 = {qk:.4g} > {limit:g}; "
                "lower beta, use float64, or use dynamics='SA'"
            )
            return None
    beta_t = b.to(dt).reshape(-1, 1, 1) if b.ndim == 1 else b.to(dt)
    return Field(beta_t, B, Qt, Kt, Vt, dynamics, causal, Vo)


def _value_map(p: Problems, V: Any, d: int, runs: int) -> tuple[Tensor | None, Tensor | None, bool]:
    """``(V, None, ok)`` for a ``[d, d]`` ``V`` (or None), or ``(W_V, W_O, ok)`` for a head's OV
    given as the pair ``(W_V [d, r], W_O [r, d])``, ``V = (W_V W_O)^T`` (each may carry a leading
    ``runs`` axis)."""
    if not isinstance(V, (tuple, list)):
        return V, None, check_matrix(p, "V", V, d, d, runs)
    if len(V) != 2 or not all(isinstance(m, Tensor) for m in V):
        p.add("V must be a [d, d] tensor, None, or a head's (W_V [d, r], W_O [r, d]) pair")
        return None, None, False
    W_V, W_O = V
    ok = check_matrix(p, "V's W_O", W_O, d, None, runs)
    if ok and not check_matrix(p, "V's W_V", W_V, int(W_O.shape[-2]), d, runs):
        ok = False
    if ok and W_V.ndim != W_O.ndim:
        p.add(
            f"V's W_V and W_O must both have a runs axis or neither: {shape_str(W_V)}, {shape_str(W_O)}"
        )
        ok = False
    return W_V, W_O, ok


def _opnorm(B: Tensor | None, Qt: Tensor | None, Kt: Tensor | None) -> float:
    if B is not None:
        m = B
    elif Qt is not None and Kt is not None:
        m = Qt @ Kt.transpose(-1, -2)
    else:
        return 1.0
    return float(torch.linalg.matrix_norm(m, ord=2).max())


def velocity(
    x: Float[Tensor, "runs n d"],
    beta: float | Float[Tensor, " runs"] = 1.0,
    Q: Float[Tensor, "*runs m d"] | None = None,
    K: Float[Tensor, "*runs m d"] | None = None,
    V: Float[Tensor, "*runs d d"] | tuple[Tensor, Tensor] | None = None,
    dynamics: str = "SA",
    causal: bool = False,
) -> Float[Tensor, "runs n d"]:
    """The right-hand side ``dx/dt`` of (SA) or (USA) at ``x: [runs, n, d]`` (tangent to the sphere).

    >>> x = random_init(1, 5, 3, torch.Generator().manual_seed(0))
    >>> v = velocity(x, beta=1.0)
    >>> bool((v * x).sum(-1).abs().max() < 1e-12)   # tangent: <v_i, x_i> = 0
    True
    """
    p = Problems("velocity")
    field = p.raise_or(make_field(p, x, beta, Q, K, V, dynamics, causal))
    g = field.drive(x)
    return g - (g * x).sum(-1, keepdim=True) * x


def suggest_dt(
    beta: float | Float[Tensor, " runs"] = 1.0,
    Q: Tensor | None = None,
    K: Tensor | None = None,
    V: Tensor | tuple[Tensor, Tensor] | None = None,
    dynamics: str = "SA",
) -> float:
    """A fixed step for ``simulate(..., dt=...)``: ``dt = min(0.1, 0.25 / rate)``.

    ``rate`` bounds how fast the field turns: ``||V||_2 (1 + beta ||Q^T K||_2)`` for (SA)
    (softmax weights move at most ``beta ||Q^T K||`` per unit angle) and
    ``||V||_2 exp(beta ||Q^T K||_2)`` for (USA) (the weight of a particle's own cluster).
    At this step the fourth-order integrator's trajectories agree with a 64x finer
    reference to about 1e-6 on the paper's settings (see ``tests/test_particles.py``);
    the default (``dt=None``) error-controlled stepping needs no rule.

    >>> suggest_dt(1.0), suggest_dt(9.0) < 0.1, suggest_dt(4.0, dynamics="USA") < 0.01
    (0.1, True, True)
    """
    p = Problems("suggest_dt")
    check_dynamics(p, dynamics)
    b = check_beta(p, beta, None)
    if isinstance(V, (tuple, list)) and len(V) == 2:  # a head's (W_V, W_O): V = (W_V W_O)^T
        V = (V[0].to(torch.float64) @ V[1].to(torch.float64)).transpose(-1, -2)
    for name, m in (("Q", Q), ("K", K), ("V", V)):
        if m is not None and (not isinstance(m, torch.Tensor) or m.ndim not in (2, 3)):
            p.add(f"{name} must be None or a [m, d] / [runs, m, d] tensor, got {type(m).__name__}")
    if (Q is None) != (K is None):
        p.add("Q and K must be given together (or both None for the identity)")
    b = p.raise_or(b)
    b = float(b.max()) if b.ndim else float(b)
    qk = (
        1.0
        if Q is None or K is None
        else float(
            torch.linalg.matrix_norm(
                Q.transpose(-1, -2).to(torch.float64) @ K.to(torch.float64), ord=2
            ).max()
        )
    )
    v = 1.0 if V is None else float(torch.linalg.matrix_norm(V.to(torch.float64), ord=2).max())
    rate = v * (1.0 + b * qk) if dynamics == "SA" else v * math.exp(min(b * qk, 700.0))
    return min(0.1, 0.25 / max(rate, 1e-12))
