"""Input checks shared by the particle modules: every problem is collected into one error."""

from __future__ import annotations

import math
from typing import Any, TypeVar

import torch

from tl_dynamics.errors import TLDynamicsError

#: How far |x_i| may be from 1 before ``x0`` counts as off the sphere. Generous against
#: float32 rounding (about 1e-7 per coordinate), strict against unnormalised data
#: (LayerNorm outputs have norm ~sqrt(d_model)).
SPHERE_TOL = 1e-5

DYNAMICS = ("SA", "USA")
FLOAT_DTYPES = (torch.float64, torch.float32)

T = TypeVar("T")


class Problems:
    """Collects what is wrong with a call and raises once, listing everything."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.items: list[str] = []

    def add(self, message: str) -> None:
        self.items.append(message)

    def raise_if_any(self) -> None:
        if len(self.items) == 1:
            raise TLDynamicsError(f"{self.what}: {self.items[0]}")
        if self.items:
            lines = "\n".join(f"  - {m}" for m in self.items)
            raise TLDynamicsError(f"{self.what}: {len(self.items)} problems:\n{lines}")

    def raise_or(self, value: T | None) -> T:
        """``raise_if_any()``, then ``value``. A checker returns None only after adding a
        problem, so a None that gets here is a bug in that checker, not a user mistake."""
        self.raise_if_any()
        if value is None:
            raise RuntimeError(f"{self.what}: a check returned no value and no problem")
        return value


def shape_str(t: Any) -> str:
    return str(list(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__


def positive_number(p: Problems, name: str, value: Any, allow_zero: bool = False) -> float | None:
    """Check that ``value`` is a finite real number > 0 (>= 0 with ``allow_zero``)."""
    bound = ">= 0" if allow_zero else "> 0"
    try:
        v = float(value)
    except (TypeError, ValueError):
        p.add(f"{name} must be a finite number {bound}, got {value!r}")
        return None
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        p.add(f"{name} must be a finite number {bound}, got {v!r}")
        return None
    return v


def check_dynamics(p: Problems, dynamics: Any) -> None:
    if dynamics not in DYNAMICS:
        p.add(f"dynamics must be one of {DYNAMICS}, got {dynamics!r}")


def check_states(p: Problems, x: Any, name: str = "x0", on_sphere: bool = True) -> bool:
    """Check a ``[runs, n, d]`` float tensor of unit vectors; return whether it is usable."""
    if not isinstance(x, torch.Tensor):
        p.add(f"{name} must be a torch.Tensor of shape [runs, n, d], got {type(x).__name__}")
        return False
    if x.ndim != 3:
        hint = f" (for one run use {name}[None])" if x.ndim == 2 else ""
        p.add(f"{name} must have shape [runs, n, d], got {shape_str(x)}{hint}")
        return False
    if x.dtype not in FLOAT_DTYPES:
        p.add(f"{name} must be float64 or float32, got {x.dtype}")
        return False
    runs, n, d = x.shape
    if runs < 1 or n < 1:
        p.add(f"{name} needs at least one run and one particle, got shape {shape_str(x)}")
        return False
    if d < 2:
        p.add(f"{name} needs d >= 2 (particles live on S^(d-1)), got d = {d}")
        return False
    if not bool(torch.isfinite(x).all()):
        p.add(f"{name} contains NaN or inf")
        return False
    if on_sphere:
        dev = float((x.norm(dim=-1) - 1).abs().max())
        if dev > SPHERE_TOL:
            p.add(
                f"{name} must lie on the unit sphere (| |x_i| - 1 | <= {SPHERE_TOL:g}), "
                f"largest deviation is {dev:.3g}; normalise with x / x.norm(dim=-1, keepdim=True)"
            )
            return False
    return True


def check_beta(p: Problems, beta: Any, runs: int | None) -> torch.Tensor | None:
    """``beta``: a number >= 0 or a 1-D tensor of ``runs`` numbers >= 0 (one per run)."""
    if isinstance(beta, torch.Tensor) and beta.ndim > 0:
        if beta.ndim != 1 or (runs is not None and beta.shape[0] != runs):
            want = f"[{runs}]" if runs is not None else "[runs]"
            p.add(
                f"beta must be a number or a tensor of shape {want} (one per run), got {shape_str(beta)}"
            )
            return None
        b = beta.detach().to(torch.float64)
        if not bool(torch.isfinite(b).all()) or bool((b < 0).any()):
            p.add(f"beta must be finite and >= 0, got min {float(b.min()):.4g}")
            return None
        return b
    v = positive_number(
        p, "beta", beta.item() if isinstance(beta, torch.Tensor) else beta, allow_zero=True
    )
    return None if v is None else torch.tensor(v, dtype=torch.float64)


def check_matrix(p: Problems, name: str, m: Any, cols: int, rows: int | None, runs: int) -> bool:
    """``m`` is ``[rows, cols]`` or ``[runs, rows, cols]`` (``rows=None``: any)."""
    if m is None:
        return True
    if not isinstance(m, torch.Tensor):
        p.add(f"{name} must be a torch.Tensor or None (identity), got {type(m).__name__}")
        return False
    r = "m" if rows is None else str(rows)
    ok_2 = m.ndim == 2 and m.shape[1] == cols and (rows is None or m.shape[0] == rows)
    ok_3 = (
        m.ndim == 3
        and m.shape[0] == runs
        and m.shape[2] == cols
        and (rows is None or m.shape[1] == rows)
    )
    if not (ok_2 or ok_3):
        p.add(
            f"{name} must have shape [{r}, {cols}] or [{runs}, {r}, {cols}] (d = {cols}), got {shape_str(m)}"
        )
        return False
    if not bool(torch.isfinite(m).all()):
        p.add(f"{name} contains NaN or inf")
        return False
    return True


def check_eps(p: Problems, eps: Any) -> tuple[float, ...]:
    """One eps or a sequence of them, each in (0, 2]: pairs are close when <x_i, x_j> > 1 - eps."""
    values = eps if isinstance(eps, (list, tuple)) else (eps,)
    out = []
    for e in values:
        try:
            v = float(e)
        except (TypeError, ValueError):
            p.add(f"eps must be a number in (0, 2], got {e!r}")
            continue
        if not (0 < v <= 2):
            p.add(f"eps must be in (0, 2] (pairs are close when <x_i, x_j> > 1 - eps), got {v!r}")
            continue
        out.append(v)
    if not values:
        p.add("eps must contain at least one value")
    return tuple(out)
