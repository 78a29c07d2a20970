"""The bottom layer under every attached analysis: the ``Collector`` base the adapter drives
once per forward pass, the ``Analysis`` registry base, exactly mergeable sums (``ExactSum``),
the one ``torch_threads`` setting and ``to_host``. Op/sync counts for tests and benchmarks:
``tl_dynamics.collect._count.count_ops``."""

from tl_dynamics.collect._collector import Analysis, Collector
from tl_dynamics.collect._exact import ExactSum
from tl_dynamics.collect._host import to_host
from tl_dynamics.collect._threads import torch_threads

__all__ = ["Analysis", "Collector", "ExactSum", "to_host", "torch_threads"]
