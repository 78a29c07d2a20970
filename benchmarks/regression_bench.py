"""Benchmark: in-context regression (``tl_dynamics.regression.compute``) for all 144 heads of a
GPT-2-small-shaped random model on 4 x 256 tokens, as a ratio to a plain forward (issue 32).

Model: ``benchmarks/shapes.py``'s ``gpt2-small`` (12 layers, 12 heads, d_head 64, random
weights). ``compute`` runs its own forward pass with every layer captured, then per layer the
prefix sums, one float64 ``eigh`` per destination and head, the predictors and the sums of the
measure, and finally the gains, R² and bootstrap (``n_boot`` 200). The plain forward and the
analysis alternate ``--repeats`` times after one warm-up; medians are reported.

    nice -n 10 python benchmarks/regression_bench.py [--repeats 3] [--threads 2] [--stride 1]
        [--warmup 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
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

from tl_dynamics import regression  # noqa: E402
from tl_dynamics.adapter import ModelAdapter  # noqa: E402

BATCH, POSITIONS = 4, 256


def timed(fn) -> tuple[float, float]:
    """Wall seconds and this process's CPU seconds (the comparable number on a loaded machine)."""
    start, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        fn()
    return time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--stride", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs of each first")
    parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "tl_dynamics_bench"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = shapes.build("gpt2-small", Path(args.root), "cpu").eval()
    adapter = ModelAdapter(model)
    vocab = adapter.W_E.shape[0]
    tokens = torch.randint(0, vocab, (BATCH, POSITIONS), generator=torch.Generator().manual_seed(0))
    batch = adapter.tokenize(tokens)

    def plain():
        adapter.forward(batch)

    def analysis():
        regression.compute(adapter, batch, stride=args.stride)

    for _ in range(args.warmup):
        plain(), analysis()
    times: dict[str, list[tuple[float, float]]] = {"plain": [], "regression": []}
    for _ in range(args.repeats):
        times["plain"].append(timed(plain))
        times["regression"].append(timed(analysis))
    print(f"threads {args.threads}, stride {args.stride}, {BATCH} x {POSITIONS} tokens, 144 heads")
    for clock, i in (("wall", 0), ("cpu", 1)):
        forward = statistics.median(t[i] for t in times["plain"])
        cost = statistics.median(t[i] for t in times["regression"])
        print(
            f"{clock:4s}: plain forward {forward:8.3f} s, regression {cost:8.3f} s, "
            f"ratio {cost / forward:6.1f}x"
        )


if __name__ == "__main__":
    main()
