"""Time tl_dynamics.particles.simulate: n = 32 particles, 1,000 independent runs, fixed steps.

    .venv/bin/python benchmarks/particles_bench.py            # prints a markdown table
    .venv/bin/python benchmarks/particles_bench.py --dims 2 16 --steps 50

Single-threaded (torch.set_num_threads(1)) so numbers are comparable on a shared machine;
each cell is the best of --repeat runs, as wall-clock and as this process's CPU time (the
latter is less sensitive to other load on the machine). Q = K = V = I, (SA), beta = 1, dt = 0.1, observables
(eps = 0.01) recorded every 10 steps, states not kept.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from tl_dynamics.particles import random_init, simulate


def bench(
    d: int, runs: int, n: int, steps: int, method: str, dtype: torch.dtype, repeat: int
) -> tuple[float, float]:
    """Best wall-clock and best CPU seconds (this process) over ``repeat`` runs."""
    x0 = random_init(runs, n, d, torch.Generator().manual_seed(0), dtype=dtype)
    dt = 0.1
    wall = cpu = float("inf")
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        simulate(
            x0, 1.0, t_max=steps * dt, dt=dt, record_every=10 * dt, method=method, keep_states=False
        )
        wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", type=int, nargs="+", default=[2, 16, 64])
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, 1 thread, "
        f"n={args.n}, runs={args.runs}, {args.steps} fixed steps (dt=0.1, t=0..{args.steps * 0.1:g})\n"
    )
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n")
    print("| d | method | dtype | wall s | CPU s | CPU ms / step | run-steps / CPU s |")
    print("|---|---|---|---|---|---|---|")
    for d in args.dims:
        for method in ("cf4", "rk4"):
            for dtype in (torch.float64, torch.float32):
                wall, cpu = bench(d, args.runs, args.n, args.steps, method, dtype, args.repeat)
                name = str(dtype).replace("torch.", "")
                print(
                    f"| {d} | {method} | {name} | {wall:.2f} | {cpu:.2f} | {1e3 * cpu / args.steps:.1f} "
                    f"| {args.runs * args.steps / cpu:,.0f} |",
                    flush=True,
                )
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
