"""``simulate``: integrate (SA)/(USA) for a batch of independent runs and record observables."""

from __future__ import annotations

import math

from typing import Any, ContextManager, Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from tl_dynamics import sphere
from tl_dynamics.collect import torch_threads
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.particles._checks import Problems, check_eps, positive_number
from tl_dynamics.particles._dynamics import Field, make_field
from tl_dynamics.particles._integrators import STEPPERS, cf4_step
from tl_dynamics.particles._result import ParticleRun, RunParams
from tl_dynamics.particles._seeding import HeadSource

#: Default local error tolerance of the adaptive stepper (chord distance per step, per run).
DEFAULT_TOL = 1e-6
#: Step-size controller: safety factor and bounds on the change per step (standard values).
_SAFETY, _FAC_MIN, _FAC_MAX = 0.9, 0.2, 5.0
#: Below this many score entries x d per step (runs * n * n * d), intra-op threads cost more
#: than they save: small batches run on one thread (timings: benchmarks/particles_bench.py).
_SMALL_WORK = 1 << 22


def _single_thread_if_small(work: int) -> ContextManager[None]:
    """Use one intra-op thread for small batches, restoring the caller's setting afterwards."""
    return torch_threads(1 if work < _SMALL_WORK else None)


def _record_times(p: Problems, t_max: Any, record_every: Any, times: Any) -> Tensor | None:
    if times is not None:
        if t_max is not None or record_every is not None:
            p.add("give either times=[...] or t_max/record_every, not both")
            return None
        try:
            tt = torch.as_tensor(times, dtype=torch.float64).reshape(-1)
        except (TypeError, ValueError):
            p.add(f"times must be a 1-D sequence of numbers, got {type(times).__name__}")
            return None
        if (
            tt.numel() == 0
            or not bool(torch.isfinite(tt).all())
            or bool((tt < 0).any())
            or bool((tt[1:] <= tt[:-1]).any())
        ):
            p.add(f"times must be finite, >= 0 and strictly increasing, got {tt.tolist()[:8]}")
            return None
        return tt
    tm = positive_number(p, "t_max", 10.0 if t_max is None else t_max)
    if tm is None:
        return None
    every = positive_number(p, "record_every", tm / 100 if record_every is None else record_every)
    if every is None:
        return None
    k = int(math.floor(tm / every + 1e-9))
    tt = torch.arange(k + 1, dtype=torch.float64) * every
    if tm - float(tt[-1]) > 1e-9 * tm:
        tt = torch.cat([tt, torch.tensor([tm], dtype=torch.float64)])
    return tt


def simulate(
    x0: Float[Tensor, "runs n d"],
    beta: float | Float[Tensor, " runs"] = 1.0,
    Q: Float[Tensor, "*runs m d"] | None = None,
    K: Float[Tensor, "*runs m d"] | None = None,
    V: Float[Tensor, "*runs d d"] | tuple[Tensor, Tensor] | None = None,
    *,
    dynamics: str = "SA",
    t_max: float | None = None,
    dt: float | None = None,
    record_every: float | None = None,
    times: Sequence[float] | None = None,
    tol: float = DEFAULT_TOL,
    method: str = "cf4",
    causal: bool = False,
    keep_states: bool = True,
    eps: float | Sequence[float] = sphere.CLUSTER_EPS,
    max_steps: int = 1_000_000,
    source: HeadSource | None = None,
) -> ParticleRun:
    """Integrate (SA) or (USA) from ``x0: [runs, n, d]`` (unit vectors) and record observables.

    Args:
        x0: ``[runs, n, d]`` initial positions (unit vectors, e.g. ``random_init``).
        beta: inverse temperature, a number or a ``[runs]`` tensor (one per run).
        Q: ``[m, d]`` (or ``[runs, m, d]``); scores are ``beta <Q x_i, K x_j>``. ``None``: identity.
        K: ``[m, d]`` (or ``[runs, m, d]``), as ``Q``. ``None``: identity.
        V: ``[d, d]`` (or ``[runs, d, d]``); values are ``V x_j``. ``None``: identity. Or a
            head's OV in factored form, the pair ``(W_V [d, r], W_O [r, d])`` (each may carry the
            ``runs`` axis): ``V = (W_V W_O)^T``, and each step costs ``r`` rather than ``d`` per
            value (what ``HeadDynamics.kwargs()`` passes).
        dynamics: ``"SA"`` (softmax-normalised) or ``"USA"`` (unnormalised, ``1/n``).
        t_max: record until ``t_max`` (default 10), at ``0, record_every, ...`` and ``t_max``;
            or give ``times`` explicitly.
        record_every: the interval between records (default ``t_max/100``).
        dt: fixed step size (each record interval is split into equal steps ``<= dt``).
            ``None`` (default): adaptive steps, per run, keeping the local error of each
            step below ``tol`` (see below). :func:`suggest_dt` gives a safe fixed ``dt``.
        method: ``"cf4"`` (default; geometric, order 4, exact on the sphere, stable for
            stiff clusters), ``"midpoint"`` (its geometric order-2 sibling, half the cost
            per step; needs ``dt``) or ``"rk4"`` (ambient RK4 + renormalisation; needs ``dt``).
        causal: particle ``i`` attends only to ``j <= i``.
        keep_states: keep ``[T, runs, n, d]`` positions; otherwise only the observables
            at ``eps`` are kept (memory ``O(T runs n)``).
        eps: threshold(s) recorded for the eps-close fraction and cluster labels.
        max_steps: cap on the number of (batched) steps; exceeding it raises.
        source: provenance stored in ``params.source`` (e.g. from :func:`from_head`).

    Returns:
        ``ParticleRun``: the record ``times`` ``[T]``, ``states`` ``[T, runs, n, d]`` (with
        ``keep_states``), and the observables at ``eps`` (mean cosine ``[T, runs]``, eps-close
        fractions and cluster labels).

    Performance: small batches (``runs * n * n * d < 2**22``) run with one intra-op thread
    (the caller's ``torch.get_num_threads()`` is restored on return), since extra threads
    only add synchronisation on tensors this small.

    Step-size rule (adaptive). Each step also computes the embedded second-order
    solution; the chord distance between the two, maximised over the run's particles,
    estimates the step's local error. A step is accepted when it is ``<= tol`` and the
    next step is ``h * clip(0.9 (tol/err)^(1/3), 0.2, 5)``; steps are shortened to land on
    record times. The returned fourth-order solution is more accurate than ``tol`` says:
    with ``tol=1e-6`` trajectories agree with a 64x finer fixed-step reference to about
    1e-6 over ``t <= 10`` (measured in the tests).

    Example:
        >>> from tl_dynamics.particles import random_init
        >>> x0 = random_init(8, 8, 8, torch.Generator().manual_seed(0))   # d >= n
        >>> run = simulate(x0, beta=1.0, t_max=20.0, record_every=1.0, keep_states=False)
        >>> bool((run.cluster_counts()[-1] == 1).all())                      # one cluster
        True
    """
    p = Problems("simulate")
    field = make_field(p, x0, beta, Q, K, V, dynamics, causal)
    tt = _record_times(p, t_max, record_every, times)
    epss = check_eps(p, eps)
    if method not in STEPPERS:
        p.add(f"method must be one of {tuple(STEPPERS)}, got {method!r}")
    if dt is not None:
        positive_number(p, "dt", dt)
    elif method in STEPPERS and method != "cf4":
        p.add(
            f"method={method!r} has no error estimate: give a fixed dt (e.g. suggest_dt(...)) or use method='cf4'"
        )
    positive_number(p, "tol", tol)
    if not isinstance(max_steps, int) or max_steps < 1:
        p.add(f"max_steps must be an int >= 1, got {max_steps!r}")
    if not isinstance(keep_states, bool):
        p.add(f"keep_states must be True or False, got {keep_states!r}")
    field = p.raise_or(field)
    tt = p.raise_or(tt)

    runs, n, d = x0.shape
    T, E = len(tt), len(epss)
    states = torch.empty((T, runs, n, d), dtype=x0.dtype) if keep_states else None
    mean_cos = torch.empty((T, runs), dtype=torch.float64)
    close = torch.empty((E, T, runs), dtype=torch.float64)
    label_dtype = torch.int16 if n < 2**15 else torch.int64
    labels = torch.empty((E, T, runs, n), dtype=label_dtype)

    x = x0.detach().clone()
    h = torch.full((runs,), 1e-2, dtype=torch.float64)
    stats = {"iterations": 0, "rejected": 0}
    t = 0.0
    with torch.no_grad(), _single_thread_if_small(runs * n * n * d):
        for k, tk in enumerate(tt.tolist()):
            if tk > t:
                if dt is not None:
                    x = _advance_fixed(x, tk - t, float(dt), field, method, stats)
                else:
                    x, h = _advance_adaptive(x, t, tk, h, field, float(tol), stats, max_steps)
                t = tk
            G = sphere.gram(x)
            mean_cos[k] = sphere.mean_cosine(G)
            for e_i, e in enumerate(epss):
                close[e_i, k] = sphere.close_fraction(G, e)
                labels[e_i, k] = sphere.cluster_labels(G, e).to(label_dtype)
            if states is not None:
                states[k] = x

    params = RunParams(
        dynamics=dynamics,
        beta=float(beta)
        if not (isinstance(beta, Tensor) and beta.ndim)
        else beta.detach().to(torch.float64).tolist(),
        runs=runs,
        n=n,
        d=d,
        qkv="identity" if field.B is None and field.Qt is None and field.Vt is None else "custom",
        causal=causal,
        method=method,
        dt=dt,
        tol=None if dt is not None else tol,
        dtype=str(x0.dtype).replace("torch.", ""),
        iterations=stats["iterations"],
        rejected=stats["rejected"],
        source=source,
    )
    return ParticleRun(tt, states, epss, mean_cos, close, labels, params)


def _advance_fixed(
    x: Tensor, span: float, dt: float, field: Field, method: str, stats: dict[str, int]
) -> Tensor:
    m = max(1, math.ceil(span / dt - 1e-9))
    h = span / m
    step = STEPPERS[method]
    for _ in range(m):
        x = step(x, h, field)
    stats["iterations"] += m
    return x


def _advance_adaptive(
    x: Tensor,
    t0: float,
    t1: float,
    h: Tensor,
    field: Field,
    tol: float,
    stats: dict[str, int],
    max_steps: int,
) -> tuple[Tensor, Tensor]:
    """Advance every run from ``t0`` to ``t1`` with its own error-controlled steps."""
    runs = x.shape[0]
    t = torch.full((runs,), t0, dtype=torch.float64)
    active = torch.arange(runs)
    per_run = field.beta.ndim == 3 or any(
        m is not None and m.ndim == 3 for m in (field.B, field.Qt, field.Kt, field.Vt)
    )
    while active.numel():
        stats["iterations"] += 1
        if stats["iterations"] > max_steps:
            raise TLDynamicsError(
                f"simulate: more than max_steps={max_steps} steps before t={t1:g} (reached t={float(t.min()):.6g}); "
                f"raise max_steps, loosen tol={tol:g}, or lower beta"
            )
        full = active.numel() == runs
        xa = x if full else x.index_select(0, active)
        fa = field if (full or not per_run) else field.select(active)
        remaining = t1 - t[active]
        ha = h[active]
        last = ha >= remaining
        step = torch.where(last, remaining, ha)
        x4, x2 = cf4_step(xa, step.to(x.dtype).reshape(-1, 1, 1), fa, embedded=True)
        err = (x4 - x2).norm(dim=-1).amax(-1).to(torch.float64)
        ok = err <= tol
        fac = torch.where(
            torch.isfinite(err),
            (_SAFETY * (tol / err.clamp_min(1e-300)) ** (1.0 / 3.0)).clamp(_FAC_MIN, _FAC_MAX),
            torch.full_like(err, _FAC_MIN),
        )
        h_new = step * fac
        # an accepted step that was shortened to hit t1 says nothing against the longer proposal
        h_new = torch.where(ok & last, torch.maximum(h_new, ha), h_new)
        h[active] = h_new
        if bool(ok.any()):
            acc = active[ok]
            x = x.index_copy(0, acc, x4[ok]) if not (full and bool(ok.all())) else x4
            t[acc] = torch.where(last[ok], torch.full_like(step[ok], t1), t[acc] + step[ok])
        stats["rejected"] += int((~ok).sum())
        if bool((h[active] < 1e-14 * max(1.0, t1)).any()):
            raise TLDynamicsError(
                f"simulate: step size underflow near t={float(t[active].min()):.6g} with tol={tol:g}; "
                "the field is too stiff or not finite (check beta, Q, K, V)"
            )
        active = active[t[active] < t1]
    return x, h
