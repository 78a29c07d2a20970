"""Benchmark: QK attribution (``tl_dynamics.qk_attribution.compute``) on a GPT-2-small-shaped
random model, 1 x 1,024 tokens, the last layer (the most components: 2 embeddings, 132 heads,
11 attention biases, 11 MLPs), as a ratio to a plain forward (issue 41).

Two cases: one head (L11H0) and all 12 heads of layer 11, each with the marginals, the top 5
pairs per row and the odds-ratio parts. ``compute`` runs its own forward pass (the ratio includes
it). Memory: each case runs in a fresh process, and its peak resident memory above the process's
resident memory once the model is loaded is compared with a plain forward's, measured the same
way (``--memory``).

    nice -n 10 python benchmarks/qk_attribution_bench.py [--repeats 3] [--threads 1] [--memory]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # shapes.py beside this file
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere
import shapes  # noqa: E402

from tl_dynamics import qk_attribution  # noqa: E402
from tl_dynamics.adapter import ModelAdapter  # noqa: E402

POSITIONS, LAYER = 1024, 11
CASES = {"forward": None, "one head": [0], "all heads": None}


def timed(fn) -> tuple[float, float]:
    """Wall seconds and this process's CPU seconds."""
    start, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        fn()
    return time.perf_counter() - start, time.process_time() - cpu


def setup(root: str, threads: int):
    torch.set_num_threads(threads)
    adapter = ModelAdapter(shapes.build("gpt2-small", Path(root), "cpu").eval())
    tokens = torch.randint(
        0, adapter.W_E.shape[0], (1, POSITIONS), generator=torch.Generator().manual_seed(0)
    )
    return adapter, adapter.tokenize(tokens)


def run(adapter, batch, case: str) -> None:
    if case == "forward":
        adapter.forward(batch)
    else:
        qk_attribution.compute(adapter, batch, layers=LAYER, heads=CASES[case])


def status_mb(field: str) -> float:
    """``VmRSS`` (resident now) or ``VmHWM`` (its peak) of this process, in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak() -> None:
    """Reset ``VmHWM`` to the present resident size (Linux: ``clear_refs`` 5), so that the peak
    read after a case is that case's, not the model build's."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def memory_child(case: str, root: str, threads: int) -> None:
    """Run one case in this (fresh) process; print its peak above the loaded baseline."""
    adapter, batch = setup(root, threads)
    adapter.W_Q(LAYER), adapter.W_K(LAYER), adapter.rotation(LAYER)  # weights read once
    reset_peak()
    base = status_mb("VmRSS")
    with torch.no_grad():
        run(adapter, batch, case)
    peak = status_mb("VmHWM")
    print(json.dumps({"case": case, "base_mb": base, "peak_mb": peak, "extra_mb": peak - base}))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--memory", action="store_true", help="peak memory per case (subprocesses)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "tl_dynamics_bench"))
    args = parser.parse_args()
    if args.child:
        memory_child(args.child, args.root, args.threads)
        return
    adapter, batch = setup(args.root, args.threads)
    for case in CASES:  # warm-up
        run(adapter, batch, case)
    times: dict[str, list[tuple[float, float]]] = {case: [] for case in CASES}
    for _ in range(args.repeats):
        for case in CASES:
            times[case].append(timed(lambda case=case: run(adapter, batch, case)))
    print(f"threads {args.threads}, 1 x {POSITIONS} tokens, GPT-2-small shape, layer {LAYER}")
    for clock, i in (("wall", 0), ("cpu", 1)):
        forward = statistics.median(t[i] for t in times["forward"])
        parts = [f"forward {forward:.3f} s"]
        for case in ("one head", "all heads"):
            cost = statistics.median(t[i] for t in times[case])
            parts.append(f"{case} {cost:.3f} s ({cost / forward:.2f}x)")
        print(f"{clock:4s}: " + ", ".join(parts))
    if args.memory:
        extra = {}
        for case in CASES:
            out = subprocess.run(
                [sys.executable, __file__, "--child", case, "--root", args.root,
                 "--threads", str(args.threads)],
                check=True, capture_output=True, text=True,
            ).stdout  # fmt: skip
            extra[case] = json.loads(out.strip().splitlines()[-1])["extra_mb"]
        for case in ("one head", "all heads"):
            print(
                f"memory: {case} {extra[case]:.0f} MB above the loaded model, forward "
                f"{extra['forward']:.0f} MB ({extra[case] / extra['forward']:.2f}x)"
            )


if __name__ == "__main__":
    main()
