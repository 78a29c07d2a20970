"""Benchmark: the cost of the intervals behind every label (issue 39), as ratios to the same
analysis without them and to a plain forward, on a GPT-2-small-shaped random model.

- ``odds_ratio``: ``compute`` on 4 x 256 tokens, all 144 heads, with the Poisson bootstrap
  replicates of the label sums (200, formed on the host at ``result()``) against the same call
  with the replicates switched off (``BootSums.add`` a no-op).
- ``regression``: ``compute`` on 16 x 64 tokens, the 12 heads of layer 0, ``ablation=False``
  (its Poisson replicates of the held-out units cost what the multinomial ones they replaced
  did) and with the ablation column (one patched forward per head, replicas batched), as a
  ratio to a plain forward.

The plain forward and each variant alternate ``--repeats`` times after one warm-up; medians.

    nice -n 10 python benchmarks/evidence_bench.py [--repeats 3] [--threads 1]
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

from tl_dynamics import odds_ratio, regression  # noqa: E402
from tl_dynamics.adapter import ModelAdapter  # noqa: E402
from tl_dynamics.odds_ratio import _boot  # noqa: E402


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        with torch.no_grad():
            fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "tl_dynamics_bench"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    adapter = ModelAdapter(shapes.build("gpt2-small", Path(args.root), "cpu").eval())
    vocab = int(adapter.W_E.shape[0])
    gen = torch.Generator().manual_seed(0)
    odds_tokens = adapter.tokenize(torch.randint(0, vocab, (4, 256), generator=gen))
    reg_tokens = adapter.tokenize(torch.randint(0, vocab, (16, 64), generator=gen))

    forward = median_seconds(lambda: adapter.forward(odds_tokens), args.repeats)
    with_boot = median_seconds(
        lambda: odds_ratio.compute(adapter, odds_tokens, keep_tensors=False), args.repeats
    )
    add = _boot.BootSums.add
    _boot.BootSums.add = lambda self, *a, **k: None  # type: ignore[method-assign]
    try:
        without = median_seconds(
            lambda: odds_ratio.compute(adapter, odds_tokens, keep_tensors=False), args.repeats
        )
    finally:
        _boot.BootSums.add = add  # type: ignore[method-assign]
    print(
        f"odds_ratio 4 x 256, 144 heads: forward {forward:.3f} s; compute with intervals "
        f"{with_boot:.3f} s, without {without:.3f} s: {with_boot / without:.3f}x"
    )

    forward = median_seconds(lambda: adapter.forward(reg_tokens), args.repeats)
    reading = median_seconds(
        lambda: regression.compute(adapter, reg_tokens, ablation=False), args.repeats
    )
    full = median_seconds(lambda: regression.compute(adapter, reg_tokens), args.repeats)
    print(
        f"regression 16 x 128, 144 heads: forward {forward:.3f} s; compute {reading:.3f} s "
        f"({reading / forward:.1f}x a forward); with the ablation column {full:.3f} s "
        f"(+{(full - reading) / forward:.1f} forwards)"
    )


if __name__ == "__main__":
    main()
