"""One step of the integrators on (S^{d-1})^n.

``cf4`` (default) is a geometric, commutator-free Lie-group method of order 4
(Celledoni, Marthinsen & Owren, 2003) built on one exact flow. Every (SA)/(USA) velocity
has the form ``v_i = P_{x_i} g_i`` with ``g_i = sum_j w_ij V x_j``. For a *frozen*
``g`` the ODE ``x' = P_x g`` is a Moebius "boost" of the sphere and has a closed form:
``x`` slides along the great circle towards ``g/|g|`` with ``tan(theta/2)`` shrinking
like ``exp(-|g| t)`` (theta: the angle to ``g``). The method evaluates ``g`` four times
and composes two such boosts with the CMO coefficients, so

* points stay on the sphere exactly (up to rounding; each step also renormalises);
* a tight cluster, where every ``g_i`` points at the cluster, contracts at the exact
  rate whatever the step, so a long step never blows up (explicit Runge-Kutta does once
  ``dt |g| > 2.8``, and ``|g| ~ e^beta`` inside a (USA) cluster);
* the global error is O(dt^4) (tested: halving dt divides the error by about 16).

Stability is not accuracy: a frozen boost saturates at ``g/|g|``, so when ``|g| dt >> 1``
the slow drift of a cluster (whose ``g`` is dominated by its own pull) is underestimated.
The adaptive controller detects this and keeps ``dt ~ 1/|g|``; (USA) at large beta
therefore costs about ``e^beta`` steps per unit time (beta = 4, n = 32, d = 2: ~90).
A stiff (Rosenbrock-type) integrator would remove that cost; none is provided.

An embedded second-order solution (the exponential midpoint rule, one extra boost, no
extra field evaluation) estimates the local error for adaptive steps.

``rk4`` is classical RK4 on the projected field in the ambient space, renormalised after
each step: O(dt^4) and slightly more accurate on smooth problems, but explicit, so it
needs ``dt`` below about ``2.8 / rate`` (see ``suggest_dt``). It serves as an
independent reference.
"""

from __future__ import annotations


import torch
from jaxtyping import Float
from torch import Tensor

from tl_dynamics.particles._dynamics import Field

Step = float | Tensor  # a number or [runs, 1, 1]


def boost(
    x: Float[Tensor, "*batch n d"], g: Float[Tensor, "*batch n d"], h: Step
) -> Float[Tensor, "*batch n d"]:
    """Exact time-``h`` flow of ``x' = g - <g, x> x`` with ``g`` frozen (rows of ``[..., n, d]``).

    With ``c = <x, g/|g|>`` and ``s = exp(-|g| h)`` the flow is
    ``x(h) = [ (1 - s)(1 + c + s(1 - c)) g/|g| + 2 s x ] / [ (1 + c) + s^2 (1 - c) ]``,
    the stereographic image of a dilation by ``s`` (exact on the sphere, ``x(0) = x``,
    ``x -> g/|g|`` as ``h -> inf``). It is evaluated through ``q = (1 - s)/|g|`` (``expm1``;
    ``q = h`` when ``g = 0``), so a vanishing drive is exact and nothing divides by ``|g|``.
    """
    gam = torch.linalg.vector_norm(g, dim=-1, keepdim=True)
    xg = torch.linalg.vecdot(x, g).unsqueeze(-1)
    em = torch.expm1(-gam * h)  # s - 1
    s = em + 1
    q = torch.where(gam > 0, -em / gam, h * torch.ones_like(gam))
    t = xg * q  # c (1 - s)
    den = (1 + s * s + t * (1 + s)).clamp_min(torch.finfo(x.dtype).tiny)
    return torch.addcmul((2 * s / den) * x, q * ((1 + s) + t) / den, g)


def _normalize(y: Tensor) -> Tensor:
    return y / y.norm(dim=-1, keepdim=True)


def cf4_step(
    x: Tensor, h: Step, field: Field, embedded: bool = False
) -> Tensor | tuple[Tensor, Tensor]:
    """One CF4 step of size ``h``; with ``embedded=True`` also the second-order solution."""
    f1 = field.drive(x)
    y2 = boost(x, f1, h / 2)
    f2 = field.drive(y2)
    y3 = boost(x, f2, h / 2)
    f3 = field.drive(y3)
    y4 = boost(y2, torch.add(f3, f1, alpha=-0.5), h)
    f4 = field.drive(y4)
    f23 = f2 + f3
    first = torch.add(f23, f1, alpha=1.5).sub_(f4, alpha=0.5)  # 6 x (3 f1 + 2 f2 + 2 f3 - f4)/12
    second = torch.add(f23, f4, alpha=1.5).sub_(f1, alpha=0.5)  # 6 x (-f1 + 2 f2 + 2 f3 + 3 f4)/12
    z = boost(x, first, h / 6)
    x4 = _normalize(boost(z, second, h / 6))
    if not embedded:
        return x4
    return x4, boost(x, f2, h)


def midpoint_step(x: Tensor, h: Step, field: Field) -> Tensor:
    """The exponential midpoint rule (second order, two field evaluations): CF4's embedded method."""
    y2 = boost(x, field.drive(x), h / 2)
    return _normalize(boost(x, field.drive(y2), h))


def rk4_step(x: Tensor, h: Step, field: Field) -> Tensor:
    """One classical RK4 step on the projected field, then renormalisation."""

    def vel(y: Tensor) -> Tensor:
        y = _normalize(y)
        g = field.drive(y)
        return g - (g * y).sum(-1, keepdim=True) * y

    k1 = vel(x)
    k2 = vel(x + (h / 2) * k1)
    k3 = vel(x + (h / 2) * k2)
    k4 = vel(x + h * k3)
    return _normalize(x + (h / 6) * (k1 + 2 * k2 + 2 * k3 + k4))


STEPPERS = {"cf4": cf4_step, "midpoint": midpoint_step, "rk4": rk4_step}
