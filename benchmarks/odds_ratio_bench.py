"""Benchmark: odds-ratio statistics for all 144 heads of a GPT-2-small-shaped random model,
collected during the forward pass, against a plain forward pass (issue 4, item 9).

Model: GPT2Config(n_layer=12, n_head=12, n_embd=768, vocab 50257, n_positions 1024), random
weights, saved to a temporary folder and booted with ``TransformerBridge.boot_transformers``;
batch 4 x 256 random tokens. Timings are medians over ``--repeats`` runs after one warm-up,
interleaved (plain, cached, attached, ...) so that load from other processes hits them alike.

    python benchmarks/odds_ratio_bench.py [--repeats 7] [--threads 2] [--profile]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from tl_dynamics import odds_ratio, testing  # noqa: E402
from tl_dynamics.adapter import ModelAdapter  # noqa: E402
from tl_dynamics.odds_ratio import _collect

GPT2_SMALL = dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, n_positions=1024)
BATCH, POSITIONS = 4, 256


def build_model(root: Path):
    import transformers

    folder = root / "gpt2-small-random"
    if not (folder / "config.json").exists():
        torch.manual_seed(0)
        config = transformers.GPT2Config(**GPT2_SMALL, bos_token_id=0, eos_token_id=0)
        transformers.GPT2LMHeadModel(config).eval().save_pretrained(folder)
        testing.tokenizer().save_pretrained(folder)
    model = testing.bridge_class().boot_transformers(str(folder), device="cpu")
    return model.eval()


def timed(fn) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "tl_dynamics_bench"))
    parser.add_argument(
        "--profile", action="store_true", help="torch profiler table of one attached run"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(Path(args.root))
    adapter = ModelAdapter(model)
    tokens = torch.randint(
        0, GPT2_SMALL["vocab_size"], (BATCH, POSITIONS), generator=torch.Generator().manual_seed(0)
    )

    def plain():
        model(tokens)

    def cached():
        model.run_with_cache(tokens)

    def capture_only():
        with adapter.capture(lambda la: None):
            model(tokens)

    def attached():
        with odds_ratio.attach(adapter, layers=None, heads=None, threads=1) as collector:
            model(tokens)
        return collector

    def attached_torch_threads():
        with odds_ratio.attach(adapter, layers=None, heads=None, threads=None):
            model(tokens)

    runs = {
        "plain forward": plain,
        "run_with_cache": cached,
        "capture q/k/v only (no statistics)": capture_only,
        "odds_ratio.attach, 144 heads, threads=1": attached,
        "  same, statistics on torch's threads": attached_torch_threads,
    }
    for fn in runs.values():  # warm-up
        timed(fn)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            times[name].append(timed(fn))
    base = statistics.median(times["plain forward"])
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, batch {BATCH}x{POSITIONS}, "
        f"load average {os.getloadavg()}"
    )
    for name, values in times.items():
        med = statistics.median(values)
        print(
            f"{name:40s} median {med:6.3f} s  ({med / base:4.2f}x plain)  min {min(values):6.3f} s"
        )
    # time spent inside the statistics callback alone (the rest is the forward pass + capture)
    spent: list[float] = []
    collector = _collect.OddsRatioCollector(
        adapter, adapter.check_layers(None), adapter.check_heads(None)
    )  # torch's threads

    def timed_layer(la):
        start = time.perf_counter()
        collector.on_layer(la)
        spent.append(time.perf_counter() - start)

    with torch.no_grad(), adapter.capture(timed_layer):
        model(tokens)
    print(
        f"statistics callback alone: {sum(spent):.3f} s over {len(spent)} layers "
        f"({sum(spent) / base:.2f}x plain)"
    )
    print(collector.result().to_dataframe()["label"].value_counts().to_dict())
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            timed(attached)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
