"""Benchmark (issue 43): what a statistics run pays at start to know what it computes from.

Model: the GPT-2-small shape (``benchmarks/shapes.py``: 12 layers, d_model 768, vocabulary 50,257,
float32, random weights, 124M parameters) written to a folder and loaded with
``tl_dynamics.load_model(folder)``, as ``tl-dynamics stats --model FOLDER`` loads it. In this one
process, interleaved over ``--repeats`` rounds (medians): a plain forward of one 256-token
prompt, the weights' fingerprint (SHA-256 of the state dict), the configuration's and the
tokenizer's, and the finite check (``torch.isfinite`` over every weight, which the self-check runs
first). CPU time of this process (``time.process_time``) beside the wall clock: the machine is
shared, and CPU seconds move less with other jobs' load.

    python benchmarks/fingerprint_bench.py                  # 5 repeats, one torch thread
    python benchmarks/fingerprint_bench.py --tiny           # the CPU smoke test
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's tl_dynamics
import shapes  # noqa: E402

from tl_dynamics import load_model  # noqa: E402
from tl_dynamics.adapter import ModelAdapter, _finite  # noqa: E402


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--root", default=str(Path(tempfile.gettempdir()) / "tld_bench_shapes"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    folder = shapes.folder("gpt2-small", args.root, args.tiny)
    model = load_model(str(folder), device="cpu")
    adapter = ModelAdapter(model)
    n_params = sum(t.numel() for _, t in _finite.named_tensors(model))
    tokens = torch.randint(0, shapes.vocab("gpt2-small", args.tiny), (1, 256))
    tokenizer = adapter.tokenizer
    rows: dict[str, Callable[[], Any]] = {
        "plain forward, 1 x 256 tokens": lambda: model(tokens),
        "fingerprint: weights": lambda: _finite._weights_digest(model),
        "list the distinct tensors": lambda: _finite.named_tensors(model),
        "fingerprint: config": lambda: _finite._config_digest(model),
        "fingerprint: tokenizer": lambda: _finite._tokenizer_digest(tokenizer, True),
        "all three (adapter.fingerprints())": adapter.fingerprints,
        "finite check (every weight)": lambda: _finite.check_finite(model),
    }
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in rows}
    with torch.no_grad():
        model(tokens)  # warm
        for _ in range(args.repeats):
            for name, fn in rows.items():
                times[name].append(timed(fn))
    base = statistics.median(c for _, c in times["plain forward, 1 x 256 tokens"])
    print(f"{folder.name}: {n_params / 1e6:.1f}M weights, threads {args.threads}")
    print("| step | wall s | CPU s | CPU vs forward |")
    print("|---|---|---|---|")
    for name, values in times.items():
        wall = statistics.median(w for w, _ in values)
        cpu = statistics.median(c for _, c in values)
        print(f"| {name} | {wall:.3f} | {cpu:.3f} | {cpu / base:.2f}x |")


if __name__ == "__main__":
    main()
