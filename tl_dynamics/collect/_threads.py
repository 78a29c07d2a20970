"""The one place that sets torch's intra-op thread count (restored on exit, even on errors)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from tl_dynamics.errors import TLDynamicsError


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block with ``n`` intra-op threads (None: leave torch's setting as it is).

    Example:
        >>> import torch
        >>> before = torch.get_num_threads()
        >>> with torch_threads(1):
        ...     torch.get_num_threads()
        1
        >>> torch.get_num_threads() == before
        True
    """
    if n is None:
        yield
        return
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise TLDynamicsError(f"threads must be a positive integer or None, got {n!r}")
    before = torch.get_num_threads()
    if n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
