"""Benchmark (issue 33): the odds-ratio statistics of one pass on the CPU, GPT-2-small's shape
(12 layers x 12 heads, d_head 64, causal), one thread, the main thread's CPU time, medians of 3:
the CPU's own plan eager (what the collector runs there), the GPU's plan eager, and the GPU's
plan compiled by inductor (``Collector.fused``; the compile itself is timed apart).

    PYTHONPATH=. python benchmarks/fused_bench.py 4x256 1x1024
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tl_dynamics.collect._fused import Fused, compiled_as  # noqa: E402
from tl_dynamics.odds_ratio import _fused, _stats  # noqa: E402
from tl_dynamics.odds_ratio._fast import MaskFacts  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    shapes = [tuple(map(int, a.split("x"))) for a in sys.argv[1:]] or [(4, 256), (1, 1024)]
    for b, n in shapes:
        one(b, n)


def one(b: int, n: int) -> None:
    gen = torch.Generator().manual_seed(0)
    q = [torch.randn(b, n, 12, 64, generator=gen) * 0.5 for _ in range(12)]
    k = [torch.randn(b, n, 12, 64, generator=gen) * 0.5 for _ in range(12)]
    allowed = torch.ones(b, n, n, dtype=torch.bool).tril()
    valid = torch.ones(b, n, dtype=torch.bool)
    masks = MaskFacts.of(allowed, valid, True, None)
    qc, kc = torch.cat(q, 2), torch.cat(k, 2)
    fused = Fused(_fused.group_sums)

    def cpu_plan() -> torch.Tensor:
        sums, sinks = _stats.layer_sums(
            q, k, 0.125, None, allowed, valid, masks=masks, layer_heads=12, launch_bound=False
        )
        return _fused.stacked(sums, sinks, 12, 12)

    def gpu_plan() -> torch.Tensor:
        return _fused.group_sums(qc, kc, masks, 0.125, 12, 12, True)[0]

    def compiled() -> torch.Tensor:
        with compiled_as(True):
            return fused(torch.device("cpu"), qc, kc, masks, 0.125, 12, 12, True)[0]

    start = time.perf_counter()
    diff = float((cpu_plan() - compiled()).abs().max())
    print(
        f"{b} x {n}: compile and first call {time.perf_counter() - start:.1f} s wall; "
        f"largest difference from the CPU plan {diff:.2g}",
        flush=True,
    )
    for name, fn in (
        ("CPU plan, eager", cpu_plan),
        ("GPU plan, eager", gpu_plan),
        ("GPU plan, compiled", compiled),
    ):
        times = []
        for _ in range(3):
            start = time.thread_time()
            fn()
            times.append(time.thread_time() - start)
        print(f"{b} x {n}, {name}: {sorted(times)[1]:.3f} s CPU", flush=True)


if __name__ == "__main__":
    main()
