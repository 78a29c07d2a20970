"""Benchmark: the three analyses attached with their defaults at long context (issue 48).

Model: ``shapes.py``'s ``llama-long`` (4 layers, 8 query and 2 key/value heads, d_model 256,
d_head 32, rotary, vocab 1,024, float32, random weights drawn in memory), so that attention,
quadratic in the tokens, is most of the forward. Inputs: 1 x 512, 1,024, 2,048 and 4,096 random
token ids. Every row runs in this one process, interleaved with the plain forward it is divided
by (``cost_bench.run_rows``: medians over ``--repeats`` rounds after a warm-up, then each row's
peak memory above its start from one more call), timed by the main thread's CPU time on one
torch thread.

    python benchmarks/long_bench.py --repeats 3
    python benchmarks/long_bench.py --tokens 4096 --profile "all three attached, defaults"
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's tl_dynamics
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

import cost_bench  # noqa: E402  (benchmarks/cost_bench.py: run_rows, _attached, profile_row)
import shapes  # noqa: E402
from tl_dynamics import contextual_mlp, odds_ratio, trajectories  # noqa: E402
from tl_dynamics.adapter import ModelAdapter  # noqa: E402


def rows(model, adapter: ModelAdapter, tokens: torch.Tensor) -> dict:
    odds = lambda: odds_ratio.attach(adapter)  # noqa: E731
    mlp = lambda: contextual_mlp.attach(adapter)  # noqa: E731
    traj = lambda: trajectories.attach(adapter)  # noqa: E731  (lens="view")
    attached = cost_bench._attached(model, tokens)
    return {
        "plain forward": lambda: model(tokens),
        "odds_ratio.attach": attached(odds),
        "contextual_mlp.attach + result()": attached(mlp),
        "trajectories.attach (lens='view')": attached(traj),
        "all three attached, defaults": attached(odds, mlp, traj),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, action="append", help="default: 512 ... 4,096")
    parser.add_argument("--profile", help="print a torch profiler table for the row of this name")
    parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "tl_dynamics_bench"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    cost_bench.CLOCK = "cpu"
    model = shapes.build("llama-long", args.root, "cpu")
    adapter = ModelAdapter.of(model)
    print(
        f"llama-long: {shapes.describe(model)}; torch {torch.__version__}, 1 thread, "
        f"{platform.machine()} with {os.cpu_count()} cores, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    gen = torch.Generator().manual_seed(0)
    for n in args.tokens or [n for _, n in shapes.ATTACH_TOKENS["llama-long"]]:
        tokens = torch.randint(0, shapes.vocab("llama-long"), (1, n), generator=gen)
        table = rows(model, adapter, tokens)
        if args.profile:
            cost_bench.profile_row(table, args.profile, f"1 x {n}")
            continue
        cost_bench.run_rows(f"llama-long, attach, batch 1 x {n}", table, args.repeats, "cpu")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
