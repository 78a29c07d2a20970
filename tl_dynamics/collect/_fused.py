"""Per-pass statistics run as one compiled plan where that pays (issue 33).

A collector's work at the end of a pass is a pure function of the tensors it kept (no host reads
in the launch-bound plan, ``_policy``). On a GPU each of its torch ops is a kernel launch, so
``Fused(fn)`` runs it through ``torch.compile`` (``fullgraph=True``, ``dynamic=False``: shapes are
static per pass, and one shape's plan is reused by every pass of that shape), which fuses the
elementwise work into few kernels. Where it does not pay it runs ``fn`` itself:

- the CPU, unless the function was measured faster compiled there (``Fused(fn, cpu=True)``);
- a shape seen for the first time (``auto``): a corpus of prompts of many lengths would compile
  for each and run each once; the second pass of a shape compiles it, later ones reuse it;
- past ``MAX_SHAPES`` compiled shapes of one function (``MAX_FORCED_SHAPES`` under ``always``): a
  compile takes seconds, so a corpus whose batches come in many recurring lengths pays for two;
- after a compile failed (a warning names it; the eager function then runs, as it always did).

``TL_DYNAMICS_COMPILE`` (environment) is ``auto`` (the default: the rules above), ``always``
(every device and shape, from the first pass: tests), or ``never``. ``compiled_as(True|False)``
says the same for a block of code.
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Iterator

import torch

from tl_dynamics.errors import TLDynamicsError

ENV = "TL_DYNAMICS_COMPILE"
MODES = ("auto", "always", "never")
# distinct static shapes compiled per function under ``auto``, and under ``always`` (torch's own
# recompile limit is 8)
MAX_SHAPES = 2
MAX_FORCED_SHAPES = 8
_FORCED: ContextVar[bool | None] = ContextVar("tl_dynamics_compiled", default=None)


def compile_mode() -> str:
    """``TL_DYNAMICS_COMPILE`` (``auto`` when unset), checked."""
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise TLDynamicsError(f"{ENV}={os.environ.get(ENV)!r}: valid values are {', '.join(MODES)}")
    return mode


@contextmanager
def compiled_as(compiled: bool) -> Iterator[None]:
    """Run every ``Fused`` function compiled (True, from the first call of each shape) or eager
    (False) inside the block, on any device."""
    token = _FORCED.set(compiled)
    try:
        yield
    finally:
        _FORCED.reset(token)


def _key(args: tuple, kwargs: dict) -> tuple:
    def one(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return ("t", tuple(x.shape), x.dtype, x.device)
        if isinstance(x, (list, tuple)):
            return tuple(one(v) for v in x)
        return x if isinstance(x, (int, float, bool, str, type(None))) else type(x).__name__

    return one(args), tuple(sorted((k, one(v)) for k, v in kwargs.items()))


class Fused:
    """``fn`` (a pure function of tensors and static settings), compiled where it pays.

    Example:
        >>> import torch
        >>> def stats(x):
        ...     return (x - x.mean(-1, keepdim=True)).square().sum(-1)
        >>> fused = Fused(stats)
        >>> x = torch.arange(6.0).view(2, 3)
        >>> fused(x.device, x).tolist()       # the CPU: eager (compile with cpu=True)
        [2.0, 2.0]
        >>> fused.compiled_shapes
        0
    """

    def __init__(self, fn: Callable[..., Any], cpu: bool = False):
        self.fn, self.cpu = fn, cpu
        self.seen: dict[tuple, int] = {}
        self.compiled: set[tuple] = set()
        self.failed: str | None = None
        self._compiled: Callable[..., Any] | None = None

    @property
    def compiled_shapes(self) -> int:
        """How many static shapes run compiled so far."""
        return len(self.compiled)

    def wants(self, device: torch.device, key: tuple) -> bool:
        """Whether this call (its device and its shapes' key) runs compiled."""
        forced = _FORCED.get()
        mode = compile_mode()
        if self.failed is not None or forced is False or (forced is None and mode == "never"):
            return False
        if key in self.compiled:
            return True
        if forced or mode == "always":
            return len(self.compiled) < MAX_FORCED_SHAPES
        return (
            (device.type != "cpu" or self.cpu)
            and self.seen.get(key, 0) >= 2
            and len(self.compiled) < MAX_SHAPES
        )

    def __call__(self, device: torch.device, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, compiled or not; ``device`` is where its tensors live."""
        key = _key(args, kwargs)
        self.seen[key] = self.seen.get(key, 0) + 1
        if not self.wants(torch.device(device), key):
            return self.fn(*args, **kwargs)
        if self._compiled is None:
            self._compiled = torch.compile(self.fn, fullgraph=True, dynamic=False)
        if key in self.compiled:
            return self._compiled(*args, **kwargs)
        try:  # this shape's first compiled call compiles it
            out = self._compiled(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 (a compiler's failure: run eager from now on)
            self.failed = f"{type(err).__name__}: {str(err)[:300]}"
            warnings.warn(
                f"torch.compile of {getattr(self.fn, '__qualname__', self.fn)} failed; "
                f"running it eagerly from now on ({self.failed})",
                RuntimeWarning,
                stacklevel=2,
            )
            return self.fn(*args, **kwargs)
        self.compiled.add(key)
        return out
