"""Counting what a block of code asks of the device: torch ops (each a kernel launch on a GPU)
and host synchronisations (reads of a device tensor's values on the host, and outputs whose
size depends on the data).

Counts are repeatable on any machine, unlike times, so tests may assert them. On the CPU there is
no device, so the count follows where data would live on a GPU: a tensor is *host* data once it
was copied there (``.cpu()``) or computed from host data only; reading host data is free, reading
anything else counts as a sync. Tensors made from nothing (``torch.zeros(...)``) count as device
tensors: library code makes them on its inputs' device."""

from __future__ import annotations

import collections
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tl_dynamics.collect._policy import planned_as

# Reads of a tensor's values on the host (a wait for the device when it lives there).
READS = frozenset(
    {
        "item",
        "tolist",
        "cpu",
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "__array__",
        "equal",
        "allclose",
        "is_nonzero",
    }
)
# Ops whose output size depends on the data: the host waits to learn it.
DATA_DEPENDENT = frozenset(
    {
        "nonzero",
        "argwhere",
        "unique",
        "unique_consecutive",
        "masked_select",
        "bincount",
        "repeat_interleave",
    }
)


class _HostSet:
    """Tensors known to hold host data, by identity (a ``WeakSet`` would compare tensors
    with ``==``, which is elementwise)."""

    def __init__(self) -> None:
        self._refs: dict[int, "weakref.ref[torch.Tensor]"] = {}

    def add(self, t: torch.Tensor) -> None:
        self._refs[id(t)] = weakref.ref(t)

    def __contains__(self, t: torch.Tensor) -> bool:
        ref = self._refs.get(id(t))
        return ref is not None and ref() is t


@dataclass
class OpCount:
    """Torch ops dispatched (``ops``: on device data, each a kernel launch on a GPU; ``host_ops``:
    on host data only, which launch nothing) and host syncs requested inside ``count_ops``."""

    ops: int = 0
    syncs: int = 0
    host_ops: int = 0
    by_op: collections.Counter = field(default_factory=collections.Counter)
    by_sync: collections.Counter = field(default_factory=collections.Counter)


class _Ops(TorchDispatchMode):
    def __init__(self, count: OpCount, host: _HostSet):
        super().__init__()
        self.count, self.host = count, host

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # computed from host data only (0-dim inputs are Python scalars lifted to tensors,
        # which live on the host on every device): no launch, and its output is host data
        inputs = [
            t
            for t in tree_flatten((args, kwargs or {}))[0]
            if isinstance(t, torch.Tensor) and t.dim() > 0
        ]
        if inputs and all(t in self.host for t in inputs):
            self.count.host_ops += 1
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.host.add(t)
            return out
        self.count.ops += 1
        self.count.by_op[func.overloadpacket.__name__] += 1
        return out


class _Syncs(TorchFunctionMode):
    def __init__(self, count: OpCount, host: _HostSet):
        super().__init__()
        self.count, self.host = count, host

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        on_device = any(t not in self.host for t in tensors)
        if (name in READS and on_device) or name in DATA_DEPENDENT:
            self.count.syncs += 1
            self.count.by_sync[name] += 1
        out = func(*args, **(kwargs or {}))
        if name == "cpu" and isinstance(out, torch.Tensor):
            self.host.add(out)
        return out


@contextmanager
def count_ops(launch_bound: bool | None = None) -> Iterator[OpCount]:
    """Count torch ops and host syncs run inside the block (any device). ``launch_bound=True``
    runs the block with the GPU's plan (``_policy``: budget-sized chunks, rare reads) on any
    device, so the launches a GPU would make are counted on the CPU.

    Example:
        >>> import torch
        >>> with count_ops() as c:
        ...     x = torch.ones(3) * 2
        ...     total = x.sum().item()       # a read of device data: a sync
        ...     host = x.cpu()               # one copy (a sync), then reads of it are free
        ...     _ = host.tolist(), int(host[0])
        >>> c.ops, c.syncs, c.host_ops      # ones, mul, sum, item's read, cpu; int's select
        (5, 2, 1)
    """
    count = OpCount()
    host = _HostSet()
    plan = planned_as(launch_bound) if launch_bound is not None else nullcontext()
    with plan, _Syncs(count, host), _Ops(count, host):
        yield count
