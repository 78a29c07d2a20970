"""Where a launch costs more than a pass over memory, and where not.

On a GPU every torch op is a kernel launch (microseconds of host time each) and every read of a
device value waits for the device: the analyses then work in few, large launches (chunks sized by a
memory budget, results read rarely). On a CPU an op costs next to nothing to start, a "sync" costs
nothing, and large temporaries fall out of the cache: the same code works in cache-sized chunks and
checks convergence every round. ``launch_bound(device)`` says which plan applies;
``count_ops(launch_bound=True)`` (``_count.py``) makes the code take the GPU plan on the CPU, so that
the launches a GPU would see can be counted on any machine."""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

import torch

_FORCED: ContextVar[bool | None] = ContextVar("tl_dynamics_launch_bound", default=None)


def launch_bound(device: torch.device | str) -> bool:
    """Whether work on ``device`` should be planned in few large launches (any device but the
    CPU), unless ``planned_as`` says otherwise for the block being run.

    Example:
        >>> launch_bound("cpu"), launch_bound("cuda:0")
        (False, True)
        >>> with planned_as(launch_bound=True):
        ...     launch_bound("cpu")
        True
    """
    forced = _FORCED.get()
    if forced is not None:
        return forced
    return torch.device(device).type != "cpu"


@contextmanager
def planned_as(launch_bound: bool) -> Iterator[None]:
    """Plan every device as launch-bound (True) or not (False) inside the block."""
    token = _FORCED.set(launch_bound)
    try:
        yield
    finally:
        _FORCED.reset(token)
