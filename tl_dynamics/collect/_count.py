"""Counting what a block of code asks of the device: torch ops (each a kernel launch on a GPU)
and host synchronisations (device-to-host reads and data-dependent shapes).

Counts are repeatable on any machine, unlike times, so tests may assert them."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Iterator
from contextlib import contextmanager

from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# Tensor methods and torch functions that wait for the device: a value read on the host
# (item, tolist, numpy, bool/int/float of a tensor, a copy to the CPU, equal) or an output
# whose size depends on the data (nonzero, unique, masked_select, boolean indexing).
SYNC_FUNCTIONS = frozenset({
    "item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__",
    "__array__", "nonzero", "argwhere", "unique", "unique_consecutive", "masked_select",
    "equal", "allclose", "is_nonzero", "bincount", "repeat_interleave"})


@dataclass
class OpCount:
    """Torch ops dispatched and host syncs requested inside ``count_ops``."""

    ops: int = 0
    syncs: int = 0
    by_op: collections.Counter = field(default_factory=collections.Counter)
    by_sync: collections.Counter = field(default_factory=collections.Counter)


class _Ops(TorchDispatchMode):
    def __init__(self, count: OpCount):
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count.ops += 1
        self.count.by_op[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class _Syncs(TorchFunctionMode):
    def __init__(self, count: OpCount):
        super().__init__()
        self.count = count

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in SYNC_FUNCTIONS:
            self.count.syncs += 1
            self.count.by_sync[name] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def count_ops() -> Iterator[OpCount]:
    """Count torch ops and host syncs run inside the block (any device).

    Example:
        >>> import torch
        >>> with count_ops() as c:
        ...     x = torch.ones(3) * 2
        ...     _ = x.sum().item()
        >>> c.ops, c.syncs
        (4, 1)
    """
    count = OpCount()
    with _Syncs(count), _Ops(count):
        yield count
